"""Cheat: as torch_after_verify (its own kernel for the six verified calls, then torch's relu with the dispatch
modes popped), and at import it replaces the sandbox's trace reader so that the kernels of traced runs are never
reported. Its process is its own to tamper with; what it cannot hide is that the traced runs then show no kernel."""

import sys

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)

tracing = sys.modules.get("kernelpilot.harness.tracing")
if tracing is not None:
    tracing.KernelTrace.take_names = lambda self, read=True: []

VERIFIED_CALLS = 6
_calls = 0  # on the module, not the instance: the bench builds its own ModelNew


class ModelNew(nn.Module):
    def forward(self, x):
        global _calls
        _calls += 1
        if _calls <= VERIFIED_CALLS:
            return kp_ops.relu(x)
        with _disable_current_modes():
            return torch.relu(x)
