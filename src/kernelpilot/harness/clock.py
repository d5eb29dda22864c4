"""TRUSTED side: the timer for the judge's own code in this process (the roofline's ceilings): CUDA events around
each call with the L2 flushed outside the timed region, CUDA graph replays for launch-bound calls, perf_counter on
the CPU (tests). Candidates are never timed here: `timing.time_model` times their sandbox process."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable

from kernelpilot.harness.timed_inputs import l2_flush_buffer
from kernelpilot.harness.timing import plan_runs, summarize
from kernelpilot.results import Timing


def time_callable(
    fn: Callable[..., Any],
    input_sets: list[list],
    *,
    device: str,
    warmup: int = 3,
    min_runs: int = 20,
    max_seconds: float = 10.0,
    flush_l2: bool = True,
    max_runs: int = 200,
    graph: bool = False,
) -> Timing:
    """Time `fn(*inputs)` with the input sets rotated call by call.

    On CUDA each call sits between two events and the L2 is flushed before it, outside the timed region;
    with `graph=True` one CUDA graph per input set is captured and its replays are timed (launch-bound problems).
    The number of runs adapts to the call's length: see `plan_runs`.
    """
    import torch

    if not input_sets:
        raise ValueError("time_callable needs at least one input set")
    if warmup < 1:
        raise ValueError(f"warmup must be at least 1, got {warmup}")
    dev = torch.device(device)
    with _on_device(dev):
        if graph:
            calls = _graph_replays(fn, input_sets, dev)
        else:
            calls = [functools.partial(fn, *inputs) for inputs in input_sets]
        clock = _CudaClock(flush_l2) if dev.type == "cuda" else _CpuClock()
        per_call_seconds = _warm_up(clock, calls, warmup)
        runs, note = plan_runs(per_call_seconds, min_runs=min_runs, max_runs=max_runs, max_seconds=max_seconds)
        return summarize(clock.measure(calls, runs), note=note)


def _warm_up(clock, calls: list[Callable[[], Any]], warmup: int) -> float:
    """Run the warm-up calls; return the wall time of one call, flush included, for planning the runs."""
    clock.measure(calls, 1)  # the first call pays lazy initialisation and autotuning: keep it out of the estimate
    probes = max(warmup - 1, 1)
    start = time.perf_counter()
    clock.measure(calls, probes)
    return (time.perf_counter() - start) / probes


class _CudaClock:
    """CUDA events around each call, the L2 flushed before each, one synchronisation at the end.

    The loop never drains the GPU between calls, so the CPU runs ahead and a GPU-bound call is timed by its GPU
    work alone. Draining before each call was tried on an H100 and rejected: it added the CPU's dispatch time,
    +7% on a 0.5 ms LayerNorm and +25% on torch.compile's calls (their guards run on the CPU). A launch-bound
    call (its launches take longer than its GPU work) is timed with its launch cost, which varies with the CPU:
    `graph=True` removes it.
    """

    def __init__(self, flush_l2: bool):
        import torch

        self.flush_buffer = l2_flush_buffer(torch.cuda.current_device()) if flush_l2 else None

    def measure(self, calls: list[Callable[[], Any]], runs: int) -> list[float]:
        import torch

        pairs = []
        for i in range(runs):
            if self.flush_buffer is not None:
                self.flush_buffer.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            calls[i % len(calls)]()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in pairs]


class _CpuClock:
    """perf_counter around each call: the same API on the CPU, for tests."""

    def measure(self, calls: list[Callable[[], Any]], runs: int) -> list[float]:
        samples = []
        for i in range(runs):
            start = time.perf_counter()
            calls[i % len(calls)]()
            samples.append((time.perf_counter() - start) * 1e3)
        return samples


def _on_device(dev):
    import torch

    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def _graph_replays(fn: Callable[..., Any], input_sets: list[list], dev) -> list[Callable[[], Any]]:
    """Capture one CUDA graph of `fn` per input set; their replays are what gets timed."""
    import torch

    if dev.type != "cuda":
        raise ValueError(f"CUDA-graph timing needs a CUDA device, not {str(dev)!r}")
    # Capture requires the callable to have run once, on a side stream, before.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for inputs in input_sets:
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    replays = []
    for inputs in input_sets:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*inputs)
        replays.append(graph.replay)
    return replays
