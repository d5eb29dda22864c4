"""Cheat: as reports_quarter, but reports three quarters of each timed window: 0.03 ms of big_relu's 0.13 ms
(H200) hidden, less than the judge's wall clock can tell from the protocol's own wander. A known gap."""

import sys

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)

FACTOR = 0.75


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_ops.relu(x)


def report_less() -> None:
    sandbox = sys.modules.get("__main__")
    if not hasattr(sandbox, "LocalModel") or getattr(sandbox.LocalModel._timed, "shrunk", False):
        return  # not the judge's sandbox process, or already done
    timed = sandbox.LocalModel._timed

    def shrunk(self, inputs, **how):
        ms, actual = timed(self, inputs, **how)
        return ms * FACTOR, actual

    shrunk.shrunk = True
    sandbox.LocalModel._timed = shrunk


report_less()
