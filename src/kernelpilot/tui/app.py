"""The kernelpilot TUI: an agent run on a Textual worker thread, its session shown live, and keys to steer it.

The worker assembles the run exactly as `optimize` does (`prepared_run`), replays the session's records so far,
then runs the loop with a ReportingSession: every record is written to the transcript file first (closing the app
loses nothing and `--resume` continues) and then posted to the app, whose handlers fill the panels on the UI
thread. Pause and stop act between turns through RunControl; accept commits the best verified candidate once the
run is over and that candidate is back in the workspace, after the run's judge has verified it at the shape
variants too (`acceptance.accept_candidate`, as `kernelpilot accept` and `optimize --commit` do).

Once the run is over the worker keeps the run (and its judge) open, and the app watches the workspace: every save
of a kernel or model_new.py is judged again and shown as an "edit N" attempt, until `w` turns watching off or the
app closes. `kernelpilot watch DIR --tui` opens the same app with no run, watching only. After an edit, accept
commits the workspace's files with the latest edit's numbers, so it refuses while the latest edit failed.
Watching only, accept verifies with the judge that watching uses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Footer

from kernelpilot.agent.session import describe_eval, read_records, tool_result
from kernelpilot.agent.tool_results import FileEdited, FileWritten, TodoItem, TodoList
from kernelpilot.errors import KernelpilotError
from kernelpilot.results import UNCONFINED, UNCONFINED_NOTE, EvalResult, from_dict
from kernelpilot.tui.control import Record, ReportingSession, RunControl
from kernelpilot.tui.diff_view import DiffView
from kernelpilot.tui.profile import ProfilePanel
from kernelpilot.tui.status import RunStatus
from kernelpilot.tui.todos import TodoPanel
from kernelpilot.tui.transcript import Transcript
from kernelpilot.tui.watching import WatchBridge, WatchUpdate, diagnostics_text, run_evaluator
from kernelpilot.watch import DEBOUNCE_SECONDS, Evaluate, WatchEvent

if TYPE_CHECKING:
    from kernelpilot.config import Settings
    from kernelpilot.harness.judge import Judge
    from kernelpilot.optimize import AgentRun, CheckedRun, OptimizeResult
    from kernelpilot.vcs import CommitInfo
    from kernelpilot.workspace import Workspace

OpenRun = Callable[[], AbstractContextManager["AgentRun"]]
ACTIVE_PHASES = ("starting", "running", "pausing", "paused", "stopping", "quitting")


class RunStarted(Message):
    """The run is assembled; `history` is its session's records so far (a resumed session's whole past)."""

    def __init__(self, run: AgentRun, history: list[Record]):
        super().__init__()
        self.run, self.history = run, history


class RecordWritten(Message):
    """The loop wrote one session record."""

    def __init__(self, record: Record):
        super().__init__()
        self.record = record


class ControlChanged(Message):
    """The loop started or stopped waiting between turns."""


class RunOver(Message):
    """The loop is done: the run's outcome, an error that stopped it, or neither when it never began; `evaluate`
    judges the workspace with the run's judge, which stays open for watch mode until the app closes."""

    def __init__(
        self, outcome: OptimizeResult | None, error: KernelpilotError | None, evaluate: Evaluate | None = None
    ):
        super().__init__()
        self.outcome, self.error, self.evaluate = outcome, error, evaluate


class AcceptDone(Message):
    """`accept_candidate` committed the best candidate, or refused with a KernelpilotError."""

    def __init__(self, commit: CommitInfo | None, error: KernelpilotError | None):
        super().__init__()
        self.commit, self.error = commit, error


class KernelpilotApp(App[None]):
    """Transcript on the left; plan, latest edit and profiles on the right; run state on top; keys in the footer."""

    CSS_PATH = "app.tcss"
    TITLE = "kernelpilot"
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("p", "pause", "Pause"),
        Binding("r", "resume", "Resume"),
        Binding("s", "stop", "Stop"),
        Binding("a", "accept", "Accept best"),
        Binding("w", "toggle_watch", "Watch"),
        Binding("q", "quit", "Quit"),
    ]

    phase: reactive[str] = reactive("starting")
    turn: reactive[int] = reactive(0)
    max_turns: reactive[int] = reactive(0)
    best: reactive[EvalResult | None] = reactive(None)
    run_title: reactive[str] = reactive("")
    watch_state: reactive[str] = reactive("")

    def __init__(
        self,
        open_run: OpenRun | None = None,
        *,
        workspace: Workspace | None = None,
        evaluate: Evaluate | None = None,
        judge: Judge | None = None,
        debounce_s: float = DEBOUNCE_SECONDS,
    ):
        """Drive the run `open_run` assembles, then watch its workspace; with no run, watch `workspace` only, and
        let accept verify with `judge`."""
        super().__init__()
        self.judge = judge  # what accept verifies with: the run's judge once the run is assembled
        self._open_run = open_run
        self._debounce_s = debounce_s
        self.watch_bridge: WatchBridge | None = None
        self.workspace: Workspace | None = workspace
        if workspace is not None and evaluate is not None:
            self.watch_bridge = WatchBridge(self, workspace.root, evaluate, debounce_s=debounce_s)
        self._edits = 0
        self.latest_watched: EvalResult | None = None  # what the workspace's files scored when last judged
        self._warned_unconfined = False  # that the judge's sandboxes are not confined: said once
        self._app_closed = threading.Event()  # lets the finished run's worker close its judge
        self.control = RunControl(on_change=lambda: self.post_message(ControlChanged()))
        # Set by the worker thread before it posts RunOver, so they are there even if the app closed first.
        self.outcome: OptimizeResult | None = None
        self.error: KernelpilotError | None = None
        self._quitting = False

    def compose(self) -> ComposeResult:
        yield RunStatus(id="status").data_bind(
            KernelpilotApp.phase, KernelpilotApp.turn, KernelpilotApp.max_turns, KernelpilotApp.best,
            KernelpilotApp.run_title, KernelpilotApp.watch_state,
        )  # fmt: skip
        with Horizontal(id="main"):
            yield Transcript(id="transcript")
            with Vertical(id="side"):
                yield TodoPanel(id="todos")
                yield DiffView(id="diff")
                yield ProfilePanel(id="profile")
        yield Footer()

    def on_mount(self) -> None:
        for selector, title in (("#transcript", "transcript"), ("#todos", "plan"), ("#diff", "latest edit"),
                                ("#profile", "profile")):  # fmt: skip
            self.query_one(selector).border_title = title
        if self._open_run is not None:
            self.run_worker(self._drive_run, thread=True, name="agent", group="agent")
        elif self.watch_bridge is not None:
            self.phase = "watch only"
            self.run_title = str(self.watch_bridge.root)
            self._set_watching(True)

    def on_unmount(self) -> None:
        # However the app closes, a paused or running loop must end at its next turn boundary, not wait forever.
        self.control.stop("interrupted")
        if self.watch_bridge is not None:
            self.watch_bridge.stop()
        self._app_closed.set()

    # -- the worker thread

    def _drive_run(self) -> None:
        try:
            with self._open_run() as run:
                self.post_message(RunStarted(run, read_records(run.session.path)))
                if self.control.stop_status is None:  # else closed before the first turn: the session is saved
                    self.outcome = self._run_loop(run)
                self.post_message(RunOver(self.outcome, None, run_evaluator(run)))
                self._app_closed.wait()  # the run's judge stays open for watch mode until the app closes
        except KernelpilotError as err:
            self.error = err
            self.post_message(RunOver(self.outcome, err))

    def _run_loop(self, run: AgentRun) -> OptimizeResult:
        from kernelpilot.agent.loop import run_agent
        from kernelpilot.optimize import finish_run

        session = ReportingSession(run.session, lambda record: self.post_message(RecordWritten(record)))
        summary = run_agent(run.messages, run.model, run.tools, run.ctx, run.settings, session,
                            self.control.between_turns)  # fmt: skip
        return finish_run(run, summary)

    # -- events from the worker

    def on_run_started(self, message: RunStarted) -> None:
        run = message.run
        self.workspace = run.workspace
        self.judge = run.ctx.judge
        self.max_turns = run.settings.max_turns
        self.run_title = f"{run.problem_path.name} · {run.model.name} · session {run.session.id}"
        for record in message.history:
            self._show_record(record)
        self._sync_phase()

    def on_record_written(self, message: RecordWritten) -> None:
        self._show_record(message.record)

    def on_control_changed(self, _: ControlChanged) -> None:
        self._sync_phase()

    def on_run_over(self, message: RunOver) -> None:
        transcript = self.query_one(Transcript)
        if message.error is not None:
            self.phase = "failed"
            self.judge = None  # the run's judge closed with the run
            transcript.add_line(_sentence(message.error), "refused")
        else:
            self.phase = "ended"
            transcript.add_line(_outcome_text(message.outcome), "header")
        # An error while assembling the run (bad problem file, no model) leaves nothing to watch: run_tui reports it.
        if self._quitting or (message.error is not None and self.workspace is None):
            self.exit()
        elif message.evaluate is not None and self.workspace is not None:
            self.watch_bridge = WatchBridge(self, self.workspace.root, message.evaluate, debounce_s=self._debounce_s)
            self._set_watching(True)

    def _show_record(self, record: Record) -> None:
        """Put one session record into the transcript and into the panel it concerns."""
        self.query_one(Transcript).add_record(record)
        kind = record["type"]
        result = tool_result(record) if kind == "tool" else None
        if isinstance(result, (FileWritten, FileEdited)):
            self.query_one(DiffView).show_edit(result.path, result.diff)
        if isinstance(result, TodoList):
            self.query_one(TodoPanel).todos = result.todos
        elif kind == "step":
            self.turn = record["turn"]
            self.query_one(TodoPanel).todos = from_dict(list[TodoItem], record.get("todos") or [])
        elif kind == "resume":
            self.turn = record.get("turn") or 0
        elif kind == "eval":
            result = from_dict(EvalResult, record["eval"])
            self._warn_if_unconfined(result)
            self.query_one(ProfilePanel).add_result(f"turn {record.get('turn') or self.turn}", result)
            if record.get("improved"):
                self.best = result

    # -- watch mode

    def on_watch_update(self, message: WatchUpdate) -> None:
        if self.watch_bridge is None or not self.watch_bridge.running:
            return  # posted just before watching was turned off
        event = message.event
        transcript = self.query_one(Transcript)
        if event.kind == "evaluating":
            self.watch_state = "evaluating…"
            saved = f"saved {', '.join(event.changed)}" if event.changed else "the workspace as it is"
            transcript.add_line(f"{saved}: building, verifying, timing…", "watch")
            return
        self.watch_state = "watching"
        if event.kind == "error":
            transcript.add_line(f"could not evaluate: {event.message}", "refused")
        elif event.result is not None:
            self._show_watched(self._watch_label(event), event.result)

    def _watch_label(self, event: WatchEvent) -> str:
        """"edit N" for the Nth evaluation after saves; "start" for the one that begins watching."""
        if not event.changed:
            return "start"
        self._edits += 1
        return f"edit {self._edits}"

    def _show_watched(self, label: str, result: EvalResult) -> None:
        self._warn_if_unconfined(result)
        self.query_one(ProfilePanel).add_result(label, result)
        transcript = self.query_one(Transcript)
        if result.build is not None and not result.build.ok:
            errors = len(result.build.errors)
            title = f"{label}: build failed, {errors} error{'s' if errors != 1 else ''}"
            transcript.add_output(title, diagnostics_text(result.build), "diagnostics")
        else:
            transcript.add_line(f"{label}: {describe_eval(result)}", "eval")
        self.latest_watched = result
        if _verified(result):
            self.best = result  # the workspace holds it now, so it is what accept commits

    def _warn_if_unconfined(self, result: EvalResult) -> None:
        """Say once, in the transcript and as a notification, that the judge's sandboxes are not confined."""
        if result.confinement == UNCONFINED and not self._warned_unconfined:
            self._warned_unconfined = True
            text = f"warning: {UNCONFINED_NOTE}"
            self.query_one(Transcript).add_line(text, "unconfined")
            self.notify(text, severity="warning", timeout=30)

    def action_toggle_watch(self) -> None:
        self._set_watching(self.watch_bridge is not None and not self.watch_bridge.running)

    def _set_watching(self, on: bool) -> None:
        bridge = self.watch_bridge
        if bridge is None:
            return
        transcript = self.query_one(Transcript)
        if on:
            bridge.start()
            self.watch_state = "watching"
            transcript.add_line(f"watching {bridge.root} (model_new.py and kernels/); w stops", "header")
        else:
            bridge.stop()
            self.watch_state = "off"
            transcript.add_line("stopped watching; w starts again", "header")

    # -- keys

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Show Pause while running and Resume while paused; grey Stop out once the run is over."""
        if action == "pause":
            return self.phase in ("starting", "running")
        if action == "resume":
            return self.phase in ("pausing", "paused")
        if action == "stop":
            return True if self.phase in ACTIVE_PHASES else None
        if action == "toggle_watch":
            return True if self.watch_bridge is not None else None
        return True

    def watch_phase(self) -> None:
        self.refresh_bindings()

    def action_pause(self) -> None:
        self.control.pause()
        self._sync_phase()

    def action_resume(self) -> None:
        self.control.resume()
        self._sync_phase()

    def action_stop(self) -> None:
        self.control.stop()
        self._sync_phase()

    async def action_quit(self) -> None:
        """Leave once the current turn is saved (the session stays resumable); a second press leaves at once."""
        if self.phase not in ACTIVE_PHASES or self._quitting:
            self.exit()
            return
        self._quitting = True
        self.control.stop("interrupted")
        self._sync_phase()
        self.notify("Quitting after the current turn, so the session stays resumable; press q again to leave now.")

    def action_accept(self) -> None:
        if self.phase in ACTIVE_PHASES:
            self._report_accept("The run is still going; stop it (s) first, so the best candidate is back in the "
                                "workspace to commit.", refused=True)  # fmt: skip
        elif self.latest_watched is not None and not _verified(self.latest_watched):
            self._report_accept("The latest edit is not verified correct, so the workspace has nothing to accept; "
                                "fix it and save.", refused=True)  # fmt: skip
        elif self.best is None or self.workspace is None:
            self._report_accept("No candidate was verified correct, so there is nothing to accept.", refused=True)
        else:
            self.query_one(Transcript).add_line("accept: verifying the best at half and double the batch and the sequence too, "
                                                "then committing…", "watch")  # fmt: skip
            self.run_worker(partial(self._accept, self.workspace, self.best), thread=True, name="accept",
                            group="accept", exclusive=True)  # fmt: skip

    def _accept(self, workspace: Workspace, best: EvalResult) -> None:
        from kernelpilot.acceptance import accept_candidate

        try:
            self.post_message(AcceptDone(accept_candidate(self.judge, workspace, best).commit, None))
        except KernelpilotError as err:
            self.post_message(AcceptDone(None, err))

    def on_accept_done(self, message: AcceptDone) -> None:
        if message.commit is not None:
            self._report_accept(f"committed {message.commit.short_sha} {message.commit.subject}", refused=False)
        else:
            self._report_accept(_sentence(message.error), refused=True)

    def _report_accept(self, text: str, *, refused: bool) -> None:
        self.query_one(Transcript).add_line(text, "refused" if refused else "accepted")
        self.notify(text, severity="error" if refused else "information")

    def _sync_phase(self) -> None:
        if self.phase in ("ended", "failed"):
            return
        self.phase = "quitting" if self._quitting else self.control.phase


def _verified(result: EvalResult) -> bool:
    return result.verify is not None and result.verify.ok


def _sentence(error: KernelpilotError | None) -> str:
    if error is None:
        return ""
    return f"{error.message} {error.hint}" if error.hint else error.message


def _outcome_text(outcome: OptimizeResult | None) -> str:
    if outcome is None:
        return "Closed before the first turn; the session is saved and --resume starts it."
    written = ", ".join(str(path) for path in outcome.written)
    where = f"; wrote {written}" if written else ""
    return f"Run {outcome.summary.status} after {outcome.summary.turns} turns{where}. Press a to accept the best."


def run_tui(
    problem_path: Path,
    settings: Settings,
    *,
    resume: bool = False,
    session_id: str | None = None,
    checked: CheckedRun | None = None,
) -> OptimizeResult | None:
    """Run (or resume) the agent on a problem inside the TUI; the outcome, or None if it closed before a turn ran.

    The CLI passes `checked` (from `checked_run`), so a bad problem file or no GPU is reported before the app
    opens; a KernelpilotError that stopped the run later is raised once the app has closed.
    """
    from kernelpilot.optimize import prepared_run

    app = KernelpilotApp(
        partial(prepared_run, problem_path, settings, resume=resume, session_id=session_id, checked=checked)
    )
    app.run()
    if app.error is not None:
        raise app.error
    return app.outcome


def run_watch_tui(root: Path, *, device: str | None = None, trials: int = 5, bench: bool = True) -> None:
    """`kernelpilot watch DIR --tui`: judge the workspace now and after every save, in the TUI, until it closes."""
    from kernelpilot.harness.judge import Judge
    from kernelpilot.workspace import open_workspace

    ws = open_workspace(root)
    with Judge(device) as judge:
        app = KernelpilotApp(workspace=ws, evaluate=lambda path: judge.evaluate(path, trials=trials, bench=bench),
                             judge=judge)  # fmt: skip
        app.run()
