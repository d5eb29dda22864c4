"""TRUSTED side: timing a model in its process, with every timed call a call that may be checked.

Each timed run is one request: this side draws fresh inputs from a seed it picks into tensors it lent the model's
process, flushes the L2 (timed_inputs.py), then the model's process times one call on them between CUDA events
around a device-wide synchronisation (work on every stream counts) and copies the outputs into slots this side
owns. Four things keep the figure honest however the process lies:

- **Fresh inputs per run, from seeds nobody can foretell**: nothing can be reused from one run to the next
  (memoising by input identity, data pointer or content gains nothing), and nothing can be made ready for the next
  one either: each run's seed is drawn here at random (a failing run's message names it), so the model's process,
  which sees each seed, cannot draw the next run's inputs and compute its answer between runs, where no clock runs
  (seeds that went up in steps let it: tests/adversarial/test_computed_ahead.py).
- **Checked runs**: after some runs, chosen here at random and never announced, this side copies the slots as the
  reply found them, draws the same inputs, runs the reference and compares; a model idle or wrong while timed
  fails as a mismatch, and so does one that wrote its answer into the slots after its reply (on a GPU only an
  answer that lands before the copy, within about the reply's own trip, 0.2-0.4 ms, would be missed). After the
  runs, the checked ones are checked across them as verification's trials are (element_trials.py).
- **Traced runs**: the candidate's process collects the kernels of another random sample of runs (tracing.py; its
  profiler is on in every run, so it cannot tell them apart by that): torch's own kernels among them fail as
  torch-compute. Their times, slowed by the collecting, are left out of the figures.
- **A trusted clock**: this side measures each request's wall time; wall time minus the reported time is the
  protocol's cost, which the baselines' clean process measures for the same problem (drawing the inputs and
  flushing the L2 happen on this side before the clock starts, so that cost is small and steady). A model whose
  unaccounted time is well above that did work outside its timed window (or reported less than it took):
  "unaccounted-time".
  On a GPU the typical unaccounted time is the median; on a CPU, whose runs a busy machine holds up now and then
  (scheduling only ever adds time), the lower quartile: work done outside the window every run still shows there.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kernelpilot.harness.guards import NO_CUSTOM_KERNEL, find_torch_kernels, tensor_leaves
from kernelpilot.harness.process import Deadline
from kernelpilot.harness.shared import SharedArena
from kernelpilot.harness.timed_inputs import TimedInputs
from kernelpilot.results import GuardFinding, Timing

UNACCOUNTED_TIME = "unaccounted-time"
# Short calls get runs until about this much timed work (more samples, steadier median) up to `max_runs`.
TARGET_TIMED_SECONDS = 0.5
# A call so long that `min_runs` would blow the time cap still gets this many runs.
LONG_CALL_MIN_RUNS = 5
# Checked runs: this share of the timed runs, at least CHECKED_MIN (all runs when there are fewer).
CHECKED_SHARE = 0.1
CHECKED_MIN = 3
# Unaccounted time above the clean process's by more than this floor and share of the reported median fails.
# On an H200 a run's protocol costs 0.9-1.3 ms (most of it copying the outputs out), and the clean process's
# figure differs from an honest candidate's by about a tenth of a millisecond either way.
# CPU timings serve tests, on machines that may be busy: a fresh-clone test run on 2 busy cores saw 5.4 ms of
# unaccounted time on an honest CPU candidate (its lower quartile, timed twice); the CPU cheats hold 30 ms.
UNACCOUNTED_FLOOR_MS = {"cuda": 0.1, "cpu": 15.0}
UNACCOUNTED_SHARE = {"cuda": 0.1, "cpu": 0.25}
COMPANION_RUNS = 12
COMPANION_BURST = 2
_clock = time.perf_counter


@dataclass
class TimedRuns:
    """What timing a model produced: the timing, or the failure that stopped it."""

    timing: Timing | None = None
    error_kind: str | None = None
    message: str = ""
    checked: int = 0
    findings: list[GuardFinding] = field(default_factory=list)
    # The companion's (a clean process timed between the model's runs) median unaccounted time, if one ran.
    companion_unaccounted_ms: float | None = None
    # The companion's median of (wall time) - (the time its process says the run spent in it): `Timing.transport_ms`.
    companion_transport_ms: float | None = None
    phases: dict[str, float] = field(default_factory=dict)  # seconds: warm-up, runs, checks, companion


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



class Checker:
    """Compares a timed run's slots with the reference on the same inputs (trusted side), and, after the runs, the
    checked runs' answers across them, as verification's trials are (element_trials.py): a model honest while
    verified and answering with a constant while timed (a mean loss; a weight plus a small multiple of the input)
    passes each run's element test."""

    def __init__(self, problem: Any, reference: torch.nn.Module, device: torch.device, *, atol: float, rtol: float):
        from kernelpilot.harness.element_trials import ChecksAcrossTrials

        self.problem, self.reference, self.device, self.atol, self.rtol = problem, reference, device, atol, rtol
        self.across = ChecksAcrossTrials(atol=atol, rtol=rtol)
        self.last: tuple[int, list] | None = None  # the last checked run's seed and comparisons

    def mismatch(self, seed: int, structure: Any, slots: list[torch.Tensor]) -> str:
        """"" when the slots hold the reference's answer for inputs drawn from `seed`, else why not."""
        from kernelpilot.harness.compare import compare_outputs, trial_from
        from kernelpilot.harness.shared import actual_from

        inputs = self.problem.make_inputs(self.device, seed)
        torch.manual_seed(seed)
        with torch.no_grad():
            expected = self.reference(*inputs)
        actual = actual_from(structure, slots)
        leaves = compare_outputs(actual, expected, atol=self.atol, rtol=self.rtol)
        trial = trial_from(seed, leaves)
        if trial.ok:
            self.across.add(leaves, actual, expected)
            self.last = (seed, leaves)
        return "" if trial.ok else trial.message

    def across_runs(self) -> str:
        """After the last checked run: "" unless the checked runs' answers were no better than a constant or than
        ignoring the input (nothing is said where nothing can tell: verification warned of those)."""
        from kernelpilot.harness.compare import trial_from
        from kernelpilot.harness.verify import OwnError, float64_outputs

        if self.last is None:
            return ""
        seed, leaves = self.last
        owned: list[OwnError] = []  # made on first need: the last checked run's inputs and outputs drawn again

        def own_error(name: str) -> float | None:
            if not owned:
                inputs = self.problem.make_inputs(self.device, seed)
                torch.manual_seed(seed)
                with torch.no_grad():
                    expected = self.reference(*inputs)
                owned.append(OwnError(lambda: float64_outputs(self.reference, inputs, expected)[0], expected))
            return owned[0](name)

        self.across.apply(leaves, own_error)
        trial = trial_from(0, leaves)
        return "" if trial.ok else trial.message


def time_model(
    model: Any,
    expected_like: Any,
    *,
    problem: Any,
    device: torch.device,
    seed: int,
    deadline: Deadline,
    checker: Checker | None,
    min_runs: int = 20,
    max_runs: int = 200,
    max_seconds: float = 10.0,
    runs: int | None = None,
    companion: Any = None,
) -> TimedRuns:
    """Time the model a ModelProcess serves on `problem`'s inputs; `expected_like` is one reference output (the
    slots' layout).

    A `companion` (the clean eager process) gets one run after every few of the model's, so that the protocol's
    cost it shows was measured under the same load as the model's runs.
    """
    with SharedArena(device) as arena:
        slots, refs = _slots(arena, expected_like)
        inputs = TimedInputs(problem, arena, device, seed)
        bound = [process for process in (model, companion) if process is not None]
        try:
            return _time_bound(model, companion, slots, refs, inputs, device=device, seed=seed, deadline=deadline,
                               checker=checker, min_runs=min_runs, max_runs=max_runs, max_seconds=max_seconds,
                               runs=runs)  # fmt: skip
        finally:
            for process in bound:  # the slots and inputs go back with the arena: no process keeps them mapped
                process.request("bind", {"slots": [], "inputs": None}, timeout=min(deadline.left(), 30.0))


def _time_bound(model: Any, companion: Any, slots: list[torch.Tensor], refs: list[dict], inputs: TimedInputs, *,
                device: torch.device,
                seed: int, deadline: Deadline, checker: Checker | None, min_runs: int, max_runs: int,
                max_seconds: float, runs: int | None) -> TimedRuns:  # fmt: skip
    """`time_model`'s runs, with the arena's slots made: the model and its companion write the same slots (a run
    that leaves the companion's output there fails its check, which draws the model's own seed)."""
    bound = _bind(model, refs, inputs, deadline)
    if bound is not None:
        return TimedRuns(error_kind=bound.get("error_kind") or "runtime", message=bound.get("message", ""))
    if companion is not None and _bind(companion, refs, inputs, deadline) is not None:
        companion = None
    run_seed = _unforeseeable_seeds()
    started = _clock()
    warm = [_run(model, inputs, next(run_seed), deadline) for _ in range(3)]  # the first pays lazy initialisation
    failed = next((reply for reply, _ in warm if not reply.get("ok")), None)
    if failed is not None:
        return TimedRuns(error_kind=failed.get("error_kind") or "runtime", message=failed.get("message", ""))
    if runs is None:
        per_call_s = statistics.fmean(wall for _, wall in warm[1:]) / 1e3
        runs, note = plan_runs(per_call_s, min_runs=min_runs, max_runs=max_runs, max_seconds=max_seconds)
    else:
        note = ""
    phases = {"warm-up": _clock() - started, "runs": 0.0, "checks": 0.0, "companion": 0.0}
    chooser, sample_size = random.SystemRandom(), min(runs, max(CHECKED_MIN, int(runs * CHECKED_SHARE)))
    checked_runs = set(chooser.sample(range(runs), sample_size))
    # Traced runs are drawn apart from the checked ones: a candidate that can tell a traced run (by the delay its
    # tracing adds, say) learns nothing about which runs are checked.
    traced_runs = set(chooser.sample(range(runs), sample_size)) if checker is not None else set()
    samples, unaccounted, companion_unaccounted, checked = [], [], [], 0
    transport: list[float | None] = []
    companion_transport: list[float | None] = []
    every = max(runs // COMPANION_RUNS, 1)
    for index in range(runs):
        if companion is not None and index % every == 0:
            # Two runs back to back, the second counted: a process that waited through several of the model's runs
            # pays more for its first (seen on an H200: 0.1-0.2 ms), and the model's runs come back to back.
            for _ in range(COMPANION_BURST):
                reply, wall_ms = _run(companion, inputs, next(run_seed), deadline)
                phases["companion"] += wall_ms / 1e3
            if reply.get("ok"):
                companion_unaccounted.append(wall_ms - float(reply.get("ms", 0.0)))
                companion_transport.append(_transport(reply, wall_ms))
        run_seed_now = next(run_seed)
        traced = index in traced_runs
        reply, wall_ms = _run(model, inputs, run_seed_now, deadline, trace=traced)
        phases["runs"] += wall_ms / 1e3
        if not reply.get("ok"):
            kind = reply.get("error_kind") or "runtime"
            return TimedRuns(error_kind=kind, message=f"timed run {index + 1}: {reply.get('message', '')}", checked=checked)
        reported = float(reply.get("ms", 0.0))
        if not traced or runs - len(traced_runs) < 2:  # a traced run's time is the tracing's as much as the model's
            samples.append(reported)
            unaccounted.append(wall_ms - reported)
            transport.append(_transport(reply, wall_ms))
        if checker is not None and index in checked_runs:
            check_started = _clock()
            # The slots as the reply found them, copied before anything else: the model's process keeps them mapped,
            # and an answer it wrote there after its reply, while this side drew the inputs again and ran the
            # reference, would otherwise be what is checked (tests/adversarial/test_computed_ahead.py).
            answered = [slot.clone() for slot in slots]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            problem = checker.mismatch(run_seed_now, reply.get("structure"), answered)
            del answered
            phases["checks"] += _clock() - check_started
            checked += 1
            if problem:
                message = f"timed call {index + 1} of {runs} (seed {run_seed_now}) is wrong: {problem}"
                return TimedRuns(error_kind="mismatch", message=message, checked=checked)
    if checker is not None:
        across = checker.across_runs()
        if across:
            message = f"the {checked} checked timed calls, across them: {across}"
            return TimedRuns(error_kind="mismatch", message=message, checked=checked)
        stopped = _traced_kernels_finding(model, deadline, traced=len(traced_runs))
        if stopped is not None:
            return TimedRuns(error_kind=stopped.error_kind, message=stopped.message, checked=checked, findings=stopped.findings)
    timing = summarize(samples, note=note)
    timing.unaccounted_ms = typical_unaccounted(unaccounted, device.type)
    companion_ms = typical_unaccounted(companion_unaccounted, device.type) if companion_unaccounted else None
    phases = {name: round(seconds, 4) for name, seconds in phases.items()}
    timing.transport_ms = _median(transport)
    return TimedRuns(timing=timing, checked=checked, companion_unaccounted_ms=companion_ms, phases=phases,
                     companion_transport_ms=_median(companion_transport))


def _transport(reply: dict, wall_ms: float) -> float | None:
    in_process = reply.get("in_process_ms")
    return wall_ms - float(in_process) if isinstance(in_process, (int, float)) else None


def _median(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def _unforeseeable_seeds() -> Iterator[int]:
    """Each timed run's seed, drawn from the operating system's randomness (63 bits: any of torch's seeds)."""
    draw = random.SystemRandom()
    while True:
        yield draw.getrandbits(63)


def typical_unaccounted(values: list[float], device_type: str) -> float:
    """The unaccounted time of a series of runs: the median on a GPU, the lower quartile on a CPU (see above)."""
    if device_type == "cuda" or len(values) < 4:
        return statistics.median(values)
    return statistics.quantiles(values, n=4, method="inclusive")[0]


def _slots(arena: SharedArena, expected_like: Any) -> tuple[list[torch.Tensor], list[dict]]:
    """Slots shaped like the reference's outputs, and the references a sandbox maps them by."""
    slots, refs = [], []
    for _, tensor in tensor_leaves(expected_like, "out"):
        slot, ref = arena.like(tensor)
        slots.append(slot)
        refs.append(ref)
    return slots, refs


def _bind(model: Any, refs: list[dict], inputs: TimedInputs, deadline: Deadline) -> dict | None:
    """Bind the slots as the model's timed runs' outputs and the lent inputs as their inputs; the failed reply,
    or None."""
    bound = model.request("bind", {"slots": refs, "inputs": inputs.description}, timeout=deadline.left())
    return None if bound.get("ok") else bound


def _run(model: Any, inputs: TimedInputs, seed: int, deadline: Deadline, *, trace: bool = False) -> tuple[dict, float]:
    """One timed run on the inputs drawn from `seed`; its reply and its wall time on this side's clock, which
    starts once the inputs are in place."""
    args = {"seed": seed, **inputs.feed(seed), **({"trace": True} if trace else {})}
    start = _clock()
    reply = model.request("run", args, timeout=deadline.left())
    return reply, (_clock() - start) * 1e3


def _traced_kernels_finding(model: Any, deadline: Deadline, *, traced: int) -> TimedRuns | None:
    """The verdict on the kernels the `traced` runs launched: None when each launched at least one (a run that
    launches none computed nothing, or its process hid its kernels) and none of them was torch's own compute."""
    reply = model.request("traced_kernels", {}, timeout=deadline.left())
    if not reply.get("ok"):
        return TimedRuns(error_kind=reply.get("error_kind") or "runtime", message=reply.get("message", ""))
    names = [str(name) for name in reply.get("kernels", [])]
    finding = find_torch_kernels(names, during="a timed call")
    if finding is None and reply.get("traced") and len(names) < traced:
        finding = GuardFinding(NO_CUSTOM_KERNEL, "fail",
                               f"{traced} traced timed runs launched {len(names)} kernels: a timed run that launches no "
                               "kernel computed nothing, or its process hid its kernels from the trace.")  # fmt: skip
    if finding is None:
        return None
    return TimedRuns(error_kind="guard", message=f"guard {finding.guard} failed: {finding.message}", findings=[finding])


def find_unaccounted_time(candidate: Timing, clean_unaccounted_ms: float, *, device_type: str = "cuda") -> GuardFinding | None:
    """Fail when the candidate's runs took clearly longer on the trusted clock than it reported, beyond the
    protocol's own cost as the clean (reference) process showed it for the same problem, under the same load."""
    if candidate.unaccounted_ms is None:
        return None
    excess = candidate.unaccounted_ms - clean_unaccounted_ms
    allowed = max(UNACCOUNTED_FLOOR_MS[device_type], UNACCOUNTED_SHARE[device_type] * candidate.median_ms)
    if excess <= allowed:
        return None
    return GuardFinding(
        UNACCOUNTED_TIME,
        "fail",
        f"each timed run took {excess:.3f} ms longer on the judge's clock than the model's process reported "
        f"(median {candidate.median_ms:.3f} ms reported; the protocol's own cost is {clean_unaccounted_ms:.3f} ms, "
        f"at most {allowed:.3f} ms more is allowed): work ran outside the timed window or the timer was changed.",
    )
