"""Timing of forward calls: CUDA events, L2 flushed, inputs rotated; eager and compile baselines cached on disk.

Runs inside the GPU worker. `time_callable` is the one timer (CUDA events on a GPU, perf_counter on the CPU
for tests); `bench_candidate` times a candidate against the eager and torch.compile references on the same
inputs, with the baselines measured once per (problem, GPU, torch version, input dtype) so that a turn never
re-runs torch.compile.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from kernelpilot.harness.cache import device_name, environment_key, load_entry, store_entry
from kernelpilot.harness.roofline import dominant_dtype, nbytes_of, problem_roofline
from kernelpilot.results import BenchResult, KernelTime, Roofline, Timing, from_dict, to_dict

if TYPE_CHECKING:
    from kernelpilot.problem import Problem

# Short calls get runs until about this much timed work (more samples, steadier median) up to `max_runs`.
TARGET_TIMED_SECONDS = 0.5
# A call so long that `min_runs` would blow the time cap still gets this many runs.
LONG_CALL_MIN_RUNS = 5
INPUT_SETS = 3
BENCH_SEED = 1_000_003  # far from verify's seeds: timing inputs are not the ones checked
# Input sets may take at most this share of the free GPU memory; the rest is for outputs and the callables.
INPUT_SETS_MEMORY_SHARE = 0.25
TOP_KERNELS = 10
BASELINES_KIND = "baselines"
# Bump when the timing method changes, so baselines measured the old way are measured again.
TIMING_METHOD = 1


# ------------------------------------------------------------------------------------------- timing


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


def plan_runs(per_call_seconds: float, *, min_runs: int, max_runs: int, max_seconds: float) -> tuple[int, str]:
    """How many timed runs to make, and a note when a long call gets fewer than `min_runs`."""
    if per_call_seconds * min_runs > max_seconds:
        runs = max(LONG_CALL_MIN_RUNS, int(max_seconds / per_call_seconds))
        note = (
            f"one call takes {per_call_seconds * 1e3:.0f} ms, so {runs} runs were timed instead of "
            f"{min_runs} to stay near the {max_seconds:g} s cap"
        )
        return runs, note
    budget = min(TARGET_TIMED_SECONDS, max_seconds)
    wanted = int(budget / per_call_seconds) if per_call_seconds > 0 else max_runs
    return min(max(wanted, min_runs), max(max_runs, min_runs)), ""


def summarize(samples_ms: list[float], *, note: str = "") -> Timing:
    """Median, p10, p90 and mean of the samples."""
    if len(samples_ms) < 2:
        raise ValueError("a timing needs at least two samples")
    deciles = statistics.quantiles(samples_ms, n=10, method="inclusive")
    return Timing(
        median_ms=statistics.median(samples_ms),
        p10_ms=deciles[0],
        p90_ms=deciles[-1],
        mean_ms=statistics.fmean(samples_ms),
        runs=len(samples_ms),
        note=note,
    )


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

        self.flush_buffer = _l2_flush_buffer(torch.cuda.current_device()) if flush_l2 else None

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


@functools.cache
def _l2_flush_buffer(device_index: int):
    """A buffer twice the GPU's L2: writing it evicts whatever the previous call left in the cache."""
    import torch

    l2_bytes = torch.cuda.get_device_properties(device_index).L2_cache_size
    return torch.empty(2 * l2_bytes // 4, dtype=torch.int32, device=f"cuda:{device_index}")


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


# ---------------------------------------------------------------------------------------- baselines


@dataclass
class Baselines:
    """The reference's eager and torch.compile timings for one problem on one GPU."""

    eager: Timing
    compiled: Timing | None = None
    compile_note: str = ""  # why `compiled` is None


def baseline_key(problem: Problem, *, device: str, dtype: str, graph: bool = False) -> dict[str, Any]:
    """What a baseline depends on: the problem, the GPU, torch, the inputs' dtype and the timing method."""
    return {
        "problem_id": problem.problem_id,
        **environment_key(device),
        "dtype": dtype,
        "graph": graph,
        "method": TIMING_METHOD,
    }


def load_baselines(key: dict[str, Any], cache_dir: Path | None = None) -> Baselines | None:
    """The cached baselines under `key`, or None."""
    cached = load_entry(BASELINES_KIND, key, cache_dir)
    return from_dict(Baselines, cached) if cached is not None else None


def store_baselines(key: dict[str, Any], baselines: Baselines, cache_dir: Path | None = None) -> Path:
    """Store baselines under `key`; returns the file written."""
    return store_entry(BASELINES_KIND, key, to_dict(baselines), cache_dir)


def measure_baselines(
    problem: Problem, input_sets: list[list], *, device: str, min_runs: int = 20, graph: bool = False, **timing: Any
) -> Baselines:
    """Time the eager reference and its torch.compile (default mode); a compile failure is a note."""
    reference = problem.make_model(device)
    eager = time_callable(reference, input_sets, device=device, min_runs=min_runs, graph=graph, **timing)
    compiled, compile_note = _time_compiled(reference, input_sets, device=device, min_runs=min_runs, graph=graph, **timing)
    return Baselines(eager=eager, compiled=compiled, compile_note=compile_note)


def _time_compiled(reference, input_sets: list[list], *, device: str, **timing: Any) -> tuple[Timing | None, str]:
    import torch

    # Forget earlier problems' graphs: one worker compiles many models and dynamo's caches only grow.
    torch._dynamo.reset()
    compiled = torch.compile(reference)
    try:
        compiled(*input_sets[0])  # the compilation itself, outside any timed region
        return time_callable(compiled, input_sets, device=device, **timing), ""
    except Exception as err:  # noqa: BLE001 - any compiler failure is a property of the problem, not a crash
        if is_device_failure(err):
            raise
        return None, f"torch.compile failed on this problem ({type(err).__name__}: {_first_line(err)})"


def cached_baselines(
    problem: Problem,
    input_sets: list[list],
    *,
    device: str,
    cache_dir: Path | None = None,
    min_runs: int = 20,
    graph: bool = False,
) -> tuple[Baselines, str]:
    """The problem's baselines from the cache, else measured and stored; and a note if storing failed."""
    key = baseline_key(problem, device=device, dtype=dominant_dtype(input_sets[0]), graph=graph)
    baselines = load_baselines(key, cache_dir)
    if baselines is not None:
        return baselines, ""
    baselines = measure_baselines(problem, input_sets, device=device, min_runs=min_runs, graph=graph)
    try:
        store_baselines(key, baselines, cache_dir)
    except OSError as err:
        return baselines, f"baselines not cached ({err.strerror or err}): the next turn measures them again"
    return baselines, ""


# ------------------------------------------------------------------------------------------- inputs


def make_input_sets(problem: Problem, *, device: str, count: int = INPUT_SETS, base_seed: int = BENCH_SEED) -> list[list]:
    """`count` input sets from different seeds (fewer when they would crowd the GPU's free memory)."""
    first = problem.make_inputs(device=device, seed=base_seed)
    fitting = _sets_that_fit(nbytes_of(first), device, count)
    return [first] + [problem.make_inputs(device=device, seed=base_seed + i) for i in range(1, fitting)]


def _sets_that_fit(set_bytes: int, device: str, wanted: int) -> int:
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or set_bytes == 0:
        return wanted
    free_bytes, _ = torch.cuda.mem_get_info(dev)
    return max(1, min(wanted, int(free_bytes * INPUT_SETS_MEMORY_SHARE // set_bytes)))


# -------------------------------------------------------------------------------------- the profile


def profile_kernels(model: Callable[..., Any], inputs: list, *, device: str, top: int = TOP_KERNELS) -> list[KernelTime]:
    """The kernels of one call, longest first: GPU kernels on CUDA, operators by self time on the CPU."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        model(*inputs)
        if on_cuda:
            torch.cuda.synchronize()
    wanted = DeviceType.CUDA if on_cuda else DeviceType.CPU
    rows = [row for row in prof.key_averages() if row.device_type == wanted]

    def micros(row) -> float:
        return row.device_time_total if on_cuda else row.self_cpu_time_total

    rows.sort(key=micros, reverse=True)
    return [KernelTime(name=row.key, total_ms=micros(row) / 1e3, calls=row.count) for row in rows[:top]]


# ---------------------------------------------------------------------------------------- the bench


def bench_candidate(
    problem: Problem,
    candidate_model: Callable[..., Any],
    *,
    device: str,
    cache_dir: Path | None = None,
    min_runs: int = 20,
    graph: bool = False,
    ceilings: dict[str, Any] | None = None,
) -> BenchResult:
    """Time the candidate against eager and torch.compile on the same inputs; speedups, % SOL, kernel breakdown.

    `ceilings` replaces the measured GPU ceilings (needed for a roofline off the GPU). A failure of the
    candidate or the reference is a result with a message; CUDA errors and OOM are raised for the worker,
    which knows how to recover from them.
    """
    import torch

    try:
        with torch.no_grad():
            return _bench(problem, candidate_model, device, cache_dir, min_runs, graph, ceilings)
    except Exception as err:  # noqa: BLE001 - a failing candidate is a result, not a crash
        if is_device_failure(err):
            raise
        return BenchResult(
            ok=False,
            gpu=device_name(device),
            error_kind="runtime",
            message=f"timing failed: {type(err).__name__}: {_first_line(err)}",
        )


def _bench(problem, candidate_model, device, cache_dir, min_runs, graph, ceilings) -> BenchResult:
    input_sets = make_input_sets(problem, device=device)
    notes = [] if len(input_sets) > 1 else ["inputs not rotated: a second input set does not fit in GPU memory"]
    baselines, cache_note = cached_baselines(
        problem, input_sets, device=device, cache_dir=cache_dir, min_runs=min_runs, graph=graph
    )
    candidate = time_callable(candidate_model, input_sets, device=device, min_runs=min_runs, graph=graph)
    roofline, roofline_note = _roofline_or_note(problem, device, cache_dir, ceilings)
    kernels, profile_note = _kernels_or_note(candidate_model, input_sets[0], device)
    notes += [cache_note, baselines.compile_note, roofline_note, profile_note, candidate.note]
    return BenchResult(
        ok=True,
        gpu=device_name(device),
        candidate=candidate,
        eager=baselines.eager,
        compiled=baselines.compiled,
        speedup_vs_eager=_ratio(baselines.eager, candidate),
        speedup_vs_compile=_ratio(baselines.compiled, candidate),
        roofline=roofline,
        sol_candidate=_sol(roofline, candidate),
        sol_eager=_sol(roofline, baselines.eager),
        sol_compile=_sol(roofline, baselines.compiled),
        kernels=kernels,
        message="; ".join(note for note in notes if note),
    )


def _roofline_or_note(problem, device, cache_dir, ceilings) -> tuple[Roofline | None, str]:
    import torch

    if ceilings is None and torch.device(device).type != "cuda":
        return None, f"no roofline on {device}: ceilings are measured on a GPU"
    try:
        return problem_roofline(problem, device=device, cache_dir=cache_dir, ceilings=ceilings), ""
    except Exception as err:  # noqa: BLE001 - % SOL is extra information; its absence must not fail the bench
        if is_device_failure(err):
            raise
        return None, f"roofline unavailable ({type(err).__name__}: {_first_line(err)})"


def _kernels_or_note(model, inputs, device) -> tuple[list[KernelTime], str]:
    try:
        return profile_kernels(model, inputs, device=device), ""
    except Exception as err:  # noqa: BLE001 - the breakdown is extra information, like the roofline
        if is_device_failure(err):
            raise
        return [], f"kernel breakdown unavailable ({type(err).__name__}: {_first_line(err)})"


def _ratio(baseline: Timing | None, candidate: Timing) -> float | None:
    if baseline is None or candidate.median_ms <= 0:
        return None
    return baseline.median_ms / candidate.median_ms


def _sol(roofline: Roofline | None, timing: Timing | None) -> float | None:
    if roofline is None or timing is None or timing.median_ms <= 0:
        return None
    return roofline.floor_ms / timing.median_ms


def is_device_failure(err: BaseException) -> bool:
    """OOM and CUDA errors: the worker classifies these (and restarts when the CUDA context is poisoned)."""
    import torch

    if isinstance(err, torch.cuda.OutOfMemoryError):
        return True
    return type(err).__name__ == "AcceleratorError" or "CUDA error" in str(err)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no message"
