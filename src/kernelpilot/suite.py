"""`kernelpilot suite`: optimize every problem in a folder and report the benchmark's metrics.

Problems are the .py files under the folder (KernelBench's level folders included). Each gets a workspace and a
result JSON under the output folder, which says why when the problem ended without a verified candidate (the
failing check's kind and first line, the model's words when the judge never checked one, or why the problem
cannot run: agent/failure.py). A problem whose result JSON exists is skipped, and one whose run was
interrupted resumes its newest session, so a suite can be stopped and restarted. Problems run concurrently, one
worker per visible GPU. The metrics are KernelBench's:
pass rate, fast_p (correct and more than p times faster) vs eager and vs torch.compile, plus the geometric-mean
speedup over the correct ones, the mean milestone reward and the cost.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelpilot.agent.session import SESSIONS_DIR
from kernelpilot.config import Settings
from kernelpilot.errors import KernelpilotError, ProblemError, WorkspaceError
from kernelpilot.results import least_confined

if TYPE_CHECKING:
    from kernelpilot.optimize import OptimizeResult

FAST_P_THRESHOLDS = (1.0, 1.05)
RESULTS_DIR = "results"
WORKSPACES_DIR = "workspaces"
CANDIDATES_DIR = "candidates"


@dataclass
class ProblemOutcome:
    """One problem's line in the suite: what the run ended with (from its result JSON)."""

    problem: str  # path relative to the suite folder
    status: str
    correct: bool
    reward: int
    speedup_vs_eager: float | None = None
    speedup_vs_compile: float | None = None
    cost_usd: float | None = None
    turns: int = 0
    failure: str = ""  # what kept it from a verified candidate: the judge's error kind, no-candidate, problem, ...
    # That failure in one line (the failing check's first line, the model's, or the problem's); for a correct result,
    # "torch.compile is faster here: ..." or why torch.compile has no time.
    message: str = ""
    confinement: str | None = None  # the least confined the run's sandboxes were ("none": unverified); None: no judge
    seconds: float | None = None  # the problem's wall time to its result (None: written before this was recorded)
    sol: float | None = None  # the best candidate's fraction of speed-of-light (None: no roofline, or not recorded)

    @property
    def speedup_vs_both(self) -> float | None:
        """The speedup over the faster of eager and torch.compile; None unless both were measured."""
        if self.speedup_vs_eager is None or self.speedup_vs_compile is None:
            return None
        return min(self.speedup_vs_eager, self.speedup_vs_compile)


@dataclass
class SuiteReport:
    """The suite's metrics over all its problems."""

    outcomes: list[ProblemOutcome]
    pass_rate: float
    fast_p_vs_eager: dict[str, float]
    fast_p_vs_compile: dict[str, float]
    fast_p_vs_both: dict[str, float]  # faster than the better of eager and torch.compile by more than p
    geomean_speedup_vs_eager: float | None
    geomean_speedup_vs_compile: float | None
    mean_reward: float
    cost_usd: float | None
    confinement: str | None = None  # the least confined of the problems' ("none": some numbers are unverified)


# A file that names none of these at the start of a line is no attempt at a problem (a script, a model's module).
_PROBLEM_NAMES = re.compile(r"^(class Model\b|def get_inputs\b|def get_init_inputs\b|Model\s*=)", re.MULTILINE)


def find_problems(folder: Path) -> list[Path]:
    """The problem files under `folder`: .py files that define `Model`, `get_inputs` or `get_init_inputs` (a broken
    one is then reported, while scripts and modules beside them, such as examples/models/, are skipped), outside
    hidden, private (`_x.py`) and kernelpilot workspace folders."""
    def wanted(path: Path) -> bool:
        parts = path.relative_to(folder).parts
        if any(part.startswith((".", "_", "kp-")) for part in parts) or path.name == "model_new.py":
            return False
        return _PROBLEM_NAMES.search(path.read_text(encoding="utf-8", errors="replace")) is not None

    problems = sorted(path for path in folder.rglob("*.py") if wanted(path))
    if not problems:
        raise ProblemError(f"{folder} holds no problem files (.py files defining Model, get_inputs, get_init_inputs).",
                           hint="Pass a folder of KernelBench-format problems.")  # fmt: skip
    return problems


def run_suite(
    folder: Path,
    settings: Settings,
    out_dir: Path,
    *,
    jobs: int | None = None,
    on_problem: Callable[[Path], Any] | None = None,
    run_problem: Callable[..., ProblemOutcome] | None = None,
) -> SuiteReport:
    """Optimize each problem without a result JSON yet, `jobs` at once (default: one per visible GPU); report on all.

    Each parallel worker has a device of its own (settings.device becomes cuda:0, cuda:1, ...). An interrupted
    problem gets no result JSON (a rerun resumes its session) and stops the workers from starting new problems.
    `run_problem` (default: the agent's optimize) takes the arguments of `_optimize_one`.
    """
    from kernelpilot.harness.batch import lane_devices, spread

    run_problem = run_problem or _optimize_one
    interrupted = threading.Event()

    def run_one(device: str, problem: Path) -> None:
        if interrupted.is_set():
            return
        name = _result_name(folder, problem)
        progress = on_problem(problem) if on_problem is not None else None
        on_device = dataclasses.replace(settings, device=device)
        started = time.monotonic()
        outcome = run_problem(problem, folder, on_device, out_dir, name, progress)
        outcome.seconds = round(time.monotonic() - started, 1)
        # A run that ends after Ctrl-C may have failed because of it (the main thread's unwinding kills the judge
        # workers), so it is no result either.
        if outcome.status == "interrupted" or interrupted.is_set():
            interrupted.set()
            return
        result_path = out_dir / RESULTS_DIR / f"{name}.json"
        result_path.parent.mkdir(parents=True, exist_ok=True)
        result_path.write_text(json.dumps(dataclasses.asdict(outcome), indent=2) + "\n")

    try:
        spread(_unfinished_problems(folder, out_dir), lane_devices(settings.device, jobs), run_one)
    except KeyboardInterrupt:  # reaches only this thread: the lanes still running must not write their results
        interrupted.set()
        raise
    return summarize(list(_read_outcomes(out_dir / RESULTS_DIR)))


def _unfinished_problems(folder: Path, out_dir: Path) -> list[Path]:
    """The problems under `folder` with no result JSON yet, leaving out the suite's own outputs."""
    results_root = out_dir.resolve()
    return [
        problem
        for problem in find_problems(folder)
        # the suite's own workspaces and candidates, when --out lies inside the folder, are not problems
        if not problem.resolve().is_relative_to(results_root)
        and not (out_dir / RESULTS_DIR / f"{_result_name(folder, problem)}.json").is_file()
    ]


def _optimize_one(problem: Path, folder: Path, settings: Settings, out_dir: Path, name: str, on_turn: Any) -> ProblemOutcome:
    from kernelpilot.optimize import optimize

    relative, ws_dir = str(problem.relative_to(folder)), out_dir / WORKSPACES_DIR / name
    resume = any((ws_dir / SESSIONS_DIR).glob("*.jsonl"))
    # Problems share a folder, so each one's candidate goes to a folder of its own, not beside the problem.
    output = out_dir / CANDIDATES_DIR / name / "model_new.py"
    per_problem = dataclasses.replace(settings, workspace=ws_dir, output=output)
    try:
        result = optimize(problem, per_problem, resume=resume, on_turn=on_turn)
    except (ProblemError, WorkspaceError) as err:  # this problem cannot run; the others still can
        failure = "problem" if isinstance(err, ProblemError) else "workspace"
        return ProblemOutcome(problem=relative, status="invalid", correct=False, reward=-1, failure=failure,
                              message=err.message)  # fmt: skip
    return outcome_of(relative, result)


def outcome_of(relative: str, result: OptimizeResult) -> ProblemOutcome:
    """A finished `optimize` run as the suite records it."""
    summary, best, failure = result.summary, result.summary.best, result.failure
    bench = best.bench if best is not None and best.bench is not None and best.bench.ok else None
    if failure is not None:
        message = failure.message
    elif bench is not None and bench.compiled is None and bench.message:
        message = bench.message  # why torch.compile has no time (it failed on the problem, say)
    else:
        message = result.compile_is_faster or ""
    return ProblemOutcome(
        problem=relative,
        status=summary.status,
        correct=best is not None,
        reward=best.reward if best is not None else -1,
        speedup_vs_eager=bench.speedup_vs_eager if bench else None,
        speedup_vs_compile=bench.speedup_vs_compile if bench else None,
        sol=bench.sol_candidate if bench else None,
        cost_usd=summary.cost_usd,
        turns=summary.turns,
        failure=failure.kind if failure is not None else "",
        message=message,
        confinement=result.confinement,
    )


def _result_name(folder: Path, problem: Path) -> str:
    return "__".join(problem.relative_to(folder).with_suffix("").parts)


def _read_outcomes(results_dir: Path) -> Iterator[ProblemOutcome]:
    for path in sorted(results_dir.glob("*.json")):
        try:
            yield ProblemOutcome(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as err:
            raise KernelpilotError(f"The suite result {path} cannot be read ({err}).", hint="Delete it to rerun that problem.") from None


def summarize(outcomes: list[ProblemOutcome]) -> SuiteReport:
    """KernelBench's metrics over `outcomes` (an empty suite has a pass rate of 0)."""
    count = len(outcomes) or 1
    correct = [outcome for outcome in outcomes if outcome.correct]
    costs = [outcome.cost_usd for outcome in outcomes]
    return SuiteReport(
        outcomes=outcomes,
        pass_rate=len(correct) / count,
        fast_p_vs_eager={f"{p:g}": fast_p(outcomes, p, "speedup_vs_eager") for p in FAST_P_THRESHOLDS},
        fast_p_vs_compile={f"{p:g}": fast_p(outcomes, p, "speedup_vs_compile") for p in FAST_P_THRESHOLDS},
        fast_p_vs_both={f"{p:g}": fast_p(outcomes, p, "speedup_vs_both") for p in FAST_P_THRESHOLDS},
        geomean_speedup_vs_eager=geometric_mean([o.speedup_vs_eager for o in correct]),
        geomean_speedup_vs_compile=geometric_mean([o.speedup_vs_compile for o in correct]),
        mean_reward=sum(outcome.reward for outcome in outcomes) / count,
        cost_usd=None if any(cost is None for cost in costs) else sum(costs),
        confinement=least_confined(*(outcome.confinement for outcome in outcomes)),
    )


def fast_p(outcomes: list[ProblemOutcome], p: float, speedup: str) -> float:
    """The share of all problems that are correct and more than `p` times faster (KernelBench's fast_p)."""
    fast = [o for o in outcomes if o.correct and (getattr(o, speedup) or 0.0) > p]
    return len(fast) / (len(outcomes) or 1)


def geometric_mean(values: list[float | None]) -> float | None:
    """Geometric mean of the values that were measured; None when none were."""
    measured = [value for value in values if value is not None and value > 0]
    if not measured:
        return None
    return math.exp(sum(math.log(value) for value in measured) / len(measured))
