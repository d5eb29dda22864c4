"""The agentic RL environment (per-trajectory workspaces) and the verl configuration, checked against verl's schema
where verl is installed (its package is found without importing it: importing verl needs Ray)."""

import importlib.util
from pathlib import Path

import pytest
import yaml

from kernelpilot.agent.tool_results import ToolError
from kernelpilot.train.agent_env import TrajectoryWorkspaces
from kernelpilot.train.rl import compute_score
from kernelpilot.train.synth import SynthReport
from kernelpilot.train.synth_dataset import write_dataset
from kernelpilot.train.tasks import Task
from kernelpilot.train.verl_config import (
    TOOL_CLASS,
    VerlSettings,
    tool_names,
    write_verl_config,
)
from kp_testing import nonempty

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TASK = (EXAMPLES / "rmsnorm.py").read_text()


def no_judge():
    raise AssertionError("editing tools must not start a judge")


def test_each_trajectory_edits_its_own_workspace(tmp_path):
    envs = TrajectoryWorkspaces(no_judge, root=tmp_path)
    envs.run("a", TASK, "Write", {"path": "kernels/a.cu", "content": "// a\n"})
    assert "// a" in envs.run("a", TASK, "Read", {"path": "kernels/a.cu"}).text
    assert isinstance(envs.run("b", TASK, "Read", {"path": "kernels/a.cu"}).result, ToolError)
    assert isinstance(envs.run("b", TASK, "Nope", {}).result, ToolError)
    assert envs.best_reward("a") == -1  # nothing judged yet
    folders = list(tmp_path.iterdir())
    envs.release("a")
    assert len(list(tmp_path.iterdir())) == len(folders) - 1


def test_multi_turn_reward_is_the_tools_last_verdict():
    assert compute_score("kernelpilot-synth", "anything", TASK, {"tool_rewards": [-1.0, 1.0, 2.0]}) == 2.0


@pytest.fixture
def tasks(tmp_path):
    write_dataset(
        SynthReport(1, [Task("t0", TASK, ["nn.RMSNorm"], "rows", {})], {}, [], {}, 0.0), tmp_path / "tasks", settings={}
    )
    return tmp_path / "tasks"


def test_multi_turn_config_names_our_tools_and_passes_the_task_to_them(tasks, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (pip install 'kernelpilot[train]')")
    paths = write_verl_config(VerlSettings(model="m", tasks=tasks, output_dir=tmp_path / "verl", multi_turn=True))
    config = yaml.safe_load(paths["config"].read_text())
    assert config["actor_rollout_ref"]["rollout"]["multi_turn"]["tool_config_path"] == str(paths["tools"])
    tools = yaml.safe_load(paths["tools"].read_text())["tools"]
    assert [tool["tool_schema"]["function"]["name"] for tool in tools] == tool_names()
    assert {tool["class_name"] for tool in tools} == {TOOL_CLASS}
    [row] = pq.read_table(paths["data"]).to_pylist()
    assert row["agent_name"] == "tool_agent"
    assert row["extra_info"]["tools_kwargs"]["Compile"]["create_kwargs"]["task_code"] == TASK


def _leaf_paths(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaf_paths(value, (*prefix, key))
        else:
            yield (*prefix, key)


def _verl_package() -> Path:
    spec = importlib.util.find_spec("verl")
    if spec is None:
        pytest.skip("verl is not installed (pip install verl)")
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.mark.parametrize("multi_turn", [False, True])
def test_every_key_we_set_exists_in_verls_trainer_config(tasks, tmp_path, multi_turn):
    pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install 'kernelpilot[train]')")
    schema = yaml.safe_load((_verl_package() / "trainer" / "config" / "_generated_ppo_trainer.yaml").read_text())
    settings = VerlSettings(
        model="m", tasks=tasks, output_dir=tmp_path / "verl", multi_turn=multi_turn, algorithm="gae"
    )
    config = yaml.safe_load(write_verl_config(settings)["config"].read_text())
    for path in nonempty(_leaf_paths(config), "keys we set"):
        node = schema
        for key in path:
            assert isinstance(node, dict) and key in node, f"verl has no config key {'.'.join(path)}"
            node = node[key]
