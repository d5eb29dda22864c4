"""Training refuses a judge whose sandboxes Landlock does not confine: a policy rewarded by a judge that candidates
can write out of learns to exploit it. Without Landlock, `train rollout`, `train ppo` and `train run` (with a judged
stage to run) stop with one sentence and a hint before any work, unless `--allow-unconfined`; a sandbox that later
says it is not confined ends the rollouts and the GRPO rewards (the judge's own refusal: tests/harness/
test_confinement.py); a verl config carries the flag to its nodes' judges.

"No Landlock" is this process's `confine.landlock_available` answering False; the refusal comes before a task is
read, a worker starts or a model loads, so the commands' later errors (a missing dataset) show that nothing ran.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kernelpilot.cli import app
from kernelpilot.config import Settings
from kernelpilot.errors import UnconfinedJudgeError
from kernelpilot.harness import confine
from kernelpilot.results import EvalResult
from kernelpilot.train import rl, rollout
from kernelpilot.train.pipeline import STAGE_DONE
from kernelpilot.train.synth import SynthReport
from kernelpilot.train.synth_dataset import write_dataset
from kernelpilot.train.tasks import Task

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REFUSAL = "This system offers no Landlock, so the judge's sandboxes cannot be confined"


@pytest.fixture
def no_landlock(monkeypatch):
    monkeypatch.setattr(confine, "landlock_available", lambda: False)


def _rollout(tmp_path: Path, monkeypatch) -> tuple[list[str], str]:
    return ["train", "rollout", str(tmp_path / "tasks"), "--model", "m", "--out", str(tmp_path / "out")], "No task dataset"


def _ppo(tmp_path: Path, monkeypatch) -> tuple[list[str], str]:
    real = rl.run_grpo

    def run_grpo(settings, **kwargs):
        if not settings.allow_unconfined:
            return real(settings, **kwargs)  # which refuses first
        print("GRPO starts, its judges allowed to run unconfined")  # (not TRL, a policy and judges: not under test)
        return []

    monkeypatch.setattr(rl, "run_grpo", run_grpo)
    return ["train", "ppo", str(tmp_path / "tasks"), "--model", "m", "--out", str(tmp_path / "out")], "GRPO starts"


def _run(tmp_path: Path, monkeypatch) -> tuple[list[str], str]:
    (tmp_path / "train.toml").write_text(f'run_dir = "{tmp_path / "out"}"\nmodel = "m"\n\n[rollout]\nmodel = "m"\n')
    return ["train", "run", "--config", str(tmp_path / "train.toml")], "No task dataset"


@pytest.mark.parametrize("command", [_rollout, _ppo, _run], ids=["rollout", "ppo", "run"])
def test_without_landlock_the_judged_train_commands_refuse_before_any_work_unless_allowed(tmp_path, monkeypatch,
                                                                                          no_landlock, command):  # fmt: skip
    args, next_step = command(tmp_path, monkeypatch)
    runner = CliRunner()

    refused = runner.invoke(app, args)
    assert refused.exit_code == 2, refused.output
    assert f"error: {REFUSAL}" in refused.stderr and "hint: " in refused.stderr and "--allow-unconfined" in refused.stderr
    assert next_step not in refused.output and not (tmp_path / "out").exists(), "work started before the refusal"

    allowed = runner.invoke(app, [*args, "--allow-unconfined"])
    assert REFUSAL not in allowed.output and next_step in allowed.output, allowed.output


def test_a_judged_stage_already_done_needs_no_landlock(tmp_path, no_landlock):
    from kernelpilot.train.pipeline import STAGES, run_pipeline

    (tmp_path / "run" / "rollout").mkdir(parents=True)
    (tmp_path / "run" / "rollout" / STAGE_DONE).write_text('{"model": "m"}')
    [outcome] = run_pipeline({"run_dir": "run", "model": "m", "rollout": {}}, STAGES, base_dir=tmp_path)
    assert outcome.skipped


def test_a_sandbox_that_reports_itself_unconfined_ends_the_rollouts_before_the_next_task(tmp_path, monkeypatch):
    tasks = [Task(name, (EXAMPLES / f"{name}.py").read_text(), [], "rows", {}) for name in ("rmsnorm", "row_mean")]
    write_dataset(SynthReport(2, tasks, {}, [], {}, 0.0), tmp_path / "tasks", settings={})
    started = []

    def episode(task_id, problem, workspace, settings, *, allow_unconfined):
        started.append((task_id, allow_unconfined))
        raise UnconfinedJudgeError("A sandbox of the judge reported that Landlock does not confine it.")

    monkeypatch.setattr(rollout, "rollout_task", episode)
    with pytest.raises(UnconfinedJudgeError, match="does not confine it"):
        rollout.run_rollouts(tmp_path / "tasks", tmp_path / "out", Settings(model="m"), devices=["cpu"])
    assert started == [("rmsnorm", False)], "the next task started, or the episode's judge was allowed unconfined"
    assert not (tmp_path / "out" / rollout.ROLLOUTS_FILE).exists()


def test_an_episode_the_judge_broke_off_is_run_again_by_the_next_rollouts(tmp_path):
    from kernelpilot.agent.session import Session

    for status in ("error", "finished"):  # "error": what run_agent writes when UnconfinedJudgeError ends the run
        Session.create(tmp_path / status, problem="task.py", model="m").append_vouched("end", status=status, summary=None)
    assert rollout.finished_session(tmp_path / "error") is None
    assert rollout.finished_session(tmp_path / "finished").status == "finished"


def test_grpo_rewards_come_from_judges_that_must_be_confined(tmp_path, monkeypatch, no_landlock):
    from kernelpilot.train import rft

    def engine(*names):
        raise AssertionError("the training engine was loaded before the refusal")

    monkeypatch.setattr(rft, "require_training_engine", engine)
    with pytest.raises(UnconfinedJudgeError, match="offers no Landlock"):
        rl.run_grpo(rl.GrpoSettings(model="m", tasks=tmp_path / "tasks", output_dir=tmp_path / "out"))
    with pytest.raises(UnconfinedJudgeError, match="offers no Landlock"):
        rl.judge_evaluator("cpu")
    with pytest.raises(UnconfinedJudgeError, match="offers no Landlock"):  # verl's reward function, on a node
        rl.compute_score("kernelpilot-synth", "no files", "task source")
    rl.judge_evaluator("cpu", allow_unconfined=True)  # (a CPU judge starts its worker when first asked to judge)

    def unconfined_evaluate(device):
        def evaluate(ws_root) -> EvalResult:
            raise UnconfinedJudgeError("A sandbox of the judge reported that Landlock does not confine it.")

        return evaluate

    reward = rl.HarnessReward(unconfined_evaluate, ["cpu"])
    completion = "### model_new.py\n```python\nfrom model import Model as ModelNew\n```\n"
    with pytest.raises(UnconfinedJudgeError):  # the reward TRL asked for is not a number: training stops
        reward(prompts=[None], completions=[completion], task_code=[(EXAMPLES / "rmsnorm.py").read_text()])
    reward.close()


def test_a_verl_config_tells_its_nodes_judges_whether_they_may_run_unconfined(tmp_path):
    from kernelpilot.train.verl_config import VerlSettings, tool_config, trainer_config

    for allowed in (False, True):
        settings = VerlSettings(model="m", tasks=tmp_path, output_dir=tmp_path, allow_unconfined=allowed)
        config = trainer_config(settings, tmp_path / "train.parquet", tmp_path / "tools.yaml")
        assert config["custom_reward_function"]["reward_kwargs"] == {"allow_unconfined": allowed}
        assert {tool["config"]["allow_unconfined"] for tool in tool_config(allowed)["tools"]} == {allowed}
