"""The RL warm-up's reward plumbing: completions parsed into candidate files, judged, and fed to TRL's GRPOTrainer."""

import threading
import time
from pathlib import Path

import pytest

from kernelpilot.results import EvalResult, VerifyResult
from kernelpilot.train.rl import (
    GrpoSettings,
    HarnessReward,
    judge_completion,
    parse_completion,
    run_grpo,
)
from kernelpilot.train.synth import SynthReport
from kernelpilot.train.synth_dataset import write_dataset
from kernelpilot.train.tasks import Task

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TASK = (EXAMPLES / "silu_scale_shift.py").read_text()


def completion(model_new: str, extra: str = "") -> str:
    return f"Here is my kernel.\n\n### model_new.py\n```python\n{model_new}\n```\n{extra}"


TORCH_COPY = """import torch
from model import Model as ModelNew
"""
OFF_BY_ONE = """import torch
from model import Model


class ModelNew(Model):
    def forward(self, *args):
        return super().forward(*args) + 1.0
"""


def test_parse_completion_keeps_only_candidate_files():
    text = completion(
        TORCH_COPY,
        "### kernels/silu.cu\n```cuda\n__global__ void k() {}\n```\n"
        "### setup.py\n```python\nimport os\n```\n### ../evil.cu\n```cuda\nx\n```\n",
    )
    assert set(parse_completion(text)) == {"model_new.py", "kernels/silu.cu"}


SMALL_TASK = TASK.replace("ROWS = 16384", "ROWS = 64").replace("COLUMNS = 16384", "COLUMNS = 128")


@pytest.mark.cuda_build
def test_the_real_judge_rewards_a_torch_copy_with_minus_one(tmp_path):
    # Through the real CPU judge (one g++ build of the protected kp_module.cpp): a completion that just reuses the
    # reference's torch ops is caught by the verifier's torch-compute guard, so its reward is -1, not 1.
    from kernelpilot.harness.judge import Judge

    results = []
    with Judge("cpu", arch="9.0") as judge:

        def evaluate(root):
            results.append(judge.evaluate(root, trials=1, bench=False))
            return results[-1]

        assert judge_completion(SMALL_TASK, completion(TORCH_COPY), evaluate) == -1.0
    assert results[0].build.ok and results[0].error_kind == "guard"


def test_harness_reward_spreads_completions_over_devices_and_keeps_their_order():
    busy, peak, lock = set(), [0], threading.Lock()
    # Each device's first completion waits for the other's: the barrier breaks (and the test fails) if completions are
    # judged one at a time. (Timing alone cannot show it: each completion first makes a workspace, which takes a
    # varying while on a busy machine.)
    both_devices_busy, first_calls = threading.Barrier(2, timeout=60), set()

    def make_evaluate(device):
        def evaluate(ws_root):
            with lock:
                assert device not in busy  # one completion per device at a time
                busy.add(device)
                peak[0] = max(peak[0], len(busy))
                first = device not in first_calls
                first_calls.add(device)
            if first:
                both_devices_busy.wait()
            time.sleep(0.05)
            with lock:
                busy.discard(device)
            correct = "+ 1.0" not in (Path(ws_root) / "model_new.py").read_text()
            return EvalResult("p", str(ws_root), verify=VerifyResult(ok=correct), reward=1 if correct else -1)

        return evaluate

    reward = HarnessReward(make_evaluate, ["cuda:0", "cuda:1"])
    texts = [completion(TORCH_COPY), completion(OFF_BY_ONE), "no files", completion(TORCH_COPY)]
    assert reward(prompts=[None] * 4, completions=texts, task_code=[TASK] * 4) == [1.0, -1.0, -1.0, 1.0]
    assert peak[0] == 2
    reward.close()


def test_a_verifier_failure_scores_minus_one_and_is_logged_as_one(caplog):
    message = "kernelpilot's verifier failed, not the candidate: KeyError: 'out'"

    def evaluate(ws_root):
        verify = VerifyResult(ok=False, error_kind="harness", message=message)
        return EvalResult("p", str(ws_root), verify=verify, error_kind="harness", message=message)

    with caplog.at_level("WARNING", logger="kernelpilot.train.rl"):
        assert judge_completion(TASK, completion(TORCH_COPY), evaluate) == -1.0
    assert [record.getMessage() for record in caplog.records] == [
        f"the verifier failed on a completion, scored -1 though it was not judged: {message}"
    ]


def test_a_tiny_grpo_run_reads_tasks_and_logs_rewards(tmp_path, monkeypatch):
    pytest.importorskip("trl", reason="trl is not installed (pip install 'kernelpilot[train]')")
    from train_testing import tiny_model_and_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = [Task(f"t{i}", TASK, ["nn.SiLU"], "rows", {}) for i in range(2)]
    write_dataset(SynthReport(2, tasks, {}, [], {}, 0.0), tmp_path / "tasks", settings={})
    model, tokenizer = tiny_model_and_tokenizer()
    calls = []

    def reward(prompts, completions, task_code, **_):
        calls.append(len(completions))
        return [float(len(text) % 3) for text in completions]  # varied, so the advantages are not all zero

    settings = GrpoSettings(
        model="tiny",
        tasks=tmp_path / "tasks",
        output_dir=tmp_path / "out",
        max_steps=2,
        num_generations=2,
        batch_size=2,
        max_completion_length=8,
    )
    history = run_grpo(settings, reward=reward, tokenizer=tokenizer, model=model)
    assert calls and all(n == 2 for n in calls)
    assert any("reward" in entry for entry in history)
