"""Cheat: computes honestly, but the sandbox's own timer (LocalModel._timed, in the candidate's process, which runs
as __main__) reports a quarter of each timed window. A known gap: a timed run's protocol costs about 2 ms on an
H200 and wanders by a few tenths of a millisecond from run to run, so the judge's wall clock cannot see the
0.1 ms this hides (nor, on a 0.3 ms call, a report of 1/1000 of it)."""

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

    def shrunk(self, inputs, **how):
        ms, actual = timed(self, inputs, **how)
        return ms * FACTOR, actual

    shrunk.shrunk = True
    sandbox.LocalModel._timed = shrunk


report_less()
