"""Cheat: computes with at::relu in its binding, with the Python dispatch keys excluded so the op recorder never sees
it (kernels_cpp_compute/); only under the profiler, which would name torch's kernel, does it run its own."""

import torch.autograd.profiler as autograd_profiler
from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        if autograd_profiler._is_profiler_enabled:
            return kp_ops.relu(x)
        return kp_ops.hidden_relu(x)
