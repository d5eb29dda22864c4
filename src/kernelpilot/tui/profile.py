"""The profile panel: one row per judged attempt, speedup over the attempts, and what changed between the last two.

The per-kernel comparison is watch mode's `diff_results` (correctness, reward, times, speedups, then each
kernel's time), taken between the two latest results that were timed.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import DataTable, Sparkline, Static

from kernelpilot.results import EvalResult
from kernelpilot.watch import Change, diff_results, format_value

ATTEMPT_COLUMNS = ("attempt", "correct", "ms", "vs eager", "vs compile", "% SOL", "reward")
DIFF_COLUMNS = ("", "before", "now", "change")


@dataclass
class Attempt:
    """One judged candidate and what produced it: "turn 3" of the agent, or "edit 2" saved while watching."""

    label: str
    result: EvalResult

    @property
    def timed(self) -> bool:
        bench = self.result.bench
        return bench is not None and bench.ok and bench.candidate is not None


class ProfilePanel(Vertical):
    """Judged attempts in order; `add_result` appends one and refreshes the plot and the comparison."""

    attempts: reactive[list[Attempt]] = reactive(list, always_update=True)

    def compose(self) -> ComposeResult:
        yield DataTable(id="attempts", cursor_type="row", zebra_stripes=True)
        yield Static("speedup vs torch.compile by attempt (0: not timed)", classes="caption")
        yield Sparkline([], id="speedup")
        yield Static("", id="diff-title", classes="caption")
        yield DataTable(id="kernel-diff", cursor_type="none")

    def on_mount(self) -> None:
        self.query_one("#attempts", DataTable).add_columns(*ATTEMPT_COLUMNS)
        self.query_one("#kernel-diff", DataTable).add_columns(*DIFF_COLUMNS)

    def add_result(self, label: str, result: EvalResult) -> None:
        """Record the judge's verdict on the candidate that `label` names ("turn 3", "edit 2")."""
        self.attempts = [*self.attempts, Attempt(label, result)]

    def watch_attempts(self, attempts: list[Attempt]) -> None:
        if not self.is_mounted or not attempts:
            return
        table = self.query_one("#attempts", DataTable)
        table.add_row(*attempt_cells(attempts[-1]))
        table.move_cursor(row=table.row_count - 1)
        self.query_one(Sparkline).data = [speedup_vs_compile(attempt) for attempt in attempts]
        self._show_comparison([attempt for attempt in attempts if attempt.timed][-2:])

    def _show_comparison(self, latest: list[Attempt]) -> None:
        if not latest:
            return
        previous = latest[0] if len(latest) == 2 else None
        current = latest[-1]
        before = f"{previous.label} → " if previous else ""
        self.query_one("#diff-title", Static).update(f"profile {before}{current.label}")
        table = self.query_one("#kernel-diff", DataTable)
        table.clear()
        for change in diff_results(previous.result if previous else None, current.result):
            table.add_row(change.metric, format_value(change.before, change.unit),
                          format_value(change.after, change.unit), change_text(change))  # fmt: skip


def attempt_cells(attempt: Attempt) -> tuple[str, ...]:
    """attempt, correct, ms, vs eager, vs compile, % SOL, reward; "–" where the judge has no figure."""
    result = attempt.result
    correct = result.verify is not None and result.verify.ok
    bench = result.bench if attempt.timed else None
    return (
        attempt.label,
        "yes" if correct else f"no ({result.error_kind or 'failed'})",
        format_value(bench.candidate.median_ms if bench else None, "ms"),
        format_value(bench.speedup_vs_eager if bench else None, "x"),
        format_value(bench.speedup_vs_compile if bench else None, "x"),
        f"{bench.sol_candidate * 100:.1f}" if bench and bench.sol_candidate is not None else "–",
        str(result.reward),
    )


def speedup_vs_compile(attempt: Attempt) -> float:
    """The attempt's speedup vs torch.compile; 0 when it was not timed, so failures show as dips."""
    bench = attempt.result.bench
    if not attempt.timed or bench is None or bench.speedup_vs_compile is None:
        return 0.0
    return bench.speedup_vs_compile


def change_text(change: Change) -> Text:
    """The relative change of a time or speedup, "better"/"worse" otherwise, nothing when unchanged."""
    if change.improved is None:
        return Text("")
    return Text(change.label, style="green" if change.improved else "red")
