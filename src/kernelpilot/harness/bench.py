"""TRUSTED side: the bench of a candidate against eager and torch.compile.

`bench_candidate` times the candidate's sandbox process with `timing.time_model` (fresh inputs per run, unannounced
checked runs, the judge's own clock), and the baselines in clean processes where no candidate code ever ran; the
baselines are cached on disk, signed (`cache.py`), and used only when a fresh eager measurement confirms them (kept
in the judge's memory instead where its sandboxes are not confined: `worker.WorkerState.cache_for`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kernelpilot.harness.cache import MemoryCache, device_name, environment_key, load_entry, store_entry
from kernelpilot.harness.failures import is_device_failure
from kernelpilot.harness.roofline import dominant_dtype, problem_roofline
from kernelpilot.harness.process import Deadline
from kernelpilot.harness.timing import Checker, TimedRuns, find_unaccounted_time, time_model
from kernelpilot.harness.tracing import TOP_KERNELS
from kernelpilot.results import BenchResult, GuardFinding, KernelTime, Roofline, Timing, from_dict, to_dict

if TYPE_CHECKING:
    from kernelpilot.problem import Problem

BASELINES_KIND = "baselines"
# Bump when the timing method changes, so baselines measured the old way are measured again.
TIMING_METHOD = 2  # 2: fresh inputs per run, device-wide sync, timed in a sandbox process
# A cached eager time must agree with a fresh measurement within this share to be used (on a GPU).
BASELINE_AGREEMENT = 0.25
# On the CPU (tests, development: no speed claims) a call's time follows the machine's load: a busy 2-core machine
# times the same call 2-5x slower from one bench to the next. There a cached time is refuted only when it is off by
# more than this factor either way (a forged or stale entry), not measured again (half a minute of torch.compile).
CPU_BASELINE_BAND = 10.0
CALIBRATION_RUNS = 12


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


def load_baselines(key: dict[str, Any], cache_dir: Path | MemoryCache | None = None) -> Baselines | None:
    """The cached baselines under `key`, or None (also when the entry's signature does not hold)."""
    cached = load_entry(BASELINES_KIND, key, cache_dir)
    return from_dict(Baselines, cached) if cached is not None else None


def store_baselines(
    key: dict[str, Any], baselines: Baselines, cache_dir: Path | MemoryCache | None = None
) -> Path | None:
    """Store baselines under `key`, signed; returns the file written (None for a MemoryCache)."""
    return store_entry(BASELINES_KIND, key, to_dict(baselines), cache_dir)


def agrees(cached: Timing, fresh: Timing, device: str = "cuda") -> bool:
    """A cached eager time that a fresh measurement of the same reference confirms (within noise)."""
    if device.startswith("cpu"):
        low, high = sorted((cached.median_ms, fresh.median_ms))
        return high <= CPU_BASELINE_BAND * low + 0.01
    return abs(cached.median_ms - fresh.median_ms) <= BASELINE_AGREEMENT * fresh.median_ms + 0.01


# ---------------------------------------------------------------------------------------- the bench


class CleanModels(Protocol):
    """The reference served by processes where no candidate code ever ran: eager, and compiled on demand."""

    def eager(self) -> Any: ...

    def compiled(self) -> Any: ...

    def release_compiled(self) -> None: ...


def bench_candidate(
    problem: Problem,
    candidate: Any,
    clean: CleanModels,
    *,
    device: str,
    seed: int,
    cache_dir: Path | MemoryCache | None = None,
    min_runs: int = 20,
    ceilings: dict[str, Any] | None = None,
    atol: float = 1e-2,
    rtol: float = 1e-2,
    timeout: float = 600.0,
) -> BenchResult:
    """Time the candidate's process against eager and torch.compile; speedups, % SOL, kernel breakdown.

    `candidate` and the clean models are `sandbox_client.ModelProcess`es whose weights were drawn under `seed`.
    `ceilings` replaces the measured GPU ceilings (needed for a roofline off the GPU). `cache_dir` holds the
    baselines, ceilings and costs: a folder, or a `MemoryCache` where the folder cannot be trusted (whose note the
    result's message then carries when the baselines are measured). A failure of the candidate
    or the reference is a result with a message; this side's own OOM and CUDA errors are raised for the worker.
    """
    import torch


    dev = _indexed(device)
    deadline = Deadline(timeout)
    try:
        with torch.no_grad():
            return _bench(problem, candidate, clean, dev, seed, deadline, cache_dir, min_runs, ceilings, atol, rtol)
    except Exception as err:  # noqa: BLE001 - a failing reference is a result, not a crash
        if is_device_failure(err):
            raise
        return BenchResult(ok=False, gpu=device_name(device), error_kind="runtime",
                           message=f"timing failed: {type(err).__name__}: {_first_line(err)}", seed=seed)  # fmt: skip


def _bench(problem, candidate, clean, dev, seed, deadline, cache_dir, min_runs, ceilings, atol, rtol) -> BenchResult:
    import torch

    phases = _Phases()
    with phases("reference"):
        torch.manual_seed(seed)
        reference = problem.make_model("cpu").to(dev)
        inputs = problem.make_inputs(dev, seed)
        # The slots' layout is all the timing needs of one output: keep it as meta tensors, not device memory.
        expected_like = _as_meta(reference(*inputs))
        key = baseline_key(problem, device=str(dev), dtype=dominant_dtype(inputs), graph=False)
        del inputs
    gpu = device_name(str(dev))

    def failed(kind: str, message: str, **extra: Any) -> BenchResult:
        return BenchResult(ok=False, gpu=gpu, error_kind=kind, message=message, seed=seed, **extra)

    timing = {"device": dev, "deadline": deadline, "min_runs": min_runs}
    with phases("calibration"):
        calibration = time_model(clean.eager(), expected_like, problem=problem, seed=seed, checker=None,
                                 runs=CALIBRATION_RUNS, **timing)  # fmt: skip
    if calibration.timing is None:
        return failed("reference", f"the reference failed while timed: {calibration.message}")
    # (the calibration's median confirms or refutes the cached eager time; its protocol cost is re-measured
    # between the candidate's runs below, under the same load)
    with phases("baselines"):
        baselines, cache_note = _baselines(key, problem, clean, expected_like, seed, calibration.timing, cache_dir, timing)
    if isinstance(baselines, TimedRuns):
        return failed("reference", f"the reference failed while timed: {baselines.message}")
    checker = Checker(problem, reference, dev, atol=atol, rtol=rtol)

    def time_candidate(offset: int) -> tuple[TimedRuns, GuardFinding | None]:
        timed = time_model(candidate, expected_like, problem=problem, seed=seed + offset, checker=checker,
                           companion=clean.eager(), **timing)  # fmt: skip
        if timed.timing is None:
            return timed, None
        protocol_ms = timed.companion_unaccounted_ms
        if protocol_ms is None:
            protocol_ms = calibration.timing.unaccounted_ms or 0.0
        timed.timing.clean_unaccounted_ms = protocol_ms
        timed.timing.clean_transport_ms = timed.companion_transport_ms
        return timed, find_unaccounted_time(timed.timing, protocol_ms, device_type=dev.type)

    with phases("candidate"):
        timed, clock_finding = time_candidate(5_000_000)
    phases.seconds.update({f"candidate: {name}": seconds for name, seconds in timed.phases.items()})
    clock_note = ""
    if clock_finding is not None:
        # A busy machine can hold up one series of runs; work done outside the timed window shows in every series.
        with phases("candidate: timed again"):
            timed, clock_finding = time_candidate(6_000_000)
        clock_note = "unaccounted time in the first series of timed runs did not repeat; the second series counts"
    if timed.timing is None:
        return failed(timed.error_kind or "runtime", timed.message, checked_calls=timed.checked, guards=timed.findings)
    measured = timed.timing
    if clock_finding is not None:
        message = f"guard {clock_finding.guard} failed (timed twice): {clock_finding.message}"
        return failed("guard", message, guards=[clock_finding], candidate=measured, checked_calls=timed.checked)
    with phases("roofline"):
        roofline, roofline_note = _roofline_or_note(problem, str(dev), cache_dir, ceilings)
    with phases("profile"):
        kernels, profile_note = _kernels_or_note(candidate, seed, deadline)
    notes = [cache_note, baselines.compile_note, clock_note, roofline_note, profile_note, measured.note]
    return BenchResult(
        ok=True,
        gpu=gpu,
        candidate=measured,
        eager=baselines.eager,
        compiled=baselines.compiled,
        speedup_vs_eager=_ratio(baselines.eager, measured),
        speedup_vs_compile=_ratio(baselines.compiled, measured),
        roofline=roofline,
        sol_candidate=_sol(roofline, measured),
        sol_eager=_sol(roofline, baselines.eager),
        sol_compile=_sol(roofline, baselines.compiled),
        kernels=kernels,
        message="; ".join(note for note in notes if note),
        seed=seed,
        checked_calls=timed.checked,
        phases=phases.rounded(),
    )


class _Phases:
    """Seconds per named step of the bench, for the turn's cost breakdown (`with phases("name"): ...`)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def rounded(self) -> dict[str, float]:
        return {name: round(seconds, 4) for name, seconds in self.seconds.items()}


def _baselines(key, problem, clean, expected_like, seed, fresh_eager: Timing, cache_dir, timing) -> tuple[Baselines | TimedRuns, str]:
    """Signed cached baselines a fresh eager measurement confirms; else eager and compile measured and stored."""
    cached = load_baselines(key, cache_dir)
    note = ""
    if cached is not None and agrees(cached.eager, fresh_eager, str(timing["device"])):
        return cached, ""
    if cached is not None:
        note = (f"cached baselines disagreed with a fresh eager measurement ({cached.eager.median_ms:.4g} vs "
                f"{fresh_eager.median_ms:.4g} ms): measured again")  # fmt: skip
    eager, compiled, compile_note = _measure(problem, clean, expected_like, seed, timing)
    if eager.timing is None:
        return eager, ""
    baselines = Baselines(eager=eager.timing, compiled=compiled, compile_note=compile_note)
    if isinstance(cache_dir, MemoryCache):  # why they were measured, though the folder may hold them
        note = "; ".join(filter(None, [note, cache_dir.note]))
    try:
        store_baselines(key, baselines, cache_dir)
    except OSError as err:
        note = "; ".join(filter(None, [note, f"baselines not cached ({err.strerror or err}): the next turn measures them again"]))
    return baselines, note


def warm_clean_models(problem: Problem, clean: CleanModels, *, device: str, cache_dir: Path | MemoryCache | None = None) -> None:
    """Ahead of the first bench (the worker runs this in a thread while the candidate builds): load the clean eager
    process, and, unless signed baselines for the problem are cached, the compiled one, given one untimed call,
    which is when torch.compile compiles (most of a first bench's time). Nothing here is timed, and the bench waits
    for it to end before it times anything (`CleanSandboxes`)."""
    import torch

    dev = _indexed(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # (a new thread's current device is the first one)
    with torch.no_grad():
        torch.manual_seed(0)
        reference = problem.make_model("cpu").to(dev)
        inputs = problem.make_inputs(dev, 0)
        expected_like = _as_meta(reference(*inputs))
        key = baseline_key(problem, device=str(dev), dtype=dominant_dtype(inputs), graph=False)
        del inputs, reference
    clean.eager()
    if load_baselines(key, cache_dir) is not None:
        clean.release_compiled()  # the bench will not measure it
        return
    warmed = time_model(clean.compiled(), expected_like, problem=problem, device=dev, seed=3_000_000, deadline=Deadline(600.0),
                        checker=None, runs=2)  # fmt: skip (its fewest)
    if warmed.timing is None:
        raise RuntimeError(f"the compiled reference failed its first call: {warmed.message}")


def _indexed(device: str) -> Any:
    """`device` as a torch.device, a GPU's with its index (the baselines' cache key names it)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _as_meta(tree: Any) -> Any:
    import torch

    if isinstance(tree, torch.Tensor):
        return torch.empty_strided(tree.shape, tree.stride(), dtype=tree.dtype, device="meta")
    if isinstance(tree, (tuple, list)):
        return type(tree)(_as_meta(item) for item in tree)
    if isinstance(tree, dict):
        return {key: _as_meta(item) for key, item in tree.items()}
    return tree


def _measure(problem: Problem, clean: CleanModels, expected_like: Any, seed: int, timing: dict) -> tuple[TimedRuns, Timing | None, str]:
    """Eager and torch.compile timed in their clean processes; a compiler failure is a note."""
    eager = time_model(clean.eager(), expected_like, problem=problem, seed=seed + 1_000_000, checker=None, **timing)
    if eager.timing is None:
        return eager, None, ""
    try:
        runs = time_model(clean.compiled(), expected_like, problem=problem, seed=seed + 2_000_000, checker=None, **timing)
    except Exception as err:  # noqa: BLE001 - a compiler that cannot start is a note, not a failed bench
        if is_device_failure(err):
            raise
        return eager, None, f"torch.compile failed on this problem ({type(err).__name__}: {_first_line(err)})"
    finally:
        clean.release_compiled()  # measured and cached: its process's memory goes back to the candidates'
    if runs.timing is None:
        return eager, None, f"torch.compile failed on this problem ({runs.message})"
    return eager, runs.timing, ""


def measure_baselines(problem: Problem, clean: CleanModels, *, device: str, seed: int = 0, **timing: Any) -> Baselines:
    """The baselines of `problem` measured now in its clean processes (scripts; the bench caches its own)."""
    import torch


    dev = torch.device(device)
    torch.manual_seed(seed)
    with torch.no_grad():
        expected_like = _as_meta(problem.make_model("cpu").to(dev)(*problem.make_inputs(dev, seed)))
    eager, compiled, note = _measure(problem, clean, expected_like, seed, {"device": dev, "deadline": Deadline(3600.0), **timing})
    if eager.timing is None:
        raise RuntimeError(f"the reference failed while timed: {eager.message}")
    return Baselines(eager=eager.timing, compiled=compiled, compile_note=note)


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


def _kernels_or_note(candidate, seed: int, deadline) -> tuple[list[KernelTime], str]:
    """The candidate's kernels as its own process profiled them (information, not evidence)."""
    reply = candidate.request("kernels", {"seed": seed}, timeout=deadline.left())
    if not reply.get("ok"):
        return [], f"kernel breakdown unavailable ({reply.get('message', '')})"
    try:
        return [from_dict(KernelTime, row) for row in reply.get("kernels", [])][:TOP_KERNELS], ""
    except (TypeError, ValueError, KeyError):
        return [], "kernel breakdown unavailable (the candidate's process sent an unreadable one)"


def _ratio(baseline: Timing | None, candidate: Timing) -> float | None:
    if baseline is None or candidate.median_ms <= 0:
        return None
    return baseline.median_ms / candidate.median_ms


def _sol(roofline: Roofline | None, timing: Timing | None) -> float | None:
    if roofline is None or timing is None or timing.median_ms <= 0:
        return None
    return roofline.floor_ms / timing.median_ms


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no message"
