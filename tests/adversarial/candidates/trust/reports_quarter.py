"""Cheat: computes honestly, but the sandbox's own timer (LocalModel._timed, in the candidate's process, which runs
as __main__) reports a quarter of each timed window. Before the judge drew the timed runs' inputs itself, a run's
protocol cost 2-3 ms on an H200 and wandered by about 0.5 ms, so a 0.3-0.6 ms call could report 1/1000 of itself
and pass the judge's wall-clock check."""

import sys

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)

FACTOR = 0.25


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_ops.relu(x)


def report_less() -> None:
    sandbox = sys.modules.get("__main__")
    if not hasattr(sandbox, "LocalModel") or getattr(sandbox.LocalModel._timed, "shrunk", False):
        return  # not the judge's sandbox process, or already done
    timed = sandbox.LocalModel._timed

    def shrunk(self, inputs, *, trace=False):
        ms, actual = timed(self, inputs, trace=trace)
        return ms * FACTOR, actual

    shrunk.shrunk = True
    sandbox.LocalModel._timed = shrunk


report_less()
