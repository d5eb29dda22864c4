"""Plain JSON-able result types shared by build, harness, agent, TUI, check and trainer.

Every result crosses a process boundary (the GPU worker) or lands in a file (transcripts, lock files,
`--json`), so each is a dataclass of plain values; `to_dict` / `from_dict` convert both ways.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


def to_dict(obj: Any) -> Any:
    """A dataclass (possibly nested in lists/dicts) as plain JSON-able values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj


def from_dict(cls: type[T], data: Any) -> T:
    """Rebuild a dataclass of type `cls` from `to_dict` output; unknown keys are ignored."""
    return _convert(cls, data)


def _convert(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            return _convert(arg, value)
    if origin in (list, tuple):
        (item_type, *_) = typing.get_args(tp) or (Any,)
        return [_convert(item_type, v) for v in value]
    if origin is dict:
        _, val_type = typing.get_args(tp) or (Any, Any)
        return {k: _convert(val_type, v) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        known = {f.name for f in dataclasses.fields(tp)}
        return tp(**{k: _convert(hints[k], v) for k, v in value.items() if k in known})
    return value


# --------------------------------------------------------------------------------------------- build


@dataclass
class Diagnostic:
    """One compiler/linker message: where, how bad, what."""

    severity: str  # "error" | "warning" | "note"
    message: str
    file: str | None = None
    line: int | None = None
    column: int | None = None
    tool: str = "nvcc"  # "nvcc" | "gcc" | "ptxas" | "ld" | "ninja"


@dataclass
class KernelResources:
    """`-Xptxas -v` resource use of one compiled kernel."""

    kernel: str  # demangled name
    arch: str  # e.g. "sm_90"
    registers: int = 0
    shared_bytes: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    constant_bytes: int = 0
    source: str | None = None  # the .cu file it came from


@dataclass
class AheadBuilds:
    """Other versions of a workspace's kernel files built side by side after its build, so that a later build of any
    of them compiles nothing (`build_ahead.py`)."""

    asked: int  # versions asked for
    built: int = 0  # compiled now
    kept_before: int = 0  # already a kept version (or the same as another one asked for)
    failed: list[int] = field(default_factory=list)  # the asked versions (0-based) that did not compile
    compiled: list[str] = field(default_factory=list)  # the sources each version's build compiled, all together
    seconds: float = 0.0


@dataclass
class BuildResult:
    """Outcome of building a workspace's extension."""

    ok: bool
    workspace: str
    extension_name: str
    arch: str
    library: str | None = None  # versioned copy of the .so to load (unique path per content)
    compiled: list[str] = field(default_factory=list)  # sources recompiled by this build
    linked: bool = False
    diagnostics: list[Diagnostic] = field(default_factory=list)
    resources: list[KernelResources] = field(default_factory=list)
    log: str = ""
    seconds: float = 0.0
    error: str | None = None  # one sentence when ok is False
    reused: bool = False  # these very sources were built before: `library` is that build, nothing was compiled
    ahead: AheadBuilds | None = None  # the other versions of the kernels built with it (`build_ahead.py`), if asked

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]


# ------------------------------------------------------------------------------------------ harness

# How the sandboxes that ran a candidate (and the reference) were confined (`harness/confine.py`): by Landlock, or
# UNCONFINED where the system offers no Landlock. Unconfined, a candidate could write anything the user can (the
# judge's own code, the Python installation, the workspace), so the result is no evidence against a hostile
# candidate. A result's confinement is None when no sandbox served it (or it was written before this was recorded).
LANDLOCK, UNCONFINED = "landlock", "none"
UNCONFINED_NOTE = ("the candidate's sandboxes are not confined on this system (no Landlock): a hostile candidate could "
                   "change what the judge runs; treat these numbers as unverified.")  # fmt: skip


def least_confined(*confinements: str | None) -> str | None:
    """The weakest of several steps' confinements: UNCONFINED if any step was, else LANDLOCK if any was, else None."""
    if UNCONFINED in confinements:
        return UNCONFINED
    return LANDLOCK if LANDLOCK in confinements else None



@dataclass
class GuardFinding:
    """One anti-cheat guard's verdict on a candidate."""

    guard: str  # e.g. "torch-compute", "no-custom-kernel", "output-aliases-input"
    severity: str  # "fail" | "warn"
    message: str


@dataclass
class TrialResult:
    """One correctness trial on fresh inputs."""

    seed: int
    ok: bool
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    worst_index: list[int] | None = None
    output: str | None = None  # which output (e.g. "0" or "out[1]") the numbers refer to
    message: str = ""


# The status (and a variant verification's error kind) of inputs a shape variant cannot be made of, or that the
# reference rejects.
NOT_APPLICABLE = "not-applicable"


@dataclass
class VariantCheck:
    """The verification at one leading-dim variant of the problem's inputs ("half", "double")."""

    variant: str
    status: str  # "verified" | "failed" | NOT_APPLICABLE
    inputs: list[list[int] | None] | None = None  # each input's shape (None: not a tensor); None when not made
    message: str = ""  # trials passed, the failure's first line, or why the variant does not apply
    error_kind: str | None = None  # of a failure


# The error kind of a verification that kernelpilot's own checking code broke off: the candidate was not judged.
HARNESS_ERROR = "harness"

# The error kind of a verification stopped because its calls were far slower than a time the caller gave (a launch
# search's best so far): the candidate was neither verified further nor timed. Never a verdict on correctness.
SLOWER = "slower"


@dataclass
class VerifyResult:
    """Correctness of a candidate over several trials, with guard findings."""

    ok: bool
    trials: list[TrialResult] = field(default_factory=list)
    guards: list[GuardFinding] = field(default_factory=list)
    atol: float = 1e-2
    rtol: float = 1e-2
    # None | "mismatch" | "guard" | "runtime" | "timeout" | "crash" | "oom" | "harness" (HARNESS_ERROR) | ...
    error_kind: str | None = None
    message: str = ""
    seconds: float = 0.0
    traceback: str = ""  # the full traceback of a HARNESS_ERROR, for the bug report its message asks for
    base_seed: int = 0  # trial i draws its inputs from base_seed + i * SEED_STRIDE; the weights from base_seed
    phases: dict[str, float] = field(default_factory=dict)  # seconds per step of the trials (inputs, compare, ...)
    input_shapes: list[list[int] | None] | None = None  # the first trial's input shapes (None: not a tensor)
    variants: list[VariantCheck] = field(default_factory=list)  # the leading-dim variants verified after the trials
    confinement: str | None = None  # LANDLOCK | UNCONFINED: the judge's sandboxes, as the worker saw them

    @property
    def max_abs_error(self) -> float | None:
        vals = [t.max_abs_error for t in self.trials if t.max_abs_error is not None]
        return max(vals) if vals else None

    @property
    def max_rel_error(self) -> float | None:
        vals = [t.max_rel_error for t in self.trials if t.max_rel_error is not None]
        return max(vals) if vals else None


@dataclass
class Timing:
    """Distribution of one callable's time, in milliseconds."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    mean_ms: float
    runs: int
    note: str = ""  # why the timing differs from the usual method (e.g. fewer runs for a very long call)
    # Median over the runs of (the trusted side's wall time of a run) - (the time the model's process reported):
    # the protocol's own cost for an honest model (inputs drawn, L2 flushed, outputs copied, the round trip).
    unaccounted_ms: float | None = None
    # The same for the clean eager process timed between the model's runs (the candidate's timing only): what
    # the unaccounted-time check compares `unaccounted_ms` with.
    clean_unaccounted_ms: float | None = None
    # Diagnostics, the processes' word: the median over the runs of (wall time) - (the time the model's process says
    # each run's request spent in it), the pipes' and the scheduler's share of `unaccounted_ms`; and the same for the
    # clean process (the candidate's timing only).
    transport_ms: float | None = None
    clean_transport_ms: float | None = None

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the relative spread."""
        return (self.p90_ms - self.p10_ms) / self.median_ms if self.median_ms else 0.0


@dataclass
class KernelTime:
    """One GPU kernel's share of a profiled call."""

    name: str
    total_ms: float
    calls: int


@dataclass
class Roofline:
    """Speed-of-light floor for a problem on a GPU."""

    flops: float
    bytes: float
    floor_ms: float
    bound: str  # "memory" | "compute"
    bandwidth_gbs: float
    matmul_tflops: float


@dataclass
class BenchResult:
    """Times of eager, torch.compile and the candidate on the same inputs."""

    ok: bool
    gpu: str = ""
    candidate: Timing | None = None
    eager: Timing | None = None
    compiled: Timing | None = None
    speedup_vs_eager: float | None = None
    speedup_vs_compile: float | None = None
    roofline: Roofline | None = None
    sol_candidate: float | None = None  # fraction of speed-of-light, 0..1
    sol_eager: float | None = None
    sol_compile: float | None = None
    kernels: list[KernelTime] = field(default_factory=list)
    error_kind: str | None = None
    message: str = ""
    guards: list[GuardFinding] = field(default_factory=list)  # e.g. unaccounted-time
    seed: int = 0  # the bench's seed (its first inputs' layout); each timed run's seed is drawn apart, at random
    checked_calls: int = 0  # timed calls whose outputs were compared with the reference's
    phases: dict[str, float] = field(default_factory=dict)  # seconds per step (calibration, candidate runs, ...)
    confinement: str | None = None  # LANDLOCK | UNCONFINED: the judge's sandboxes, as the worker saw them


@dataclass
class EvalResult:
    """Everything the judge says about one candidate: build, verify, bench, reward."""

    problem_id: str
    workspace: str
    build: BuildResult | None = None
    verify: VerifyResult | None = None
    bench: BenchResult | None = None
    reward: int = -1
    error_kind: str | None = None
    message: str = ""
    confinement: str | None = None  # the least confined of its verification's and timing's (`least_confined`)
