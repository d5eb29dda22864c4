"""Rejection fine-tuning: keep the agent's good trajectories as chat-format SFT data, train with TRL's SFTTrainer.

A trajectory is an agent session transcript (agent/session.py). It is kept only when the judge verified a candidate
in it (an `eval` record with reward >= 1 that kernelpilot vouched for, agent/vouched.py: what the model claimed in
Finish, or wrote into its transcript, counts for nothing), the verifier never
failed in it (the model then acted on an observation about kernelpilot, not its kernel), none of its tool calls was
refused (answered with a ToolError), it never repeats one action in a loop, and its conversation fits the context
budget.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kernelpilot.errors import KernelpilotError
from kernelpilot.results import HARNESS_ERROR

RFT_FILTERS = ("verifier-failed", "no-positive-outcome", "invalid-tool-call", "repeated-action", "over-long")


class MissingTrainingDependency(KernelpilotError):
    """A training engine (trl, transformers, datasets, peft) is not installed."""


@dataclass
class Trajectory:
    """One session transcript, read for training: its conversation, tool records and the judge's best reward."""

    path: Path
    messages: list[dict[str, Any]]
    tool_records: list[dict[str, Any]]
    best_reward: int


@dataclass
class FilterLimits:
    """Thresholds of the RFT filters."""

    min_reward: int = 1
    max_repeats: int = 3  # the same call this many times in a row is a loop
    max_tokens: int = 32768


def load_trajectory(path: Path) -> Trajectory:
    """A transcript as a trajectory; its reward is the best the judge gave any candidate in it (-1 if none)."""
    from kernelpilot.agent.session import read_records, rebuild_messages, rebuild_state

    records = read_records(Path(path))
    rewards = [result.reward for result in rebuild_state(records, Path(path)).evals]
    tools = [record for record in records if record["type"] == "tool"]
    return Trajectory(Path(path), rebuild_messages(records), tools, max(rewards, default=-1))


def rejection_reason(trajectory: Trajectory, limits: FilterLimits) -> str | None:
    """The first RFT filter a trajectory fails, or None when it is kept."""
    from kernelpilot.agent.context import count_tokens
    from kernelpilot.agent.session import refused_call

    if verifier_failed(trajectory):
        return "verifier-failed"
    if trajectory.best_reward < limits.min_reward:
        return "no-positive-outcome"
    if any(refused_call(record) for record in trajectory.tool_records):
        return "invalid-tool-call"
    if longest_repeat(trajectory.tool_records) >= limits.max_repeats:
        return "repeated-action"
    if count_tokens(trajectory.messages) > limits.max_tokens:
        return "over-long"
    return None


def verifier_failed(trajectory: Trajectory) -> bool:
    """True when kernelpilot's verifier broke on some call: the trajectory's rewards say nothing about its kernels."""
    return any(_verifier_failed(record) for record in trajectory.tool_records)


def _verifier_failed(record: dict[str, Any]) -> bool:
    # Verify and Profile both keep the verifier's result under "verify" in their data (None when nothing was verified).
    verify = (record.get("data") or {}).get("verify") or {}
    return verify.get("error_kind") == HARNESS_ERROR


def longest_repeat(tool_records: list[dict[str, Any]]) -> int:
    """The longest run of consecutive identical calls (same tool, same arguments)."""
    longest, run, previous = 0, 0, None
    for record in tool_records:
        action = (record.get("name"), json.dumps(record.get("arguments"), sort_keys=True))
        run = run + 1 if action == previous else 1
        longest, previous = max(longest, run), action
    return longest


def filter_trajectories(
    trajectories: Iterable[Trajectory], limits: FilterLimits
) -> tuple[list[Trajectory], dict[str, int]]:
    """The kept trajectories, and how many each filter dropped (each dropped one counts under its first failure)."""
    kept, dropped = [], dict.fromkeys(RFT_FILTERS, 0)
    for trajectory in trajectories:
        reason = rejection_reason(trajectory, limits)
        if reason is None:
            kept.append(trajectory)
        else:
            dropped[reason] += 1
    return kept, dropped


def sft_example(trajectory: Trajectory, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat-format SFT row: the messages (tool-call arguments as objects, as chat templates expect) and tools."""
    return {"messages": [_chat_message(message) for message in trajectory.messages], "tools": tools}


def _chat_message(message: dict[str, Any]) -> dict[str, Any]:
    converted = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        converted["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": _arguments(call["function"].get("arguments")),
                },
            }
            for call in message["tool_calls"]
        ]
    return converted


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        parsed = json.loads(raw or "{}")
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


@dataclass
class RftDataReport:
    """What `build_sft_dataset` read, dropped per filter, and wrote."""

    read: int
    kept: int
    dropped_by_filter: dict[str, int]
    output: Path


def build_sft_dataset(transcripts: Iterable[Path], output: Path, limits: FilterLimits | None = None) -> RftDataReport:
    """Filter transcripts and write the kept ones as SFT JSONL (one chat per line) to `output`."""
    from kernelpilot.agent.tools import default_tools, tool_schemas

    paths = list(transcripts)
    kept, dropped = filter_trajectories((load_trajectory(path) for path in paths), limits or FilterLimits())
    schemas = tool_schemas(default_tools())
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    with Path(output).open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(sft_example(trajectory, schemas)) + "\n" for trajectory in kept)
    return RftDataReport(len(paths), len(kept), dropped, Path(output))


def find_transcripts(root: Path) -> list[Path]:
    """Every session transcript under `root` (rollout folders hold one workspace per task)."""
    from kernelpilot.agent.session import SESSIONS_DIR

    return sorted(Path(root).rglob(f"{SESSIONS_DIR}/*.jsonl"))


def require_transcripts(root: Path) -> list[Path]:
    """`find_transcripts`, or one sentence when `root` is missing or holds none (nothing to learn from)."""
    hint = "Pass the --out folder of `kernelpilot train rollout`, or a workspace with .kernelpilot/sessions/."
    if not Path(root).is_dir():
        raise KernelpilotError(f"{root} does not exist or is not a folder.", hint=hint)
    found = find_transcripts(root)
    if not found:
        raise KernelpilotError(f"{root} holds no agent session transcripts (.kernelpilot/sessions/*.jsonl).", hint=hint)
    return found


def sft_data_from(root: Path, output: Path) -> RftDataReport:
    """`build_sft_dataset` over the transcripts under `root`; one sentence, and no file written, when none is kept."""
    paths = require_transcripts(root)
    kept, dropped = filter_trajectories((load_trajectory(path) for path in paths), FilterLimits())
    if not kept:
        reasons = ", ".join(f"{name} {count}" for name, count in dropped.items() if count)
        raise KernelpilotError(
            f"None of the {len(paths)} trajectories under {root} passed the filters ({reasons}), so there is "
            "nothing to train on.",
            hint="Keep the trajectories whose candidates the judge verified: run more rollouts, or a stronger policy.",
        )
    return build_sft_dataset(paths, output)


# ------------------------------------------------------------------------------------------------- train


@dataclass(kw_only=True)
class TrainerKnobs:
    """The knobs every trainer run here shares (SFT, critic), given by keyword after a settings' own fields."""

    epochs: float = 1.0
    max_steps: int = -1
    learning_rate: float = 1e-5
    batch_size: int = 1
    max_length: int = 8192


@dataclass
class SftSettings(TrainerKnobs):
    """What `run_sft` trains: the base model (a local path or hub id), the data, and TRL's main knobs."""

    model: str
    data: Path
    output_dir: Path
    lora_rank: int = 0  # 0: full fine-tuning; > 0: LoRA adapters of this rank through peft


def require_training_engine(*modules: str) -> None:
    """Raise one sentence and a hint when a training engine is not installed."""
    import importlib.util

    from kernelpilot.resources import install_hint

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        names = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
        verb = "is" if len(missing) == 1 else "are"
        raise MissingTrainingDependency(
            f"Training needs {names}, which {verb} not installed.",
            hint=f"Install the training extras: {install_hint('train')}",
        )


def run_sft(settings: SftSettings, tokenizer: Any = None, model: Any = None) -> dict[str, Any]:
    """Fine-tune on the SFT JSONL with TRL's SFTTrainer; returns the train metrics. Saves to `output_dir`.

    `model` and `tokenizer` default to loading `settings.model`; pass objects to train one built in memory.
    """
    require_training_engine("trl", "datasets", "transformers", *(["peft"] if settings.lora_rank else []))
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    dataset = load_dataset("json", data_files=str(settings.data), split="train")
    config = SFTConfig(**trainer_arguments(settings), num_train_epochs=settings.epochs, max_length=settings.max_length)
    trainer = SFTTrainer(
        model=model or settings.model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=_lora_config(settings.lora_rank),
    )
    metrics = trainer.train().metrics
    trainer.save_model(str(settings.output_dir))
    return metrics


class TrainerSettings(Protocol):
    """The knobs every trainer's settings share (SFT, GRPO, the critic)."""

    output_dir: Path
    max_steps: int
    learning_rate: float
    batch_size: int


def trainer_arguments(settings: TrainerSettings) -> dict[str, Any]:
    """The arguments every trainer gives its TRL or transformers config: the shared knobs, a log line a step, no
    checkpoints (the caller saves the final model once), no reporting services, and bf16 where the GPU has it."""
    return {
        "output_dir": str(settings.output_dir),
        "max_steps": settings.max_steps,
        "learning_rate": settings.learning_rate,
        "per_device_train_batch_size": settings.batch_size,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "bf16": bf16_supported(),
    }


def bf16_supported() -> bool:
    """Train in bf16 where the GPU supports it; TRL's bf16 default refuses to start on a CPU."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def _lora_config(rank: int) -> Any:
    if rank <= 0:
        return None
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM")
