"""The lock file of an accepted candidate: what was measured, on what, with what, and the exact files measured.

`kernelpilot.lock.json` sits in the workspace beside model_new.py. `kernelpilot accept` writes it from the
judge's EvalResult and commits it with the kernels; `kernelpilot check` reads it back to re-verify and re-time
the candidate against the recorded figures on the same GPU model, and to verify again the input shapes (the
problem's and its leading-dim variants) verified at accept. It also records whether Landlock confined the judge's
sandboxes (`confinement`), so a reviewer sees figures that a hostile candidate could have forged.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from kernelpilot.errors import KernelpilotError
from kernelpilot.results import NOT_APPLICABLE, BenchResult, EvalResult, Timing, VerifyResult, from_dict, to_dict
from kernelpilot.workspace import PROTECTED_FILES, Workspace
from kernelpilot.workspace_files import write_file

LOCK_NAME = "kernelpilot.lock.json"
LOCK_VERSION = 1
# The sources a candidate consists of besides model_new.py: what the build compiles and what it includes.
KERNEL_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")
_REWRITE_HINT = "Write it again with `kernelpilot accept DIR` (or `--no-commit` to only write the lock file)."


class LockFileError(KernelpilotError):
    """A lock file is missing, unreadable, of another version, or cannot be made from a result."""


@dataclass
class Environment:
    """Where the figures were measured."""

    gpu: str | None  # the device name the judge timed on (a GPU model, or "cpu"); None when not timed
    torch: str
    cuda: str | None  # torch's CUDA version; None for a CPU build of torch


@dataclass
class Verification:
    """How correctness was checked: the trials' seeds and the tolerances."""

    atol: float
    rtol: float
    seeds: list[int] = field(default_factory=list)


# The variant name of the problem's own inputs, as get_inputs() makes them, among the verified shape sets.
PROBLEM_SHAPES = "problem"


@dataclass
class ShapeSet:
    """One set of input shapes the candidate was verified at (or failed at, or that does not apply)."""

    variant: str  # PROBLEM_SHAPES, or a leading-dim variant of them ("half", "double")
    inputs: list[list[int] | None] | None = None  # each input's shape (None: not a tensor); None when not made
    message: str = ""  # a failure's first line, or why the variant does not apply


@dataclass
class Shapes:
    """The input shapes verified at accept: `check` verifies the same variants again."""

    verified: list[ShapeSet] = field(default_factory=list)
    failed: list[ShapeSet] = field(default_factory=list)
    not_applicable: list[ShapeSet] = field(default_factory=list)

    @property
    def verified_variants(self) -> list[str]:
        """The leading-dim variants verified (the problem's own shapes left out: they are always verified)."""
        return [shape_set.variant for shape_set in self.verified if shape_set.variant != PROBLEM_SHAPES]


@dataclass
class RecordedTiming:
    """One timed callable: median and the p10–p90 spread, in milliseconds."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    spread: float
    runs: int


@dataclass
class Timings:
    """Eager, torch.compile and the candidate on the same inputs, and the speedups that follow."""

    bench_seed: int
    candidate: RecordedTiming | None = None
    eager: RecordedTiming | None = None
    compile: RecordedTiming | None = None
    speedup_vs_eager: float | None = None
    speedup_vs_compile: float | None = None


@dataclass
class Lock:
    """The contents of kernelpilot.lock.json."""

    problem_id: str
    environment: Environment
    verification: Verification
    timings: Timings
    reward: int
    files: dict[str, str]  # workspace-relative path -> SHA-256 of the candidate's files
    version: int = LOCK_VERSION
    shapes: Shapes | None = None  # None in a lock written before shapes were recorded
    # How the judge's sandboxes were confined: "landlock", or "none" (no Landlock: a hostile candidate could have
    # changed what the judge ran, so the figures are unverified); None in a lock written before it was recorded.
    confinement: str | None = None


def lock_path(ws: Workspace) -> Path:
    """Where the workspace's lock file lives."""
    return ws.root / LOCK_NAME


def candidate_files(ws: Workspace) -> list[str]:
    """The candidate's own files, workspace-relative and sorted: kernel sources and headers, and model_new.py."""
    kernels = [
        path.relative_to(ws.root).as_posix()
        for path in ws.kernels_dir.rglob("*")
        if path.is_file() and path.suffix in KERNEL_SUFFIXES
    ]
    return sorted(name for name in [*kernels, "model_new.py"] if name not in PROTECTED_FILES)


def lock_from_eval(ws: Workspace, result: EvalResult, environment: Environment | None = None) -> Lock:
    """The lock of a verified result; LockFileError when the result is not a verified candidate of `ws`.

    `environment` defaults to this process's torch, which is the judge worker's: it runs the same interpreter.
    """
    _require_verified(ws, result)
    bench = result.bench if result.bench is not None and result.bench.ok else None
    env = environment or local_environment(bench.gpu if bench else None)
    return Lock(
        problem_id=result.problem_id,
        environment=env,
        verification=Verification(
            atol=result.verify.atol, rtol=result.verify.rtol, seeds=[trial.seed for trial in result.verify.trials]
        ),
        timings=_timings(bench),
        reward=result.reward,
        files=file_hashes(ws),
        shapes=shapes_of(result.verify),
        confinement=result.confinement,
    )


def shapes_of(verify: VerifyResult) -> Shapes | None:
    """The shape sets of a verification: its own inputs' and its variants', by outcome (None when not recorded)."""
    if verify.input_shapes is None:
        return None
    shapes = Shapes(verified=[ShapeSet(PROBLEM_SHAPES, verify.input_shapes)])
    for check in verify.variants:
        if check.status == "verified":
            shapes.verified.append(ShapeSet(check.variant, check.inputs))
        elif check.status == NOT_APPLICABLE:
            shapes.not_applicable.append(ShapeSet(check.variant, message=check.message))
        else:
            shapes.failed.append(ShapeSet(check.variant, check.inputs, check.message))
    return shapes


def local_environment(gpu: str | None) -> Environment:
    """This interpreter's torch and CUDA versions, with the device name the judge reported."""
    import torch

    return Environment(gpu=gpu, torch=torch.__version__, cuda=torch.version.cuda)


def file_hashes(ws: Workspace) -> dict[str, str]:
    """SHA-256 of each of the candidate's files as they are now."""
    return {name: hashlib.sha256((ws.root / name).read_bytes()).hexdigest() for name in candidate_files(ws)}


def changed_files(ws: Workspace, lock: Lock) -> list[str]:
    """The candidate's files added, removed or edited since the lock was written, sorted."""
    now = file_hashes(ws)
    return sorted(name for name in set(now) | set(lock.files) if now.get(name) != lock.files.get(name))


def write_lock(ws: Workspace, lock: Lock) -> Path:
    """Write the lock file into the workspace: version first, then a fixed key order, so diffs stay small."""
    from kernelpilot.workspace_record import store_lock

    path = lock_path(ws)
    fields = to_dict(lock)
    text = json.dumps({"version": fields.pop("version"), **fields}, indent=2) + "\n"
    write_file(path, text, ws.root)  # a link there is replaced, not written through (`workspace_files.py`)
    store_lock(ws.root, text)  # where the agent cannot write: a lock it rewrites is then no accepted one
    return path


def read_lock(path: Path) -> Lock:
    """The lock at `path`; LockFileError when it is missing, not JSON, not a lock of this version, or not one that
    `accept` wrote into this workspace where it has recorded any (`workspace_record.py`)."""
    from kernelpilot.workspace_record import lock_written_here

    try:
        text = path.read_text()
        data = json.loads(text)
    except FileNotFoundError:
        raise LockFileError(
            f"There is no lock file at {path}.", hint="Run `kernelpilot accept DIR` to write one."
        ) from None
    except (OSError, ValueError) as err:
        raise LockFileError(f"The lock file {path} cannot be read ({err}).", hint=_REWRITE_HINT) from None
    if not isinstance(data, dict) or data.get("version") != LOCK_VERSION:
        raise LockFileError(f"{path} is not a version-{LOCK_VERSION} kernelpilot lock file.", hint=_REWRITE_HINT)
    if lock_written_here(path.parent, text) is False:
        raise LockFileError(
            f"The lock file {path} is not one that `kernelpilot accept` wrote into this workspace: it was changed "
            "since.",
            hint=f"Bring back an accepted lock (git checkout -- {path}), or verify and accept again: "
            f"kernelpilot accept {path.parent}",
        )
    try:
        return from_dict(Lock, data)
    except (TypeError, AttributeError) as err:
        raise LockFileError(f"The lock file {path} is malformed ({err}).", hint=_REWRITE_HINT) from None


def _require_verified(ws: Workspace, result: EvalResult) -> None:
    if result.problem_id != ws.problem_id:
        raise LockFileError(
            f"The result is for problem {result.problem_id}, not this workspace's ({ws.problem_id}).",
            hint="Evaluate this workspace, then accept that result.",
        )
    if result.verify is None or not result.verify.ok or result.reward < 1:
        reason = result.message or "it did not pass verification"
        raise LockFileError(
            f"Only a verified candidate can be accepted, and this one is not: {reason}",
            hint="Fix it until `kernelpilot eval DIR` passes, then accept it.",
        )


def _timings(bench: BenchResult | None) -> Timings:
    if bench is None:
        return Timings(bench_seed=0)
    return Timings(
        bench_seed=bench.seed,  # the bench's seed; each timed run drew its own at random
        candidate=_recorded(bench.candidate),
        eager=_recorded(bench.eager),
        compile=_recorded(bench.compiled),
        speedup_vs_eager=bench.speedup_vs_eager,
        speedup_vs_compile=bench.speedup_vs_compile,
    )


def _recorded(timing: Timing | None) -> RecordedTiming | None:
    if timing is None:
        return None
    return RecordedTiming(
        median_ms=timing.median_ms, p10_ms=timing.p10_ms, p90_ms=timing.p90_ms, spread=timing.spread, runs=timing.runs
    )
