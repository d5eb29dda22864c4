"""The training pipeline's smoke run on a GPU: synth >= 20 tasks -> built-in-policy rollouts -> RFT 1 epoch -> critic
-> 2 GRPO steps with real harness rewards, on a tiny randomly initialised model (nothing from a hub).

Run with `pytest -m gpu -s tests/train/test_train_gpu.py` to see the figures (tasks kept per filter, rewards, losses,
seconds per stage) that docs/TRAINING.md reports.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_testing import tiny_model_and_tokenizer

from kernelpilot.config import Settings
from kernelpilot.train.critic import CriticSettings, run_critic
from kernelpilot.train.rft import (
    SftSettings,
    build_sft_dataset,
    find_transcripts,
    run_sft,
)
from kernelpilot.train.rl import GrpoSettings, run_grpo
from kernelpilot.train.rollout import run_rollouts
from kernelpilot.train.synth import SynthReport, synthesize
from kernelpilot.train.synth_dataset import write_dataset

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _log(stage: str, seconds: float, **figures) -> None:
    print(f"[train smoke] {stage} ({seconds:.1f} s): {json.dumps(figures, default=str)}")


def _policy_supports(task, folder: Path) -> bool:
    from kernelpilot.policy.analysis import analyze
    from kernelpilot.problem import load_problem

    path = folder / "analysed" / f"task_{task.task_id}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(task.code)
    return analyze(load_problem(path)).supported


@pytest.mark.gpu
def test_the_pipeline_runs_end_to_end_on_a_gpu(tmp_path, monkeypatch):
    pytest.importorskip("trl", reason="trl is not installed (pip install 'kernelpilot[train]')")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    started = time.monotonic()
    report = synthesize(48, seed=0, scale="full", devices=["cuda"], benchmark_dir=EXAMPLES)
    write_dataset(report, tmp_path / "tasks", settings={"seed": 0, "scale": "full", "devices": "cuda"})
    _log(
        "synth",
        time.monotonic() - started,
        composed=report.composed,
        kept=len(report.kept),
        dropped=report.dropped_by_filter,
        eager_ms=[task.eager_ms for task in report.kept[:5]],
    )
    assert len(report.kept) >= 20
    assert all(task.eager_ms is not None and task.compile_ms is not None for task in report.kept)

    started = time.monotonic()
    # Rollouts start from tasks the built-in policy can write (it names the others unsupported and scores -1).
    few = SynthReport(3, [task for task in report.kept if _policy_supports(task, tmp_path)][:3], {}, [], {}, 0.0)
    assert len(few.kept) == 3, "fewer than 3 synthesised tasks are within the built-in policy's reach"
    write_dataset(few, tmp_path / "rollout-tasks", settings={})
    rollouts = run_rollouts(tmp_path / "rollout-tasks", tmp_path / "rollouts", Settings(max_turns=8), ["cuda"])
    _log(
        "rollout (built-in policy)",
        time.monotonic() - started,
        episodes=[(r.task_id, r.status, r.reward, r.turns) for r in rollouts],
    )
    assert len(rollouts) == 3 and all(Path(r.session).is_file() for r in rollouts)

    started = time.monotonic()
    transcripts = find_transcripts(tmp_path / "rollouts")
    data = build_sft_dataset(transcripts, tmp_path / "rft" / "sft.jsonl")
    _log("rft data", time.monotonic() - started, read=data.read, kept=data.kept, dropped=data.dropped_by_filter)
    assert data.kept >= 1, "the built-in policy verified no candidate on three synthesised tasks"
    model, tokenizer = tiny_model_and_tokenizer()
    started = time.monotonic()
    metrics = run_sft(
        SftSettings(
            model="tiny",
            data=data.output,
            output_dir=tmp_path / "rft" / "model",
            epochs=1,
            learning_rate=1e-3,
            max_length=2048,
        ),
        tokenizer=tokenizer,
        model=model,
    )
    _log("rft sft 1 epoch", time.monotonic() - started, **metrics)

    from transformers import LlamaForSequenceClassification

    config = model.config
    config.num_labels, config.problem_type = 1, "regression"
    started = time.monotonic()
    critic = run_critic(
        CriticSettings(model="tiny", output_dir=tmp_path / "critic", max_steps=2, max_length=2048),
        transcripts,
        tokenizer=tokenizer,
        model=LlamaForSequenceClassification(config),
    )
    _log("critic 2 steps", time.monotonic() - started, **critic)

    started = time.monotonic()
    history = run_grpo(
        GrpoSettings(
            model="tiny",
            tasks=tmp_path / "rollout-tasks",
            output_dir=tmp_path / "grpo",
            max_steps=2,
            num_generations=2,
            batch_size=2,
            max_completion_length=64,
            learning_rate=1e-3,
        ),
        tokenizer=tokenizer,
        model=model,
    )
    seconds = time.monotonic() - started
    steps = [entry for entry in history if "loss" in entry]
    _log("grpo 2 steps (harness reward)", seconds, seconds_per_step=seconds / 2, steps=steps)
    assert len(steps) == 2 and all("reward" in entry for entry in steps)


TRAIN_TOML = """
run_dir = "run"
model = "{model}"

[synth]
count = 20
seed = 1
scale = "full"
devices = ["cuda"]
benchmark_dir = "{examples}"

[warmup]
max_steps = 2
num_generations = 2
batch_size = 2
max_completion_length = 64
learning_rate = 1e-3
devices = ["cuda"]

[rollout]
max_turns = 6
devices = ["cuda"]

[rft]
epochs = 1

[critic]
epochs = 1
"""


@pytest.mark.gpu
def test_train_run_chains_every_stage_from_one_config_on_a_gpu(tmp_path, monkeypatch):
    """`kernelpilot train run --config train.toml` on a GPU: synth -> GRPO warm-up -> built-in-policy rollouts -> RFT
    -> critic, each stage starting from the last one's checkpoint, through the real CLI."""
    pytest.importorskip("trl", reason="trl is not installed (pip install 'kernelpilot[train]')")
    model, tokenizer = tiny_model_and_tokenizer()
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    (tmp_path / "train.toml").write_text(TRAIN_TOML.format(model=tmp_path / "tiny", examples=EXAMPLES))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kernelpilot", "train", "run", "--config", "train.toml"],
        cwd=tmp_path, capture_output=True, text=True, timeout=1200, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    _log("train run (5 stages)", time.monotonic() - started, tail=done.stdout[-1500:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "run"
    for stage in ("synth", "warmup", "rollout", "rft", "critic"):
        assert (run / stage / "STAGE_DONE.json").is_file(), stage
