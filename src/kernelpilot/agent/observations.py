"""What the model reads of a tool's result: the one place typed results (the workspace tools' results of
`agent/tool_results.py`, and the judge's BuildResult, VerifyOutcome and EvalResult) become text. Nothing parses this
text back; callers that decide (the loop, the built-in policy, the TUI) read the typed results."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernelpilot.agent import ToolOutput
from kernelpilot.agent.tool_results import (
    CommandRun,
    FileEdited,
    FileRead,
    FileWritten,
    GlobMatches,
    NcuLaunch,
    NcuReport,
    RunFinished,
    TodoList,
    ToolError,
    ToolResult,
    VerifyOutcome,
    transcript_data,
)
from kernelpilot.results import (
    HARNESS_ERROR,
    SLOWER,
    AheadBuilds,
    BenchResult,
    BuildResult,
    Diagnostic,
    EvalResult,
    Timing,
    TrialResult,
    VerifyResult,
)
from kernelpilot.workspace import PROTECTED_REASON

MAX_ERRORS_SHOWN = 20
TOP_KERNELS_SHOWN = 10
MAX_LAUNCHES_SHOWN = 20
BUSY_PERCENT = 60.0  # a unit above this share of its peak is what limits the kernel


def observe(result: ToolResult) -> ToolOutput:
    """A tool's answer: its typed result, the text the model reads and the data the transcript keeps."""
    return ToolOutput(result=result, text=render(result), data=transcript_data(result))


def render(result: ToolResult) -> str:
    """The text the model reads for a tool's result."""
    return _RENDERERS[type(result)](result)


# ------------------------------------------------------------------------------------- workspace tools


def glob_text(glob: GlobMatches) -> str:
    """The matching paths, one per line, and how many more there are when the listing was capped."""
    if not glob.matches:
        return f"No file matches {glob.pattern}."
    text = "\n".join(glob.matches)
    if glob.total > len(glob.matches):
        text += f"\n(showing {len(glob.matches)} of {glob.total} matches; narrow the pattern to see the rest)"
    return text


def read_text(read: FileRead) -> str:
    """The lines shown, numbered, and where to continue when the file goes on."""
    if not read.line_count:
        return f"{read.path} is empty."
    text = "\n".join(f"{number:6d}\t{line}" for number, line in enumerate(read.shown, read.offset))
    if read.last_line < read.line_count:
        text += (f"\n(lines {read.offset}-{read.last_line} of {read.line_count}; "
                 f"continue with offset={read.last_line + 1})")  # fmt: skip
    return text


def written_text(written: FileWritten) -> str:
    if written.unchanged:
        return f"Left {written.path} as it was: it already holds this content ({written.lines} lines)."
    return f"{'Created' if written.created else 'Overwrote'} {written.path} ({written.lines} lines)."


def edited_text(edited: FileEdited) -> str:
    return f"Applied {edited.edits} edit(s) to {edited.path} (+{edited.added} -{edited.removed} lines)."


def command_text(run: CommandRun) -> str:
    """The command's output, then what ended it and which protected files were put back."""
    parts = [run.output.rstrip("\n") or "(no output)"]
    if run.timed_out:
        parts.append(f"[timed out after {run.timeout_s:g} s: the command and its child processes were killed]")
    elif run.exit_code != 0:
        parts.append(f"[exit code {run.exit_code}]")
    if run.restored:
        parts.append(f"[kernelpilot restored {', '.join(run.restored)}: protected, {PROTECTED_REASON}; "
                     "put your work in kernels/ and model_new.py]")  # fmt: skip
    if run.not_restored:
        parts.append(f"[protected files changed and not restorable: {', '.join(run.not_restored)}; the judge will "
                     "reject the workspace until they are restored (`kernelpilot init` brings back deleted ones)]")  # fmt: skip
    return "\n".join(parts)


def todos_text(plan: TodoList) -> str:
    """The plan as a checklist, with how much of it is done."""
    if not plan.todos:
        return "Todo list cleared."
    marks = {"pending": "[ ]", "in_progress": "[>]", "completed": "[x]"}
    done = sum(1 for item in plan.todos if item.status == "completed")
    items = [f"  {marks[item.status]} {item.content}" for item in plan.todos]
    return "\n".join([f"Todo list ({done}/{len(plan.todos)} done):", *items])


def finished_text(finished: RunFinished) -> str:
    return f"Run finished: {finished.summary}"


def error_text(error: ToolError) -> str:
    return f"Error: {error.message}"


# ----------------------------------------------------------------------------------------- judge tools


def verify_outcome_text(outcome: VerifyOutcome) -> str:
    """Verify's answer: the verification, or that it was skipped because the build failed."""
    if outcome.verify is None:
        return "Verify skipped: the build failed.\n" + build_text(outcome.build)
    return verify_text(outcome.verify)


def build_text(build: BuildResult) -> str:
    """A build for the model: verdict, what recompiled, errors (file:line: message), per-kernel resources."""
    recompiled = ", ".join(build.compiled) or "nothing (up to date)"
    if build.reused:
        recompiled = "nothing (these sources were built before; that build is reused)"
    if build.ok:
        lines = [f"Build ok for sm_{build.arch.replace('.', '')} in {build.seconds:.1f} s; recompiled: {recompiled}."]
    else:
        lines = [f"Build FAILED: {build.error or 'see the errors below'}", f"Recompiled: {recompiled}."]
    errors = compiler_errors(build)
    if errors:
        lines.append(f"Errors ({len(errors)}):")
        lines += [f"  {diagnostic_line(d)}" for d in errors[:MAX_ERRORS_SHOWN]]
        if len(errors) > MAX_ERRORS_SHOWN:
            lines.append(f"  ({len(errors) - MAX_ERRORS_SHOWN} more errors not shown; fix these first)")
    elif not build.ok and build.log:
        lines += ["Last lines of the build log:", *build.log.splitlines()[-30:]]
    warnings = [d for d in build.diagnostics if d.severity == "warning"]
    if warnings:
        lines.append(f"Warnings ({len(warnings)}), first: {diagnostic_line(warnings[0])}")
    if build.ahead is not None:
        lines.append(ahead_text(build.ahead))
    if build.resources:
        lines.append("Kernels (ptxas): registers, shared memory, stack, spill stores/loads")
        for kernel in build.resources:
            spilling = " (SPILLING)" if kernel.spill_stores or kernel.spill_loads else ""
            spills = f"spills {kernel.spill_stores}/{kernel.spill_loads}{spilling}"
            lines.append(f"  {kernel.kernel}: {kernel.registers} regs, {kernel.shared_bytes} B smem, "
                         f"{kernel.stack_bytes} B stack, {spills}")  # fmt: skip
    return "\n".join(lines)


def ahead_text(ahead: AheadBuilds) -> str:
    """The builds ahead in one line: how many compiled, were built before, failed (by 0-based index)."""
    parts = [f"{ahead.built} compiled"]
    if ahead.kept_before:
        parts.append(f"{ahead.kept_before} built before")
    if ahead.failed:
        parts.append(f"{len(ahead.failed)} failed to compile (ahead[{', '.join(map(str, ahead.failed))}]; writing one "
                     "and building shows its errors)")
    return f"Built ahead: {ahead.asked} version(s) in {ahead.seconds:.1f} s: {', '.join(parts)}."


def compiler_errors(build: BuildResult) -> list[Diagnostic]:
    """The build's errors, the compilers' own first: ninja's "FAILED: x.o" only repeats a compiler's message, so it
    is kept only when it is all there is."""
    errors = build.errors
    return [d for d in errors if d.tool != "ninja"] or errors


def diagnostic_line(diagnostic: Diagnostic) -> str:
    """'kernels/a.cu:12:5: message' (the tool's name where there is no file)."""
    return f"{_location(diagnostic)}: {diagnostic.message}"


def _location(diagnostic: Diagnostic) -> str:
    if not diagnostic.file:
        return diagnostic.tool
    place = diagnostic.file
    if diagnostic.line:
        place += f":{diagnostic.line}" + (f":{diagnostic.column}" if diagnostic.column else "")
    return place


def verify_text(verify: VerifyResult) -> str:
    """A verification for the model: verdict, each trial's errors and worst element, guard findings."""
    passed = sum(1 for trial in verify.trials if trial.ok)
    if verify.error_kind == HARNESS_ERROR:  # no verdict on the kernel: the model must not "fix" it for this
        lines = [f"Verify did not judge the candidate: kernelpilot's verifier failed, not your kernel "
                 f"({passed} trials passed before it did)."]  # fmt: skip
    else:
        verdict = "PASSED" if verify.ok else f"FAILED ({verify.error_kind or 'mismatch'})"
        lines = [f"Verify {verdict}: {passed}/{len(verify.trials)} trials within |actual - expected| <= "
                 f"{verify.atol:g} + {verify.rtol:g} * |expected|."]  # fmt: skip
    if not verify.ok and verify.message and not any(finding.message in verify.message for finding in verify.guards):
        lines.append(verify.message)
    if verify.max_abs_error is not None:
        lines.append(f"Max abs error {verify.max_abs_error:.3g}, max rel error {verify.max_rel_error:.3g}.")
    for trial in verify.trials:
        lines.append(f"  trial seed {trial.seed}: {_trial_text(trial)}")
    for finding in verify.guards:
        lines.append(f"  guard {finding.guard} [{finding.severity}]: {finding.message}")
    return "\n".join(lines)


def _trial_text(trial: TrialResult) -> str:
    parts = ["ok" if trial.ok else "FAILED"]
    if trial.max_abs_error is not None:
        parts.append(f"max abs {trial.max_abs_error:.3g}, max rel {trial.max_rel_error:.3g}")
    if trial.worst_index is not None:
        output = f" of output {trial.output}" if trial.output else ""
        parts.append(f"worst at index {trial.worst_index}{output}")
    if trial.message:
        parts.append(trial.message)
    return "; ".join(parts)


def eval_text(result: EvalResult) -> str:
    """A whole judgement for the model: reward, what failed, and the timings when there are some."""
    if result.error_kind == SLOWER:  # stopped against the time to beat: no verdict on correctness
        return "Profile stopped early: slower than the time to beat, so neither verified further nor timed.\n" + result.message
    lines = [f"Profile: reward {result.reward} (-1 broken or wrong, 1 correct, 2 faster than eager, "
             "3 faster than eager and torch.compile)."]  # fmt: skip
    build_failed = result.build is not None and not result.build.ok
    verify_failed = result.verify is not None and not result.verify.ok
    if result.error_kind and not (build_failed or verify_failed):  # those two explain themselves below
        lines.append(f"{result.error_kind}: {result.message}")
    if build_failed:
        lines.append(build_text(result.build))
    if result.verify is not None:
        lines.append(verify_text(result.verify) if verify_failed else verify_text(result.verify).splitlines()[0])
    if result.bench is not None and result.bench.ok:
        lines.append(bench_text(result.bench))
    return "\n".join(lines)


def bench_text(bench: BenchResult) -> str:
    """Times against eager and torch.compile, speedups, % of speed-of-light and the candidate's top kernels."""
    lines = [f"Times on {bench.gpu or 'this device'} (median; p10-p90; spread):"]
    rows = (("candidate", bench.candidate, bench.sol_candidate), ("eager", bench.eager, bench.sol_eager),
            ("torch.compile", bench.compiled, bench.sol_compile))  # fmt: skip
    for label, timing, sol in rows:
        if timing is not None:
            of_light = f"; {sol * 100:.1f}% of speed-of-light" if sol is not None else ""
            lines.append(f"  {label:<14}{_timing_text(timing)}{of_light}")
    lines.append(f"Speedup: {speedup_text(bench)}.")
    if bench.roofline is not None:
        floor = bench.roofline
        lines.append(f"Speed-of-light floor: {floor.floor_ms:.4g} ms ({floor.bound}-bound: {floor.bytes / 1e9:.3g} GB, "
                     f"{floor.flops / 1e9:.3g} GFLOP).")  # fmt: skip
    if bench.kernels:
        total = sum(kernel.total_ms for kernel in bench.kernels) or 1.0
        lines.append("Top kernels of the candidate (total ms, calls, share):")
        for kernel in sorted(bench.kernels, key=lambda k: -k.total_ms)[:TOP_KERNELS_SHOWN]:
            lines.append(f"  {kernel.total_ms:.4g} ms  x{kernel.calls}  {kernel.total_ms / total:.0%}  {kernel.name}")
    if bench.message:
        lines.append(f"Note: {bench.message}")
    return "\n".join(lines)


def _timing_text(timing: Timing) -> str:
    return (f"{timing.median_ms:.4g} ms; {timing.p10_ms:.4g}-{timing.p90_ms:.4g} ms; "
            f"{timing.spread:.1%} ({timing.runs} runs)")  # fmt: skip


def _speedup(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def speedup_text(bench: BenchResult) -> str:
    """'1.20x vs eager, 0.95x vs torch.compile'."""
    return f"{_speedup(bench.speedup_vs_eager)} vs eager, {_speedup(bench.speedup_vs_compile)} vs torch.compile"


def ncu_text(report: NcuReport) -> str:
    """ncu's findings for the model, or why it found nothing."""
    if not report.available:
        return report.reason
    if report.build is not None:
        return "Ncu skipped: the build failed.\n" + build_text(report.build)
    if report.timed_out:
        return (f"ncu did not finish within {report.timeout_s:g} s and was stopped; profile fewer kernels with "
                "`kernel`.")  # fmt: skip
    if not report.launches:
        matched = report.kernel and report.exit_code == 0
        reason = f"no kernel matched {report.kernel!r}" if matched else f"exit code {report.exit_code}"
        return f"ncu profiled no kernel ({reason}).\n{report.output_tail}".rstrip()
    launches = report.launches
    lines = [f"ncu: {len(launches)} kernel launch(es) in one forward call:"]
    lines += [f"  {_launch_text(launch)}" for launch in launches[:MAX_LAUNCHES_SHOWN]]
    if len(launches) > MAX_LAUNCHES_SHOWN:
        lines.append(f"  ({len(launches) - MAX_LAUNCHES_SHOWN} more launches not shown; narrow them with `kernel`)")
    return "\n".join(lines)


def _launch_text(launch: NcuLaunch) -> str:
    def shown(value: float | None, template: str) -> str | None:
        return template.format(value) if value is not None else None

    parts = [
        shown(launch.duration_us, "{:.4g} us"),
        shown(launch.dram_pct, "DRAM {:.1f}%"),
        shown(launch.sm_pct, "SM {:.1f}%"),
        shown(launch.occupancy_pct, "occupancy {:.1f}%"),
        shown(launch.registers, "{:.0f} regs"),
        shown(launch.block_size, "block {:.0f}"),
        shown(launch.grid_size, "grid {:.0f}"),
    ]
    return f"{launch.kernel}: " + ", ".join(part for part in parts if part) + f" -> {_limiter(launch)}"


def _limiter(launch: NcuLaunch) -> str:
    if launch.dram_pct is None and launch.sm_pct is None:
        return "limit unknown (no throughput counters)"
    dram, sm = launch.dram_pct or 0.0, launch.sm_pct or 0.0
    if dram >= BUSY_PERCENT and dram >= sm:
        return "memory-bound (DRAM busy): move fewer bytes"
    if sm >= BUSY_PERCENT:
        return "compute-bound (SM busy): fewer or cheaper instructions, tensor cores"
    return "latency-bound (neither DRAM nor SM busy): more parallel work in flight, fewer stalls"


_RENDERERS: dict[type, Callable[[Any], str]] = {
    GlobMatches: glob_text, FileRead: read_text, FileWritten: written_text, FileEdited: edited_text,
    CommandRun: command_text, TodoList: todos_text, RunFinished: finished_text, ToolError: error_text,
    BuildResult: build_text, VerifyOutcome: verify_outcome_text, EvalResult: eval_text, NcuReport: ncu_text,
}  # fmt: skip
