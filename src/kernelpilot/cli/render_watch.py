"""How `kernelpilot watch` looks in a terminal: each WatchEvent as a line, a result as its verdict and its diff."""

from __future__ import annotations

from datetime import datetime

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kernelpilot.cli.base import warn_if_unconfined
from kernelpilot.cli.render_build import render_build
from kernelpilot.results import UNCONFINED, EvalResult
from kernelpilot.watch import Change, WatchEvent, diff_results, format_value


class TerminalView:
    """Prints watch events as plain terminal output: what was saved, diagnostics or the result and its diff."""

    def __init__(self, console: Console):
        self.console = console
        self._warned = False  # that the judge's sandboxes are not confined: said once, with the first such result

    def __call__(self, event: WatchEvent) -> None:
        stamp = f"[dim]{datetime.now():%H:%M:%S}[/]"
        if event.kind == "evaluating":
            what = ", ".join(event.changed) if event.changed else "the workspace"
            self.console.print(f"{stamp} {escape(what)}: building, verifying, timing ...", highlight=False)
        elif event.kind == "error":
            self.console.print(f"{stamp} [bold red]could not evaluate:[/] {escape(event.message)}", highlight=False)
        elif event.result is not None:
            self._show_result(event.result, event.previous)

    def _show_result(self, result: EvalResult, previous: EvalResult | None) -> None:
        if result.confinement == UNCONFINED and not self._warned:
            self._warned = True
            warn_if_unconfined(self.console, result.confinement)
        if result.build is not None and not result.build.ok:
            render_build(self.console, result.build)
            return
        self.console.print(_verdict(result), highlight=False)
        if result.verify is not None and result.verify.ok:
            self.console.print(_diff_table(diff_results(previous, result)))
        for finding in result.verify.guards if result.verify is not None else []:
            self.console.print(
                f"  guard {finding.guard} ({finding.severity}): {escape(finding.message)}", highlight=False
            )


def _verdict(result: EvalResult) -> str:
    if result.verify is not None and result.verify.ok:
        return f"[bold green]correct[/] · reward {result.reward}" + (
            f" · {escape(result.message)}" if result.message else ""
        )
    return f"[bold red]{escape(result.error_kind or 'failed')}:[/] {escape(result.message)}"


def _diff_table(changes: list[Change]) -> Table:
    table = Table(show_edge=False, box=None, padding=(0, 2))
    for column, justify in (("", "left"), ("before", "right"), ("now", "right"), ("change", "right")):
        table.add_column(column, justify=justify)
    for change in changes:
        table.add_row(escape(change.metric), format_value(change.before, change.unit),
                      format_value(change.after, change.unit), _change_text(change))  # fmt: skip
    return table


def _change_text(change: Change) -> str:
    if change.improved is None:
        return ""
    colour = "green" if change.improved else "red"
    return f"[{colour}]{change.label}[/]"
