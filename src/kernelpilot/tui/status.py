"""The status line: what is running (problem, model, session), the turn, the run's phase, the best so far and
what watch mode is doing."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from kernelpilot.results import UNCONFINED, EvalResult

PHASE_STYLES = {"running": "bold green", "pausing": "yellow", "paused": "bold yellow", "stopping": "yellow",
                "quitting": "yellow", "ended": "bold cyan", "failed": "bold red", "starting": "dim",
                "watch only": "bold cyan"}  # fmt: skip
WATCH_STYLES = {"watching": "green", "evaluating…": "bold yellow", "off": "dim"}


class RunStatus(Static):
    """One line, redrawn whenever the app's run state (bound reactives) changes."""

    run_title: reactive[str] = reactive("")
    phase: reactive[str] = reactive("starting")
    turn: reactive[int] = reactive(0)
    max_turns: reactive[int] = reactive(0)
    best: reactive[EvalResult | None] = reactive(None)
    watch_state: reactive[str] = reactive("")  # "" (watch mode never started) | "watching" | "evaluating…" | "off"

    def render(self) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(f" {self.phase} ", style=f"reverse {PHASE_STYLES.get(self.phase, '')}")
        if self.max_turns:
            text.append(f"  turn {self.turn}/{self.max_turns}")
        text.append(f"  ·  best: {best_text(self.best)}  ·  ")
        if self.watch_state:
            text.append("watch: ")
            text.append(self.watch_state, style=WATCH_STYLES.get(self.watch_state, ""))
            text.append("  ·  ")
        text.append(self.run_title, style="dim")
        return text


def best_text(best: EvalResult | None) -> str:
    """The best verified candidate in a few words (unverified, when the judge's sandboxes were not confined)."""
    if best is None:
        return "nothing verified yet"
    if best.confinement == UNCONFINED:
        return f"{_best_text(best)}, unverified: no Landlock"
    return _best_text(best)


def _best_text(best: EvalResult) -> str:
    bench = best.bench
    if bench is None or not bench.ok or bench.candidate is None:
        return f"correct, not timed (reward {best.reward})"
    versus = "no compile baseline"
    if bench.speedup_vs_compile is not None:
        versus = f"{bench.speedup_vs_compile:.2f}x vs compile"
    return f"{bench.candidate.median_ms:.4g} ms, {versus} (reward {best.reward})"
