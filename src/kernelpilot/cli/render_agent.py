"""How agent runs look in a terminal: live progress, a run's summary, a suite's report, sessions and transcripts."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from kernelpilot.agent.loop import RunSummary
from kernelpilot.agent.session import RunState, SessionInfo, describe_eval, read_records
from kernelpilot.cli.render_git import render_commit
from kernelpilot.optimize import OptimizeResult
from kernelpilot.results import EvalResult, from_dict
from kernelpilot.suite import SuiteReport


def render_session_list(console: Console, infos: list[SessionInfo]) -> None:
    """A table of sessions: id, problem, model, start, status, turns, best speedup, reward."""
    if not infos:
        console.print("No sessions found (they live in <workspace>/.kernelpilot/sessions/).")
        return
    table = Table(title="kernelpilot sessions", title_justify="left")
    for column in ("id", "problem", "model", "started", "status", "turns", "best vs compile", "reward"):
        table.add_column(column, justify="right" if column in ("turns", "best vs compile", "reward") else "left",
                         no_wrap=column in ("id", "started"))
    for info in infos:
        speedup = f"{info.best_speedup_vs_compile:.2f}x" if info.best_speedup_vs_compile is not None else "–"
        table.add_row(info.id, escape(Path(info.problem).name), escape(info.model),
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(info.started)), info.status, str(info.turns),
                      speedup, str(info.reward) if info.reward is not None else "–")
    console.print(table)


def render_transcript(console: Console, path: Path) -> None:
    """Print a transcript turn by turn: the model's text, its tool calls, what they returned, judge results."""
    records = read_records(path)
    start = records[0]
    console.print(f"[bold]session {path.stem}[/] · {escape(start.get('problem', ''))} · model {escape(start.get('model') or '?')}")
    turn = 0
    for record in records[1:]:
        if record.get("turn", turn) != turn and record["type"] in ("message", "tool"):
            turn = record["turn"]
            console.rule(f"turn {turn}")
        if record["type"] == "message" and record["message"]["role"] == "assistant" and record["message"].get("content"):
            console.print(Panel(escape(record["message"]["content"]), title="assistant", title_align="left"))
        for line in _replay_lines(record):
            console.print(line, highlight=False, soft_wrap=True)


def _replay_lines(record: dict[str, Any]) -> Iterator[str]:
    kind = record["type"]
    if kind == "message":
        for call in record["message"].get("tool_calls") or []:
            arguments = _shorten(call["function"]["arguments"], 300)
            yield f"[cyan]→ {escape(call['function']['name'])}[/] {escape(arguments)}"
    elif kind == "tool":
        yield f"[dim]← {escape(record.get('name', ''))} ({record.get('seconds', 0):.1f} s):[/] {escape(_shorten(record['message']['content'], 600))}"
    elif kind == "eval":
        yield f"[bold]{'★ new best' if record.get('improved') else 'judged'}:[/] {escape(describe_eval(from_dict(EvalResult, record['eval'])))}"
    elif kind in ("resume", "end"):
        yield f"[bold magenta]{kind}[/] {escape(record.get('status', ''))} {escape(record.get('message', ''))}"


def _shorten(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


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
    if result.failure is not None:
        console.print(f"[bold]why:[/] {escape(result.failure.kind)}: {escape(result.failure.message)}", highlight=False,
                      soft_wrap=True)  # fmt: skip
    if result.commit is not None:
        render_commit(console, result.commit)
    if result.compile_is_faster is not None:
        console.print(f"[bold]{escape(result.compile_is_faster)}[/]", highlight=False, soft_wrap=True)


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


def render_report(console: Console, report: SuiteReport) -> None:
    """One row per problem, why each one that is not correct failed (a line each, not wrapped), the notes on correct
    ones (torch.compile faster, or not timed), then the metrics."""
    table = Table(title="kernelpilot suite", title_justify="left")
    for column in ("problem", "status", "correct", "vs eager", "vs compile", "reward", "failure"):
        table.add_column(column, justify="left" if column in ("problem", "status", "failure") else "right")
    for o in report.outcomes:
        table.add_row(escape(o.problem), escape(o.status), "yes" if o.correct else "no", ratio_text(o.speedup_vs_eager),
                      ratio_text(o.speedup_vs_compile), str(o.reward), escape(o.failure) or "–")
    console.print(table)
    failed = [o for o in report.outcomes if not o.correct and o.message]
    if failed:
        console.print("[bold]why not correct[/]")
        for o in failed:
            console.print(f"  {escape(o.problem)}: {escape(o.failure or o.status)}: {escape(o.message)}",
                          highlight=False, soft_wrap=True)  # fmt: skip
    notes = [o for o in report.outcomes if o.correct and o.message]
    if notes:  # correct, but torch.compile is faster, or has no time
        console.print("[bold]notes[/]")
        for o in notes:
            console.print(f"  {escape(o.problem)}: {escape(o.message)}", highlight=False, soft_wrap=True)
    metrics = Table(show_header=False, title="metrics", title_justify="left")
    metrics.add_column(style="bold")
    metrics.add_column()
    metrics.add_row("pass rate", f"{report.pass_rate:.1%}")
    for p in report.fast_p_vs_eager:
        metrics.add_row(f"fast_{p} vs eager / compile / both",
                        f"{report.fast_p_vs_eager[p]:.1%} / {report.fast_p_vs_compile[p]:.1%} / {report.fast_p_vs_both[p]:.1%}")
    geomeans = ratio_text(report.geomean_speedup_vs_eager), ratio_text(report.geomean_speedup_vs_compile)
    metrics.add_row("geomean speedup vs eager / compile", " / ".join(geomeans))
    metrics.add_row("mean reward", f"{report.mean_reward:.2f}")
    seconds = sorted(o.seconds for o in report.outcomes if o.seconds is not None)
    if seconds:
        metrics.add_row("seconds per problem (median / max)", f"{seconds[len(seconds) // 2]:.0f} / {seconds[-1]:.0f}")
    sols = sorted(o.sol for o in report.outcomes if o.correct and o.sol is not None)
    if sols:
        metrics.add_row("median % of speed-of-light", f"{100 * sols[len(sols) // 2]:.0f}% (of {len(sols)})")
    metrics.add_row("cost", f"${report.cost_usd:.4f}" if report.cost_usd is not None else "unknown")
    console.print(metrics)
