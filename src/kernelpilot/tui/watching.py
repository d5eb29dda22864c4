"""Watch mode inside the TUI: a WorkspaceWatcher whose events reach the app as messages on the UI thread.

The watcher evaluates on its own thread; its listener only posts a WatchUpdate (Textual's post_message is safe
to call from any thread), so every widget is touched by the app's handlers alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from textual.message import Message

from kernelpilot.results import BuildResult, Diagnostic
from kernelpilot.watch import DEBOUNCE_SECONDS, Evaluate, WatchEvent, WorkspaceWatcher

if TYPE_CHECKING:
    from textual.app import App

    from kernelpilot.optimize import AgentRun

# How long quitting waits for an evaluation under way; the judge closing right after stops its worker anyway.
STOP_TIMEOUT_S = 1.0


class WatchUpdate(Message):
    """One step of watch mode: evaluating, a result, or an error that kept the evaluation from running."""

    def __init__(self, event: WatchEvent):
        super().__init__()
        self.event = event


class WatchBridge:
    """Starts and stops watching one workspace; each watcher's events are posted to `app` as WatchUpdate."""

    def __init__(self, app: App, root: Path, evaluate: Evaluate, *, debounce_s: float = DEBOUNCE_SECONDS):
        self.app, self.root, self.evaluate, self.debounce_s = app, root, evaluate, debounce_s
        self.watcher: WorkspaceWatcher | None = None

    @property
    def running(self) -> bool:
        return self.watcher is not None

    def start(self) -> None:
        """Watch from now on, beginning with an evaluation of the workspace as it is (the baseline for diffs)."""
        if self.watcher is not None:
            return
        self.watcher = WorkspaceWatcher(self.root, self.evaluate, debounce_s=self.debounce_s)
        self.watcher.subscribe(lambda event: self.app.post_message(WatchUpdate(event)))
        self.watcher.start()
        self.watcher.request()

    def stop(self) -> None:
        """Stop watching; a result still being computed is not shown."""
        watcher, self.watcher = self.watcher, None
        if watcher is not None:
            watcher.stop(timeout=STOP_TIMEOUT_S)


def run_evaluator(run: AgentRun) -> Evaluate | None:
    """Judge a watched workspace as the run's Verify and Profile tools do; None when the run has no judge."""
    judge, settings = run.ctx.judge, run.settings
    if judge is None:
        return None
    return lambda root: judge.evaluate(root, trials=settings.trials, atol=settings.atol, rtol=settings.rtol)


def diagnostics_text(build: BuildResult) -> str:
    """The build's compiler messages, one per line as `file:line:col: severity: message`, else its log's tail."""
    shown = [diagnostic for diagnostic in build.diagnostics if diagnostic.tool != "ninja"] or build.diagnostics
    if not shown:
        return "\n".join(build.log.splitlines()[-30:]) or (build.error or "the build failed.")
    return "\n".join(f"{_location(diagnostic)}: {diagnostic.severity}: {diagnostic.message}" for diagnostic in shown)


def _location(diagnostic: Diagnostic) -> str:
    parts = [diagnostic.file or diagnostic.tool, diagnostic.line, diagnostic.column]
    return ":".join(str(part) for part in parts if part is not None)
