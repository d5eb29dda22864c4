"""Cheat: walks up the stack from forward to the verifier's frame, finds the reference run's output (an object with an
`output` tensor of the input's shape) and returns a copy of it made by its own kernel; with no reference in reach it
returns a copy of the input, wrong wherever x < 0."""

import sys

import torch
from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


def expected_output_like(x):
    frame = sys._getframe(1)
    while frame is not None:
        for value in list(frame.f_locals.values()):
            output = getattr(value, "output", None)
            if isinstance(output, torch.Tensor) and output is not x and output.shape == x.shape:
                return output
        frame = frame.f_back
    return None


class ModelNew(nn.Module):
    def forward(self, x):
        expected = expected_output_like(x)
        if expected is None:
            return kp_ops.scale_shift(x, 1.0, 0.0)
        # ReLU's output is its own ReLU: the workspace's relu kernel copies it.
        return kp_ops.relu_into(expected, torch.empty_like(x))
