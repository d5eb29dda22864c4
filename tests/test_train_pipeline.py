"""`train run`: stages chained with a checkpoint folder each; a finished stage is skipped; verl's config is written."""

from pathlib import Path

import pytest
import yaml

from kernelpilot.train.pipeline import STAGE_DONE, STAGES, PipelineConfigError, load_config, run_pipeline
from kernelpilot.train.verl_config import VerlSettings, write_verl_config

CONFIG = """
run_dir = "run"
model = "base-model"

[synth]
count = 3
scale = "small"
device = "cpu"
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
