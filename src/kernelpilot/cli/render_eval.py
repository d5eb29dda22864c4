"""How EvalResults look in a terminal: one result as a table (`eval`, `accept`), many as rows (`eval DIR`), and
the progress bar while a folder of workspaces is judged."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kernelpilot.results import NOT_APPLICABLE, BenchResult, EvalResult, Timing, VariantCheck, VerifyResult


def render_eval(console: Console, result: EvalResult) -> None:
    """Print an EvalResult for a person: verdict, errors, times, speedups, % SOL, reward, guard findings, and the
    traceback of a verifier failure (kernelpilot's bug, which its message asks to report)."""
    table = Table(title=f"kernelpilot eval · {result.workspace}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for label, value in _summary_rows(result):
        table.add_row(label, value)
    console.print(table)
    if result.bench is not None and result.bench.kernels:
        console.print(_kernel_table(result.bench))
    if result.verify is not None and result.verify.traceback:
        console.print("The verifier's traceback:", style="bold red")
        console.print(result.verify.traceback, markup=False, highlight=False)


def _summary_rows(result: EvalResult) -> Iterator[tuple[str, str]]:
    yield "problem", result.problem_id
    if result.build is not None:
        built = "[green]ok[/]" if result.build.ok else "[red]failed[/]"
        yield "build", f"{built} ({len(result.build.compiled)} recompiled, {result.build.seconds:.1f} s)"
    yield from _verify_rows(result.verify)
    yield from _bench_rows(result.bench)
    colour = "green" if result.reward >= 1 else "red"
    yield "reward", f"[bold {colour}]{result.reward}[/]"
    if result.error_kind:
        yield "error", f"[red]{result.error_kind}[/]: {escape(result.message)}"


def _verify_rows(verify: VerifyResult | None) -> Iterator[tuple[str, str]]:
    if verify is None:
        return
    passed = sum(1 for trial in verify.trials if trial.ok)
    verdict = "[green]yes[/]" if verify.ok else "[red]no[/]"
    yield "correct", f"{verdict} ({passed}/{len(verify.trials)} trials, atol {verify.atol:g}, rtol {verify.rtol:g})"
    if verify.max_abs_error is not None:
        yield "max abs / rel error", f"{verify.max_abs_error:.3g} / {verify.max_rel_error:.3g}"
    for finding in verify.guards:
        colour = "red" if finding.severity == "fail" else "yellow"
        yield f"guard {finding.guard}", f"[{colour}]{finding.severity}[/]: {escape(finding.message)}"
    if verify.variants and verify.input_shapes is not None:
        yield "shapes", f"[green]verified[/] at {_shapes_text(verify.input_shapes)}"
    for check in verify.variants:
        yield f"shapes {check.variant}", _variant_text(check)


def _variant_text(check: VariantCheck) -> str:
    """One line per leading-dim variant: verified, failed (recorded, not a failure of the candidate), or why not."""
    at = f" at {_shapes_text(check.inputs)}" if check.inputs is not None else ""
    if check.status == "verified":
        return f"[green]verified[/]{at}"
    if check.status == NOT_APPLICABLE:
        return f"[dim]not applicable[/]: {escape(check.message)}"
    return f"[yellow]failed[/]{at} (recorded, not a verdict): {escape(check.message)}"


def _shapes_text(shapes: list) -> str:
    return escape(", ".join(str(tuple(shape)) if shape is not None else "value" for shape in shapes) or "no inputs")


def _bench_rows(bench: BenchResult | None) -> Iterator[tuple[str, str]]:
    if bench is None or not bench.ok:
        return
    if bench.gpu:
        yield "gpu", bench.gpu
    for label, timing, sol in (
        ("eager", bench.eager, bench.sol_eager),
        ("torch.compile", bench.compiled, bench.sol_compile),
        ("candidate", bench.candidate, bench.sol_candidate),
    ):
        if timing is not None:
            yield f"{label} ms", _timing_text(timing, sol)
    yield "speedup vs eager", _speedup_text(bench.speedup_vs_eager)
    yield "speedup vs compile", _speedup_text(bench.speedup_vs_compile)
    if bench.roofline is not None:
        roofline = bench.roofline
        yield "speed-of-light", f"{roofline.floor_ms:.4g} ms ({roofline.bound}-bound)"
    if bench.message:
        yield "note", escape(bench.message)


def _timing_text(timing: Timing, sol: float | None) -> str:
    text = f"{timing.median_ms:.4g}  (p10–p90 {timing.p10_ms:.4g}–{timing.p90_ms:.4g}, spread {timing.spread:.1%})"
    if sol is not None:
        text += f"  {sol * 100:.1f}% SOL"
    return text


def _speedup_text(speedup: float | None) -> str:
    if speedup is None:
        return "–"
    colour = "green" if speedup > 1 else "red"
    return f"[{colour}]{speedup:.2f}x[/]"


def _kernel_table(bench: BenchResult) -> Table:
    table = Table(title="candidate kernels", title_justify="left")
    table.add_column("kernel", overflow="fold")
    table.add_column("total ms", justify="right")
    table.add_column("calls", justify="right")
    for kernel in bench.kernels:
        table.add_row(escape(kernel.name), f"{kernel.total_ms:.4g}", str(kernel.calls))
    return table


@contextmanager
def eval_progress(console: Console, total: int, enabled: bool = True) -> Iterator[Callable[[Path, EvalResult], None] | None]:
    """A progress bar over `total` workspaces; yields the per-workspace callback that advances it."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("judging"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("", total=total)
        lock = threading.Lock()  # lanes finish concurrently

        def advance(workspace: Path, result: EvalResult) -> None:
            with lock:
                progress.update(task, advance=1, description=f"last: {workspace.name} (reward {result.reward})")

        yield advance


def render_batch(console: Console, folder: Path, results: Sequence[EvalResult]) -> None:
    """One row per workspace: correct, candidate time, speedups and reward; the errors underneath."""
    table = Table(title=f"kernelpilot eval · {folder}", title_justify="left")
    for column in ("workspace", "correct", "candidate ms", "vs eager", "vs compile", "reward"):
        table.add_column(column, justify="left" if column == "workspace" else "right")
    for result in results:
        bench = result.bench if result.bench is not None and result.bench.ok else None
        correct = result.verify is not None and result.verify.ok
        table.add_row(
            escape(_relative(folder, result.workspace)),
            "[green]yes[/]" if correct else "[red]no[/]",
            f"{bench.candidate.median_ms:.4g}" if bench is not None and bench.candidate is not None else "–",
            _ratio(bench.speedup_vs_eager if bench is not None else None),
            _ratio(bench.speedup_vs_compile if bench is not None else None),
            str(result.reward),
        )
    console.print(table)
    for result in results:
        if result.error_kind:
            line = f"{_relative(folder, result.workspace)}: {result.error_kind}: {_first_line(result.message)}"
            console.print(f"[red]{escape(line)}[/]", highlight=False, soft_wrap=True)


def _relative(folder: Path, workspace: str) -> str:
    try:
        return str(Path(workspace).relative_to(folder.resolve()))
    except ValueError:
        return workspace


def _ratio(speedup: float | None) -> str:
    return "–" if speedup is None else f"{speedup:.2f}x"


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else ""
