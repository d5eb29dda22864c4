"""Synthesis filters in worker processes: verdicts as in-process; a hang or a crash drops only its own task."""

from kernelpilot.train.filter_worker import check_tasks
from kernelpilot.train.filters import check_task

OPTIONS = {"compile_backend": "aot_eager"}


def _problem(forward: str) -> str:
    return f"""import os
import time
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        {forward}


def get_inputs():
    return [torch.randn(4, 16)]


def get_init_inputs():
    return []
"""


def test_hangs_and_crashes_drop_only_their_task():
    codes = [
        _problem("return torch.tanh(x)"),
        _problem("time.sleep(600)\n        return x"),
        _problem("os._exit(3)"),
        _problem("return x * 0"),
        _problem("return torch.sigmoid(x)"),
    ]
    seen = []
    # The time-out counts from the task's start, after the worker's (spawn, import torch), but covers a first
    # torch.compile: on a loaded 2-core machine that takes up to about 20 s.
    verdicts = check_tasks(codes, ["cpu", "cpu"], OPTIONS, timeout_s=30, on_verdict=lambda i, v: seen.append(i))
    assert [(v.kept, v.reason) for v in verdicts] == [
        (True, None),
        (False, "timeout"),
        (False, "crash"),
        (False, "degenerate"),
        (True, None),
    ]
    assert "exit code 3" in verdicts[2].detail
    assert sorted(seen) == list(range(5))
    assert verdicts[3] == check_task(codes[3], **OPTIONS)
