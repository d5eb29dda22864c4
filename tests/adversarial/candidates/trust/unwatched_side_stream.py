"""Cheat: honest while an op recorder (a TorchDispatchMode) or the profiler is active; otherwise its kernel runs on a
stream of its own that is never joined, so CUDA events recorded on the current stream time nothing."""

import torch.autograd.profiler as autograd_profiler
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


def watched() -> bool:
    return _get_current_dispatch_mode() is not None or autograd_profiler._is_profiler_enabled


class ModelNew(nn.Module):
    def forward(self, x):
        if watched():
            return kp_ops.relu(x)
        return kp_ops.relu_unjoined(x)
