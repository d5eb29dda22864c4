"""How a BuildResult looks in a terminal: status line, diagnostics table, per-kernel ptxas resources."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from kernelpilot.results import BuildResult, Diagnostic, KernelResources


def render_build(console: Console, result: BuildResult) -> None:
    """Print a build: status line, what recompiled, diagnostics table, per-kernel resources (spills highlighted)."""
    console.print(_status_line(result), highlight=False)
    diagnostics = _worth_showing(result.diagnostics)
    if diagnostics:
        table = Table(title="diagnostics", title_justify="left", show_edge=False)
        for column in ("location", "severity", "message"):
            table.add_column(column, overflow="fold")
        for d in diagnostics:
            style = {"error": "red", "warning": "yellow"}.get(d.severity, "dim")
            table.add_row(_location(d), f"[{style}]{d.severity}[/]", d.message)
        console.print(table)
    elif not result.ok:
        console.print("\n".join(result.log.splitlines()[-30:]), highlight=False, markup=False)
    if result.resources:
        console.print(_resources_table(result.resources))


def _worth_showing(diagnostics: list[Diagnostic]) -> list[Diagnostic]:
    """ninja's "FAILED: x.o" only repeats what a compiler message says better; keep it when it is all there is."""
    from_compilers = [d for d in diagnostics if d.tool != "ninja"]
    has_compiler_error = any(d.severity == "error" for d in from_compilers)
    return from_compilers if has_compiler_error else diagnostics


def _status_line(result: BuildResult) -> str:
    if result.ok:
        head = f"[bold green]built[/] {result.extension_name} for sm_{result.arch.replace('.', '')}"
    else:
        head = f"[bold red]build failed:[/] {result.error}"
    if result.reused:
        return f"{head}  [dim]these sources were built before: reused {_short(result.library)} in {result.seconds:.1f} s[/]"
    recompiled = ", ".join(result.compiled) if result.compiled else "nothing"
    linked = "; linked" if result.linked else ""
    return f"{head}  [dim]recompiled {recompiled}{linked} in {result.seconds:.1f} s[/]"


def _short(library: str | None) -> str:
    """build/versions/<hash>/kp_kernels.so -> versions/<hash>."""
    return "/".join(Path(library).parts[-3:-1]) if library else "?"


def _location(d: Diagnostic) -> str:
    if not d.file:
        return d.tool
    return f"{d.file}:{d.line}" if d.line else d.file


def _resources_table(resources: list[KernelResources]):
    table = Table(title="kernel resources (ptxas; bytes except regs)", title_justify="left", show_edge=False)
    table.add_column("kernel", overflow="fold")
    table.add_column("source", overflow="fold")
    for numeric in ("regs", "smem", "stack", "spill st/ld", "cmem"):
        table.add_column(numeric, justify="right", no_wrap=True)
    for k in resources:
        spills = f"{k.spill_stores}/{k.spill_loads}"
        if k.spill_stores or k.spill_loads:
            spills = f"[bold red]{spills}[/]"
        table.add_row(
            _short_kernel_name(k.kernel), Path(k.source).name if k.source else "", str(k.registers),
            str(k.shared_bytes), str(k.stack_bytes), spills, str(k.constant_bytes),
        )
    return table


def _short_kernel_name(kernel: str) -> str:
    """"void kp::tile<4>(float*)" -> "kp::tile<4>": the table has no room for parameter lists."""
    name = kernel.replace("(anonymous namespace)::", "").removeprefix("void ")
    if not name.endswith(")"):
        return name
    depth = 0
    for index in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[index], 0)
        if depth == 0:
            return name[:index]
    return name
