"""The `kernelpilot` commands: one small function per subcommand, no logic beyond arguments and rendering.

Heavy modules (torch, litellm, textual) are imported inside the commands, so `kernelpilot --help` stays fast. The
domain returns results and raises KernelpilotError; the `render_*` modules beside this one print them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from kernelpilot import __version__
from kernelpilot.cli.base import App, console, err_console, one_of, print_json, warn_if_unconfined
from kernelpilot.cli.run_args import DirOpt, RunArgs, run_command
from kernelpilot.cli.train import train_app
from kernelpilot.errors import KernelpilotError

app = App(
    name="kernelpilot",
    help="Write, verify and time fast CUDA kernels for PyTorch code.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(train_app, name="train")


def _print_version(value: bool) -> None:
    if value:
        console.print(f"kernelpilot {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _global_options(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print kernelpilot's version and exit.")] = False,
) -> None:  # fmt: skip
    """Write, verify and time fast CUDA kernels for PyTorch code."""


def _check_buildable(device: str | None) -> None:
    """On the CPU the judge still compiles the kernels, and with no GPU to ask only TORCH_CUDA_ARCH_LIST says for
    which architecture: say so now, in words that fit a command without --arch, not after a worker started."""
    if device is not None and device.startswith("cpu"):
        from kernelpilot.build import resolve_arch

        resolve_arch(None, arch_option=False)


@app.command()
def init(
    problem: Path = typer.Argument(..., help="A KernelBench-format file: Model, get_inputs(), get_init_inputs()."),
    dir: DirOpt = None,
) -> None:
    """Scaffold a task workspace for PROBLEM: kernels/, model_new.py, setup.py, benchmark.py."""
    from kernelpilot.cli.render_git import render_init_summary
    from kernelpilot.workspace import init_workspace

    ws, created = init_workspace(problem, dir)
    render_init_summary(console, ws, created)


@app.command()
def build(
    workspace: Path = typer.Argument(Path("."), help="A workspace made by `kernelpilot init`."),
    arch: Optional[str] = typer.Option(None, "--arch", help="CUDA arch, e.g. 9.0 or sm_90 (default: the GPU's, or TORCH_CUDA_ARCH_LIST)."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="Parallel compile jobs (default: CPU count)."),
    as_json: bool = typer.Option(False, "--json", help="Print the BuildResult as JSON."),
) -> None:
    """Build the workspace's extension incrementally (only changed sources recompile)."""
    from kernelpilot.build import build_workspace
    from kernelpilot.cli.render_build import render_build
    from kernelpilot.results import to_dict

    result = build_workspace(workspace, arch=arch, jobs=jobs)
    if as_json:
        print_json(to_dict(result))
    else:
        render_build(console, result)
    if not result.ok:
        raise typer.Exit(1)


@app.command("eval")
def eval_(
    target: Path = typer.Argument(Path("."), help="A workspace folder, or a problem file judged with --candidate."),
    candidate: Optional[Path] = typer.Option(None, "--candidate", help="A model_new.py to judge against the problem file TARGET (a kernels/ folder beside it comes too)."),
    trials: int = typer.Option(5, "--trials", min=1, help="Correctness trials, each on fresh random inputs."),
    atol: float = typer.Option(1e-2, "--atol", help="Absolute tolerance."),
    rtol: float = typer.Option(1e-2, "--rtol", help="Relative tolerance."),
    no_bench: bool = typer.Option(False, "--no-bench", help="Check correctness only; skip timing."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda, cuda:N or cpu (cpu only exercises the harness)."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="For a folder of workspaces: judges in parallel (default: one per visible GPU; 1 on cpu)."),
    as_json: bool = typer.Option(False, "--json", help="Print the EvalResult as JSON (a list for a folder of workspaces)."),
) -> None:
    """Judge a candidate (or every workspace under a folder): build, verify, time against eager and torch.compile, reward."""
    from kernelpilot.cli.render_eval import render_eval
    from kernelpilot.harness.batch import find_workspaces, is_folder_of_workspaces
    from kernelpilot.harness.judge import evaluate_path
    from kernelpilot.results import to_dict

    if not target.exists():
        raise KernelpilotError(f"{target} does not exist.", hint="Pass a workspace made by `kernelpilot init PROBLEM.py`, "
                               "a folder of workspaces, or a problem file with --candidate.")  # fmt: skip
    if candidate is None and is_folder_of_workspaces(target):
        _eval_folder(find_workspaces(target), target, device=device, workers=workers, trials=trials, atol=atol,
                     rtol=rtol, bench=not no_bench, as_json=as_json)  # fmt: skip
        return
    if (candidate is None) == target.is_dir():  # a workspace, or a problem file and its candidate: judged as given
        _check_buildable(device)
    result = evaluate_path(target, candidate, device=device, trials=trials, atol=atol, rtol=rtol, bench=not no_bench)
    if as_json:
        print_json(to_dict(result))
    else:
        render_eval(console, result)
    warn_if_unconfined(err_console, result.confinement)
    if result.reward < 1:
        raise typer.Exit(1)


def _eval_folder(workspaces: list[Path], folder: Path, *, device: Optional[str], workers: Optional[int],
                 as_json: bool, **judging) -> None:  # fmt: skip
    """`eval` over the workspaces under FOLDER, spread over the devices; exit 1 unless all are correct."""
    from kernelpilot.cli.render_eval import eval_progress, render_batch
    from kernelpilot.harness.batch import evaluate_workspaces, lane_devices
    from kernelpilot.results import to_dict

    _check_buildable(device)
    with eval_progress(err_console, len(workspaces), enabled=not as_json) as on_done:
        results = evaluate_workspaces(workspaces, lane_devices(device, workers), on_done=on_done, **judging)
    if as_json:
        print_json(to_dict(results))
    else:
        render_batch(console, folder, results)
    warn_if_unconfined(err_console, *(result.confinement for result in results))
    if any(result.reward < 1 for result in results):
        raise typer.Exit(1)


@app.command()
@run_command
def optimize(
    args: RunArgs,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run summary as JSON (no live progress).")] = False,
    tui: Annotated[bool, typer.Option("--tui", help="Watch and steer the run in a terminal UI (same as `kernelpilot tui`).")] = False,
    commit: Annotated[bool, typer.Option("--commit", help="Commit the best verified candidate as `kernelpilot accept` does: the workspace's kernels, model_new.py and kernelpilot.lock.json (the copy beside PROBLEM is not committed). Git must be on a branch.")] = False,
) -> None:
    """Let a model write, verify and time CUDA kernels for PROBLEM; keep the best verified candidate."""
    _optimize(args, as_json=as_json, tui=tui, commit=commit)


@app.command("tui")
@run_command
def tui_(args: RunArgs) -> None:
    """`optimize --tui`: watch the agent work on PROBLEM live; pause, resume, stop it and accept the best as a commit."""
    _optimize(args, as_json=False, tui=True, commit=False)


def _optimize(args: RunArgs, *, as_json: bool, tui: bool, commit: bool) -> None:
    from kernelpilot.cli.render_agent import live_progress, render_result
    from kernelpilot.config import load_settings
    from kernelpilot.optimize import EXIT_INTERRUPTED, checked_run, optimize as run_optimize

    if tui and commit:
        raise KernelpilotError("--commit does not apply to --tui, which commits with its own accept key.",
                               hint="Press a in the TUI once the run is over, or run without --tui.")
    problem, resume, session = args.problem, args.resume, args.session
    workspace = one_of(args.dir, args.workspace, "--dir", "--workspace")
    settings = load_settings(dict(model=args.model, api_base=args.api_base, api_key=args.api_key,
                                  max_turns=args.max_turns, target_speedup=args.target, workspace=workspace,
                                  output=args.output, device=args.device))  # fmt: skip
    # Everything checkable (problem, session, model, git, GPU) is checked before the workspace is made.
    with checked_run(problem, settings, resume=resume, session_id=session, commit=commit) as checked:
        if settings.model is None and not as_json:
            err_console.print("No model configured: using the built-in policy (fused elementwise chains and "
                              "reductions, cuBLASLt matmuls and cuDNN convolutions with fused epilogues; see "
                              "docs/POLICY.md); pass --model to use an LLM.", highlight=False, soft_wrap=True)  # fmt: skip
        if tui:
            from kernelpilot.tui.app import run_tui

            result = run_tui(problem, settings, resume=resume, session_id=session, checked=checked)
            if result is None:
                err_console.print("Closed before the first turn; the session is saved, and --resume starts it.")
                raise typer.Exit(EXIT_INTERRUPTED)
        else:
            with live_progress(err_console, settings.max_turns, enabled=not as_json) as on_turn:
                result = run_optimize(problem, settings, resume=resume, session_id=session, on_turn=on_turn,
                                      commit=commit, checked=checked)  # fmt: skip
    if as_json:
        print_json(result.to_json())
    else:
        render_result(console, result)
    warn_if_unconfined(err_console, result.confinement)
    if result.commit_refusal is not None:
        raise result.commit_refusal  # after the outcome, which it must not hide
    raise typer.Exit(result.exit_code)


@app.command()
def suite(
    folder: Path = typer.Argument(..., help="A folder of problem files (KernelBench's level folders work)."),
    model: Optional[str] = typer.Option(None, "--model", help="litellm model, e.g. openai/gpt-5 (default: the built-in policy)."),
    api_base: Optional[str] = typer.Option(None, "--api-base", help="OpenAI-compatible endpoint."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="API key."),
    max_turns: Optional[int] = typer.Option(None, "--max-turns", help="Most model turns per problem."),
    target: Optional[float] = typer.Option(None, "--target", help="Speedup vs torch.compile that counts as done."),
    dir: Optional[Path] = typer.Option(None, "--dir", help="Workspaces, candidates and result JSONs (default: ./kp-suite; rerun to resume)."),
    out: Optional[Path] = typer.Option(None, "--out", hidden=True),
    device: Optional[str] = typer.Option(None, "--device", help="cuda, cuda:N or cpu."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, help="Problems run at once, each on a GPU of its own (default: one per visible GPU; 1 on cpu)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Optimize every problem in FOLDER: pass rate, fast_p vs eager and torch.compile, geomean speedup, reward, cost."""
    import dataclasses

    from kernelpilot.cli.render_agent import render_report
    from kernelpilot.config import load_settings
    from kernelpilot.suite import run_suite

    out = one_of(dir, out, "--dir", "--out") or Path("kp-suite")
    settings = load_settings(dict(model=model, api_base=api_base, api_key=api_key, max_turns=max_turns,
                                  target_speedup=target, device=device))
    report = run_suite(folder, settings, out, jobs=jobs, on_problem=None if as_json else lambda p: err_console.print(f"[bold]{p}[/]"))
    if as_json:
        print_json(dataclasses.asdict(report))
    else:
        render_report(console, report)
    warn_if_unconfined(err_console, report.confinement)


@app.command()
def sessions(
    folder: Path = typer.Argument(Path("."), help="A workspace, or a folder of workspaces."),
) -> None:
    """List the agent sessions recorded under FOLDER."""
    from kernelpilot.agent.session import list_sessions
    from kernelpilot.cli.render_agent import render_session_list

    render_session_list(console, list_sessions(folder))


@app.command()
def replay(
    session: Path = typer.Argument(..., help="A transcript: .kernelpilot/sessions/<id>.jsonl."),
) -> None:
    """Show a recorded session turn by turn."""
    from kernelpilot.cli.render_agent import render_transcript

    render_transcript(console, session)


@app.command()
def accept(
    workspace: Path = typer.Argument(Path("."), help="A workspace whose candidate passes `kernelpilot eval`."),
    message: Optional[str] = typer.Option(None, "--message", "-m", help="Commit subject (the body always carries the numbers)."),
    no_commit: bool = typer.Option(False, "--no-commit", help="Only write kernelpilot.lock.json; do not commit."),
    trials: int = typer.Option(5, "--trials", min=1, help="Correctness trials, each on fresh random inputs."),
    atol: float = typer.Option(1e-2, "--atol", help="Absolute tolerance (recorded for `kernelpilot check`)."),
    rtol: float = typer.Option(1e-2, "--rtol", help="Relative tolerance (recorded for `kernelpilot check`)."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda, cuda:N or cpu (cpu only exercises the harness)."),
) -> None:
    """Evaluate the workspace (also at half and double its batch size and sequence length) and commit its kernels, model_new.py and
    kernelpilot.lock.json with the numbers and the shapes verified."""
    from kernelpilot.acceptance import accept_candidate
    from kernelpilot.cli.render_eval import render_eval
    from kernelpilot.cli.render_git import render_commit
    from kernelpilot.harness.judge import Judge
    from kernelpilot.results import EvalResult
    from kernelpilot.vcs import check_ready_to_commit
    from kernelpilot.workspace import open_workspace

    ws = open_workspace(workspace)
    _check_buildable(device)
    if not no_commit:
        check_ready_to_commit(ws.root)  # before the judge starts (no GPU is an error there) and minutes of evaluation
    def judged(result: EvalResult) -> None:  # before the lock file, which records the confinement too
        render_eval(console, result)
        warn_if_unconfined(err_console, result.confinement)

    with Judge(device) as judge:
        accepted = accept_candidate(judge, ws, trials=trials, atol=atol, rtol=rtol, commit=not no_commit,
                                    message=message, on_judged=judged)  # fmt: skip
    if accepted.commit is not None:
        render_commit(console, accepted.commit)
    else:
        console.print(f"wrote {accepted.lock_path}", highlight=False)


@app.command()
def check(
    paths: Optional[list[Path]] = typer.Argument(None, help="Changed files or folders (default: every lock file under here)."),
    tolerance: float = typer.Option(0.05, "--tolerance", min=0.0, help="Allowed slowdown vs the recorded time, as a fraction (0.05 = 5%)."),
    require_gpu: bool = typer.Option(False, "--require-gpu", help="Fail when no GPU is visible instead of skipping."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda, cuda:N or cpu (cpu only exercises the harness)."),
) -> None:
    """Rebuild, verify and re-time accepted kernels against their lock files; exit 1 on a regression."""
    from kernelpilot.check import run_check
    from kernelpilot.cli.render_git import render_check

    report = run_check(paths or [], tolerance=tolerance, require_gpu=require_gpu, device=device)
    render_check(console, report)
    warn_if_unconfined(err_console, report.confinement)
    if report.failed:
        raise typer.Exit(1)


@app.command()
def watch(
    workspace: Path = typer.Argument(Path("."), help="A workspace made by `kernelpilot init`."),
    trials: int = typer.Option(5, "--trials", min=1, help="Correctness trials per evaluation."),
    no_bench: bool = typer.Option(False, "--no-bench", help="Check correctness only; skip timing."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda, cuda:N or cpu (cpu only exercises the harness)."),
    tui: bool = typer.Option(False, "--tui", help="Show each result in the terminal UI: profile rows, diffs, diagnostics."),
) -> None:
    """Re-evaluate the workspace on every save of a kernel, binding or model_new.py; show what changed."""
    _check_buildable(device)
    if tui:
        from kernelpilot.tui.app import run_watch_tui

        run_watch_tui(workspace, device=device, trials=trials, bench=not no_bench)
        return
    from kernelpilot.cli.render_watch import TerminalView
    from kernelpilot.watch import watch_workspace

    def ready(root: Path) -> None:
        console.print(f"watching {root} (model_new.py and kernels/); Ctrl-C stops", highlight=False)

    watch_workspace(workspace, TerminalView(console), device=device, trials=trials, bench=not no_bench, on_ready=ready)
    console.print("stopped watching", highlight=False)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
