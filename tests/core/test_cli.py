"""The command line as a newcomer meets it, through the real `python -m kernelpilot` in a fresh folder: every
mistake ends in one `error:` sentence and a `hint:`, a non-zero exit, no traceback, and nothing left behind.
The help, `--version` and the README are checked against the commands the app really has.

No GPU is made visible to these runs (CUDA_VISIBLE_DEVICES is empty), so they behave the same on any machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import yaml

from kernelpilot import __version__
from kernelpilot.workspace import init_workspace
from kp_testing import DOUBLE_PROBLEM, write_problem

REPO_ROOT = Path(__file__).resolve().parents[2]
SRC = REPO_ROOT / "src"
ALT_SCREEN = "\x1b[?1049h"  # what a full-screen (Textual) app writes first


def kernelpilot(folder: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the CLI in `folder` with no GPU visible and a wide terminal (no wrapped sentences)."""
    run_env = {name: value for name, value in os.environ.items() if name != "TORCH_CUDA_ARCH_LIST"}
    run_env.update({"CUDA_VISIBLE_DEVICES": "", "COLUMNS": "200", "PYTHONPATH": str(SRC), **(env or {})})
    return subprocess.run([sys.executable, "-m", "kernelpilot", *args], cwd=folder, env=run_env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def assert_refused(result: subprocess.CompletedProcess, sentence: str, hint: str) -> None:
    """A non-zero exit with one `error:` sentence and its `hint:`, and no traceback."""
    assert result.returncode != 0, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert any(line.startswith("error: ") and sentence in line for line in lines), result.stderr
    assert any(line.startswith("hint: ") and hint in line for line in lines), result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def entries(folder: Path) -> set[str]:
    return {path.name for path in folder.iterdir()}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A folder holding one problem file: whatever else appears in it, a command created."""
    write_problem(tmp_path, DOUBLE_PROBLEM, "double.py")
    return tmp_path


# ------------------------------------------------------------------------------------------- optimize, tui


def test_optimize_without_a_gpu_says_so_before_making_a_workspace_or_printing_the_banner(folder):
    result = kernelpilot(folder, "optimize", "double.py")

    assert_refused(result, "no CUDA GPU is visible", "Run it on a machine with an NVIDIA GPU")
    assert "No model configured" not in result.stderr
    assert entries(folder) == {"double.py"}


def test_the_built_in_policy_banner_shows_once_the_run_proceeds(folder):
    result = kernelpilot(folder, "optimize", "double.py", "--device", "cpu", "--max-turns", "1",
                         env={"TORCH_CUDA_ARCH_LIST": "9.0"})  # fmt: skip

    assert "No model configured: using the built-in policy" in result.stderr, result.stderr
    assert "error:" not in result.stderr
    assert (folder / "kp-double" / ".kernelpilot" / "sessions").is_dir()


def test_tui_without_a_gpu_says_so_before_opening_the_app(folder):
    result = kernelpilot(folder, "tui", "double.py")

    assert_refused(result, "no CUDA GPU is visible", "Run it on a machine with an NVIDIA GPU")
    assert ALT_SCREEN not in result.stdout + result.stderr
    assert entries(folder) == {"double.py"}


def test_resuming_a_run_that_never_started_names_the_missing_session_and_makes_nothing(folder):
    (folder / "empty-ws").mkdir()
    never_made = kernelpilot(folder, "optimize", "double.py", "--resume")
    no_session = kernelpilot(folder, "tui", "double.py", "--resume", "--dir", "empty-ws")

    assert_refused(never_made, f"There is no run to resume: the workspace {(folder / 'kp-double').resolve()} does "
                   "not exist.", "Drop --resume to start a run")  # fmt: skip
    assert_refused(no_session, "No session found in", "kernelpilot sessions DIR")
    assert entries(folder) == {"double.py", "empty-ws"}
    assert not any((folder / "empty-ws").iterdir())


def test_the_old_workspace_option_still_works_as_a_hidden_alias_of_dir(folder):
    aliased = kernelpilot(folder, "optimize", "double.py", "--workspace", "mine", "--resume")
    both = kernelpilot(folder, "optimize", "double.py", "--dir", "a", "--workspace", "b")

    assert_refused(aliased, f"the workspace {(folder / 'mine').resolve()} does not exist", "Drop --resume")
    assert_refused(both, "--dir and --workspace name the same folder; pass only one.", "Use --dir.")
    assert "--workspace" not in kernelpilot(folder, "optimize", "--help").stdout
    assert entries(folder) == {"double.py"}


@pytest.mark.asyncio
async def test_the_tui_runs_what_was_checked_before_it_opened_and_makes_the_workspace_only_then(folder):
    from kernelpilot.agent import ModelReply, ToolCall
    from kernelpilot.agent.model import ScriptedModel
    from kernelpilot.agent.session import read_records
    from kernelpilot.agent.tool_results import TodoItem
    from kernelpilot.config import Settings
    from kernelpilot.harness.judge import Judge
    from kernelpilot.optimize import CheckedRun, prepared_run
    from kernelpilot.problem import load_problem
    from kernelpilot.tui.app import KernelpilotApp
    from kernelpilot.tui.todos import TodoPanel

    plan = [{"content": "fuse the doubling", "status": "in_progress"}]
    model = ScriptedModel([ModelReply("plan first", [ToolCall(id="call-1", name="TodoWrite", arguments={"todos": plan})])])
    settings = Settings(max_turns=1, workspace=folder / "kp-double")
    with Judge("cpu") as judge:  # the CPU judge starts no worker until asked to judge, which this run never does
        checked = CheckedRun(load_problem(folder / "double.py"), model, judge, (folder / "kp-double").resolve())
        assert entries(folder) == {"double.py"}
        app = KernelpilotApp(partial(prepared_run, folder / "double.py", settings, checked=checked))
        async with app.run_test() as pilot:
            deadline = time.monotonic() + 30
            while app.phase != "ended":
                assert time.monotonic() < deadline, f"the run did not end (phase {app.phase})"
                await pilot.pause(0.02)
            assert app.query_one(TodoPanel).todos == [TodoItem("fuse the doubling", "in_progress")]
            await pilot.press("q")

    sessions = list((folder / "kp-double" / ".kernelpilot" / "sessions").glob("*.jsonl"))
    assert len(sessions) == 1
    assert [record["type"] for record in read_records(sessions[0])][0] == "start"


# --------------------------------------------------------------------------------- build, eval, watch, sessions


def test_build_of_a_missing_folder_says_it_does_not_exist(folder):
    result = kernelpilot(folder, "build", "no-such-folder")

    assert_refused(result, f"{folder.resolve() / 'no-such-folder'} does not exist.", "kernelpilot init PROBLEM.py")
    assert entries(folder) == {"double.py"}


def test_eval_of_a_missing_folder_says_it_does_not_exist(folder):
    result = kernelpilot(folder, "eval", "no-such-folder")

    assert_refused(result, "no-such-folder does not exist.", "Pass a workspace made by `kernelpilot init PROBLEM.py`")


@pytest.mark.parametrize("command", ["eval", "watch"])
def test_eval_and_watch_on_cpu_without_an_arch_name_the_variable_not_an_option_they_lack(folder, command):
    init_workspace(folder / "double.py", folder / "ws")

    result = kernelpilot(folder, command, "ws", "--device", "cpu")

    assert_refused(result, "No GPU is visible and TORCH_CUDA_ARCH_LIST is not set", "export TORCH_CUDA_ARCH_LIST=9.0")
    assert "--arch" not in result.stderr
    assert not (folder / "ws" / "build").exists()


def test_sessions_of_a_missing_folder_is_an_error_not_an_empty_list(folder):
    result = kernelpilot(folder, "sessions", str(folder / "nonexistent"))

    assert_refused(result, "does not exist or is not a folder.", "Pass a workspace, or a folder of workspaces.")
    assert "No sessions found" not in result.stdout


def test_check_of_a_missing_path_is_an_error_not_a_skip(folder):
    result = kernelpilot(folder, "check", "no-such-file.cu")

    assert_refused(result, f"{folder.resolve() / 'no-such-file.cu'} does not exist.", "Pass files or folders")
    assert "skipped" not in result.stdout


# ------------------------------------------------------------------------------------------------- train


def test_train_synth_with_an_unknown_scale_names_the_scales(folder):
    result = kernelpilot(folder, "train", "synth", "--scale", "huge", "--count", "1", "--devices", "cpu")

    assert_refused(result, "Unknown --scale huge.", "Use --scale full or --scale small.")
    assert entries(folder) == {"double.py"}


def test_train_synth_filtering_on_a_gpu_that_is_not_there_is_refused_before_composing(folder):
    result = kernelpilot(folder, "train", "synth", "--count", "1")

    assert_refused(result, "--devices names a GPU, and no CUDA GPU is visible.", "--devices cpu --scale small")
    assert entries(folder) == {"double.py"}


def test_train_ppo_writes_no_verl_config_for_a_dataset_that_is_not_there(folder):
    pytest.importorskip("pyarrow", reason="pyarrow is not installed (the verl config is written as parquet)")

    result = kernelpilot(folder, "train", "ppo", "no-tasks", "--model", "m", "--engine", "verl")

    assert_refused(result, "No task dataset at no-tasks", "kernelpilot train synth --out DIR")
    assert entries(folder) == {"double.py"}


def test_train_ppo_with_an_unknown_engine_is_refused_before_anything_runs(folder):
    result = kernelpilot(folder, "train", "ppo", "tasks", "--model", "m", "--engine", "nope")

    assert_refused(result, "Unknown --engine nope.", "Use --engine trl or --engine verl.")
    assert entries(folder) == {"double.py"}


def test_train_rft_on_a_folder_without_transcripts_fails_and_makes_no_output_folder(folder):
    result = kernelpilot(folder, "train", "rft", ".", "--model", "m")

    assert_refused(result, "holds no agent session transcripts", "kernelpilot train rollout")
    assert "kept 0 of 0" not in result.stdout
    assert entries(folder) == {"double.py"}


def test_train_run_without_a_config_does_not_suggest_the_default_it_just_tried(folder):
    result = kernelpilot(folder, "train", "run")

    assert_refused(result, "Cannot read train.toml", "Write a pipeline config (docs/TRAINING.md shows one)")
    assert "--config train.toml" not in result.stderr


def test_a_missing_training_engine_is_named_in_a_sentence_with_the_install_command_for_a_checkout(monkeypatch):
    from kernelpilot.train.rft import MissingTrainingDependency, require_training_engine

    monkeypatch.chdir(REPO_ROOT)
    with pytest.raises(MissingTrainingDependency) as one:
        require_training_engine("kp_absent_engine")
    with pytest.raises(MissingTrainingDependency) as three:
        require_training_engine("kp_absent_a", "kp_absent_b", "kp_absent_c")

    assert one.value.message == "Training needs kp_absent_engine, which is not installed."
    assert three.value.message == "Training needs kp_absent_a, kp_absent_b and kp_absent_c, which are not installed."
    assert "pip install -e '.[train]'" in three.value.hint


# ------------------------------------------------------------------------------------------ help and version


def test_version_prints_the_package_version(tmp_path):
    result = kernelpilot(tmp_path, "--version")

    assert result.returncode == 0
    assert result.stdout.strip() == f"kernelpilot {__version__}"


def test_help_shows_arguments_by_name_flags_without_a_type_and_config_tables_as_written(tmp_path):
    optimize = kernelpilot(tmp_path, "optimize", "--help").stdout
    check = kernelpilot(tmp_path, "check", "--help").stdout
    train_run = kernelpilot(tmp_path, "train", "run", "--help").stdout

    assert "optimize [OPTIONS] PROBLEM" in optimize
    assert "{problem}" not in optimize
    assert "<bool>" not in optimize + check
    assert "check [OPTIONS] [PATHS...]" in check
    assert "list[Path]" not in check
    assert "[synth], [warmup], [rollout], [rft], [critic], [agentic]" in train_run


# ------------------------------------------------------------------------------------ README and the hook


def _command_names() -> list[str]:
    import typer

    from kernelpilot.cli import app

    root = typer.main.get_command(app)
    names = []
    for name, command in root.commands.items():
        names += [f"{name} {sub}" for sub in getattr(command, "commands", {})] or [name]
    return names


def test_the_readme_documents_every_command_the_version_flag_and_the_tui_keys():
    from kernelpilot.tui.app import KernelpilotApp

    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    names = _command_names()

    assert {"tui", "train synth", "train run"} <= set(names)
    undocumented = [name for name in names if f"kernelpilot {name}" not in readme]
    assert not undocumented, f"README.md does not document: {undocumented}"
    assert "kernelpilot --version" in readme
    for binding in KernelpilotApp.BINDINGS:
        assert re.search(rf"\| `{binding.key}` \|", readme), f"README.md does not document the TUI key {binding.key}"


def test_the_pre_commit_hook_shows_its_output_even_when_it_passes():
    hooks = yaml.safe_load((REPO_ROOT / ".pre-commit-hooks.yaml").read_text(encoding="utf-8"))
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    local_hook = readme[readme.index("- repo: local"):]

    assert [hook.get("verbose") for hook in hooks] == [True]
    assert "verbose: true" in local_hook[: local_hook.index("```")]
