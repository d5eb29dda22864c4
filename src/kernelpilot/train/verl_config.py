"""Write a verl configuration for cluster RL: our reward function and our task data.

verl (Ray) runs PPO/GRPO across nodes; kernelpilot supplies what is specific to kernels: the reward function
(`kernelpilot.train.rl.compute_score`, the harness milestone reward) and the task prompts as parquet in verl's data
format. Single-turn only for now: multi-turn episodes need an adapter from our tools to verl's BaseTool, which is
not written yet (docs/TRAINING.md).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kernelpilot.train.rl as rl

DATA_SOURCE = "kernelpilot-synth"


@dataclass
class VerlSettings:
    """The knobs of a verl run that kernelpilot sets; everything else keeps verl's defaults."""

    model: str
    tasks: Path
    output_dir: Path
    algorithm: str = "grpo"  # verl's adv_estimator: grpo (no critic) or gae (PPO with a critic)
    critic_model: str | None = None
    nnodes: int = 1
    gpus_per_node: int = 8
    rollout_engine: str = "vllm"
    epochs: int = 1


def verl_data_rows(tasks_path: Path) -> list[dict[str, Any]]:
    """The tasks in verl's RL data format: prompt messages, a data source, and the task source as ground truth."""
    from kernelpilot.train.synth import read_tasks

    return [
        {"data_source": DATA_SOURCE, "prompt": rl.warmup_prompt(task.code),
         "reward_model": {"style": "rule", "ground_truth": task.code},
         "extra_info": {"task_id": task.task_id, "ops": task.ops}}
        for task in read_tasks(tasks_path)
    ]


def trainer_config(settings: VerlSettings, train_file: Path) -> dict[str, Any]:
    """The overrides of verl's ppo_trainer config (main_ppo) for a kernelpilot run."""
    critic = {"model": {"path": settings.critic_model or settings.model}} if settings.algorithm == "gae" else {}
    return {
        "algorithm": {"adv_estimator": settings.algorithm},
        "data": {"train_files": str(train_file), "val_files": str(train_file), "prompt_key": "prompt",
                 "return_raw_chat": True},
        "actor_rollout_ref": {
            "model": {"path": settings.model},
            "rollout": {"name": settings.rollout_engine},
        },
        **({"critic": critic} if critic else {}),
        "custom_reward_function": {"path": inspect.getfile(rl), "name": rl.compute_score.__name__},
        "trainer": {"nnodes": settings.nnodes, "n_gpus_per_node": settings.gpus_per_node,
                    "total_epochs": settings.epochs, "default_local_dir": str(settings.output_dir),
                    "project_name": "kernelpilot", "logger": ["console"]},
    }


def write_verl_config(settings: VerlSettings) -> dict[str, Path]:
    """Write train.parquet and verl.yaml under `output_dir`; returns their paths by name."""
    import yaml

    from kernelpilot.train.rft import require_training_engine

    require_training_engine("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(settings.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = verl_data_rows(settings.tasks)
    train_file = out / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{**row, "extra_info": json.dumps(row["extra_info"])} for row in rows]),
                   train_file)
    config_path = out / "verl.yaml"
    config_path.write_text(yaml.safe_dump(trainer_config(settings, train_file), sort_keys=False),
                           encoding="utf-8")
    return {"data": train_file, "config": config_path}


def launch_command(config_path: Path) -> str:
    """The command that starts verl with the written configuration (run it on the cluster's head node)."""
    return f"python -m verl.trainer.main_ppo --config-path {config_path.parent.resolve()} --config-name {config_path.stem}"
