"""`kernelpilot train ...`: task synthesis, rollouts, RFT, GRPO warm-up, critic, verl configs, the chained pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kernelpilot.cli.base import App, console
from kernelpilot.errors import KernelpilotError

train_app = App(name="train", help="Train a model on kernel tasks: synthesis, RFT, GRPO warm-up (TRL; verl on clusters).",
                no_args_is_help=True)
# The commands whose rewards come from the judge refuse sandboxes that Landlock does not confine, unless told.
AllowUnconfined = Annotated[bool, typer.Option(
    "--allow-unconfined",
    help="Judge even where Landlock does not confine the candidates' sandboxes (no Landlock in this kernel or "
         "container): a candidate could then change what the judge runs, so the rewards are unverified and the policy "
         "may learn to exploit that.",
)]  # fmt: skip
SCALES = ("full", "small")
STAGES = ("warmup", "agentic")
ENGINES = ("trl", "verl")


def _require_choice(value: str, choices: tuple[str, ...], option: str) -> None:
    """One sentence for an option value outside its choices, before anything is composed, trained or written."""
    if value not in choices:
        raise KernelpilotError(f"Unknown {option} {value}.", hint=f"Use {option} " + f" or {option} ".join(choices) + ".")


@train_app.command("synth")
def train_synth(
    out: Path = typer.Option(Path("kp-tasks"), "--out", help="Dataset folder: tasks.jsonl, tasks.parquet, README.md."),
    count: int = typer.Option(100, "--count", min=1, help="Problems to compose before filtering."),
    seed: int = typer.Option(0, "--seed", help="Composition seed (same seed, same problems)."),
    scale: str = typer.Option("full", "--scale", metavar="full|small", help="Problem sizes: full (GPU) or small (CPU checks)."),
    devices: str = typer.Option("cuda", "--devices", help="Comma-separated devices the filters run on, one worker each (cuda times them; cpu does not)."),
    benchmark: Optional[Path] = typer.Option(None, "--decontaminate", help="A benchmark folder of problems to stay away from."),
    compile_backend: str = typer.Option("inductor", "--compile-backend", help="torch.compile backend the eager-vs-compile filter uses."),
    composer: str = typer.Option("deterministic", "--composer", metavar="deterministic|llm", help="deterministic (sampled operators chained in order) or llm (a model writes each problem around them)."),
    model: Optional[str] = typer.Option(None, "--model", help="The llm composer's model, e.g. openai/<name> served by vLLM."),
    api_base: Optional[str] = typer.Option(None, "--api-base", help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="API key for --model (default: the provider's variable, e.g. OPENAI_API_KEY)."),
) -> None:
    """Compose KernelBench-format tasks from torch.nn operators and keep those the execution filters pass."""
    from kernelpilot.train.llm_composer import composer_model
    from kernelpilot.train.synth import crawl_operators, synthesize
    from kernelpilot.train.synth_dataset import write_dataset

    _require_choice(scale, SCALES, "--scale")
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
    from kernelpilot.train.rft import SftSettings, run_sft, sft_data_from

    data = sft_data_from(transcripts, out / "sft.jsonl")  # one sentence, and nothing written, when nothing is kept
    console.print(f"kept {data.kept} of {data.read} trajectories; dropped: {data.dropped_by_filter}", highlight=False)
    run_sft(SftSettings(model=model, data=data.output, output_dir=out / "model", epochs=epochs, lora_rank=lora_rank))


@train_app.command("rollout")
def train_rollout(
    tasks: Path = typer.Argument(..., help="A dataset folder from `kernelpilot train synth`."),
    model: str = typer.Option(..., "--model", help="The policy, e.g. openai/<name> served by vLLM."),
    api_base: Optional[str] = typer.Option(None, "--api-base", help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1."),
    out: Path = typer.Option(Path("kp-rollouts"), "--out", help="Task files, workspaces with transcripts, rollouts.jsonl."),
    devices: str = typer.Option("cuda", "--devices", help="Comma-separated devices, one episode on each at a time."),
    max_turns: int = typer.Option(20, "--max-turns", min=1, help="Most model turns per task."),
    allow_unconfined: AllowUnconfined = False,
) -> None:
    """Run the agent over every task against a policy endpoint; rerun to resume."""
    from kernelpilot.config import Settings
    from kernelpilot.train.rollout import run_rollouts

    settings = Settings(model=model, api_base=api_base, max_turns=max_turns)
    run_rollouts(tasks, out, settings, devices.split(","), on_rollout=lambda r: console.print(
        f"{r.task_id}: {'skipped (done)' if r.skipped else r.status}, reward {r.reward}", highlight=False),
        allow_unconfined=allow_unconfined)


@train_app.command("ppo")
def train_ppo(
    tasks: Path = typer.Argument(..., help="A dataset folder from `kernelpilot train synth`."),
    model: str = typer.Option(..., "--model", help="Policy: a local checkpoint folder or hub id."),
    out: Path = typer.Option(Path("kp-ppo"), "--out", help="Checkpoint folder (or verl config folder)."),
    stage: str = typer.Option("warmup", "--stage", metavar="warmup|agentic", help="warmup (single-turn) or agentic (multi-turn, verl only)."),
    max_steps: int = typer.Option(100, "--max-steps", min=1, help="Optimizer steps (TRL)."),
    engine: str = typer.Option("trl", "--engine", metavar="trl|verl", help="trl (one node, GRPO) or verl (write a cluster config)."),
    allow_unconfined: AllowUnconfined = False,
) -> None:
    """RL rewarded by the harness: single-turn GRPO warm-up on TRL, or a verl configuration for a cluster (whose
    nodes' judges refuse unconfined sandboxes unless the config, written with --allow-unconfined, allows them)."""
    _require_choice(stage, STAGES, "--stage")
    _require_choice(engine, ENGINES, "--engine")
    if engine == "verl":
        from kernelpilot.train.verl_config import VerlSettings, launch_command, write_verl_config

        paths = write_verl_config(VerlSettings(model=model, tasks=tasks, output_dir=out, multi_turn=stage == "agentic",
                                               allow_unconfined=allow_unconfined))  # fmt: skip
        console.print(f"wrote {paths['config']}; launch with: {launch_command(paths['config'])}", highlight=False)
        return
    if stage == "agentic":
        raise KernelpilotError("Multi-turn (agentic) RL runs on verl, not TRL.", hint="Add --engine verl.")
    from kernelpilot.train.rl import GrpoSettings, run_grpo

    run_grpo(GrpoSettings(model=model, tasks=tasks, output_dir=out, max_steps=max_steps, allow_unconfined=allow_unconfined))


@train_app.command("critic")
def train_critic(
    transcripts: Path = typer.Argument(..., help="A folder with agent session transcripts (rollout workspaces)."),
    model: str = typer.Option(..., "--model", help="Base model of the value function: a local checkpoint or hub id."),
    out: Path = typer.Option(Path("kp-critic"), "--out", help="Where the value model goes."),
    epochs: float = typer.Option(1.0, "--epochs", help="Training epochs."),
) -> None:
    """Pretrain a value model on scored rollouts (the judge's rewards) before agentic PPO."""
    from kernelpilot.train.critic import CriticSettings, run_critic
    from kernelpilot.train.rft import require_transcripts

    metrics = run_critic(CriticSettings(model=model, output_dir=out, epochs=epochs), require_transcripts(transcripts))
    console.print(f"value model in {out}; train loss {metrics.get('train_loss', float('nan')):.4g}", highlight=False)


@train_app.command("run")
def train_run(
    config: Path = typer.Option(Path("train.toml"), "--config", help=r"Pipeline config: \[synth], \[warmup], \[rollout], \[rft], \[critic], \[agentic] tables (docs/TRAINING.md)."),
    allow_unconfined: AllowUnconfined = False,
) -> None:
    """Run the configured stages in order; a stage whose checkpoint is complete is skipped."""
    from kernelpilot.train.pipeline import STAGES, load_config, run_pipeline

    run_pipeline(load_config(config), STAGES, on_stage=lambda outcome: console.print(
        f"{outcome.name}: {'skipped (done)' if outcome.skipped else 'done'} -> {outcome.out_dir}", highlight=False),
        allow_unconfined=allow_unconfined)
