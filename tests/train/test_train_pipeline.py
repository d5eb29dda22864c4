"""`train run`: stages chained with a checkpoint folder each; a finished stage is skipped; verl's config is written."""

import importlib.util
from pathlib import Path

import pytest
import yaml

from kernelpilot.errors import KernelpilotError
from kernelpilot.train.pipeline import (
    STAGE_DONE,
    STAGES,
    PipelineConfigError,
    load_config,
    run_pipeline,
)
from kernelpilot.train.verl_config import VerlSettings, write_verl_config

CONFIG = """
run_dir = "run"
model = "base-model"

[synth]
count = 3
scale = "small"
devices = ["cpu"]
compile_backend = "aot_eager"
"""


def test_a_finished_stage_is_skipped_on_resume(tmp_path):
    (tmp_path / "train.toml").write_text(CONFIG)
    config = load_config(tmp_path / "train.toml")
    [first] = run_pipeline(config, STAGES, base_dir=tmp_path)
    assert not first.skipped and (first.out_dir / "tasks.jsonl").is_file() and (first.out_dir / STAGE_DONE).is_file()
    written = (first.out_dir / "tasks.jsonl").stat().st_mtime_ns
    [again] = run_pipeline(config, STAGES, base_dir=tmp_path)
    assert again.skipped and again.model == "base-model"
    assert (first.out_dir / "tasks.jsonl").stat().st_mtime_ns == written


def test_a_stage_that_fails_is_not_marked_done(tmp_path):
    config = {"run_dir": "run", "rft": {"transcripts": str(tmp_path / "none")}}
    with pytest.raises(Exception, match="No trajectory passed"):
        run_pipeline(config, STAGES, base_dir=tmp_path)
    assert not (tmp_path / "run" / "rft" / STAGE_DONE).exists()


def test_unknown_stage_tables_are_refused(tmp_path):
    (tmp_path / "train.toml").write_text("[sytnh]\ncount = 3\n")
    with pytest.raises(PipelineConfigError, match="sytnh"):
        load_config(tmp_path / "train.toml")


def test_verl_config_names_our_reward_function_and_data(tmp_path):
    pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install 'kernelpilot[train]')")
    (tmp_path / "train.toml").write_text(CONFIG)
    run_pipeline(load_config(tmp_path / "train.toml"), STAGES, base_dir=tmp_path)
    paths = write_verl_config(VerlSettings(model="m", tasks=tmp_path / "run" / "synth", output_dir=tmp_path / "verl"))
    config = yaml.safe_load(paths["config"].read_text())
    assert config["custom_reward_function"]["name"] == "compute_score"
    assert Path(config["custom_reward_function"]["path"]).name == "rl.py"
    assert config["data"]["train_files"] == str(paths["data"]) and paths["data"].is_file()


def test_the_agentic_stage_writes_verls_config_and_says_how_to_launch_it(tmp_path):
    pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install 'kernelpilot[train]')")
    if importlib.util.find_spec("verl") is not None:
        pytest.skip("verl is installed here: the stage would launch a real run")
    (tmp_path / "train.toml").write_text(CONFIG + "\n[agentic]\ngpus_per_node = 2\n")
    with pytest.raises(KernelpilotError, match="verl, which is not installed") as raised:
        run_pipeline(load_config(tmp_path / "train.toml"), STAGES, base_dir=tmp_path)
    assert "verl.trainer.main_ppo" in raised.value.hint
    assert (tmp_path / "run" / "agentic" / "tools.yaml").is_file()
    assert (tmp_path / "run" / "synth" / STAGE_DONE).is_file() and not (
        tmp_path / "run" / "agentic" / STAGE_DONE
    ).exists()


def test_train_commands_from_the_cli(tmp_path):
    from typer.testing import CliRunner

    from kernelpilot.cli import app

    runner = CliRunner()
    synth = runner.invoke(
        app,
        [
            "train",
            "synth",
            "--out",
            str(tmp_path / "tasks"),
            "--count",
            "3",
            "--scale",
            "small",
            "--devices",
            "cpu",
            "--compile-backend",
            "aot_eager",
        ],
    )
    assert synth.exit_code == 0, synth.output
    assert "of 3 tasks" in synth.output and (tmp_path / "tasks" / "tasks.jsonl").is_file()
    agentic_on_trl = runner.invoke(app, ["train", "ppo", str(tmp_path / "tasks"), "--model", "m", "--stage", "agentic"])
    assert agentic_on_trl.exit_code == 2 and "--engine verl" in agentic_on_trl.output
    missing = runner.invoke(app, ["train", "run", "--config", str(tmp_path / "nope.toml")])
    assert missing.exit_code == 2 and "Cannot read" in missing.output


def test_train_run_chains_synth_warmup_rft_and_critic_from_one_config(tmp_path, monkeypatch):
    """One `train.toml`, the real CLI and real TRL runs on a tiny local model, on the CPU: every stage leaves its
    checkpoint and the next starts from it; a second run skips them all."""
    pytest.importorskip("trl", reason="trl is not installed (pip install 'kernelpilot[train]')")
    from train_testing import tiny_model_and_tokenizer, write_transcript
    from typer.testing import CliRunner

    from kernelpilot.agent.session import SESSIONS_DIR
    from kernelpilot.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = tiny_model_and_tokenizer()
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    sessions = tmp_path / "rollouts" / "task_0" / SESSIONS_DIR  # where a rollout's workspace keeps its transcript
    sessions.mkdir(parents=True)
    write_transcript(sessions / "good.jsonl", reward=2)
    (tmp_path / "train.toml").write_text(
        CONFIG.replace('model = "base-model"', f'model = "{tmp_path / "tiny"}"')
        + f"""
[warmup]
max_steps = 1
num_generations = 2
batch_size = 2
max_completion_length = 16
learning_rate = 1e-3
devices = ["cpu"]

[rft]
transcripts = "{tmp_path / "rollouts"}"
epochs = 1

[critic]
transcripts = "{tmp_path / "rollouts"}"
epochs = 1
"""
    )
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    first = runner.invoke(app, ["train", "run", "--config", "train.toml"])
    assert first.exit_code == 0, first.output
    run = tmp_path / "run"
    assert all((run / stage / STAGE_DONE).is_file() for stage in ("synth", "warmup", "rft", "critic"))
    assert (run / "rft" / "model" / "config.json").is_file() and (run / "critic" / "model" / "config.json").is_file()
    second = runner.invoke(app, ["train", "run", "--config", "train.toml"])
    assert second.exit_code == 0 and second.output.count("skipped") >= 4, second.output
