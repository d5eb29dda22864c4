"""The TUI through Textual's pilot: a scripted model's run on a real workspace fills the transcript, plan and diff
panels; the pause, resume and stop keys really hold and end the loop; accept verifies the best again at the shape
variants with the run's judge and commits it with a lock file that records them, in a real git repository (and
says why not outside one); the profile panel shows judged results and the per-kernel diff;
watch mode turns saves in a real workspace into profile rows and compile errors into diagnostics, `w` turns it off
and on, and quitting ends the watcher's thread; results of an unconfined judge are flagged as unverified."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import git
import pytest
from textual.app import App, ComposeResult
from textual.css.query import NoMatches
from textual.widgets import Collapsible, DataTable, Sparkline, Static

from kernelpilot.agent import ModelReply, RunEnded, ToolCall, ToolContext
from kernelpilot.agent.model import ScriptedModel
from kernelpilot.agent.session import Session, read_records
from kernelpilot.agent.tool_results import TodoItem
from kernelpilot.agent.tools import default_tools
from kernelpilot.config import Settings
from kernelpilot.harness.variants import VARIANTS
from kernelpilot.lockfile import LOCK_NAME, read_lock
from kernelpilot.optimize import AgentRun
from kernelpilot.results import (
    NOT_APPLICABLE,
    UNCONFINED,
    UNCONFINED_NOTE,
    BenchResult,
    BuildResult,
    Diagnostic,
    EvalResult,
    KernelTime,
    Timing,
    TrialResult,
    VariantCheck,
    VerifyResult,
    to_dict,
)
from kernelpilot.tui.app import KernelpilotApp, RecordWritten
from kernelpilot.tui.diff_view import DiffView
from kernelpilot.tui.profile import ProfilePanel
from kernelpilot.tui.status import RunStatus
from kernelpilot.tui.todos import TodoPanel
from kernelpilot.tui.transcript import Transcript
from kernelpilot.workspace import init_workspace, open_workspace
from kp_testing import DOUBLE_PROBLEM, write_problem

CANDIDATE = """from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        return x + x
"""

PLAN = [{"content": "write a fused kernel", "status": "in_progress"}, {"content": "profile it", "status": "pending"}]
# How long a condition may take to hold: generous, as only a failing test waits it out (on a busy 2-core machine the
# first run of a test process also checks the problem in a child process that imports torch).
WAIT_S = 60.0


def call(name: str, **arguments) -> ModelReply:
    return ModelReply(f"next: {name}", [ToolCall(id=f"call-{name}", name=name, arguments=arguments)])


def plan_write_finish() -> list[ModelReply]:
    return [call("TodoWrite", todos=PLAN), call("Write", path="model_new.py", content=CANDIDATE),
            call("Finish", summary="wrote a candidate")]  # fmt: skip


class GatedModel:
    """The scripted model, answering only when the test lets it: each query takes one permit."""

    def __init__(self, replies: list[ModelReply]):
        self.name = "gated"
        self.permits = threading.Semaphore(0)
        self.queries = 0
        self._script = ScriptedModel(replies)

    def query(self, messages, tools) -> ModelReply:
        self.queries += 1
        if not self.permits.acquire(timeout=WAIT_S):
            raise RunEnded("test-gave-no-permit")
        return self._script.query(messages, tools)


@pytest.fixture(autouse=True)
def isolated_git(tmp_path, monkeypatch):
    """Git sees neither the user's nor the system's configuration, nor a repository above the temp folder."""
    (tmp_path / "gitconfig").write_text("[user]\n\tname = Ada Lovelace\n\temail = ada@example.com\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))


@pytest.fixture
def problem(tmp_path) -> Path:
    return write_problem(tmp_path / "project", DOUBLE_PROBLEM, "double.py")


def scripted_run(problem_path: Path, model, max_turns: int = 10, judge=None):
    """An OpenRun as `prepared_run` gives, with a scripted model and, unless given, no judge (file tools need none)."""

    @contextmanager
    def open_run():
        ws, _ = init_workspace(problem_path, problem_path.parent / "kp-double")
        settings = Settings(max_turns=max_turns)
        session = Session.create(ws.root, problem=str(problem_path), model=model.name)
        messages = [{"role": "system", "content": "You write CUDA kernels."},
                    {"role": "user", "content": "Make Model faster.\n" + DOUBLE_PROBLEM}]  # fmt: skip
        for message in messages:
            session.append("message", turn=0, message=message)
        ctx = ToolContext(workspace=ws, judge=judge, settings=settings)
        yield AgentRun(problem_path, ws, model, default_tools(), ctx, settings, session, messages)

    return open_run


def holds(condition) -> bool:
    """The condition, where a widget it reads not mounted yet (or an empty list) counts as not yet."""
    try:
        return bool(condition())
    except (NoMatches, IndexError):
        return False


async def wait_for(pilot, condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not holds(condition):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.02)


async def eventually(pilot, check) -> None:
    """Run `check` (a function of asserts) until it passes: widgets are mounted and refreshed by messages after an
    action, so a query right after a key press or a file save can run before them. Past WAIT_S its failure stands."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            check()
            return
        except (AssertionError, NoMatches, IndexError):
            if time.monotonic() >= deadline:
                raise
        await pilot.pause(0.02)


def timing(median_ms: float) -> Timing:
    return Timing(median_ms=median_ms, p10_ms=median_ms * 0.98, p90_ms=median_ms * 1.02, mean_ms=median_ms, runs=50)


def judged(problem_id: str, workspace: str, candidate_ms: float, kernels: dict[str, float]) -> EvalResult:
    """A correct, timed result as the judge reports it (eager 0.5 ms, torch.compile 0.4 ms)."""
    return EvalResult(
        problem_id=problem_id,
        workspace=workspace,
        verify=VerifyResult(ok=True, trials=[TrialResult(seed=seed, ok=True) for seed in (0, 1, 2)]),
        bench=BenchResult(
            ok=True,
            gpu="NVIDIA H100 80GB HBM3",
            candidate=timing(candidate_ms),
            eager=timing(0.5),
            compiled=timing(0.4),
            speedup_vs_eager=0.5 / candidate_ms,
            speedup_vs_compile=0.4 / candidate_ms,
            sol_candidate=0.6,
            kernels=[KernelTime(name, ms, 1) for name, ms in kernels.items()],
        ),
        reward=3,
    )


def lines(app: App) -> list[str]:
    """The transcript's one-line entries (not the bodies of tool outputs), oldest first."""
    transcript = app.query_one(Transcript)
    return [str(line.content) for line in transcript.query(Static) if line.parent is transcript]


@pytest.mark.asyncio
async def test_run_fills_transcript_plan_and_diff(problem):
    app = KernelpilotApp(scripted_run(problem, ScriptedModel(plan_write_finish())))
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: app.phase == "ended", "the run to end")

        def filled():
            assert app.outcome.summary.status == "finished" and app.turn == 3

            assert app.query_one(TodoPanel).todos == [TodoItem(**item) for item in PLAN]
            plan_text = str(app.query_one(TodoPanel).content)
            assert "write a fused kernel" in plan_text and "profile it" in plan_text

            diff_view = app.query_one(DiffView)
            assert diff_view.path == "model_new.py"
            assert "+        return x + x" in diff_view.diff

            titles = [str(block.title) for block in app.query_one(Transcript).query(Collapsible)]
            assert any(title.startswith("→ Write") for title in titles)
            assert any(title.startswith("→ TodoWrite") for title in titles)
            assert "next: Finish" in lines(app)
            assert "run ended: finished" in lines(app)

        await eventually(pilot, filled)

    # Everything shown came from the transcript file, which a resume reads.
    records = read_records(next((problem.parent / "kp-double/.kernelpilot/sessions").glob("*.jsonl")))
    assert [record["type"] for record in records][-1] == "end"


@pytest.mark.asyncio
async def test_pause_resume_and_stop_keys_drive_the_loop(problem):
    model = GatedModel([call("TodoWrite", todos=PLAN)] * 3)
    app = KernelpilotApp(scripted_run(problem, model))
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: model.queries == 1, "the first query")
        await pilot.press("p")
        # The turn under way finishes first: its model query holds no permit, so "pausing" lasts until the release.
        await wait_for(pilot, lambda: app.phase == "pausing", "the pause key to be handled")

        model.permits.release(2)  # one answer for this turn, one the loop must not take while paused
        await wait_for(pilot, lambda: app.phase == "paused" and app.control.loop_waiting and app.turn == 1,
                       "the loop to block between turns")  # fmt: skip
        await pilot.pause(0.3)  # what must not happen: a paused loop taking the second permit
        assert model.queries == 1 and app.turn == 1

        await pilot.press("a")
        await wait_for(pilot, lambda: "stop it (s) first" in lines(app)[-1], "accept's refusal during a run")

        await pilot.press("r")
        await wait_for(pilot, lambda: model.queries == 3 and app.turn == 2, "turn 2 and the start of turn 3")
        assert app.phase == "running"

        await pilot.press("s")
        await wait_for(pilot, lambda: app.phase == "stopping", "the stop key to be handled")  # no permit: it stays
        model.permits.release()
        await wait_for(pilot, lambda: app.phase == "ended", "the stop to end the run")
        assert app.outcome.summary.status == "stopped" and app.outcome.summary.turns == 3


class VerifyingJudge:
    """The run's judge after the run: watch mode's evaluation of the workspace as it is (the 0.25 ms candidate), and
    accept's, which verifies (no timing) at the variants it is asked for, each verified, as the worker reports them
    for DOUBLE_PROBLEM's (16, 32) input."""

    SHAPES = {"half": [[8, 32]], "double": [[32, 32]]}

    def __init__(self):
        self.calls: list[dict] = []  # accept's

    def evaluate(self, root, **judging) -> EvalResult:
        problem_id = open_workspace(root).problem_id
        if "variants" not in judging:
            return judged(problem_id, str(root), 0.25, {"twice": 0.25})
        self.calls.append(judging)
        trials = [TrialResult(seed=100 + index, ok=True) for index in range(judging["trials"])]
        checks = [VariantCheck(name, "verified", inputs=self.SHAPES[name]) if name in self.SHAPES
                  else VariantCheck(name, NOT_APPLICABLE, message="no tensor input has three or more dims")
                  for name in judging["variants"]]  # fmt: skip
        verify = VerifyResult(ok=True, trials=trials, atol=judging["atol"], rtol=judging["rtol"],
                              input_shapes=[[16, 32]], variants=checks)  # fmt: skip
        return EvalResult(problem_id, str(root), verify=verify, reward=1)


@pytest.mark.asyncio
async def test_accept_commits_the_best_in_a_repository(problem):
    repo = git.Repo.init(problem.parent, initial_branch="main")
    (problem.parent / "README.md").write_text("# project\n")
    repo.index.add(["README.md"])
    repo.index.commit("start")
    judge = VerifyingJudge()
    app = KernelpilotApp(scripted_run(problem, ScriptedModel(plan_write_finish()), judge=judge))
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: app.phase == "ended", "the run to end")
        ws = app.workspace
        # The eval record the loop writes when the judge verifies a new best (the judge needs a GPU).
        result = judged(ws.problem_id, str(ws.root), 0.25, {"twice": 0.25})
        app.post_message(RecordWritten({"type": "eval", "turn": 2, "improved": True, "eval": to_dict(result)}))
        # The run's best, and watch mode's start: the same files, judged the same.
        await wait_for(pilot, lambda: app.best is not None and app.query_one("#attempts", DataTable).row_count == 2,
                       "the best to be recorded and shown")  # fmt: skip

        await pilot.press("a")
        await wait_for(pilot, lambda: lines(app)[-1].startswith("committed"), "the commit")
        head = repo.head.commit
        assert lines(app)[-1] == f"committed {head.hexsha[:7]} {head.summary}"
        assert "accept: verifying the best at half and double the batch and the sequence too, then committing…" in lines(app)

    committed = set(head.stats.files)
    assert "kp-double/model_new.py" in committed and "kp-double/kernelpilot.lock.json" in committed
    assert "README.md" not in committed
    # Verified again, as it was (3 trials, its tolerances) and at the variants, not timed again: the run's timing.
    [verifying] = judge.calls
    assert verifying == {"trials": 3, "atol": 1e-2, "rtol": 1e-2, "bench": False, "variants": VARIANTS}
    lock = read_lock(problem.parent / "kp-double" / LOCK_NAME)
    assert [(s.variant, s.inputs) for s in lock.shapes.verified] == [
        ("problem", [[16, 32]]), ("half", [[8, 32]]), ("double", [[32, 32]])]  # fmt: skip
    assert lock.verification.seeds == [100, 101, 102]
    assert lock.timings.candidate.median_ms == 0.25 and lock.environment.gpu == "NVIDIA H100 80GB HBM3"


@pytest.mark.asyncio
async def test_accept_outside_a_repository_says_why(problem):
    app = KernelpilotApp(scripted_run(problem, ScriptedModel(plan_write_finish())))
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: app.phase == "ended", "the run to end")
        ws = app.workspace
        app.best = judged(ws.problem_id, str(ws.root), 0.25, {"twice": 0.25})
        await pilot.press("a")
        await wait_for(pilot, lambda: "not inside a git repository" in lines(app)[-1], "the refusal")
        assert "--no-commit" in lines(app)[-1]


class ProfileOnly(App):
    def compose(self) -> ComposeResult:
        yield ProfilePanel()


@pytest.mark.asyncio
async def test_profile_panel_rows_sparkline_and_kernel_diff():
    app = ProfileOnly()
    async with app.run_test(size=(120, 40)) as pilot:
        panel = app.query_one(ProfilePanel)
        panel.add_result("turn 2", judged("p", "ws", 0.5, {"fused": 0.4, "reduce": 0.1}))
        panel.add_result("turn 3", EvalResult("p", "ws", verify=VerifyResult(ok=False), error_kind="mismatch"))
        panel.add_result("turn 5", judged("p", "ws", 0.25, {"fused": 0.2, "reduce": 0.05}))

        def shown():
            attempts = app.query_one("#attempts", DataTable)
            assert attempts.row_count == 3
            assert [str(cell) for cell in attempts.get_row_at(0)] == ["turn 2", "yes", "0.5", "1.00x", "0.80x", "60.0", "3"]
            assert [str(cell) for cell in attempts.get_row_at(1)][:3] == ["turn 3", "no (mismatch)", "–"]
            assert app.query_one(Sparkline).data == [0.8, 0.0, 1.6]

            assert "turn 2 → turn 5" in str(app.query_one("#diff-title", Static).content)
            comparison = app.query_one("#kernel-diff", DataTable)
            rows = [comparison.get_row_at(index) for index in range(comparison.row_count)]
            rows = {str(row[0]): [str(cell) for cell in row[1:]] for row in rows}
            assert rows["kernel fused ms"] == ["0.4", "0.2", "-50.0%"]
            assert rows["speedup vs compile"] == ["0.80x", "1.60x", "+100.0%"]

        await eventually(pilot, shown)


# ------------------------------------------------------------------------------------------- watch mode

KERNEL = "__global__ void twice(const float* x, float* y, int n) { int i = threadIdx.x; if (i < n) y[i] = 2 * x[i]; }\n"


class ReleasedEvaluations:
    """The watcher's `evaluate`: hands out the given results in order, each only once the test releases it."""

    def __init__(self, results: list[EvalResult]):
        self.results = results
        self.permits = threading.Semaphore(0)
        self.calls = 0

    def __call__(self, root: Path) -> EvalResult:
        self.calls += 1
        if not self.permits.acquire(timeout=WAIT_S):
            raise RuntimeError("the test released no evaluation")
        return self.results.pop(0)


def build_failure(problem_id: str, workspace: str) -> EvalResult:
    """A compile error as the judge reports it: nvcc's message parsed into a diagnostic."""
    diagnostic = Diagnostic("error", 'expected a ";"', file="kernels/twice.cu", line=1, column=42)
    build = BuildResult(ok=False, workspace=workspace, extension_name="kp_ext", arch="9.0", diagnostics=[diagnostic],
                        error="the build failed: 1 error.")  # fmt: skip
    return EvalResult(problem_id, workspace, build=build, error_kind="build", message=build.error)


def watch_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "kernelpilot-watch"]


def all_end(threads: list[threading.Thread]) -> bool:
    """Whether the threads end, given WAIT_S: a stopped watcher's thread ends on its own (the app waits a second for
    it, which a busy machine may outlast); one that was never told to stop never does."""
    deadline = time.monotonic() + WAIT_S
    while any(thread.is_alive() for thread in threads) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not any(thread.is_alive() for thread in threads)


def save(path: Path, text: str) -> None:
    """Save `path` as an editor does atomically, a temporary file renamed over it: one file event. An in-place write
    is three (created or modified, then closed), which a busy machine can deliver further apart than these tests'
    50 ms debounce, making one save two evaluations. (In-place saves are watched in tests/core/test_watch.py.)"""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


@pytest.fixture
def workspace(problem):
    ws, _ = init_workspace(problem, problem.parent / "kp-double")
    return ws


def attempt_labels(app: App) -> list[str]:
    table = app.query_one("#attempts", DataTable)
    return [str(table.get_row_at(index)[0]) for index in range(table.row_count)]


@pytest.mark.asyncio
async def test_watch_only_a_saved_kernel_becomes_a_profile_row(workspace):
    root = str(workspace.root)
    evaluate = ReleasedEvaluations([judged(workspace.problem_id, root, 0.5, {"twice": 0.5}),
                                    judged(workspace.problem_id, root, 0.25, {"twice": 0.25})])  # fmt: skip
    app = KernelpilotApp(workspace=workspace, evaluate=evaluate, debounce_s=0.05)
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: app.watch_state == "evaluating…", "the first evaluation")
        assert app.phase == "watch only"
        evaluate.permits.release()
        await wait_for(pilot, lambda: attempt_labels(app) == ["start"] and app.watch_state == "watching",
                       "the starting row")  # fmt: skip

        save(workspace.root / "kernels" / "twice.cu", KERNEL)
        await wait_for(pilot, lambda: app.watch_state == "evaluating…", "the save to start an evaluation")

        def evaluating():
            assert "watch: evaluating…" in str(app.query_one(RunStatus).render())
            assert "saved kernels/twice.cu: building, verifying, timing…" in lines(app)

        await eventually(pilot, evaluating)
        evaluate.permits.release()
        await wait_for(pilot, lambda: attempt_labels(app) == ["start", "edit 1"], "the edit's row")

        def compared():
            assert "watch: watching" in str(app.query_one(RunStatus).render())
            assert "profile start → edit 1" in str(app.query_one("#diff-title", Static).content)
            comparison = app.query_one("#kernel-diff", DataTable)
            rows = {str(row[0]): [str(cell) for cell in row[1:]]
                    for row in (comparison.get_row_at(index) for index in range(comparison.row_count))}  # fmt: skip
            assert rows["kernel twice ms"] == ["0.5", "0.25", "-50.0%"]
            assert app.best.bench.candidate.median_ms == 0.25  # what accept would commit: the workspace as it is now

        await eventually(pilot, compared)


@pytest.mark.asyncio
async def test_results_of_an_unconfined_judge_are_flagged_once_in_the_transcript_and_in_the_status_line(workspace):
    root = str(workspace.root)
    unconfined = [dataclasses.replace(judged(workspace.problem_id, root, ms, {"twice": ms}), confinement=UNCONFINED)
                  for ms in (0.5, 0.25)]  # fmt: skip
    evaluate = ReleasedEvaluations(unconfined)
    app = KernelpilotApp(workspace=workspace, evaluate=evaluate, debounce_s=0.05)
    async with app.run_test(size=(200, 50)) as pilot:
        evaluate.permits.release()
        await wait_for(pilot, lambda: attempt_labels(app) == ["start"], "the starting row")
        save(workspace.root / "kernels" / "twice.cu", KERNEL)
        evaluate.permits.release()
        await wait_for(pilot, lambda: attempt_labels(app) == ["start", "edit 1"], "the edit's row")

        assert [line for line in lines(app) if line.startswith("warning:")] == [f"warning: {UNCONFINED_NOTE}"]
        assert "unverified: no Landlock" in str(app.query_one(RunStatus).render())


class EvaluatingJudge:
    """The run's judge as watch mode uses it after the run: `evaluate` only, answering as `evaluations` release."""

    def __init__(self, evaluations: ReleasedEvaluations):
        self.evaluations = evaluations

    def evaluate(self, root, *, trials, atol, rtol) -> EvalResult:
        return self.evaluations(Path(root))


@pytest.mark.asyncio
async def test_after_the_run_the_app_watches_the_workspace_with_the_runs_judge(problem):
    root = str(problem.parent / "kp-double")
    evaluate = ReleasedEvaluations([judged("double", root, 0.5, {"twice": 0.5}),
                                    judged("double", root, 0.2, {"twice": 0.2})])  # fmt: skip
    app = KernelpilotApp(scripted_run(problem, ScriptedModel(plan_write_finish()), judge=EvaluatingJudge(evaluate)),
                         debounce_s=0.05)  # fmt: skip
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: app.phase == "ended", "the run to end")
        await wait_for(pilot, lambda: app.watch_state == "evaluating…", "watching to start after the run")
        evaluate.permits.release()
        await wait_for(pilot, lambda: attempt_labels(app) == ["start"], "the starting row")

        save(problem.parent / "kp-double" / "kernels" / "twice.cu", KERNEL)
        await wait_for(pilot, lambda: app.watch_state == "evaluating…", "the save to start an evaluation")
        evaluate.permits.release()
        await wait_for(pilot, lambda: attempt_labels(app) == ["start", "edit 1"], "the edit's row")

        def recorded():
            assert "saved kernels/twice.cu: building, verifying, timing…" in lines(app)
            assert app.best.bench.candidate.median_ms == 0.2

        await eventually(pilot, recorded)
    assert evaluate.calls == 2 and all_end(watch_threads())


@pytest.mark.asyncio
async def test_watch_shows_a_compile_errors_diagnostics(workspace):
    root = str(workspace.root)
    evaluate = ReleasedEvaluations([judged(workspace.problem_id, root, 0.5, {"twice": 0.5}),
                                    build_failure(workspace.problem_id, root)])  # fmt: skip
    evaluate.permits.release(2)
    app = KernelpilotApp(workspace=workspace, evaluate=evaluate, debounce_s=0.05)
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: attempt_labels(app) == ["start"], "the starting row")
        save(workspace.root / "kernels" / "twice.cu", KERNEL.replace(";", "", 1))
        await wait_for(pilot, lambda: len(attempt_labels(app)) == 2, "the failed edit's row")

        def diagnosed():
            # The block and its contents are mounted by messages of their own, after the profile row.
            blocks = list(app.query_one(Transcript).query(Collapsible))
            assert [str(block.title) for block in blocks][-1] == "edit 1: build failed, 1 error"
            body = str(blocks[-1].query_one(Collapsible.Contents).query_one(Static).content)
            assert body == 'kernels/twice.cu:1:42: error: expected a ";"'
            assert str(app.query_one("#attempts", DataTable).get_row_at(1)[1]) == "no (build)"

        await eventually(pilot, diagnosed)
        await pilot.press("a")
        await wait_for(pilot, lambda: "latest edit is not verified correct" in lines(app)[-1], "accept's refusal")


@pytest.mark.asyncio
async def test_w_turns_watching_off_and_on(workspace):
    root = str(workspace.root)
    evaluate = ReleasedEvaluations([judged(workspace.problem_id, root, 0.5, {"twice": 0.5}),
                                    judged(workspace.problem_id, root, 0.4, {"twice": 0.4})])  # fmt: skip
    evaluate.permits.release(2)
    app = KernelpilotApp(workspace=workspace, evaluate=evaluate, debounce_s=0.05)
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: attempt_labels(app) == ["start"], "the starting row")
        first_thread = watch_threads()
        await pilot.press("w")
        await wait_for(pilot, lambda: app.watch_state == "off" and not app.watch_bridge.running, "watching to stop")
        await wait_for(pilot, lambda: not any(thread.is_alive() for thread in first_thread), "its thread to end")

        save(workspace.root / "kernels" / "twice.cu", KERNEL)
        await pilot.pause(0.3)  # six debounce periods: a watcher still running would have evaluated by now
        assert evaluate.calls == 1

        await pilot.press("w")
        await wait_for(pilot, lambda: attempt_labels(app) == ["start", "start"] and app.watch_state == "watching",
                       "watching to start again")  # fmt: skip


@pytest.mark.asyncio
async def test_quitting_stops_the_watcher_thread(workspace):
    evaluate = ReleasedEvaluations([judged(workspace.problem_id, str(workspace.root), 0.5, {"twice": 0.5})])
    evaluate.permits.release()
    app = KernelpilotApp(workspace=workspace, evaluate=evaluate, debounce_s=0.05)
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: attempt_labels(app) == ["start"] and watch_threads(), "the starting row")
        threads = watch_threads()
        assert threads and all(thread.is_alive() for thread in threads)
        await pilot.press("q")
    assert all_end(threads)
