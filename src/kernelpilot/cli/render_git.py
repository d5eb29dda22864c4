"""How workspaces and accepted kernels look in a terminal: what `init` created, an accept commit, `check`'s verdicts."""

from __future__ import annotations

from collections.abc import Iterator

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kernelpilot.check import CheckOutcome, CheckReport
from kernelpilot.vcs import CommitInfo
from kernelpilot.workspace import PROTECTED_FILES, Workspace, display_path


def render_init_summary(console: Console, ws: Workspace, created: list[str]) -> None:
    """Print what `init` wrote and the next step."""
    where = display_path(ws.root)
    if created:
        console.print(f"[bold green]Workspace ready:[/] {where}", highlight=False)
        for name in created:
            tag = "  [dim](protected)[/]" if name in PROTECTED_FILES else ""
            console.print(f"  [green]+[/] {name}{tag}", highlight=False)
    else:
        console.print(f"[bold green]Workspace up to date:[/] {where} (nothing to create)", highlight=False)
    console.print(
        "Next: write kernels in kernels/ and ModelNew.forward in model_new.py (see SKILL.md), "
        f"then run [bold]kernelpilot build {where}[/]",
        highlight=False,
    )


def render_commit(console: Console, info: CommitInfo) -> None:
    """Print the short hash and subject of an accept commit, and the files it changed."""
    console.print(f"[bold green]committed[/] [yellow]{info.short_sha}[/] {escape(info.subject)}", highlight=False)
    for name in info.files:
        console.print(f"  {escape(name)}", highlight=False)


def render_check(console: Console, report: CheckReport) -> None:
    """A table of the verdicts (or the reason nothing was checked) and the reasons for failures."""
    if report.skipped:
        console.print(
            f"[yellow]kernelpilot check: skipped:[/] {escape(report.skipped)}", highlight=False, soft_wrap=True
        )
        return
    title = f"kernelpilot check on {escape(report.device)}" if report.device else "kernelpilot check"
    table = Table(title=title, title_justify="left")
    for column, justify in (("workspace", "left"), ("verdict", "left"), ("correct", "left"), ("recorded ms", "right"),
                            ("now ms", "right"), ("change", "right"), ("timing", "left")):  # fmt: skip
        table.add_column(column, justify=justify, overflow="fold")
    for outcome in report.outcomes:
        table.add_row(*_row(outcome))
    console.print(table)
    for outcome in report.outcomes:
        for line in _notes(outcome):
            console.print(f"  {escape(outcome.workspace)}: {escape(line)}", highlight=False, soft_wrap=True)
    failed = sum(1 for outcome in report.outcomes if not outcome.passed)
    verdict = f"[bold red]{failed} failed[/]" if failed else "[bold green]all passed[/]"
    console.print(f"{len(report.outcomes)} checked, {verdict}", highlight=False)


def _row(outcome: CheckOutcome) -> list[str]:
    verdict = "[green]pass[/]" if outcome.passed else "[bold red]FAIL[/]"
    correct = {True: "[green]yes[/]", False: "[red]no[/]", None: "–"}[outcome.correct]
    change = "–"
    if outcome.slowdown is not None:
        colour = "red" if outcome.slowdown > 0 else "green"
        change = f"[{colour}]{outcome.slowdown:+.1%}[/]"
    return [escape(outcome.workspace), verdict, correct, _ms(outcome.recorded_ms), _ms(outcome.current_ms), change,
            outcome.timing]  # fmt: skip


def _notes(outcome: CheckOutcome) -> Iterator[str]:
    if outcome.reason:
        yield outcome.reason
    if outcome.gpu_note:
        yield outcome.gpu_note
    if outcome.changed:
        changed = ", ".join(outcome.changed)
        yield f"changed since the lock was written: {changed} (run `kernelpilot accept` to record it)"


def _ms(value: float | None) -> str:
    return f"{value:.4g}" if value is not None else "–"
