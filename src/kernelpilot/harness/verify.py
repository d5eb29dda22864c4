"""TRUSTED side: correctness of a model under test, trials on fresh seeded inputs against the reference.

Runs in the judge's worker, where no candidate code ever runs: the model under test lives in a sandbox process
(`sandbox.py`). Each trial draws new inputs here, runs the reference on clones of them, lends the sandbox a shared
copy of the inputs and output slots poisoned with NaN (`shared.py`), and asks it for one call. What counts comes
from this side: the comparison of the slots with the reference (`|actual - expected| <= atol + rtol * |expected|`,
plus a scale check where that band is wider than the outputs themselves, and after the last trial one across the
trials for outputs too small or uniform for it, such as a mean loss), the inputs left unchanged, outputs
that follow their inputs, the protected files, the float64 precision check. What the sandbox reports about
itself (torch ops it saw, kernels under its profiler, aliasing) is recorded too: it catches honest mistakes.
The first failing trial ends the run.

A failure of the model (it raised, ran out of memory, broke its CUDA context, hung, died) comes back as the
sandbox's reply and is the candidate's verdict; an exception of this side's own code is a "harness" error with
its traceback, never the candidate's fault.
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from traceback import extract_tb, format_exception
from typing import Any

import torch

from kernelpilot.harness import guards
from kernelpilot.harness.compare import (
    COMPARE_CHUNK,
    SCALE_UNDECIDED,
    compare_outputs,
    rms_difference,
    rounding_noise_reason,
    trial_from,
)
from kernelpilot.harness.element_trials import ChecksAcrossTrials
from kernelpilot.harness.failures import describe_exception, failure_kind, is_device_failure
from kernelpilot.harness.guards import clone_tree, tensor_leaves
from kernelpilot.harness.process import Deadline
from kernelpilot.harness.shared import SharedArena, actual_from, share_tree
from kernelpilot.harness.symbols import calls_library, find_no_own_kernel, find_torch_compute_symbols, undefined_symbols
from kernelpilot.results import HARNESS_ERROR, NOT_APPLICABLE, SLOWER, GuardFinding, TrialResult, VerifyResult

# Far apart, so that consecutive trials never draw overlapping random streams by accident.
SEED_STRIDE = 7919
# Above this many bytes of inputs and weights, the float64 reference for the precision check is skipped.
PRECISION_CHECK_MAX_BYTES = 2 * 1024**3
# Above this many bytes of outputs a trial hands its cached blocks back to the device before the next one.
LARGE_OUTPUT_BYTES = 1 << 30
# A verification given a time to beat stops once a warm call takes longer than this many times it, plus the slack
# (a call's own overhead: copies into the judge's slots, the op recorder): only configurations that cannot win.
SLOWER_FACTOR = 3.0
SLOWER_SLACK_MS = 20.0
_KERNELPILOT_DIR = Path(__file__).resolve().parents[1]


def random_seed() -> int:
    """A seed nobody can predict, recorded in the result so the run can be reproduced."""
    return secrets.randbelow(2**31 - SEED_STRIDE * 64)


def verify_candidate(
    problem: Any,
    model: Any,
    *,
    device: str,
    trials: int = 5,
    base_seed: int | None = None,
    atol: float = 1e-2,
    rtol: float = 1e-2,
    workspace: Path | None = None,
    library: str | None = None,
    timeout: float = 600.0,
    make_inputs: Callable[[torch.device, int], list] | None = None,
    slower_than_ms: float | None = None,
) -> VerifyResult:
    """Run `trials` correctness trials of the model a `sandbox_client.ModelProcess` serves against `problem`.

    `base_seed` None draws one at random; the model process must hold weights drawn under the same seed.
    `make_inputs` (device, seed) -> inputs replaces the problem's own draws (`variants.py`'s shape variants); an
    InputsNotApplicable it raises ends the run as NOT_APPLICABLE.
    `slower_than_ms` (a launch search's best time so far) stops the run after its second trial, as SLOWER, when
    that trial's call took more than SLOWER_FACTOR times as long plus SLOWER_SLACK_MS: the candidate cannot win.
    `library` is the candidate's built extension: its undefined symbols are checked for torch compute here, on the
    trusted side, without loading it.
    """
    started = guards.perf_counter()
    base_seed = random_seed() if base_seed is None else base_seed
    verification = _Verification(problem, torch.device(device), model, atol=atol, rtol=rtol, workspace=workspace,
                                 library=library, timeout=timeout, make_inputs=make_inputs,
                                 slower_than_ms=slower_than_ms)  # fmt: skip
    try:
        verification.run(trials=max(trials, 1), base_seed=base_seed)
    except _Stopped as stop:
        verification.stopped = stop
    except Exception as exc:  # noqa: BLE001 - this side's own code failing: see _checking_failure
        verification.stopped = _checking_failure(exc)
    result = verification.result()
    result.base_seed = base_seed
    result.input_shapes = verification.input_shapes
    result.phases = {name: round(seconds, 4) for name, seconds in verification.phases.items()}
    result.seconds = guards.perf_counter() - started
    return result


# ---------------------------------------------------------------------------------- fingerprints

_FINGERPRINT_SALT = secrets.randbits(62) | 1
_INTEGER_VIEWS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def fingerprint(tensor: torch.Tensor) -> int:
    """A hash of a tensor's bytes (NaN payloads included) under a salt drawn per process: equal values give equal
    fingerprints, different ones almost surely not. Computed in chunks, so a multi-GB output needs no copy."""
    if tensor.numel() == 0:
        return 0
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    words = flat.view(_INTEGER_VIEWS[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for start in range(0, words.numel(), COMPARE_CHUNK):
        chunk = words[start : start + COMPARE_CHUNK].to(torch.int64)
        index = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=tensor.device)
        total += (chunk * (index * 2654435761 + _FINGERPRINT_SALT)).sum()  # wraps modulo 2**64
    return int(total) ^ hash((tuple(tensor.shape), str(tensor.dtype)))


# ---------------------------------------------------------------------------------- outputs from slots


def fill_poison(tensor: torch.Tensor) -> None:
    """NaN in a float slot (0xFF bytes otherwise): a slot the model never wrote cannot look right."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    else:
        tensor.fill_(-1)


# ------------------------------------------------------------------------------------------ the run


class InputsNotApplicable(Exception):
    """An input maker cannot make its inputs from the problem's (a shape variant that does not apply)."""


class _Stopped(Exception):
    """Ends the run early: the model (or the reference) failed, or the checking code did."""

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
    """State of one verify_candidate call: the reference, trial results, guard findings, the last trial's slots."""

    def __init__(self, problem: Any, device: torch.device, model: Any, *, atol: float, rtol: float,
                 workspace: Path | None, library: str | None, timeout: float,
                 make_inputs: Callable[[torch.device, int], list] | None = None,
                 slower_than_ms: float | None = None):  # fmt: skip
        self.problem, self.device, self.model, self.atol, self.rtol = problem, device, model, atol, rtol
        self.make_inputs = make_inputs or problem.make_inputs
        self.input_shapes: list[list[int] | None] | None = None  # of the first trial's inputs
        self.library = library
        self.libraries_called: set[str] = set()
        self.workspace = Path(workspace) if workspace is not None else None
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.deadline = Deadline(timeout)
        self.trials: list[TrialResult] = []
        self.across_trials = ChecksAcrossTrials(atol=atol, rtol=rtol)  # answers no better than a constant
        self.findings: list[GuardFinding] = []
        self.notes: list[str] = []
        self.previous: list[tuple[str, int, int]] | None = None  # per output: name, fingerprints of slot and reference
        self.stopped: _Stopped | None = None
        self.phases: dict[str, float] = {}
        self.output_bytes = 0
        self.slower_than_ms = slower_than_ms  # a time to beat: see _stop_if_far_slower
        self.call_seconds: list[float] = []  # each trial's call, as the sandbox timed it

    # ---------------------------------------------------------------- driving

    def run(self, *, trials: int, base_seed: int) -> None:
        hello = self.model.hello
        if not hello.get("ok"):
            raise _Stopped(hello.get("error_kind") or "load", hello.get("message") or "the model could not be loaded")
        for finding in hello.get("import_findings", []):
            self._record_reported(finding)
        if self.library:  # the extension's own references to torch compute, read from its symbol table
            symbols = undefined_symbols(Path(self.library))
            self._record(find_torch_compute_symbols(symbols))
            self.libraries_called = calls_library(symbols)
        self.reference = self._build_reference(base_seed)
        try:
            for index in range(trials):
                # An arena per trial: what one trial lent the sandbox goes back before the next (a multi-GB output
                # would otherwise stay held once per trial).
                with SharedArena(self.device) as arena:
                    trial = self._run_trial(arena, index, base_seed + index * SEED_STRIDE, last=index == trials - 1)
                self.trials.append(trial)
                if self.cuda and self.output_bytes > LARGE_OUTPUT_BYTES:
                    torch.cuda.empty_cache()  # one trial's multi-GB blocks back, for the sandbox's next call
                if not trial.ok:
                    break
                self._stop_if_far_slower(index)
        finally:
            self.previous = None
            if self.workspace is not None:  # after the model ran: it may have rewritten a protected file
                self._record(guards.find_tampered_files(self.workspace))

    def _run_trial(self, arena: SharedArena, index: int, seed: int, *, last: bool) -> TrialResult:
        phase = self._phase
        with phase("inputs"):
            try:
                inputs = self.make_inputs(self.device, seed)
            except InputsNotApplicable as exc:
                raise _Stopped(NOT_APPLICABLE, str(exc)) from None
            except Exception as exc:  # noqa: BLE001 - a broken problem is reported, not raised
                message = f"the problem's get_inputs() raised {describe_exception(exc)} (seed {seed})"
                raise _Stopped("reference", message) from None
            inputs_before = clone_tree(inputs)
            if self.input_shapes is None:
                self.input_shapes = [list(item.shape) if isinstance(item, torch.Tensor) else None for item in inputs]
        with phase("reference"):
            reference = self._run_reference(inputs, seed)
        with phase("share"):
            shared_inputs, inputs_description = share_tree(arena, inputs)
            expected = tensor_leaves(reference.output, "out")
            self.output_bytes = sum(t.nbytes for _, t in expected)
            slots, slot_refs = [], []
            for _, tensor in expected:
                slot, slot_ref = arena.like(tensor)
                fill_poison(slot)
                slots.append(slot)
                slot_refs.append(slot_ref)
        with phase("candidate call"):
            reply = self.model.request(
                "call",
                {"inputs": inputs_description, "slots": slot_refs, "seed": seed,
                 "reference_aliases_inputs": reference.aliases_inputs},  # fmt: skip
                timeout=self.deadline.left(),
            )
        if not reply.get("ok"):
            raise _Stopped(reply.get("error_kind") or "runtime", reply.get("message") or "the call failed")
        for finding in reply.get("findings", []):
            self._record_reported(finding)
        call_seconds = (reply.get("seconds") or {}).get("call")
        self.call_seconds.append(float(call_seconds) if isinstance(call_seconds, (int, float)) else 0.0)
        for name, seconds in dict(reply.get("seconds") or {}, poison=reply.get("poison_s", 0.0)).items():
            if isinstance(seconds, (int, float)):
                self.phases[f"sandbox: {name}"] = self.phases.get(f"sandbox: {name}", 0.0) + float(seconds)
        with phase("compare"):
            actual = actual_from(reply.get("structure"), slots)
            leaves = compare_outputs(actual, reference.output, atol=self.atol, rtol=self.rtol)
        if any(leaf.scale_only for leaf in leaves):
            with phase("reference noise"):
                self._explain_rounding_noise(inputs_before, leaves, reference.output)
        self.across_trials.add(leaves, actual, reference.output)
        if last and all(leaf.ok for leaf in leaves):
            with phase("across trials"):
                self._check_across_trials(inputs_before, leaves, reference.output)
        trial = trial_from(seed, leaves)
        with phase("trusted guards"):
            self._check_trusted(shared_inputs, inputs_before, reference, slots, expected)
        failed_guards = self._failed_guards()
        if last and self.cuda and not failed_guards:
            # After the last trial: a model that stops computing after its first call is caught by the repeated
            # values guard on trial 2, and is not also reported for the kernels its later calls skip.
            with phase("profiled call"):
                failed_guards = self._check_profiled_call(arena, inputs_before, seed)
        if index == 0 and trial.ok and not failed_guards:
            with phase("precision"):
                self._check_precision(inputs_before, actual, reference.output)
        if failed_guards:
            trial.ok = False
            trial.message = "; ".join(filter(None, [f"guards failed: {', '.join(failed_guards)}", trial.message]))
        return trial

    def _stop_if_far_slower(self, index: int) -> None:
        """After the second trial (the first warm call), stop a candidate whose call took far longer than the time
        it must beat. The sandbox's own clock decides: it is the candidate's word, but a lie can only stop it."""
        if self.slower_than_ms is None or index != 1:
            return
        call_ms, bound_ms = self.call_seconds[1] * 1000.0, self.slower_than_ms * SLOWER_FACTOR + SLOWER_SLACK_MS
        if call_ms > bound_ms:
            raise _Stopped(SLOWER, f"stopped after 2 trials: a call took {call_ms:.4g} ms, more than "
                                   f"{SLOWER_FACTOR:g}x the {self.slower_than_ms:.4g} ms to beat "
                                   f"(+{SLOWER_SLACK_MS:g} ms); not verified further, not timed")  # fmt: skip

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Seconds spent in each step of the trials, device work included (where a verification's time goes)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        started = guards.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.phases[name] = self.phases.get(name, 0.0) + guards.perf_counter() - started

    def _build_reference(self, seed: int) -> torch.nn.Module:
        """The reference Model with the weights drawn under `seed`: the sandbox draws the same ones."""
        torch.manual_seed(seed)
        try:
            return self.problem.make_model("cpu").to(self.device)
        except Exception as exc:  # noqa: BLE001 - a broken problem is reported, not raised
            message = f"the reference Model(*get_init_inputs()) raised {describe_exception(exc)}"
            raise _Stopped("reference", message) from None

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

    # ---------------------------------------------------------------- guards

    def _check_trusted(self, shared_inputs: Any, inputs_before: Any, reference: _ReferenceRun,
                       slots: list[torch.Tensor], expected: list[tuple[str, torch.Tensor]]) -> None:  # fmt: skip
        """The guards that need no trust in the sandbox: inputs left as they were, outputs that follow the inputs."""
        self._record(
            guards.find_mutated_inputs(
                tensor_leaves(shared_inputs, "inputs"), tensor_leaves(inputs_before, "inputs"),
                mutable=reference.mutated_inputs,
            )  # fmt: skip
        )
        now = [(name, fingerprint(slot), fingerprint(ref)) for (name, ref), slot in zip(expected, slots)]
        if self.previous is not None:
            repeated = [name for (name, out, ref), (_, out_before, ref_before) in zip(now, self.previous)
                        if out == out_before and ref != ref_before]  # fmt: skip
            if repeated:
                self._record(GuardFinding(guards.CACHED_OUTPUT, "fail",
                    f"new inputs gave exactly the previous call's values ({', '.join(repeated)}) while the reference's "
                    "changed: the result was computed before the call."))  # fmt: skip
        self.previous = now

    def _check_profiled_call(self, arena: SharedArena, inputs_before: list, seed: int) -> list[str]:
        """One more forward under the sandbox's profiler: its own kernels, torch's kernels, side streams."""
        _, description = share_tree(arena, clone_tree(inputs_before))
        reply = self.model.request("profiled_call", {"inputs": description, "seed": seed}, timeout=self.deadline.left())
        if not reply.get("ok"):
            raise _Stopped(reply.get("error_kind") or "runtime", reply.get("message") or "the profiled call failed")
        names = [str(name) for name in reply.get("kernels", [])]
        streams = list(reply.get("streams", []))
        profiled = guards.ProfiledForward(
            kernels=[guards.KernelLaunch(name, stream) for name, stream in zip(names, streams)],
            current_stream=reply.get("current_stream"),
            synchronized=bool(reply.get("synchronized")),
        )
        source = guards.workspace_kernel_source(self.workspace) if self.workspace is not None else None
        if source is None:
            self._record(guards.find_no_custom_kernel(names, None))
        else:  # the libraries the extension really calls, from its symbols: a comment naming a call does not count
            self._record(find_no_own_kernel(names, source, self.libraries_called))
        # With the kernels the earlier checked calls launched, collected by the sandbox's trace while they ran.
        self._record(guards.find_torch_kernels(names + [str(name) for name in reply.get("traced_kernels", [])]))
        self._record(guards.find_unsynced_side_stream(profiled))
        return self._failed_guards()

    def _explain_rounding_noise(self, inputs: list, leaves: list, expected: Any) -> None:
        """Outputs that failed only the scale check: say so plainly where the reference's own outputs are noise."""
        exact = self._float64_reference(inputs, expected, "the rounding-noise check")
        if exact is None:
            return
        expected_leaves, exact_leaves = dict(tensor_leaves(expected, "out")), dict(tensor_leaves(exact, "out"))
        for leaf in leaves:
            if leaf.scale_only and leaf.name in expected_leaves and leaf.name in exact_leaves:
                rounding_noise_reason(leaf, expected_leaves[leaf.name], exact_leaves[leaf.name])

    def _check_across_trials(self, inputs: list, leaves: list, expected: Any) -> None:
        """After the last trial: outputs too small or uniform for the scale check (a mean loss) must be far closer
        to the references than a constant answer over the trials (`compare.AcrossTrials`), where nothing can tell a
        warning says so; the others, at elements sampled at random, far closer than an answer that ignores the
        input (`element_trials.py`). The reference's own error against float64, on this trial's inputs, is computed
        only when an answer would otherwise be refused."""
        own_error = OwnError(lambda: self._float64_reference(inputs, expected, "the check across trials' float64 run"),
                             expected)  # fmt: skip
        undecided = self.across_trials.apply(leaves, own_error)
        if undecided:
            self._record(GuardFinding(SCALE_UNDECIDED, "warn", "; ".join(undecided)))

    def _float64_reference(self, inputs: list, expected: Any, purpose: str) -> Any:
        """The reference's outputs computed in float64 on `inputs`, or None (with a note) when they are too large
        or the reference has no float64 path."""
        exact, why_not = float64_outputs(self.reference, inputs, expected)
        if why_not:
            self.notes.append(f"{purpose} skipped: {why_not}")
        return exact

    def _check_precision(self, inputs: list, actual: Any, expected: Any) -> None:
        """Warn when fp32 outputs look computed in half precision, judged against a float64 reference."""
        # Each fp32 output keeps its leaf index, which finds its own value among the fp64 reference's outputs.
        leaf_pairs = zip(tensor_leaves(actual, "out"), tensor_leaves(expected, "out"))
        checked = [
            (index, out, ref)
            for index, ((_, out), (_, ref)) in enumerate(leaf_pairs)
            if ref.dtype == torch.float32 and out.dtype == torch.float32 and ref.numel() > 0 and out.device == ref.device
        ]
        if not checked:
            return
        exact = self._float64_reference(inputs, expected, "precision check")
        if exact is None:
            return
        exact_leaves = [leaf for _, leaf in tensor_leaves(exact, "out")]
        for index, out, ref in checked:
            self._record(guards.find_precision_drop(out, ref, exact_leaves[index]))

    def _record_reported(self, finding: dict) -> None:
        """A finding the sandbox reported about itself (advice: a hostile model can always stay silent)."""
        if isinstance(finding, dict) and finding.get("severity") in ("fail", "warn"):
            self._record(GuardFinding(str(finding.get("guard")), finding["severity"], str(finding.get("message", ""))))

    def _record(self, finding: GuardFinding | None) -> None:
        """Keep the first finding of each guard (a guard that fires on every trial is reported once)."""
        if finding is not None and all(f.guard != finding.guard for f in self.findings):
            self.findings.append(finding)

    def _failed_guards(self) -> list[str]:
        return sorted({f.guard for f in self.findings if f.severity == "fail"})

    # ---------------------------------------------------------------- result

    def result(self) -> VerifyResult:
        result = VerifyResult(ok=False, trials=self.trials, guards=self.findings, atol=self.atol, rtol=self.rtol)
        failed = [f for f in self.findings if f.severity == "fail"]
        mismatched = next((t for t in self.trials if not t.ok), None)
        stopped, notes = self.stopped, list(self.notes)
        if stopped is not None:
            result.traceback = stopped.traceback
            if stopped.kind in (HARNESS_ERROR, SLOWER) and failed:
                # A guard that failed before the checking code broke (or the run was stopped as slower) is a
                # verdict on the candidate all the same.
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


def float64_outputs(reference: torch.nn.Module, inputs: list, expected: Any) -> tuple[Any, str]:
    """The reference's outputs computed in float64 on `inputs` (a copy of it), or None and why not: too large
    (PRECISION_CHECK_MAX_BYTES), or the reference has no float64 path."""
    size = sum(t.nbytes for _, t in tensor_leaves(inputs, "in")) + sum(t.nbytes for t in reference.state_dict().values())
    size += 2 * sum(t.nbytes for _, t in tensor_leaves(expected, "out"))  # the float64 outputs
    if size > PRECISION_CHECK_MAX_BYTES:
        return None, f"its float64 inputs, weights and outputs are {size / 1024**3:.1f} GB"
    try:
        reference64 = copy.deepcopy(reference).double()
        with torch.no_grad():
            return reference64(*[_as_float64(item) for item in inputs]), ""
    except Exception as exc:  # noqa: BLE001 - some models have no float64 path; the check is optional
        return None, f"the reference does not run in float64 ({describe_exception(exc)})"


class OwnError:
    """The reference's RMS error against its float64 run, per output name, the float64 run made on first need
    (`run()`: its outputs, or None)."""

    def __init__(self, run: Any, expected: Any):
        self.run, self.expected, self.exact = run, expected, []

    def __call__(self, name: str) -> float | None:
        if not self.exact:
            self.exact.append(self.run())
        reference = dict(tensor_leaves(self.expected, "out")).get(name)
        exact = dict(tensor_leaves(self.exact[0], "out")).get(name) if self.exact[0] is not None else None
        if reference is None or exact is None or exact.shape != reference.shape:
            return None
        if exact.dtype not in (torch.float64, torch.complex128):
            return None  # no float64 path for this output: its own rounding is unknown
        return rms_difference(reference, exact)


def _as_float64(item: Any) -> Any:
    return item.double() if isinstance(item, torch.Tensor) and item.dtype == torch.float32 else item


def _checking_failure(exc: Exception) -> _Stopped:
    """An exception of the trusted side's own code, where no model code runs: the device's state, or a bug."""
    if is_device_failure(exc):  # out of memory, or a CUDA error, on the judge's side
        return _Stopped(*failure_kind(exc, "checking the results"))
    place = next((f for f in reversed(extract_tb(exc.__traceback__)) if _in_kernelpilot(f.filename)), None)
    where = f" (in {place.name}, {Path(place.filename).name}:{place.lineno})" if place is not None else ""
    message = (
        f"kernelpilot's verifier failed, not the candidate: {describe_exception(exc)}{where}. This is a bug in "
        "kernelpilot; please report it with the traceback kept in the verify result's `traceback` field "
        "(`kernelpilot eval` prints it)."
    )
    return _Stopped(HARNESS_ERROR, message, "".join(format_exception(exc)))


def _in_kernelpilot(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(_KERNELPILOT_DIR)
