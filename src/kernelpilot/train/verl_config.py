"""Write a verl configuration for cluster RL: our reward function, our task data, and our tools for multi-turn runs.

verl (Ray) runs PPO/GRPO across nodes; kernelpilot supplies what is specific to kernels: the reward function
(`kernelpilot.train.rl.compute_score`, the harness milestone reward), the task prompts as parquet in verl's data
format, and, for agentic (multi-turn) runs, a tool config naming `verl_tools.KernelpilotTool` once per agent tool,
with each task's source passed to the tools through `extra_info.tools_kwargs`. Written against verl 0.9's
ppo_trainer config (`python -m verl.trainer.main_ppo`). Both the reward function and the tools judge on the nodes,
where their judges refuse sandboxes that Landlock does not confine unless the config allows it (`allow_unconfined`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelpilot.train import rl

DATA_SOURCE = "kernelpilot-synth"
TOOL_CLASS = "kernelpilot.train.verl_tools.KernelpilotTool"
TOOL_AGENT_LOOP = "tool_agent"  # verl's multi-turn agent loop; single-turn rows use its default loop


@dataclass
class VerlSettings:
    """The knobs of a verl run that kernelpilot sets; everything else keeps verl's defaults."""

    model: str
    tasks: Path
    output_dir: Path
    algorithm: str = "grpo"  # verl's adv_estimator: grpo (no critic) or gae (PPO with a critic)
    critic_model: str | None = None
    multi_turn: bool = False  # agentic episodes through our tools, rewarded by the judge's best verdict
    max_assistant_turns: int = 20
    nnodes: int = 1
    gpus_per_node: int = 8
    rollout_engine: str = "vllm"
    epochs: int = 1
    allow_unconfined: bool = False  # the nodes' judges may run where Landlock does not confine their sandboxes


def tool_names() -> list[str]:
    """The agent's tool names, in the order the model sees them."""
    from kernelpilot.agent.tools import default_tools

    return [tool.name for tool in default_tools()]


def verl_data_rows(tasks_path: Path, multi_turn: bool) -> list[dict[str, Any]]:
    """The tasks in verl's RL data format: prompt messages, a data source, and the task source as ground truth."""
    from kernelpilot.train.synth_dataset import read_tasks

    rows = []
    for task in read_tasks(tasks_path):
        row = {
            "data_source": DATA_SOURCE,
            "reward_model": {"style": "rule", "ground_truth": task.code},
            "extra_info": {"task_id": task.task_id, "ops": task.ops},
        }
        if multi_turn:
            row["prompt"] = rl.agentic_prompt(task.code)
            row["agent_name"] = TOOL_AGENT_LOOP
            row["extra_info"]["tools_kwargs"] = {
                name: {"create_kwargs": {"task_code": task.code}} for name in tool_names()
            }
        else:
            row["prompt"] = rl.warmup_prompt(task.code)
        rows.append(row)
    return rows


def tool_config(allow_unconfined: bool = False) -> dict[str, Any]:
    """verl's tool config: our adapter class once per agent tool, with that tool's OpenAI-format schema, and
    whether its judge may run unconfined (`verl_tools.KernelpilotTool` reads it)."""
    from kernelpilot.agent.tools import default_tools, tool_schemas

    config = {"type": "native", "allow_unconfined": allow_unconfined}
    return {
        "tools": [
            {"class_name": TOOL_CLASS, "config": dict(config), "tool_schema": schema}
            for schema in tool_schemas(default_tools())
        ]
    }


def trainer_config(settings: VerlSettings, train_file: Path, tool_config_path: Path | None) -> dict[str, Any]:
    """The overrides of verl's ppo_trainer config (main_ppo) for a kernelpilot run."""
    rollout: dict[str, Any] = {"name": settings.rollout_engine}
    if tool_config_path is not None:
        rollout["multi_turn"] = {
            "enable": True,
            "max_assistant_turns": settings.max_assistant_turns,
            "tool_config_path": str(tool_config_path),
        }
        rollout["agent"] = {"default_agent_loop": TOOL_AGENT_LOOP}
    config = {
        "algorithm": {"adv_estimator": settings.algorithm},
        "data": {
            "train_files": str(train_file),
            "val_files": str(train_file),
            "prompt_key": "prompt",
            "return_raw_chat": True,
        },
        "actor_rollout_ref": {"model": {"path": settings.model}, "rollout": rollout},
        "custom_reward_function": {"path": inspect.getfile(rl), "name": rl.compute_score.__name__,
                                   "reward_kwargs": {"allow_unconfined": settings.allow_unconfined}},  # fmt: skip
        "trainer": {
            "nnodes": settings.nnodes,
            "n_gpus_per_node": settings.gpus_per_node,
            "total_epochs": settings.epochs,
            "default_local_dir": str(settings.output_dir),
            "project_name": "kernelpilot",
            "logger": ["console"],
        },
    }
    if settings.algorithm == "gae":
        config["critic"] = {"model": {"path": settings.critic_model or settings.model}}
    return config


def write_verl_config(settings: VerlSettings) -> dict[str, Path]:
    """Write train.parquet, verl.yaml and (multi-turn) tools.yaml under `output_dir`; returns their paths by name."""
    import yaml

    from kernelpilot.train.rft import require_training_engine

    require_training_engine("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = verl_data_rows(settings.tasks, settings.multi_turn)  # a missing dataset is refused before out/ is made
    out = Path(settings.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"data": out / "train.parquet", "config": out / "verl.yaml"}
    pq.write_table(pa.Table.from_pylist(rows), paths["data"])
    if settings.multi_turn:
        paths["tools"] = out / "tools.yaml"
        paths["tools"].write_text(yaml.safe_dump(tool_config(settings.allow_unconfined), sort_keys=False),
                                  encoding="utf-8")  # fmt: skip
    config = trainer_config(settings, paths["data"], paths.get("tools"))
    paths["config"].write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return paths


def launch_command(config_path: Path) -> str:
    """The command that starts verl with the written configuration (run it on the cluster's head node)."""
    return (
        f"python -m verl.trainer.main_ppo --config-path {config_path.parent.resolve()} --config-name {config_path.stem}"
    )
