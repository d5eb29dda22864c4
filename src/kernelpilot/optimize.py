"""`kernelpilot optimize`: a problem file in, the best verified candidate out, through the workspace, judge and loop.

It wires the pieces (workspace, judge, model, tools, session, prompts) around `run_agent`, then writes the best
verified candidate back into the workspace and beside the problem (model_new.py and its kernels/). Everything a
run can check (problem, model, git, GPU) is checked before the workspace is made (`checked_run`), so a run that
cannot start leaves nothing behind. Nothing verified means nothing is written beside the problem, and the result
says so; the CLI renders it (`cli/render_agent.py`). The model is `models.resolve_model`'s choice (the built-in
policy when none is named), which is why this module and `suite.py` sit above `agent`: the agent package never
imports the policy.

With `commit`, the best candidate is committed from the workspace, as `kernelpilot accept` would: verified again
at the shape variants by the run's judge (`acceptance.accept_candidate`), so its lock file records the shapes;
the lock file lives there and `kernelpilot check` rebuilds from there. Git's refusal after a run is kept on the
result, so the caller shows the run's outcome first and the refusal last.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelpilot.agent.failure import RunFailure, run_failure
from kernelpilot.agent.loop import RunSummary
from kernelpilot.agent.session import RunState, Session, candidate_files, restore_best
from kernelpilot.config import Settings
from kernelpilot.errors import KernelpilotError
from kernelpilot.results import least_confined, to_dict

if TYPE_CHECKING:
    from kernelpilot.agent import JudgeRecord, Model, Tool, ToolContext
    from kernelpilot.harness.judge import Judge
    from kernelpilot.problem import Problem
    from kernelpilot.vcs import CommitInfo
    from kernelpilot.workspace import Workspace

EXIT_INTERRUPTED = 130


# A verified candidate slower than torch.compile by more than this is named so at the end of the run.
COMPILE_MARGIN = 0.03


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
    failure: RunFailure | None = None  # why nothing was verified (None when something was, or after an interruption)
    confinement: str | None = None  # the least confined the judge's sandboxes were in this run ("none": unverified)

    @property
    def exit_code(self) -> int:
        if self.summary.status == "interrupted":
            return EXIT_INTERRUPTED
        return 0 if self.summary.best is not None else 1

    @property
    def compile_is_faster(self) -> str | None:
        """One sentence when the best verified candidate is slower than torch.compile by more than COMPILE_MARGIN
        (it is still written: it may compose, or be the start of more work), else None."""
        best = self.summary.best
        bench = best.bench if best is not None and best.bench is not None and best.bench.ok else None
        if bench is None or bench.compiled is None or bench.candidate is None or bench.speedup_vs_compile is None:
            return None
        if bench.speedup_vs_compile >= 1 - COMPILE_MARGIN:
            return None
        return (f"torch.compile is faster here: {bench.compiled.median_ms:.4g} ms vs {bench.candidate.median_ms:.4g} ms "
                f"for the best candidate ({bench.speedup_vs_compile:.2f}x).")

    def to_json(self) -> dict[str, Any]:
        return {
            "problem": str(self.problem),
            "workspace": str(self.workspace),
            "model": self.model,
            "written": [str(path) for path in self.written],
            "commit": dataclasses.asdict(self.commit) if self.commit is not None else None,
            "commit_refused": self.commit_refusal.message if self.commit_refusal is not None else None,
            "failure": to_dict(self.failure),
            "confinement": self.confinement,
            "compile_is_faster": self.compile_is_faster,
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
    checked: CheckedRun | None = None,
    allow_unconfined: bool = True,
) -> OptimizeResult:
    """Run the agent on a problem (or resume one of its sessions) and write out the best verified candidate.

    With `commit`, git must be ready to commit in the workspace before the run starts (VcsError otherwise), and
    the best verified candidate is committed afterwards (`commit_best`), while the run's judge is still open.
    `checked` is what `checked_run` gave a caller that checked first (with the same `commit`); without it, the
    checks run here. With `allow_unconfined=False` (training's rollouts) the run's judge must be confined by
    Landlock: UnconfinedJudgeError ends the run otherwise (`Judge`).
    """
    from kernelpilot.agent.loop import run_agent

    with prepared_run(problem_path, settings, resume=resume, session_id=session_id, commit=commit,
                      checked=checked, allow_unconfined=allow_unconfined) as run:  # fmt: skip
        summary = run_agent(run.messages, run.model, run.tools, run.ctx, settings, run.session, on_turn)
        result = finish_run(run, summary)
        if commit:
            commit_best(result, run.ctx.judge)
    return result


def _judge_record() -> JudgeRecord:
    from kernelpilot.agent import JudgeRecord

    return JudgeRecord()


@dataclass
class CheckedRun:
    """What a run needs, checked before it writes any file: the problem, the model, a judge on a usable device,
    and the workspace folder it will use (made later, by `prepared_run`)."""

    problem: Problem
    model: Model
    judge: Judge
    workspace_root: Path
    judged: JudgeRecord = field(default_factory=lambda: _judge_record())


@contextmanager
def checked_run(
    problem_path: Path, settings: Settings, *, resume: bool = False, session_id: str | None = None,
    commit: bool = False, allow_unconfined: bool = True,
) -> Iterator[CheckedRun]:  # fmt: skip
    """Every check a run can make before it creates anything: the problem file, the session to resume, the model,
    git (for `commit`) and the device (no GPU is an error here; nor Landlock, unless `allow_unconfined`); the
    judge's worker closes on exit."""
    from kernelpilot.harness.judge import Judge, launch_worker

    # The judge's worker imports torch and starts CUDA while the checks run (a training judge checks Landlock first).
    early = launch_worker(settings.device) if allow_unconfined else None
    try:
        problem, model, root, judged = _checks(problem_path, settings, resume, session_id, commit)
        judge = Judge(settings.device, allow_unconfined=allow_unconfined, worker=early)
    except BaseException:
        if early is not None:  # nothing is left behind (a judge that refused has closed it already)
            early.close(grace_s=0)
        raise
    with judge:
        yield CheckedRun(problem, model, judge, root, judged)


def _checks(problem_path: Path, settings: Settings, resume: bool, session_id: str | None, commit: bool) -> tuple:
    """checked_run's checks, in order; returns the problem, the model, the workspace folder and the judge record."""
    from kernelpilot.agent import JudgeRecord
    from kernelpilot.agent.session import find_session
    from kernelpilot.models import resolve_model
    from kernelpilot.problem import load_problem
    from kernelpilot.problem_check import check_problem
    from kernelpilot.workspace import workspace_root

    check_problem(problem_path, device=settings.device)  # in a child process, with time and memory limits, first
    problem = load_problem(problem_path, validate=False)
    root = workspace_root(problem_path, settings.workspace)
    if (resume or session_id) and not root.is_dir():
        raise KernelpilotError(f"There is no run to resume: the workspace {root} does not exist.",
                               hint="Drop --resume to start a run, or pass the --dir of the run to resume.")  # fmt: skip
    if resume or session_id:
        find_session(root, session_id)  # SessionError when there is nothing to resume
    judged = JudgeRecord()
    # The built-in policy, when no model is named, works on this problem and reads the judge's typed results.
    model = resolve_model(settings.model, settings.api_base, settings.api_key, problem_path=Path(problem_path),
                          judge_results=judged.by_call, workspace=root)  # fmt: skip
    if commit:
        require_committable(root)  # before the run's minutes, not after
    return problem, model, root, judged


@contextmanager
def prepared_run(
    problem_path: Path,
    settings: Settings,
    *,
    resume: bool = False,
    session_id: str | None = None,
    commit: bool = False,
    checked: CheckedRun | None = None,
    allow_unconfined: bool = True,
) -> Iterator[AgentRun]:
    """Assemble a run (new, or resuming a session of the workspace) once `checked_run`'s checks passed; the judge's
    worker closes on exit. A workspace this call made is removed again if assembling the run fails."""
    from kernelpilot.agent import ToolContext
    from kernelpilot.agent.tools import default_tools
    from kernelpilot.workspace import init_workspace

    opened = nullcontext(checked) if checked is not None else checked_run(
        problem_path, settings, resume=resume, session_id=session_id, commit=commit, allow_unconfined=allow_unconfined
    )  # fmt: skip
    with opened as checked_now:
        made_here = not checked_now.workspace_root.exists()
        try:
            ws, _ = init_workspace(problem_path, checked_now.workspace_root, device=settings.device)
            checked_now.judge.prepare(ws.root)  # on a GPU, the baselines' processes start while the agent works
            ctx = ToolContext(workspace=ws, judge=checked_now.judge, settings=settings, judged=checked_now.judged)
            if resume or session_id:
                session = Session.resume(ws.root, session_id)
                messages = session.messages
            else:
                session, messages = _new_session(checked_now.problem, ws, settings, checked_now.model.name,
                                                 checked_now.judge)  # fmt: skip
        except BaseException:
            if made_here:
                shutil.rmtree(checked_now.workspace_root, ignore_errors=True)
            raise
        yield AgentRun(Path(problem_path), ws, checked_now.model, default_tools(), ctx, settings, session, messages)


def finish_run(run: AgentRun, summary: RunSummary) -> OptimizeResult:
    """Write out the best verified candidate (not after an interruption, which a resume continues) and report,
    with why nothing was verified when nothing was."""
    interrupted = summary.status == "interrupted"
    written = [] if interrupted else write_outputs(run.workspace, run.problem_path, run.settings.output,
                                                   run.session.path)  # fmt: skip
    # The judge's own word covers every step it ran; the evaluations' cover a resumed session's earlier ones.
    confinement = least_confined(getattr(run.ctx.judge, "confinement", None),
                                 *(result.confinement for result in run.ctx.judged.evals))  # fmt: skip
    return OptimizeResult(run.problem_path, run.workspace.root, run.model.name, summary, written,
                          failure=run_failure(summary, run.ctx.judged), confinement=confinement)  # fmt: skip


def require_committable(root: Path) -> None:
    """VcsError, with a hint for `optimize --commit`, unless git can commit in the repository that holds (or will
    hold) the workspace folder `root`, which need not exist yet."""
    from kernelpilot.vcs import VcsError, check_ready_to_commit

    existing = next(folder for folder in (root, *root.parents) if folder.exists())
    try:
        check_ready_to_commit(existing)
    except VcsError as err:
        raise VcsError(err.message, hint="Fix that first, or run optimize without --commit.") from None


def commit_best(result: OptimizeResult, judge: Judge | None) -> None:
    """Commit the run's best verified candidate, which `finish_run` put back into the workspace, with its lock
    file, once `judge` has verified it at the shape variants too (`acceptance.accept_candidate`: its timings are
    the run's); keep git's refusal on the result instead of raising it, so nothing is lost.
    """
    from kernelpilot.acceptance import accept_candidate
    from kernelpilot.workspace import open_workspace

    if result.summary.best is None or result.summary.status == "interrupted":
        return
    try:
        result.commit = accept_candidate(judge, open_workspace(result.workspace), result.summary.best).commit
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


def write_outputs(ws: Workspace, problem_path: Path, output: Path | None, transcript: Path) -> list[Path]:
    """Put the session's best verified candidate back into the workspace and copy it to `output` (default: beside
    the problem).

    Returns the files written outside the workspace; none when nothing was verified.
    """
    if not restore_best(ws, transcript):
        return []
    target = Path(output) if output is not None else Path(problem_path).parent / "model_new.py"
    if target.parent.resolve() == ws.root:
        return []  # the workspace is the output folder: the candidate is already there
    written = [target]
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ws.model_new_path, target)
    for relative in candidate_files(ws.root):
        if relative.parts[0] == "kernels":  # model_new.py calls them as torch ops built from kernels/
            (target.parent / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ws.root / relative, target.parent / relative)
            written.append(target.parent / relative)
    return written
