"""The `kernelpilot` command line: one small function per subcommand, no logic beyond arguments.

Heavy modules (torch, litellm, textual) are imported inside the commands, so `kernelpilot --help` stays fast.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from kernelpilot.errors import KernelpilotError

console = Console()
err_console = Console(stderr=True)


def report_error(err: KernelpilotError) -> None:
    """Print a user error as one line plus its hint."""
    # escape: messages quote user code and exceptions ("[x, y]", shapes) that rich would read as markup;
    # soft_wrap: rich would otherwise break a long message at the terminal width into several lines.
    err_console.print(f"[bold red]error:[/] {escape(err.message)}", highlight=False, soft_wrap=True)
    if err.hint:
        err_console.print(f"[dim]hint:[/] {escape(err.hint)}", highlight=False, soft_wrap=True)


class _App(typer.Typer):
    """A Typer app whose commands turn a KernelpilotError into one line and a non-zero exit."""

    def command(self, *args, **kwargs):  # type: ignore[override]
        register = super().command(*args, **kwargs)

        def decorator(fn):
            @functools.wraps(fn)
            def wrapped(*a, **kw):
                try:
                    return fn(*a, **kw)
                except KernelpilotError as err:
                    report_error(err)
                    raise typer.Exit(err.exit_code) from None

            register(wrapped)
            return fn

        return decorator


app = _App(
    name="kernelpilot",
    help="Write, verify and time fast CUDA kernels for PyTorch code.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


@app.command()
def init(
    problem: Path = typer.Argument(..., help="A KernelBench-format file: Model, get_inputs(), get_init_inputs()."),
    dir: Optional[Path] = typer.Option(None, "--dir", help="Workspace folder (default: ./kp-<problem name>)."),
) -> None:
    """Scaffold a task workspace for PROBLEM: kernels/, model_new.py, setup.py, benchmark.py."""
    from kernelpilot.workspace import init_workspace, render_init_summary

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
    from kernelpilot.build import build_workspace, render_build
    from kernelpilot.results import to_dict

    result = build_workspace(workspace, arch=arch, jobs=jobs)
    if as_json:
        _print_json(to_dict(result))
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
    from kernelpilot.harness.batch import is_folder_of_workspaces
    from kernelpilot.harness.judge import evaluate_path, render_eval
    from kernelpilot.results import to_dict

    if candidate is None and is_folder_of_workspaces(target):
        _eval_folder(target, device=device, workers=workers, trials=trials, atol=atol, rtol=rtol, bench=not no_bench,
                     as_json=as_json)
        return
    result = evaluate_path(target, candidate, device=device, trials=trials, atol=atol, rtol=rtol, bench=not no_bench)
    if as_json:
        _print_json(to_dict(result))
    else:
        render_eval(console, result)
    if result.reward < 1:
        raise typer.Exit(1)


def _eval_folder(folder: Path, *, device: Optional[str], workers: Optional[int], as_json: bool, **judging) -> None:
    """`eval` over every workspace under FOLDER, spread over the devices; exit 1 unless all are correct."""
    from kernelpilot.harness.batch import eval_progress, evaluate_workspaces, find_workspaces, lane_devices, render_batch
    from kernelpilot.results import to_dict

    workspaces = find_workspaces(folder)
    with eval_progress(err_console, len(workspaces), enabled=not as_json) as on_done:
        results = evaluate_workspaces(workspaces, lane_devices(device, workers), on_done=on_done, **judging)
    if as_json:
        _print_json(to_dict(results))
    else:
        render_batch(console, folder, results)
    if any(result.reward < 1 for result in results):
        raise typer.Exit(1)


# Options shared by `optimize` and `tui` (one declaration each).
ProblemArg = Annotated[Path, typer.Argument(help="A KernelBench-format file: Model, get_inputs(), get_init_inputs().")]
ModelOpt = Annotated[Optional[str], typer.Option("--model", help="litellm model, e.g. openai/gpt-5 (default: KERNELPILOT_MODEL, else the built-in policy).")]
ApiBaseOpt = Annotated[Optional[str], typer.Option("--api-base", help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1.")]
ApiKeyOpt = Annotated[Optional[str], typer.Option("--api-key", help="API key (default: KERNELPILOT_API_KEY or the provider's usual variable).")]
MaxTurnsOpt = Annotated[Optional[int], typer.Option("--max-turns", help="Most model turns (default 40, at most 200).")]
TargetOpt = Annotated[Optional[float], typer.Option("--target", help="Speedup vs torch.compile that counts as done (default 1.05).")]
WorkspaceOpt = Annotated[Optional[Path], typer.Option("--workspace", help="Workspace folder (default: ./kp-<problem name>).")]
OutputOpt = Annotated[Optional[Path], typer.Option("--output", help="Where the best model_new.py goes (default: beside PROBLEM); its kernels/ go beside it.")]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue the workspace's newest session (or the one --session names).")]
SessionOpt = Annotated[Optional[str], typer.Option("--session", help="Session id to resume (implies --resume).")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cuda, cuda:N or cpu (cpu only exercises the harness).")]


@app.command()
def optimize(
    problem: ProblemArg,
    model: ModelOpt = None,
    api_base: ApiBaseOpt = None,
    api_key: ApiKeyOpt = None,
    max_turns: MaxTurnsOpt = None,
    target: TargetOpt = None,
    workspace: WorkspaceOpt = None,
    output: OutputOpt = None,
    resume: ResumeOpt = False,
    session: SessionOpt = None,
    device: DeviceOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run summary as JSON (no live progress).")] = False,
    tui: Annotated[bool, typer.Option("--tui", help="Watch and steer the run in a terminal UI (same as `kernelpilot tui`).")] = False,
    commit: Annotated[bool, typer.Option("--commit", help="Commit the best verified candidate as `kernelpilot accept` does: the workspace's kernels, model_new.py and kernelpilot.lock.json (the copy beside PROBLEM is not committed). Git must be on a branch.")] = False,
) -> None:
    """Let a model write, verify and time CUDA kernels for PROBLEM; keep the best verified candidate."""
    from kernelpilot.agent.optimize import EXIT_INTERRUPTED, live_progress, optimize as run_optimize, render_result
    from kernelpilot.config import load_settings

    settings = load_settings(dict(model=model, api_base=api_base, api_key=api_key, max_turns=max_turns,
                                  target_speedup=target, workspace=workspace, output=output, device=device))
    if settings.model is None and not as_json:
        err_console.print("No model configured: using the built-in policy (fused elementwise chains and reductions, "
                          "cuBLASLt matmuls and cuDNN convolutions with fused epilogues; see docs/POLICY.md); pass "
                          "--model to use an LLM.", highlight=False, soft_wrap=True)  # fmt: skip
    if tui and commit:
        raise KernelpilotError("--commit does not apply to --tui, which commits with its own accept key.",
                               hint="Press a in the TUI once the run is over, or run without --tui.")
    if tui:
        from kernelpilot.tui.app import run_tui

        result = run_tui(problem, settings, resume=resume, session_id=session)
        if result is None:
            err_console.print("Closed before the first turn; the session is saved, and --resume starts it.")
            raise typer.Exit(EXIT_INTERRUPTED)
    else:
        with live_progress(err_console, settings.max_turns, enabled=not as_json) as on_turn:
            result = run_optimize(problem, settings, resume=resume, session_id=session, on_turn=on_turn, commit=commit)
    if as_json:
        _print_json(result.to_json())
    else:
        render_result(console, result)
    if result.commit_refusal is not None:
        raise result.commit_refusal  # after the outcome, which it must not hide
    raise typer.Exit(result.exit_code)


@app.command("tui")
def tui_(
    problem: ProblemArg,
    model: ModelOpt = None,
    api_base: ApiBaseOpt = None,
    api_key: ApiKeyOpt = None,
    max_turns: MaxTurnsOpt = None,
    target: TargetOpt = None,
    workspace: WorkspaceOpt = None,
    output: OutputOpt = None,
    resume: ResumeOpt = False,
    session: SessionOpt = None,
    device: DeviceOpt = None,
) -> None:
    """`optimize --tui`: watch the agent work on PROBLEM live; pause, resume, stop it and accept the best as a commit."""
    optimize(problem, model=model, api_base=api_base, api_key=api_key, max_turns=max_turns, target=target,
             workspace=workspace, output=output, resume=resume, session=session, device=device, as_json=False, tui=True)


@app.command()
def suite(
    folder: Path = typer.Argument(..., help="A folder of problem files (KernelBench's level folders work)."),
    model: Optional[str] = typer.Option(None, "--model", help="litellm model, e.g. openai/gpt-5 (default: the built-in policy)."),
    api_base: Optional[str] = typer.Option(None, "--api-base", help="OpenAI-compatible endpoint."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="API key."),
    max_turns: Optional[int] = typer.Option(None, "--max-turns", help="Most model turns per problem."),
    target: Optional[float] = typer.Option(None, "--target", help="Speedup vs torch.compile that counts as done."),
    out: Path = typer.Option(Path("kp-suite"), "--out", help="Workspaces, candidates and result JSONs (rerun to resume)."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda, cuda:N or cpu."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, help="Problems run at once, each on a GPU of its own (default: one per visible GPU; 1 on cpu)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Optimize every problem in FOLDER: pass rate, fast_p vs eager and torch.compile, geomean speedup, reward, cost."""
    import dataclasses

    from kernelpilot.agent.suite import render_report, run_suite
    from kernelpilot.config import load_settings

    settings = load_settings(dict(model=model, api_base=api_base, api_key=api_key, max_turns=max_turns,
                                  target_speedup=target, device=device))
    report = run_suite(folder, settings, out, jobs=jobs, on_problem=None if as_json else lambda p: err_console.print(f"[bold]{p}[/]"))
    if as_json:
        _print_json(dataclasses.asdict(report))
    else:
        render_report(console, report)


@app.command()
def sessions(
    folder: Path = typer.Argument(Path("."), help="A workspace, or a folder of workspaces."),
) -> None:
    """List the agent sessions recorded under FOLDER."""
    from kernelpilot.agent.session import list_sessions, render_session_list

    render_session_list(console, list_sessions(folder))


@app.command()
def replay(
    session: Path = typer.Argument(..., help="A transcript: .kernelpilot/sessions/<id>.jsonl."),
) -> None:
    """Show a recorded session turn by turn."""
    from kernelpilot.agent.session import render_transcript

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
    """Evaluate the workspace and commit its kernels, model_new.py and kernelpilot.lock.json with the numbers."""
    from kernelpilot.harness.judge import evaluate_path, render_eval
    from kernelpilot.lockfile import lock_from_eval, write_lock
    from kernelpilot.vcs import accept as commit_accepted, check_ready_to_commit, render_commit
    from kernelpilot.workspace import open_workspace

    ws = open_workspace(workspace)
    if not no_commit:
        check_ready_to_commit(ws.root)  # before minutes of evaluation, not after
    result = evaluate_path(ws.root, device=device, trials=trials, atol=atol, rtol=rtol)
    render_eval(console, result)
    if no_commit:
        console.print(f"wrote {write_lock(ws, lock_from_eval(ws, result))}", highlight=False)
    else:
        render_commit(console, commit_accepted(ws, result, message=message))


@app.command()
def check(
    paths: Optional[list[Path]] = typer.Argument(None, help="Changed files or folders (default: every lock file under here)."),
    tolerance: float = typer.Option(0.05, "--tolerance", min=0.0, help="Allowed slowdown vs the recorded time, as a fraction (0.05 = 5%)."),
    require_gpu: bool = typer.Option(False, "--require-gpu", help="Fail when no GPU is visible instead of skipping."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda, cuda:N or cpu (cpu only exercises the harness)."),
) -> None:
    """Rebuild, verify and re-time accepted kernels against their lock files; exit 1 on a regression."""
    from kernelpilot.check import render_check, run_check

    report = run_check(paths or [], tolerance=tolerance, require_gpu=require_gpu, device=device)
    render_check(console, report)
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
    if tui:
        from kernelpilot.tui.app import run_watch_tui

        run_watch_tui(workspace, device=device, trials=trials, bench=not no_bench)
        return
    from kernelpilot.watch import watch_workspace

    watch_workspace(workspace, console, device=device, trials=trials, bench=not no_bench)


train_app = _App(name="train", help="Train a model on kernel tasks: synthesis, RFT, GRPO warm-up (TRL; verl on clusters).",
                 no_args_is_help=True)
app.add_typer(train_app, name="train")


@train_app.command("synth")
def train_synth(
    out: Path = typer.Option(Path("kp-tasks"), "--out", help="Dataset folder: tasks.jsonl, tasks.parquet, README.md."),
    count: int = typer.Option(100, "--count", min=1, help="Problems to compose before filtering."),
    seed: int = typer.Option(0, "--seed", help="Composition seed (same seed, same problems)."),
    scale: str = typer.Option("full", "--scale", help="Problem sizes: full (GPU) or small (CPU checks)."),
    devices: str = typer.Option("cuda", "--devices", help="Comma-separated devices the filters run on, one worker each (cuda times them; cpu does not)."),
    benchmark: Optional[Path] = typer.Option(None, "--decontaminate", help="A benchmark folder of problems to stay away from."),
    compile_backend: str = typer.Option("inductor", "--compile-backend", help="torch.compile backend the eager-vs-compile filter uses."),
    composer: str = typer.Option("deterministic", "--composer", help="deterministic (sampled operators chained in order) or llm (a model writes each problem around them)."),
    model: Optional[str] = typer.Option(None, "--model", help="The llm composer's model, e.g. openai/<name> served by vLLM."),
    api_base: Optional[str] = typer.Option(None, "--api-base", help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="API key for --model (default: the provider's variable, e.g. OPENAI_API_KEY)."),
) -> None:
    """Compose KernelBench-format tasks from torch.nn operators and keep those the execution filters pass."""
    from kernelpilot.train.llm_composer import composer_model
    from kernelpilot.train.synth import crawl_operators, synthesize, write_dataset

    report = synthesize(count, seed=seed, scale=scale, devices=devices.split(","), compile_backend=compile_backend,
                        benchmark_dir=benchmark, model=composer_model(composer, model, api_base, api_key))
    settings = {"seed": seed, "scale": scale, "devices": devices, "benchmark_dir": str(benchmark) if benchmark else None,
                "composer": composer, "model": model, "api_base": api_base,
                "operator_count": len(crawl_operators().operators)}
    write_dataset(report, out, settings=settings)
    console.print(f"kept {len(report.kept)} of {report.composed} tasks in {out}; dropped: {report.dropped_by_filter}")
    if report.model_error is not None:
        raise report.model_error  # after writing: the tasks composed before it are kept


@train_app.command("rft")
def train_rft(
    transcripts: Path = typer.Argument(..., help="A folder with agent session transcripts (rollout workspaces)."),
    model: str = typer.Option(..., "--model", help="Base model: a local checkpoint folder or hub id."),
    out: Path = typer.Option(Path("kp-rft"), "--out", help="Where sft.jsonl and the fine-tuned model go."),
    epochs: float = typer.Option(1.0, "--epochs", help="Training epochs."),
    lora_rank: int = typer.Option(0, "--lora-rank", min=0, help="LoRA rank through peft (0: full fine-tuning)."),
) -> None:
    """Rejection fine-tuning: keep judge-verified trajectories, then train on them with TRL's SFTTrainer."""
    from kernelpilot.train.rft import SftSettings, build_sft_dataset, find_transcripts, run_sft

    data = build_sft_dataset(find_transcripts(transcripts), out / "sft.jsonl")
    console.print(f"kept {data.kept} of {data.read} trajectories; dropped: {data.dropped_by_filter}")
    if data.kept:
        run_sft(SftSettings(model=model, data=data.output, output_dir=out / "model", epochs=epochs, lora_rank=lora_rank))


@train_app.command("rollout")
def train_rollout(
    tasks: Path = typer.Argument(..., help="A dataset folder from `kernelpilot train synth`."),
    model: str = typer.Option(..., "--model", help="The policy, e.g. openai/<name> served by vLLM."),
    api_base: Optional[str] = typer.Option(None, "--api-base", help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1."),
    out: Path = typer.Option(Path("kp-rollouts"), "--out", help="Task files, workspaces with transcripts, rollouts.jsonl."),
    devices: str = typer.Option("cuda", "--devices", help="Comma-separated devices, one episode on each at a time."),
    max_turns: int = typer.Option(20, "--max-turns", min=1, help="Most model turns per task."),
) -> None:
    """Run the agent over every task against a policy endpoint; rerun to resume."""
    from kernelpilot.config import Settings
    from kernelpilot.train.rollout import run_rollouts

    settings = Settings(model=model, api_base=api_base, max_turns=max_turns)
    run_rollouts(tasks, out, settings, devices.split(","), on_rollout=lambda r: console.print(
        f"{r.task_id}: {'skipped (done)' if r.skipped else r.status}, reward {r.reward}", highlight=False))


@train_app.command("ppo")
def train_ppo(
    tasks: Path = typer.Argument(..., help="A dataset folder from `kernelpilot train synth`."),
    model: str = typer.Option(..., "--model", help="Policy: a local checkpoint folder or hub id."),
    out: Path = typer.Option(Path("kp-ppo"), "--out", help="Checkpoint folder (or verl config folder)."),
    stage: str = typer.Option("warmup", "--stage", help="warmup (single-turn) or agentic (multi-turn, verl only)."),
    max_steps: int = typer.Option(100, "--max-steps", min=1, help="Optimizer steps (TRL)."),
    engine: str = typer.Option("trl", "--engine", help="trl (one node, GRPO) or verl (write a cluster config)."),
) -> None:
    """RL rewarded by the harness: single-turn GRPO warm-up on TRL, or a verl configuration for a cluster."""
    if stage not in ("warmup", "agentic"):
        raise KernelpilotError(f"Unknown --stage {stage}.", hint="Use --stage warmup or --stage agentic.")
    if engine == "verl":
        from kernelpilot.train.verl_config import VerlSettings, launch_command, write_verl_config

        paths = write_verl_config(VerlSettings(model=model, tasks=tasks, output_dir=out, multi_turn=stage == "agentic"))
        console.print(f"wrote {paths['config']}; launch with: {launch_command(paths['config'])}", highlight=False)
        return
    if stage == "agentic":
        raise KernelpilotError("Multi-turn (agentic) RL runs on verl, not TRL.", hint="Add --engine verl.")
    from kernelpilot.train.rl import GrpoSettings, run_grpo

    run_grpo(GrpoSettings(model=model, tasks=tasks, output_dir=out, max_steps=max_steps))


@train_app.command("critic")
def train_critic(
    transcripts: Path = typer.Argument(..., help="A folder with agent session transcripts (rollout workspaces)."),
    model: str = typer.Option(..., "--model", help="Base model of the value function: a local checkpoint or hub id."),
    out: Path = typer.Option(Path("kp-critic"), "--out", help="Where the value model goes."),
    epochs: float = typer.Option(1.0, "--epochs", help="Training epochs."),
) -> None:
    """Pretrain a value model on scored rollouts (the judge's rewards) before agentic PPO."""
    from kernelpilot.train.critic import CriticSettings, run_critic
    from kernelpilot.train.rft import find_transcripts

    metrics = run_critic(CriticSettings(model=model, output_dir=out, epochs=epochs), find_transcripts(transcripts))
    console.print(f"value model in {out}; train loss {metrics.get('train_loss', float('nan')):.4g}", highlight=False)


@train_app.command("run")
def train_run(
    config: Path = typer.Option(Path("train.toml"), "--config", help="Pipeline config: [synth], [warmup], [rollout], [rft], [critic], [agentic] tables."),
) -> None:
    """Run the configured stages in order; a stage whose checkpoint is complete is skipped."""
    from kernelpilot.train.pipeline import STAGES, load_config, run_pipeline

    run_pipeline(load_config(config), STAGES, on_stage=lambda outcome: console.print(
        f"{outcome.name}: {'skipped (done)' if outcome.skipped else 'done'} -> {outcome.out_dir}", highlight=False))


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
