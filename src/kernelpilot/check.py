"""`kernelpilot check`: re-verify and re-time accepted candidates against their lock files (the pre-commit hook).

For each lock file found from the given paths, the judge rebuilds, verifies (the recorded trials and tolerances)
and times the workspace's candidate. A candidate fails on a wrong answer (at the problem's shapes, or at a
leading-dim variant of them verified at accept), or when it is slower than recorded by more than the tolerance
on the same GPU model; on another GPU model only correctness is checked, and the report
says so. Without a GPU nothing can be checked: the report says so and passes, unless a GPU is required.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kernelpilot.errors import KernelpilotError, NoGPUError
from kernelpilot.lockfile import LOCK_NAME, Lock, changed_files, read_lock
from kernelpilot.results import EvalResult

if TYPE_CHECKING:
    from kernelpilot.harness.judge import Judge

DEFAULT_TOLERANCE = 0.05
_NO_GPU_HINT = "Run it on a machine with an NVIDIA GPU (check `nvidia-smi`), or drop --require-gpu to skip without one."


@dataclass
class CheckOutcome:
    """The verdict on one accepted candidate."""

    workspace: str
    passed: bool
    correct: bool | None = None  # None when the check stopped before verification
    recorded_ms: float | None = None
    current_ms: float | None = None
    timing: str = ""  # "same GPU" (times compared), "other GPU" or "not recorded" (correctness only)
    gpu_note: str = ""  # which GPUs, when the times were not compared
    reason: str = ""  # why it failed
    changed: list[str] = field(default_factory=list)  # candidate files edited since the lock was written

    @property
    def slowdown(self) -> float | None:
        """current / recorded - 1: positive when the candidate got slower."""
        if self.recorded_ms is None or self.current_ms is None or self.recorded_ms <= 0:
            return None
        return self.current_ms / self.recorded_ms - 1


@dataclass
class CheckReport:
    """Every outcome, or why nothing was checked."""

    outcomes: list[CheckOutcome] = field(default_factory=list)
    skipped: str = ""
    device: str = ""  # what the candidates were checked on: the GPU's name, or "cpu"
    confinement: str | None = None  # the least confined the judge's sandboxes were ("none": unverified figures)

    @property
    def failed(self) -> bool:
        return any(not outcome.passed for outcome in self.outcomes)


def run_check(
    paths: Sequence[Path],
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    require_gpu: bool = False,
    device: str | None = None,
) -> CheckReport:
    """Check every accepted candidate whose lock file `paths` lead to (all under the current folder when empty)."""
    from kernelpilot.harness.judge import Judge

    lock_files = find_lock_files(paths)
    if not lock_files:
        return CheckReport(skipped="no kernelpilot.lock.json found: there is no accepted kernel to check.")
    try:
        judge = Judge(device)
    except NoGPUError:
        if require_gpu:
            raise NoGPUError(
                f"No CUDA GPU is visible, and --require-gpu needs one to check {_count(lock_files)}.", hint=_NO_GPU_HINT
            ) from None
        return CheckReport(
            skipped=f"no CUDA GPU is visible, so {_count(lock_files)} went unchecked (--require-gpu fails instead)."
        )
    with judge:
        outcomes = [check_one(judge, lock_file, tolerance) for lock_file in lock_files]
        return CheckReport(outcomes=outcomes, device=judge.gpu_name or judge.device, confinement=judge.confinement)


def find_lock_files(paths: Sequence[Path]) -> list[Path]:
    """The lock files `paths` belong to: a folder's lock files below it, a file's in its nearest enclosing folder.

    No paths means every lock file under the current folder. Pre-commit passes the changed files, so a kernel
    source leads to its workspace's lock file.
    """
    found: set[Path] = set()
    for path in paths or [Path.cwd()]:
        path = path.expanduser().resolve()
        if path.is_dir():
            found.update(_lock_files_below(path))
        else:
            enclosing = _enclosing_lock_file(path)
            if enclosing is not None:
                found.add(enclosing)
            elif not path.exists():  # a deleted file inside a workspace still leads to its lock file, above
                raise KernelpilotError(f"{path} does not exist.", hint="Pass files or folders of accepted workspaces, "
                                       "or nothing to check every lock file under the current folder.")  # fmt: skip
    return sorted(found)


def check_one(judge: Judge, lock_file: Path, tolerance: float) -> CheckOutcome:
    """Rebuild, verify and time the candidate beside `lock_file`; a user error becomes a failed outcome."""
    from kernelpilot.workspace import display_path, open_workspace

    where = display_path(lock_file.parent)
    try:
        ws = open_workspace(lock_file.parent)
        lock = read_lock(lock_file)
        if lock.problem_id != ws.problem_id:
            return CheckOutcome(
                where, passed=False, reason="the lock file was written for another problem than model.py's."
            )
        verification = lock.verification
        variants = lock.shapes.verified_variants if lock.shapes is not None else []
        result = judge.evaluate(ws.root, trials=max(len(verification.seeds), 1), atol=verification.atol,
                                rtol=verification.rtol, variants=variants)  # fmt: skip
        outcome = compare(lock, result, tolerance)
        outcome.workspace, outcome.changed = where, changed_files(ws, lock)
        return outcome
    except KernelpilotError as err:
        return CheckOutcome(where, passed=False, reason=err.message)


def compare(lock: Lock, result: EvalResult, tolerance: float) -> CheckOutcome:
    """The verdict on a fresh evaluation against its lock: correct, and no slower than `tolerance` on the same GPU."""
    recorded = lock.timings.candidate
    outcome = CheckOutcome(result.workspace, passed=False, recorded_ms=recorded.median_ms if recorded else None)
    if result.verify is None or not result.verify.ok or result.reward < 1:
        outcome.correct = False if result.verify is not None else None
        outcome.reason = f"{result.error_kind or 'failed'}: {result.message}"
        return outcome
    lost = _variants_lost(lock, result)
    if lost:
        outcome.correct, outcome.reason = False, lost
        return outcome
    outcome.correct = True
    bench = result.bench if result.bench is not None and result.bench.ok else None
    current_gpu = bench.gpu if bench else None
    outcome.current_ms = bench.candidate.median_ms if bench and bench.candidate else None
    if recorded is None or lock.environment.gpu is None:
        outcome.timing = "not recorded"
        outcome.gpu_note = "no time was recorded at accept: only correctness was checked."
    elif current_gpu is None:
        outcome.reason = f"correct, but it could not be timed here: {result.message}"
        return outcome
    elif current_gpu != lock.environment.gpu:
        outcome.timing = "other GPU"
        outcome.gpu_note = f"recorded on {lock.environment.gpu}, this is {current_gpu}: only correctness was checked."
    else:
        outcome.timing = "same GPU"
        if outcome.slowdown is not None and outcome.slowdown > tolerance:
            outcome.reason = f"{outcome.slowdown:.1%} slower than recorded (tolerance {tolerance * 100:g}%)."
            return outcome
    outcome.passed = True
    return outcome


def _variants_lost(lock: Lock, result: EvalResult) -> str:
    """Why a shape variant verified at accept does not verify now; empty when every one still does."""
    if lock.shapes is None:
        return ""
    now = {check.variant: check for check in result.verify.variants}
    for variant in lock.shapes.verified_variants:
        check = now.get(variant)
        if check is None or check.status != "verified":
            what = f"{check.status}: {check.message}" if check is not None else "not verified"
            return f"verified at accept at the {variant} shapes, and now {what}"
    return ""


# ------------------------------------------------------------------------------------------ finding


def _lock_files_below(folder: Path) -> Iterator[Path]:
    for current, dirs, files in os.walk(folder):
        # Hidden folders (.git, .venv) hold no workspace of the user's, and can be large.
        dirs[:] = [name for name in dirs if not name.startswith(".") and name != "__pycache__"]
        if LOCK_NAME in files:
            yield Path(current) / LOCK_NAME


def _enclosing_lock_file(path: Path) -> Path | None:
    if path.name == LOCK_NAME:
        return path
    for folder in path.parents:
        candidate = folder / LOCK_NAME
        if candidate.is_file():
            return candidate
    return None


def _count(lock_files: list[Path]) -> str:
    return f"{len(lock_files)} accepted kernel{'s' if len(lock_files) != 1 else ''}"
