"""`train run --config train.toml`: chain the stages, each writing a checkpoint folder; a finished stage is skipped.

A stage is finished when its folder holds `STAGE_DONE` (written last, after its outputs), so a run killed halfway
through a stage redoes that stage and nothing before it. Stages run in a fixed order; the TOML's tables say which
run and with what settings: [synth], [warmup], [rollout], [rft], [critic], [agentic], and the top-level
`run_dir` and `model`.

The stages rewarded by the judge (JUDGED_STAGES) need its sandboxes confined by Landlock: where the system has no
Landlock and one of them is still to run, the pipeline stops before any stage runs, unless `allow_unconfined`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from kernelpilot.errors import KernelpilotError

STAGE_DONE = "STAGE_DONE.json"
STAGE_ORDER = ("synth", "warmup", "rollout", "rft", "critic", "agentic")
JUDGED_STAGES = ("warmup", "rollout", "agentic")  # their rewards come from the judge, which candidates must not escape


class PipelineConfigError(KernelpilotError):
    """The pipeline's TOML cannot be read or names an unknown stage."""


@dataclass
class StageContext:
    """What a stage gets: its settings table, its output folder, the run folder and the model so far."""

    settings: dict[str, Any]
    out_dir: Path
    run_dir: Path
    model: str
    allow_unconfined: bool = False  # judge where Landlock does not confine the sandboxes (unverified rewards)


@dataclass
class StageOutcome:
    """A stage that ran or was skipped, and the model path later stages train from."""

    name: str
    skipped: bool
    out_dir: Path
    model: str


Stage = Callable[[StageContext], str]  # runs the stage; returns the model the next stage starts from


def load_config(path: Path) -> dict[str, Any]:
    """The pipeline TOML; one sentence when it is missing, malformed or names a stage we do not know."""
    try:
        config = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise PipelineConfigError(f"Cannot read {path} ({err.strerror}).", hint="Write a pipeline config (docs/TRAINING.md shows one), or pass --config PATH to yours.") from None
    except tomllib.TOMLDecodeError as err:
        raise PipelineConfigError(f"{path} is not valid TOML ({err}).", hint="See docs/TRAINING.md.") from None
    unknown = [key for key, value in config.items() if isinstance(value, dict) and key not in STAGE_ORDER]
    if unknown:
        raise PipelineConfigError(
            f"{path} has unknown stage table(s): {', '.join(unknown)}.", hint=f"Stages are {', '.join(STAGE_ORDER)}."
        )
    return config


def run_pipeline(
    config: dict[str, Any],
    stages: dict[str, Stage],
    *,
    base_dir: Path = Path("."),
    on_stage: Callable[[StageOutcome], None] | None = None,
    allow_unconfined: bool = False,
) -> list[StageOutcome]:
    """Run each configured stage in order, skipping those already done; returns what happened to each.

    A judged stage still to run needs Landlock (UnconfinedJudgeError first, otherwise), unless `allow_unconfined`.
    """
    run_dir = base_dir / config.get("run_dir", "kp-train")
    model = str(config.get("model", ""))
    judged = [name for name in JUDGED_STAGES if name in config and not (run_dir / name / STAGE_DONE).is_file()]
    if judged and not allow_unconfined:
        from kernelpilot.harness.judge import require_landlock

        require_landlock()
    outcomes = []
    for name in STAGE_ORDER:
        if name not in config:
            continue
        out_dir = run_dir / name
        done = out_dir / STAGE_DONE
        if done.is_file():
            model = json.loads(done.read_text(encoding="utf-8"))["model"]
            outcome = StageOutcome(name, True, out_dir, model)
        else:
            out_dir.mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            model = stages[name](StageContext(config[name], out_dir, run_dir, model, allow_unconfined))
            done.write_text(
                json.dumps({"model": model, "seconds": round(time.monotonic() - started, 1)}), encoding="utf-8"
            )
            outcome = StageOutcome(name, False, out_dir, model)
        outcomes.append(outcome)
        if on_stage is not None:
            on_stage(outcome)
    return outcomes


# ------------------------------------------------------------------------------------------ the stages


def synth_stage(ctx: StageContext) -> str:
    """Synthesise and filter tasks into `out_dir`; the model is unchanged."""
    from kernelpilot.train.llm_composer import composer_model
    from kernelpilot.train.synth import crawl_operators, synthesize
    from kernelpilot.train.tasks import DETERMINISTIC_COMPOSER
    from kernelpilot.train.synth_dataset import write_dataset

    settings = ctx.settings
    report = synthesize(
        int(settings.get("count", 100)),
        seed=int(settings.get("seed", 0)),
        scale=settings.get("scale", "full"),
        devices=settings.get("devices", ["cuda"]),
        compile_backend=settings.get("compile_backend", "inductor"),
        benchmark_dir=Path(settings["benchmark_dir"]) if settings.get("benchmark_dir") else None,
        model=composer_model(
            settings.get("composer", DETERMINISTIC_COMPOSER),
            settings.get("model"),
            settings.get("api_base"),
            settings.get("api_key"),
        ),
    )
    shown = {key: value for key, value in settings.items() if key != "api_key"}  # report.json is shared with the data
    write_dataset(report, ctx.out_dir, settings={**shown, "operator_count": len(crawl_operators().operators)})
    if report.model_error is not None:
        raise report.model_error  # the stage is not done; its tasks so far stay in out_dir
    return ctx.model


def warmup_stage(ctx: StageContext) -> str:
    """GRPO warm-up on the synth stage's tasks; the next stages start from its checkpoint."""
    from kernelpilot.train.rl import GrpoSettings, run_grpo

    settings = ctx.settings
    run_grpo(
        GrpoSettings(
            model=ctx.model,
            tasks=ctx.run_dir / "synth",
            output_dir=ctx.out_dir,
            max_steps=int(settings.get("max_steps", 100)),
            num_generations=int(settings.get("num_generations", 4)),
            batch_size=int(settings.get("batch_size", 4)),
            learning_rate=float(settings.get("learning_rate", 1e-6)),
            max_completion_length=int(settings.get("max_completion_length", 4096)),
            devices=tuple(settings.get("devices", ["cuda"])),
            allow_unconfined=ctx.allow_unconfined,
        )
    )
    return str(ctx.out_dir)


def rollout_stage(ctx: StageContext) -> str:
    """The agent over the synth tasks against the policy endpoint the table names (e.g. vLLM serving the warm-up)."""
    from kernelpilot.config import Settings
    from kernelpilot.train.rollout import run_rollouts

    settings = ctx.settings
    agent = Settings(
        model=settings.get("model"),
        api_base=settings.get("api_base"),
        api_key=settings.get("api_key"),
        max_turns=int(settings.get("max_turns", 20)),
    )
    run_rollouts(ctx.run_dir / "synth", ctx.out_dir, agent, devices=settings.get("devices", ["cuda"]),
                 allow_unconfined=ctx.allow_unconfined)  # fmt: skip
    return ctx.model


def rft_stage(ctx: StageContext) -> str:
    """Rejection fine-tuning on the transcripts under the stage's `transcripts` folder."""
    from kernelpilot.train.rft import (
        FilterLimits,
        SftSettings,
        build_sft_dataset,
        find_transcripts,
        run_sft,
    )

    settings = ctx.settings
    transcripts = find_transcripts(Path(settings.get("transcripts", ctx.run_dir / "rollout")))
    data = build_sft_dataset(
        transcripts, ctx.out_dir / "sft.jsonl", FilterLimits(max_tokens=int(settings.get("max_tokens", 32768)))
    )
    if data.kept == 0:
        raise KernelpilotError(
            "No trajectory passed the RFT filters, so there is nothing to fine-tune on.",
            hint=f"Dropped per filter: {data.dropped_by_filter}.",
        )
    run_sft(
        SftSettings(
            model=ctx.model,
            data=data.output,
            output_dir=ctx.out_dir / "model",
            epochs=float(settings.get("epochs", 1)),
            lora_rank=int(settings.get("lora_rank", 0)),
        )
    )
    return str(ctx.out_dir / "model")


def critic_stage(ctx: StageContext) -> str:
    """Pretrain a value model on every rollout transcript; the policy model is unchanged."""
    from kernelpilot.train.critic import CriticSettings, run_critic
    from kernelpilot.train.rft import find_transcripts

    settings = ctx.settings
    transcripts = find_transcripts(Path(settings.get("transcripts", ctx.run_dir / "rollout")))
    run_critic(
        CriticSettings(
            model=settings.get("model", ctx.model),
            output_dir=ctx.out_dir / "model",
            epochs=float(settings.get("epochs", 1)),
        ),
        transcripts,
    )
    return ctx.model


def agentic_stage(ctx: StageContext) -> str:
    """Multi-turn RL on verl: write its configuration, then launch it where verl is installed."""
    import importlib.util
    import subprocess

    from kernelpilot.train.verl_config import (
        VerlSettings,
        launch_command,
        write_verl_config,
    )

    settings = ctx.settings
    critic = ctx.run_dir / "critic" / "model"  # the critic stage's value model, when it ran
    paths = write_verl_config(
        VerlSettings(
            model=ctx.model,
            tasks=ctx.run_dir / "synth",
            output_dir=ctx.out_dir,
            multi_turn=True,
            algorithm=settings.get("algorithm", "gae" if critic.is_dir() else "grpo"),
            critic_model=str(critic) if critic.is_dir() else None,
            nnodes=int(settings.get("nnodes", 1)),
            gpus_per_node=int(settings.get("gpus_per_node", 8)),
            epochs=int(settings.get("epochs", 1)),
            allow_unconfined=ctx.allow_unconfined,
        )
    )
    command = launch_command(paths["config"])
    if importlib.util.find_spec("verl") is None:
        raise KernelpilotError(
            f"The agentic stage runs on verl, which is not installed; its config is in {ctx.out_dir}.",
            hint=f"On a machine with verl (pip install verl), run: {command}",
        )
    subprocess.run(command.split(), check=True)
    return str(ctx.out_dir)


STAGES: dict[str, Stage] = {
    "synth": synth_stage,
    "warmup": warmup_stage,
    "rollout": rollout_stage,
    "rft": rft_stage,
    "critic": critic_stage,
    "agentic": agentic_stage,
}
