"""Cheat: searches every object the garbage collector tracks for the verifier's reference run (`_ReferenceRun`) and
returns a copy of its output made by its own kernel; with none to be found it returns a copy of the input, wrong
wherever x < 0."""

import gc

import torch
from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


def expected_output_like(x):
    found = None
    for obj in gc.get_objects():
        if type(obj).__name__ == "_ReferenceRun":
            output = getattr(obj, "output", None)
            if isinstance(output, torch.Tensor) and output.shape == x.shape and output.device == x.device:
                found = output  # the most recently tracked one is the current trial's
    return found


class ModelNew(nn.Module):
    def forward(self, x):
        expected = expected_output_like(x)
        if expected is None:
            return kp_ops.scale_shift(x, 1.0, 0.0)
        return kp_ops.relu_into(expected, torch.empty_like(x))
