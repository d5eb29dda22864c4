"""Correctness of a candidate: trials on fresh seeded inputs against the reference, under the anti-cheat guards.

Runs inside the worker process (device "cuda"; "cpu" for tests). Each trial draws new inputs, runs the reference
on clones of them, fills the allocator's free memory with NaN (CUDA), runs the candidate, compares outputs with
`|actual - expected| <= atol + rtol * |expected|` and runs the guards of guards.py. The first failing trial ends
the run; the result always carries max abs error, max rel error and the worst index of every trial run.

Every call into the candidate's code is wrapped: what it raises is the candidate's "runtime", "oom" or "crash"
error. An exception from anywhere else is kernelpilot's own checking code failing, reported as a "harness" error
with its traceback, never as the candidate's fault (see `_checking_failure` for the exceptions it still blames on
the candidate).
"""

from __future__ import annotations

import copy
import re
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from traceback import extract_tb, format_exception
from typing import Any

import torch

from kernelpilot.harness import guards
from kernelpilot.harness.bench import is_device_failure
from kernelpilot.harness.guards import clone_tree, tensor_leaves
from kernelpilot.results import HARNESS_ERROR, GuardFinding, TrialResult, VerifyResult

# Far apart, so that consecutive trials never draw overlapping random streams by accident.
SEED_STRIDE = 7919
# Above this many bytes of inputs and weights, the float64 reference for the precision check is skipped.
PRECISION_CHECK_MAX_BYTES = 2 * 1024**3
# Elements compared per step, bounding the comparison's temporary memory (a few times 64 MB).
COMPARE_CHUNK = 1 << 24

# Captured when the worker imports this module, before any candidate can replace it.
_synchronize = torch.cuda.synchronize

# Monkeypatch findings of candidate classes whose module patched when it ran: the worker imports a module once,
# so a later verification of the same class would otherwise find everything restored.
_PATCHED_AT_IMPORT: weakref.WeakKeyDictionary[type, GuardFinding] = weakref.WeakKeyDictionary()

# CUDA errors after which the context is unusable: the worker must be replaced, not reused.
_STICKY_CUDA_ERRORS = (
    "illegal memory access", "illegaladdress", "misaligned address", "misalignedaddress", "unspecified launch failure",
    "launchfailure", "device-side assert", "illegal instruction", "illegalinstruction", "hardware stack error",
)  # fmt: skip
_SOURCE_LOCATION = re.compile(r"[\w./\\-]+\.(?:cu|cuh|cpp|cc|h|hpp):\d+")
_KERNELPILOT_DIR = Path(__file__).resolve().parents[1]


def verify_candidate(
    problem: Any,
    candidate_cls: type,
    *,
    device: str,
    trials: int = 5,
    base_seed: int = 0,
    atol: float = 1e-2,
    rtol: float = 1e-2,
    workspace: Path | None = None,
) -> VerifyResult:
    """Run `trials` correctness trials of `candidate_cls` against `problem`'s Model and every applicable guard."""
    started = guards.perf_counter()
    verification = _Verification(problem, torch.device(device), atol=atol, rtol=rtol, workspace=workspace)
    try:
        verification.run(candidate_cls, trials=max(trials, 1), base_seed=base_seed)
    except _Stopped as stop:
        verification.stopped = stop
    except Exception as exc:  # noqa: BLE001 - raised outside the candidate's wrapped calls: see _checking_failure
        verification.stopped = _checking_failure(exc, candidate_cls, verification.workspace)
    result = verification.result()
    result.seconds = guards.perf_counter() - started
    return result


# ------------------------------------------------------------------------------------------ comparison


@dataclass
class LeafComparison:
    """One output (a tensor or a plain value) compared with the reference's."""

    name: str
    ok: bool
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    worst_index: list[int] | None = None
    worst_ratio: float = 0.0  # error / allowed error at worst_index; inf for NaN, Inf and structure problems
    message: str = ""


def compare_outputs(actual: Any, expected: Any, *, atol: float, rtol: float, name: str = "out") -> list[LeafComparison]:
    """Compare two output structures (tensors, tuples, lists, dicts, plain values) leaf by leaf."""
    if isinstance(expected, torch.Tensor):
        return [compare_tensors(name, actual, expected, atol=atol, rtol=rtol)]
    if isinstance(expected, (tuple, list, dict)):
        kind = tuple if isinstance(expected, tuple) else type(expected)
        if not isinstance(actual, kind):
            return [_structure_failure(name, f"is {_describe(actual)}, the reference returns {_describe(expected)}")]
        if len(actual) != len(expected):
            return [_structure_failure(name, f"has {len(actual)} items, the reference's has {len(expected)}")]
        if isinstance(expected, dict):
            if set(actual) != set(expected):
                return [_structure_failure(name, f"has keys {sorted(map(str, actual))}, expected {sorted(map(str, expected))}")]
            pairs = [(f"{name}[{key!r}]", actual[key], expected[key]) for key in expected]
        else:
            pairs = [(f"{name}[{i}]", a, e) for i, (a, e) in enumerate(zip(actual, expected))]
        return [leaf for leaf_name, a, e in pairs for leaf in compare_outputs(a, e, atol=atol, rtol=rtol, name=leaf_name)]
    return [_compare_plain(name, actual, expected, atol=atol, rtol=rtol)]


def compare_tensors(name: str, actual: Any, expected: torch.Tensor, *, atol: float, rtol: float) -> LeafComparison:
    """Shape, dtype, device, then values: NaN/Inf must match the reference's, finite values within tolerance."""
    if not isinstance(actual, torch.Tensor):
        return _structure_failure(name, f"is {_describe(actual)}, the reference returns a tensor")
    for attribute in ("shape", "dtype", "device"):
        got, want = getattr(actual, attribute), getattr(expected, attribute)
        if got != want:
            return _structure_failure(name, f"has {attribute} {_show(got)}, the reference's is {_show(want)}")
    if expected.is_complex():
        actual, expected = torch.view_as_real(actual.resolve_conj()), torch.view_as_real(expected.resolve_conj())
    if not expected.is_floating_point():
        atol = rtol = 0.0  # integers and booleans must match exactly
    errors = _ElementErrors(expected.shape)
    flat_actual, flat_expected = actual.reshape(-1), expected.reshape(-1)
    for start in range(0, flat_expected.numel(), COMPARE_CHUNK):
        stop = start + COMPARE_CHUNK
        errors.add(flat_actual[start:stop], flat_expected[start:stop], start, atol=atol, rtol=rtol)
    return errors.verdict(name, flat_actual, flat_expected)


class _ElementErrors:
    """Running error statistics of one tensor, accumulated chunk by chunk."""

    def __init__(self, shape: torch.Size):
        self.shape = shape
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.worst_ratio = 0.0
        self.worst_flat: int | None = None
        self.outside_tolerance = 0
        self.extra_nan = 0  # NaN where the reference has a number
        self.missing_nan = 0  # a number where the reference has NaN
        self.wrong_inf = 0  # Inf where the reference has a finite value or the other Inf
        self.first_non_finite: int | None = None

    def add(self, actual: torch.Tensor, expected: torch.Tensor, offset: int, *, atol: float, rtol: float) -> None:
        compute_dtype = torch.float64 if expected.dtype == torch.float64 else torch.float32
        a, b = actual.to(compute_dtype), expected.to(compute_dtype)
        nan_a, nan_b = a.isnan(), b.isnan()
        wrong_inf = (a.isinf() | b.isinf()) & (a != b) & ~nan_a & ~nan_b
        wrong_non_finite = (nan_a != nan_b) | wrong_inf
        self.extra_nan += int((nan_a & ~nan_b).sum())
        self.missing_nan += int((nan_b & ~nan_a).sum())
        self.wrong_inf += int(wrong_inf.sum())
        if self.first_non_finite is None and bool(wrong_non_finite.any()):
            self.first_non_finite = offset + int(wrong_non_finite.nonzero()[0, 0])

        finite = a.isfinite() & b.isfinite()
        difference = torch.where(finite, (a - b).abs(), 0.0)
        allowed = atol + rtol * torch.where(finite, b.abs(), 0.0)
        self.outside_tolerance += int((difference > allowed).sum())
        ratio = difference / allowed.clamp_min(torch.finfo(compute_dtype).tiny)
        relative = torch.where(finite & (b != 0), difference / b.abs(), 0.0)
        self.max_abs = max(self.max_abs, float(difference.max()))
        self.max_rel = max(self.max_rel, float(relative.max()))
        chunk_worst = int(ratio.argmax())
        if self.worst_flat is None or float(ratio[chunk_worst]) > self.worst_ratio:
            self.worst_ratio, self.worst_flat = float(ratio[chunk_worst]), offset + chunk_worst

    def verdict(self, name: str, actual: torch.Tensor, expected: torch.Tensor) -> LeafComparison:
        comparison = LeafComparison(name, True, self.max_abs, self.max_rel, worst_ratio=self.worst_ratio)
        if self.worst_flat is None:  # an empty tensor
            return comparison
        if self.first_non_finite is not None:
            comparison.ok, comparison.worst_ratio = False, float("inf")
            comparison.worst_index = unravel_index(self.first_non_finite, self.shape)
            comparison.message = f"{name} {self._non_finite_text()} (first at {comparison.worst_index})"
            return comparison
        comparison.worst_index = unravel_index(self.worst_flat, self.shape)
        if self.outside_tolerance:
            got, want = actual[self.worst_flat].item(), expected[self.worst_flat].item()
            comparison.ok = False
            comparison.message = (
                f"{name}: {self.outside_tolerance} of {expected.numel()} elements outside tolerance; max abs error "
                f"{self.max_abs:.3g}, max rel error {self.max_rel:.3g}; worst at {comparison.worst_index}: "
                f"got {got:.6g}, expected {want:.6g}"
            )
        return comparison

    def _non_finite_text(self) -> str:
        parts = []
        if self.extra_nan:
            parts.append(f"has NaN at {self.extra_nan} positions where the reference has none")
        if self.missing_nan:
            parts.append(f"has numbers at {self.missing_nan} positions where the reference has NaN")
        if self.wrong_inf:
            parts.append(f"has Inf at {self.wrong_inf} positions where the reference differs")
        return " and ".join(parts)


def unravel_index(flat: int, shape: torch.Size) -> list[int]:
    """The multi-dimensional index of element `flat` of a contiguous tensor of `shape`."""
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return index[::-1]


def _compare_plain(name: str, actual: Any, expected: Any, *, atol: float, rtol: float) -> LeafComparison:
    """Numbers within tolerance; anything else (None, strings) must be equal."""
    numbers = (bool, int, float)
    if isinstance(expected, numbers) and isinstance(actual, numbers):
        error = abs(float(actual) - float(expected))
        relative = error / abs(float(expected)) if expected else 0.0
        ok = error <= atol + rtol * abs(float(expected))
        message = "" if ok else f"{name} is {actual!r}, the reference's is {expected!r}"
        return LeafComparison(name, ok, error, relative, worst_ratio=0.0 if ok else float("inf"), message=message)
    if type(actual) is type(expected) and actual == expected:
        return LeafComparison(name, True)
    return _structure_failure(name, f"is {actual!r}, the reference's is {expected!r}")


def _structure_failure(name: str, what: str) -> LeafComparison:
    return LeafComparison(name, False, worst_ratio=float("inf"), message=f"{name} {what}")


def _describe(value: Any) -> str:
    kind = type(value).__name__ if not isinstance(value, torch.Tensor) else "tensor"
    return "None" if value is None else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _show(value: Any) -> str:
    return str(tuple(value)) if isinstance(value, torch.Size) else str(value)


def trial_from(seed: int, leaves: list[LeafComparison]) -> TrialResult:
    """A trial's numbers: the largest errors over all outputs, the worst index of the worst output."""
    failing = [leaf for leaf in leaves if not leaf.ok]
    trial = TrialResult(seed=seed, ok=not failing)
    if not leaves:
        return trial
    worst = max(failing or leaves, key=lambda leaf: leaf.worst_ratio)
    abs_errors = [leaf.max_abs_error for leaf in leaves if leaf.max_abs_error is not None]
    rel_errors = [leaf.max_rel_error for leaf in leaves if leaf.max_rel_error is not None]
    trial.max_abs_error = max(abs_errors) if abs_errors else None
    trial.max_rel_error = max(rel_errors) if rel_errors else None
    trial.worst_index, trial.output = worst.worst_index, worst.name
    trial.message = "; ".join(leaf.message for leaf in failing[:3])
    return trial


# ------------------------------------------------------------------------------------------ poisoning


def poison_free_memory(device: torch.device, output_bytes: list[int]) -> None:
    """Fill the caching allocator's free blocks on the current stream with 0xFF bytes, NaN in every float type.

    Each free block is claimed by an allocation of exactly its size, filled and released, and so is a fresh
    block of each output's size; an output the candidate allocates but does not fully write then shows NaN
    instead of a previous result (the reference's, or an earlier trial's) that happened to lie there.
    """
    stream = torch.cuda.current_stream(device).cuda_stream
    free_blocks = [
        block["size"]
        for segment in torch.cuda.memory_snapshot()
        if segment["device"] == device.index and segment["stream"] == stream
        for block in segment["blocks"]
        if block["state"] == "inactive"
    ]
    claimed = []
    try:
        for size in [*free_blocks, *output_bytes]:
            claimed.append(torch.empty(size, dtype=torch.uint8, device=device).fill_(0xFF))
    except torch.cuda.OutOfMemoryError:
        pass  # what was claimed so far is poisoned; the rest stays as it is
    del claimed


# ------------------------------------------------------------------------------------------ the run


class _Stopped(Exception):
    """Ends the run early: the candidate (or the reference) raised, or the checking code failed."""

    def __init__(self, kind: str, message: str, traceback: str = ""):
        super().__init__(message)
        self.kind, self.message, self.traceback = kind, message, traceback


@dataclass
class _ReferenceRun:
    """The reference's output on clones of a trial's inputs, and how it treated those inputs."""

    output: Any
    mutated_inputs: set[str]
    aliases_inputs: bool


class _Verification:
    """State of one verify_candidate call: models, trial results, guard findings, what the last call returned."""

    def __init__(self, problem: Any, device: torch.device, *, atol: float, rtol: float, workspace: Path | None):
        self.problem, self.device, self.atol, self.rtol = problem, device, atol, rtol
        self.workspace = Path(workspace) if workspace is not None else None
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.trials: list[TrialResult] = []
        self.findings: list[GuardFinding] = []
        self.notes: list[str] = []
        self.previous: guards.PreviousCall | None = None
        self.stopped: _Stopped | None = None

    # ---------------------------------------------------------------- driving

    def run(self, candidate_cls: type, *, trials: int, base_seed: int) -> None:
        self._check_import_patches(candidate_cls)
        if self.workspace is not None:
            self._record(guards.find_tampered_files(self.workspace))
        self.reference, self.candidate = self._build_models(candidate_cls, base_seed)
        try:
            for index in range(trials):
                trial = self._run_trial(index, base_seed + index * SEED_STRIDE, last=index == trials - 1)
                self.trials.append(trial)
                if not trial.ok:
                    break
        finally:
            self._check_functions("after forward")
            self.previous = None

    def _run_trial(self, index: int, seed: int, *, last: bool) -> TrialResult:
        try:
            inputs = self.problem.make_inputs(self.device, seed)
        except Exception as exc:  # noqa: BLE001 - a broken problem is reported, not raised
            message = f"the problem's get_inputs() raised {describe_exception(exc)} (seed {seed})"
            raise _Stopped("reference", message) from None
        inputs_before = clone_tree(inputs)
        reference = self._run_reference(inputs, seed)
        if self.cuda:
            poison_free_memory(self.device, [t.nbytes for _, t in tensor_leaves(reference.output, "out")])
        actual, read_at_return = self._run_candidate(inputs, seed)

        trial = trial_from(seed, compare_outputs(actual, reference.output, atol=self.atol, rtol=self.rtol))
        failed_guards = self._check_call(actual, read_at_return, inputs, inputs_before, reference)
        if last and self.cuda and not failed_guards:
            # After the last trial: a candidate that stops computing after its first call is caught by the
            # cached-output guards on trial 2, and is not also reported for the kernels its later calls skip.
            failed_guards = self._check_profiled_call(inputs_before, seed)
        if index == 0 and trial.ok and not failed_guards:
            self._check_precision(inputs_before, actual, reference.output)
        if failed_guards:
            trial.ok = False
            trial.message = "; ".join(filter(None, [f"guards failed: {', '.join(failed_guards)}", trial.message]))
        return trial

    def _build_models(self, candidate_cls: type, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
        """The reference Model and `candidate_cls(*init_inputs)` holding the same weights, on the device."""
        torch.manual_seed(seed)
        try:
            reference = self.problem.make_model("cpu")
        except Exception as exc:  # noqa: BLE001 - a broken problem is reported, not raised
            message = f"the reference Model(*get_init_inputs()) raised {describe_exception(exc)}"
            raise _Stopped("reference", message) from None
        try:
            candidate = candidate_cls(*self.problem.init_inputs)
        except Exception as exc:  # noqa: BLE001 - the user's constructor failing is a result, not a crash
            raise _Stopped("init", f"ModelNew(*get_init_inputs()) raised {describe_exception(exc)}") from None
        if not isinstance(candidate, torch.nn.Module):
            raise _Stopped("init", f"ModelNew is {_describe(candidate)}, not a torch.nn.Module")
        try:
            candidate.load_state_dict(reference.state_dict(), strict=True)
        except RuntimeError as exc:
            detail = " ".join(str(exc).split())[:400]
            raise _Stopped("init", f"ModelNew's parameters and buffers do not match Model's state_dict: {detail}") from None
        try:
            return reference.to(self.device), candidate.to(self.device).train(reference.training)
        except Exception as exc:  # noqa: BLE001
            raise _Stopped(*_failure_kind(exc, "moving the models to the device")) from None

    def _run_reference(self, inputs: list, seed: int) -> _ReferenceRun:
        reference_inputs = clone_tree(inputs)
        try:
            torch.manual_seed(seed)
            with torch.no_grad():
                output = self.reference(*reference_inputs)
        except Exception as exc:  # noqa: BLE001 - a broken problem is reported, not raised
            raise _Stopped("reference", f"the reference Model raised {describe_exception(exc)} (seed {seed})") from None
        after = tensor_leaves(reference_inputs, "inputs")
        before = tensor_leaves(inputs, "inputs")
        return _ReferenceRun(
            output=output,
            mutated_inputs={name for (name, a), (_, b) in zip(after, before) if not guards.same_values(a, b)},
            aliases_inputs=bool(guards.aliased_pairs(tensor_leaves(output, "out"), after)),
        )

    def _run_candidate(self, inputs: list, seed: int) -> tuple[Any, Any]:
        """The candidate's output, and (CUDA) a copy of it read the moment forward returned."""
        recorder = guards.AtenOpRecorder()
        try:
            with torch.no_grad(), recorder:
                actual = self.candidate(*inputs)
            read_at_return = clone_tree(actual) if self.cuda else None
            if self.cuda:
                _synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - every failure of the candidate becomes a result
            kind, message = _failure_kind(exc, f"ModelNew.forward (seed {seed})")
            raise _Stopped(kind, message) from None
        self._record(guards.find_torch_compute(recorder.counts))
        return actual, read_at_return

    # ---------------------------------------------------------------- guards

    def _check_call(
        self, actual: Any, read_at_return: Any, inputs: list, inputs_before: list, reference: _ReferenceRun
    ) -> list[str]:
        """Run the per-call guards; return the names of those that failed (torch-compute included)."""
        outputs = tensor_leaves(actual, "out")
        expected = tensor_leaves(reference.output, "reference out")
        findings = [
            guards.find_output_aliasing(
                outputs, tensor_leaves(inputs, "inputs"), expected, reference_aliases_inputs=reference.aliases_inputs
            ),
            guards.find_mutated_inputs(
                tensor_leaves(inputs, "inputs"), tensor_leaves(inputs_before, "inputs"), mutable=reference.mutated_inputs
            ),
            guards.find_module_held_output(outputs, self.candidate),
        ]
        if read_at_return is not None:
            findings.append(guards.find_unsynced_output(tensor_leaves(read_at_return, "out"), outputs))
        if self.previous is not None:
            findings.append(guards.find_reused_output(outputs, self.previous))
            findings.append(guards.find_repeated_values(outputs, expected, self.previous))
        for finding in findings:
            self._record(finding)
        self.previous = guards.PreviousCall(
            outputs=[(f"previous {name}", t) for name, t in outputs],
            values=[(f"previous {name}", t.clone()) for name, t in outputs],
            reference_values=expected,
        )
        return sorted({f.guard for f in self.findings if f.severity == "fail"})

    def _check_profiled_call(self, inputs_before: list, seed: int) -> list[str]:
        """One more forward under the profiler: its own kernels, torch's kernels, side streams (CUDA only)."""
        profile_inputs = clone_tree(inputs_before)

        def forward() -> None:
            try:
                with torch.no_grad():
                    self.candidate(*profile_inputs)
            except Exception as exc:  # noqa: BLE001 - the candidate's failure, not the profiler's
                raise _Stopped(*_failure_kind(exc, f"ModelNew.forward under the profiler (seed {seed})")) from None

        profiled = guards.profile_forward(forward, self.device)
        names = [kernel.name for kernel in profiled.kernels]
        source = guards.workspace_kernel_source(self.workspace) if self.workspace is not None else None
        self._record(guards.find_no_custom_kernel(names, source))
        self._record(guards.find_torch_kernels(names))
        self._record(guards.find_unsynced_side_stream(profiled))
        return sorted({f.guard for f in self.findings if f.severity == "fail"})

    def _check_precision(self, inputs: list, actual: Any, expected: Any) -> None:
        """Warn when fp32 outputs look computed in half precision, judged against a float64 reference."""
        # Each fp32 output keeps its leaf index, which finds its own value among the fp64 reference's outputs.
        leaf_pairs = zip(tensor_leaves(actual, "out"), tensor_leaves(expected, "out"))
        checked = [
            (index, out, ref)
            for index, ((_, out), (_, ref)) in enumerate(leaf_pairs)
            if ref.dtype == torch.float32 and out.dtype == torch.float32 and ref.numel() > 0
        ]
        if not checked:
            return
        size = sum(t.nbytes for _, t in tensor_leaves(inputs, "in")) + sum(
            t.nbytes for t in self.reference.state_dict().values()
        )
        if size > PRECISION_CHECK_MAX_BYTES:
            self.notes.append(f"precision check skipped: inputs and weights are {size / 1024**3:.1f} GB")
            return
        try:
            reference64 = copy.deepcopy(self.reference).double()
            with torch.no_grad():
                exact = reference64(*[_as_float64(item) for item in inputs])
        except Exception as exc:  # noqa: BLE001 - some models have no float64 path; the check is optional
            self.notes.append(f"precision check skipped: the reference does not run in float64 ({describe_exception(exc)})")
            return
        exact_leaves = [leaf for _, leaf in tensor_leaves(exact, "out")]
        for index, out, ref in checked:
            self._record(guards.find_precision_drop(out, ref, exact_leaves[index]))

    def _check_functions(self, when: str) -> None:
        self._record(guards.find_monkeypatches(guards.PRISTINE_FUNCTIONS, when=when))
        guards.restore_functions(guards.PRISTINE_FUNCTIONS)

    def _check_import_patches(self, candidate_cls: type) -> None:
        """Patches made when the candidate's module ran; remembered, since a worker imports a module only once."""
        finding = guards.find_monkeypatches(guards.PRISTINE_FUNCTIONS, when="after the candidate was imported")
        guards.restore_functions(guards.PRISTINE_FUNCTIONS)
        if finding is not None:
            _PATCHED_AT_IMPORT[candidate_cls] = finding
        self._record(_PATCHED_AT_IMPORT.get(candidate_cls))

    def _record(self, finding: GuardFinding | None) -> None:
        """Keep the first finding of each guard (a guard that fires on every trial is reported once)."""
        if finding is not None and all(f.guard != finding.guard for f in self.findings):
            self.findings.append(finding)

    # ---------------------------------------------------------------- result

    def result(self) -> VerifyResult:
        result = VerifyResult(ok=False, trials=self.trials, guards=self.findings, atol=self.atol, rtol=self.rtol)
        failed = [f for f in self.findings if f.severity == "fail"]
        mismatched = next((t for t in self.trials if not t.ok), None)
        stopped, notes = self.stopped, list(self.notes)
        if stopped is not None:
            result.traceback = stopped.traceback
            if stopped.kind == HARNESS_ERROR and failed:
                # A guard that failed before the checking code broke is a verdict on the candidate all the same.
                stopped, notes = None, [*notes, stopped.message]
        if stopped is not None:
            result.error_kind, result.message = stopped.kind, stopped.message
        elif failed:
            result.error_kind = "guard"
            result.message = f"guard {failed[0].guard} failed: {failed[0].message}"
            if len(failed) > 1:
                result.message += f" (also failed: {', '.join(f.guard for f in failed[1:])})"
        elif mismatched is not None:
            result.error_kind = "mismatch"
            result.message = f"trial {self.trials.index(mismatched) + 1} (seed {mismatched.seed}): {mismatched.message}"
        else:
            result.ok = True
            result.message = self._passed_message(result)
        if notes:
            result.message += " (" + "; ".join(notes) + ")"
        if self.stopped is not None and self.stopped.kind == "oom" and self.cuda:
            torch.cuda.empty_cache()
        return result

    def _passed_message(self, result: VerifyResult) -> str:
        warnings = [f.guard for f in self.findings if f.severity == "warn"]
        text = (
            f"{len(self.trials)} trials passed: max abs error {result.max_abs_error or 0.0:.3g}, "
            f"max rel error {result.max_rel_error or 0.0:.3g}"
        )
        return text + (f"; warnings: {', '.join(warnings)}" if warnings else "")


def _as_float64(item: Any) -> Any:
    return item.double() if isinstance(item, torch.Tensor) and item.dtype == torch.float32 else item


def _checking_failure(exc: Exception, candidate_cls: type, workspace: Path | None) -> _Stopped:
    """Whose fault an exception raised outside the candidate's wrapped calls is.

    A CUDA error or running out of device memory reflects the device's state, which the candidate's kernels left
    (the checks run torch's own kernels on valid tensors); an exception raised while the candidate's code ran
    inside a check (a method of a tensor subclass it returned, an override on its module) is the candidate's;
    anything else is a bug in kernelpilot's checking code: a "harness" error, with the traceback for a report.
    """
    if is_device_failure(exc):  # OOM or a CUDA error, on every torch kernelpilot supports
        return _Stopped(*_failure_kind(exc, "checking ModelNew's results"))
    if _ran_candidate_code(exc, candidate_cls, workspace):
        return _Stopped("runtime", f"ModelNew's code raised {describe_exception(exc)} while its results were checked")
    place = next((f for f in reversed(extract_tb(exc.__traceback__)) if _in_kernelpilot(f.filename)), None)
    where = f" (in {place.name}, {Path(place.filename).name}:{place.lineno})" if place is not None else ""
    message = (
        f"kernelpilot's verifier failed, not the candidate: {describe_exception(exc)}{where}. This is a bug in "
        "kernelpilot; please report it with the traceback kept in the verify result's `traceback` field "
        "(`kernelpilot eval` prints it)."
    )
    return _Stopped(HARNESS_ERROR, message, "".join(format_exception(exc)))


def _ran_candidate_code(exc: BaseException, candidate_cls: type, workspace: Path | None) -> bool:
    """True when a frame of `exc`'s traceback is the candidate's: in its module's file or its workspace."""
    module_file = getattr(sys.modules.get(candidate_cls.__module__), "__file__", None)
    candidate_file = Path(module_file).resolve() if module_file else None
    workspace_root = workspace.resolve() if workspace is not None else None
    for frame in extract_tb(exc.__traceback__):
        path = Path(frame.filename).resolve()
        if path == candidate_file or (workspace_root is not None and path.is_relative_to(workspace_root)):
            return True
    return False


def _in_kernelpilot(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(_KERNELPILOT_DIR)


def _failure_kind(exc: BaseException, during: str) -> tuple[str, str]:
    """("oom" | "crash" | "runtime", one-line message) for an exception raised by the candidate."""
    message = f"{during} raised {describe_exception(exc)}"
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "oom", message
    text = str(exc).lower()
    if any(marker in text for marker in _STICKY_CUDA_ERRORS):
        return "crash", message
    return "runtime", message


def describe_exception(exc: BaseException) -> str:
    """`Type: first line`, plus the first kernel source location the message names when the first line has none."""
    lines = str(exc).strip().splitlines()
    first = lines[0][:300] if lines else ""
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    location = _SOURCE_LOCATION.search(str(exc))
    if location and location.group(0) not in first:
        text += f" (at {location.group(0)})"
    return text
