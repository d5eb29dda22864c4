"""`kernelpilot optimize`: a problem file in, the best verified candidate out, through the workspace, judge and loop.

It wires the pieces (workspace, judge, model, tools, session, prompts) around `run_agent`, then writes the best
verified candidate back into the workspace and beside the problem (model_new.py and its kernels/), and renders
the outcome. Nothing verified means nothing is written beside the problem, and the report says so.

With `commit`, the best candidate is committed from the workspace, as `kernelpilot accept` would: the lock file
lives there and `kernelpilot check` rebuilds from there. Git's refusal after a run is kept on the result, so the
caller shows the run's outcome first and the refusal last.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelpilot.agent.loop import RunSummary
from kernelpilot.agent.session import RunState, Session, candidate_files, restore_best
from kernelpilot.config import Settings
from kernelpilot.errors import KernelpilotError
from kernelpilot.results import to_dict

if TYPE_CHECKING:
    from rich.console import Console

    from kernelpilot.agent import Model, Tool, ToolContext
    from kernelpilot.vcs import CommitInfo
    from kernelpilot.workspace import Workspace

EXIT_INTERRUPTED = 130


@dataclass
class OptimizeResult:
    """A finished (or interrupted) run: its summary, the workspace, and the files written beside the problem."""

    problem: Path
    workspace: Path
    model: str
    summary: RunSummary
    written: list[Path] = field(default_factory=list)
    commit: CommitInfo | None = None  # what --commit committed
    commit_refusal: KernelpilotError | None = None  # why --commit committed nothing; the caller reports it last

    @property
    def exit_code(self) -> int:
        if self.summary.status == "interrupted":
            return EXIT_INTERRUPTED
        return 0 if self.summary.best is not None else 1

    def to_json(self) -> dict[str, Any]:
        return {
            "problem": str(self.problem),
            "workspace": str(self.workspace),
            "model": self.model,
            "written": [str(path) for path in self.written],
            "commit": dataclasses.asdict(self.commit) if self.commit is not None else None,
            "commit_refused": self.commit_refusal.message if self.commit_refusal is not None else None,
            **to_dict(self.summary),
        }


@dataclass
class AgentRun:
    """A run ready to start: the problem and its workspace, the model, the tools and their context, the session."""

    problem_path: Path
    workspace: Workspace
    model: Model
    tools: list[Tool]
    ctx: ToolContext
    settings: Settings
    session: Session
    messages: list[dict[str, Any]]  # the conversation to continue: a new task, or a resumed session's messages


def optimize(
    problem_path: Path,
    settings: Settings,
    *,
    resume: bool = False,
    session_id: str | None = None,
    on_turn: Callable[[RunState, str], None] | None = None,
    commit: bool = False,
) -> OptimizeResult:
    """Run the agent on a problem (or resume one of its sessions) and write out the best verified candidate.

    With `commit`, git must be ready to commit in the workspace before the run starts (VcsError otherwise), and
    the best verified candidate is committed afterwards (`commit_best`).
    """
    from kernelpilot.agent.loop import run_agent

    with prepared_run(problem_path, settings, resume=resume, session_id=session_id) as run:
        if commit:
            require_committable(run.workspace)  # before the run's minutes, not after
        summary = run_agent(run.messages, run.model, run.tools, run.ctx, settings, run.session, on_turn)
    result = finish_run(run, summary)
    if commit:
        commit_best(result)
    return result


@contextmanager
def prepared_run(
    problem_path: Path, settings: Settings, *, resume: bool = False, session_id: str | None = None
) -> Iterator[AgentRun]:
    """Assemble a run (new, or resuming a session of the workspace); the judge's worker closes on exit."""
    from kernelpilot.agent import JudgeRecord, ToolContext
    from kernelpilot.agent.model import resolve_model
    from kernelpilot.agent.tools import default_tools
    from kernelpilot.harness.judge import Judge
    from kernelpilot.problem import load_problem
    from kernelpilot.workspace import init_workspace

    problem = load_problem(problem_path)
    ws, _ = init_workspace(problem_path, settings.workspace)
    judged = JudgeRecord()
    # The built-in policy, when no model is named, works on this problem and reads the judge's typed results.
    model = resolve_model(settings.model, settings.api_base, settings.api_key, problem_path=ws.model_path,
                          judge_results=judged.by_call)  # fmt: skip
    with Judge(settings.device) as judge:
        ctx = ToolContext(workspace=ws, judge=judge, settings=settings, judged=judged)
        if resume or session_id:
            session = Session.resume(ws.root, session_id)
            messages = session.messages
        else:
            session, messages = _new_session(problem, ws, settings, model.name, judge)
        yield AgentRun(Path(problem_path), ws, model, default_tools(), ctx, settings, session, messages)


def finish_run(run: AgentRun, summary: RunSummary) -> OptimizeResult:
    """Write out the best verified candidate (not after an interruption, which a resume continues) and report."""
    interrupted = summary.status == "interrupted"
    written = [] if interrupted else write_outputs(run.workspace, run.problem_path, run.settings.output)
    return OptimizeResult(run.problem_path, run.workspace.root, run.model.name, summary, written)


def require_committable(ws: Workspace) -> None:
    """VcsError, with a hint for `optimize --commit`, unless git can commit in the workspace's repository now."""
    from kernelpilot.vcs import VcsError, check_ready_to_commit

    try:
        check_ready_to_commit(ws.root)
    except VcsError as err:
        raise VcsError(err.message, hint="Fix that first, or run optimize without --commit.") from None


def commit_best(result: OptimizeResult) -> None:
    """Commit the run's best verified candidate, which `finish_run` put back into the workspace, with its lock
    file (`kernelpilot.vcs.accept`); keep git's refusal on the result instead of raising it, so nothing is lost.
    """
    from kernelpilot.vcs import accept

    if result.summary.best is None or result.summary.status == "interrupted":
        return
    try:
        result.commit = accept(result.workspace, result.summary.best)
    except KernelpilotError as err:  # VcsError from git; LockFileError for a result a lock file cannot record
        later = f"The best candidate is in {result.workspace}; `kernelpilot accept {result.workspace}` commits it."
        result.commit_refusal = type(err)(err.message, hint=later)


def _new_session(problem: Any, ws: Workspace, settings: Settings, model_name: str, judge: Any) -> tuple[Session, list]:
    from kernelpilot.agent.prompts import known_facts, task_messages

    gpu_name = judge.gpu_name if judge.device != "cpu" else None
    messages = task_messages(problem, ws, settings, known_facts(gpu_name, problem.problem_id, judge.cache_dir))
    recorded_settings = dataclasses.replace(settings, api_key=None)  # a transcript never holds a secret
    session = Session.create(ws.root, problem=str(problem.path), workspace=str(ws.root), model=model_name,
                             settings=recorded_settings, gpu=gpu_name)
    for message in messages:
        session.append("message", turn=0, message=message)
    return session, messages


def write_outputs(ws: Workspace, problem_path: Path, output: Path | None) -> list[Path]:
    """Put the best verified candidate back into the workspace and copy it to `output` (default: beside the problem).

    Returns the files written outside the workspace; none when nothing was verified.
    """
    if not restore_best(ws):
        return []
    target = Path(output) if output is not None else Path(problem_path).parent / "model_new.py"
    if target.parent.resolve() == ws.root:
        return []  # the workspace is the output folder: the candidate is already there
    written = [target]
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ws.model_new_path, target)
    for relative in candidate_files(ws.root):
        if relative.parts[0] == "kernels":  # model_new.py imports them as kp_kernels, built from kernels/
            (target.parent / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ws.root / relative, target.parent / relative)
            written.append(target.parent / relative)
    return written


# ------------------------------------------------------------------------------------------- rendering


@contextmanager
def live_progress(console: Console, max_turns: int, enabled: bool = True) -> Iterator[Callable[[RunState, str], None] | None]:
    """A one-line live status (turn, last action, best speedup so far); yields the loop's per-turn callback."""
    if not enabled:
        yield None
        return
    with console.status(f"turn 0/{max_turns}: asking the model…") as status:

        def on_turn(state: RunState, last_action: str) -> None:
            status.update(f"turn {state.turn}/{max_turns} · last: {last_action} · best: {_best_text(state)}")

        yield on_turn


def _best_text(state: RunState) -> str:
    bench = state.best.bench if state.best is not None else None
    if state.best is None:
        return "nothing verified yet"
    if bench is None or bench.speedup_vs_compile is None:
        return "correct, not timed"
    return f"{bench.speedup_vs_compile:.2f}x vs torch.compile"


def render_result(console: Console, result: OptimizeResult) -> None:
    """The summary table at the end of a run, and what was written where."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"kernelpilot optimize · {escape(str(result.problem))}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for label, value in summary_rows(result.summary):
        table.add_row(label, escape(value))
    table.add_row("model", escape(result.model))
    table.add_row("workspace", escape(str(result.workspace)))
    console.print(table)
    if result.summary.status == "interrupted":
        console.print(f"Interrupted; resume with [bold]--resume --session {result.summary.session_id}[/].")
    elif result.written:
        console.print("Wrote " + ", ".join(escape(str(path)) for path in result.written), highlight=False)
    else:
        console.print("No candidate was verified correct, so nothing was written beside the problem.")
    if result.commit is not None:
        from kernelpilot.vcs import render_commit

        render_commit(console, result.commit)


def summary_rows(summary: RunSummary) -> Iterator[tuple[str, str]]:
    """Label/value pairs for a run: status, turns, tokens, cost, and the best result's times and speedups."""
    yield "status", summary.status
    yield "turns", str(summary.turns)
    yield "tokens", f"{summary.prompt_tokens} prompt + {summary.completion_tokens} completion"
    yield "cost", f"${summary.cost_usd:.4f}" if summary.cost_usd is not None else "unknown (no price for this model)"
    best = summary.best
    if best is None:
        yield "best", "nothing verified correct"
        return
    bench = best.bench if best.bench is not None and best.bench.ok else None
    for label, timing in (("eager", bench and bench.eager), ("torch.compile", bench and bench.compiled),
                          ("best candidate", bench and bench.candidate)):
        if timing:
            yield f"{label} ms", f"{timing.median_ms:.4g}"
    if bench is not None:
        yield "speedup vs eager", ratio_text(bench.speedup_vs_eager)
        yield "speedup vs compile", ratio_text(bench.speedup_vs_compile)
        yield "% SOL", f"{bench.sol_candidate * 100:.1f}%" if bench.sol_candidate is not None else "–"
    else:
        yield "best candidate", "correct, not timed"
    yield "reward", str(best.reward)


def ratio_text(ratio: float | None) -> str:
    """A speedup as the summary tables show it: "1.23x", or "–" when there is none."""
    return f"{ratio:.2f}x" if ratio is not None else "–"
