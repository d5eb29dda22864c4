"""The candidate sandbox's kernel trace (harness/tracing.py) on a GPU: kernels are collected only inside
`collecting()`, a profiler is on the whole time, and what was collected survives a pause and a read."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture
def trace():
    import torch

    from kernelpilot.harness.tracing import KernelTrace

    device = torch.device("cuda", torch.cuda.current_device())
    made = KernelTrace(device)
    yield made
    made.close()


def test_only_the_kernels_launched_while_collecting_are_read_and_a_profiler_is_on_throughout(trace):
    import torch
    import torch.autograd.profiler as autograd_profiler

    x = torch.randn(4096, device="cuda")
    torch.sigmoid(x)  # not collected
    assert autograd_profiler._is_profiler_enabled and torch._C._autograd._profiler_enabled()
    with trace.collecting():
        assert autograd_profiler._is_profiler_enabled
        torch.tanh(x)
    torch.sigmoid(x)
    names = trace.take_names()
    assert len(names) == 1 and "tanh" in names[0], names
    assert trace.take_names() == [], "a read takes what it reports"
    assert autograd_profiler._is_profiler_enabled, "the session goes on after a read"


def test_kernels_collected_before_a_pause_are_kept_and_a_profiler_of_its_own_runs_inside_it(trace):
    import torch
    from kernelpilot.harness.guards import is_torch_kernel, profile_forward

    x = torch.randn(4096, device="cuda")
    with trace.collecting():
        torch.tanh(x)
    with trace.paused():  # the profiled call's own profiler, as the sandbox runs it
        own = profile_forward(lambda: torch.abs(x), x.device)
    assert len(own.kernels) == 1 and is_torch_kernel(own.kernels[0].name), own.kernels
    assert ["tanh" in name for name in trace.take_names(read=False)] == [True]
    with trace.collecting():
        torch.relu(x)
    names = trace.take_names()
    assert len(names) == 1 and is_torch_kernel(names[0]), names
