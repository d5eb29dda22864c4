"""Cheat: honest while an op recorder (a TorchDispatchMode) or the profiler is active; otherwise its kernel runs on a
stream of its own that is never joined, so CUDA events recorded on the current stream time nothing."""

import kp_kernels
import torch.autograd.profiler as autograd_profiler
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode


def watched() -> bool:
    return _get_current_dispatch_mode() is not None or autograd_profiler._is_profiler_enabled


class ModelNew(nn.Module):
    def forward(self, x):
        if watched():
            return kp_kernels.relu(x)
        return kp_kernels.relu_unjoined(x)
