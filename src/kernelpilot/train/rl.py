"""RL warm-up: single-turn GRPO on TRL, rewarded by the harness; and the reward function verl calls on a cluster.

A prompt is a task (a problem's source) and the instructions to answer with the candidate's files in a fenced
format; a completion is parsed into those files, written into a fresh workspace of the task and judged. The reward
is the harness milestone reward (-1 broken or wrong, 1 correct, 2 beats eager, 3 beats eager and compile), computed
by `Judge` worker processes, each step with its own timeout, one judge per device, several completions at once. A
completion the verifier failed on (kernelpilot's bug, error kind "harness") scores -1 too, since nothing was
verified, and is logged as a warning so that the failure does not pass for a wrong kernel.

The judges must be confined by Landlock: a policy rewarded by a judge whose sandboxes a candidate can write out of
learns to exploit that. Without Landlock nothing is judged (UnconfinedJudgeError, before any model is loaded), nor
once a sandbox says it is not confined, unless `allow_unconfined` is set (`--allow-unconfined`).
"""

from __future__ import annotations

import logging
import re
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from kernelpilot.results import HARNESS_ERROR, EvalResult

FILE_BLOCK = re.compile(r"^### (?P<path>[\w./-]+)\s*\n```[\w+]*\n(?P<body>.*?)\n```", re.MULTILINE | re.DOTALL)
EDITABLE_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")
UNPARSABLE_REWARD = -1.0
_log = logging.getLogger(__name__)
SYSTEM_PROMPT = """\
You write fast, correct CUDA kernels for PyTorch models. Answer with the complete files of your candidate, each as
a level-3 heading with its path followed by one fenced block: `### model_new.py` (class ModelNew with the same
constructor and outputs as Model, calling your kernels as torch ops: `kp_ops.<op>(...)` with
`kp_ops = workspace_ops(__file__)` from kernelpilot.ops) and `### kernels/<name>.cu` for each kernel source. Nothing
else is read."""


AGENT_SYSTEM_PROMPT = (
    "You write fast, correct CUDA kernels for PyTorch models, working in a task workspace through tools."
)


def warmup_prompt(task_code: str) -> list[dict[str, str]]:
    """The chat prompt of a single-turn warm-up episode for a task."""
    user = f"Write a faster ModelNew for this problem.\n\n```python\n{task_code}\n```"
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def agentic_prompt(task_code: str) -> list[dict[str, str]]:
    """The chat prompt of a multi-turn episode: the task; the tools (given by the engine) do the rest."""
    user = (
        f"Make this PyTorch problem faster with CUDA kernels in the workspace: write kernels/ and model_new.py, "
        f"Compile, Verify, then Profile to be judged; Finish when done.\n\n```python\n{task_code}\n```"
    )
    return [{"role": "system", "content": AGENT_SYSTEM_PROMPT}, {"role": "user", "content": user}]


def parse_completion(text: str) -> dict[str, str]:
    """The candidate files of a completion: model_new.py and kernels/* sources; anything else is ignored."""
    files = {}
    for match in FILE_BLOCK.finditer(text):
        path = match["path"]
        if path == "model_new.py" or (
            path.startswith("kernels/") and path.endswith(EDITABLE_SUFFIXES) and ".." not in path
        ):
            files[path] = match["body"] + "\n"
    return files


def completion_text(completion: Any) -> str:
    """A TRL completion as text: a plain string, or the assistant messages of a conversational completion."""
    if isinstance(completion, str):
        return completion
    return "\n".join(str(message.get("content") or "") for message in completion if isinstance(message, dict))


def judge_completion(task_code: str, completion: str, evaluate: Callable[[Path], EvalResult]) -> float:
    """The milestone reward of one completion: its files in a fresh workspace of the task, judged by `evaluate`."""
    from kernelpilot.agent.session import candidate_files
    from kernelpilot.harness.reward import reward_of
    from kernelpilot.workspace import PROTECTED_FILES, init_workspace

    files = {path: body for path, body in parse_completion(completion).items() if path not in PROTECTED_FILES}
    if "model_new.py" not in files:
        return UNPARSABLE_REWARD
    with tempfile.TemporaryDirectory(prefix="kp-grpo-") as folder:
        problem = Path(folder) / "task.py"
        problem.write_text(task_code, encoding="utf-8")
        ws, _ = init_workspace(problem, Path(folder) / "ws")
        for scaffolded in list(candidate_files(ws.root)):  # the candidate is the completion's files and nothing else
            (ws.root / scaffolded).unlink()
        for relative, body in files.items():
            (ws.root / relative).parent.mkdir(parents=True, exist_ok=True)
            (ws.root / relative).write_text(body, encoding="utf-8")
        result = evaluate(ws.root)
    if result.error_kind == HARNESS_ERROR:
        _log.warning("the verifier failed on a completion, scored -1 though it was not judged: %s", result.message)
    return float(reward_of(result))


class HarnessReward:
    """A TRL reward function: the milestone reward of each completion, judged in parallel by a pool of judges.

    TRL calls it with the prompts, the completions and the dataset's other columns (here `task_code`) as lists.
    `make_evaluate` builds one evaluate callable per device; completions go to whichever device is free.
    """

    __name__ = "harness_reward"  # TRL names logged reward columns after the function

    def __init__(self, make_evaluate: Callable[[str], Callable[[Path], EvalResult]], devices: Sequence[str]):
        self._free: list[Callable[[Path], EvalResult]] = [make_evaluate(device) for device in devices]
        self._lock = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=len(devices), thread_name_prefix="kp-reward")

    def __call__(self, prompts: list, completions: list, task_code: list[str], **_: Any) -> list[float]:
        texts = [completion_text(completion) for completion in completions]
        return list(self._pool.map(self._score, task_code, texts))

    def _score(self, code: str, text: str) -> float:
        with self._lock:
            self._lock.wait_for(lambda: self._free)
            evaluate = self._free.pop()
        try:
            return judge_completion(code, text, evaluate)
        finally:
            with self._lock:
                self._free.append(evaluate)
                self._lock.notify()

    def close(self) -> None:
        self._pool.shutdown()


def judge_evaluator(device: str, trials: int = 3, *, allow_unconfined: bool = False) -> Callable[[Path], EvalResult]:
    """An evaluate callable backed by a `Judge` worker on `device` (its timeouts bound every step) that refuses
    unconfined sandboxes (UnconfinedJudgeError) unless `allow_unconfined`."""
    from kernelpilot.harness.judge import Judge

    judge = Judge(device, allow_unconfined=allow_unconfined)
    return lambda ws_root: judge.evaluate(ws_root, trials=trials)


# ---------------------------------------------------------------------------------------------- verl


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, *,
    allow_unconfined: bool = False,
) -> float:  # fmt: skip
    """verl's custom reward function. `ground_truth` carries the task's source.

    A multi-turn episode was judged by its own tools: verl passes their rewards (the best verdict so far, see
    verl_tools.py) as `extra_info["tool_rewards"]`, and the last is the episode's. A single-turn completion is judged
    here, on this node's GPU, by a judge that must be confined unless `allow_unconfined` (the config's
    `custom_reward_function.reward_kwargs`, which verl passes here).
    """
    tool_rewards = list((extra_info or {}).get("tool_rewards") or [])
    if tool_rewards:
        return float(tool_rewards[-1])
    return judge_completion(ground_truth, solution_str, _node_evaluator(allow_unconfined))


_node_judge: list[Callable[[Path], EvalResult]] = []


def _node_evaluator(allow_unconfined: bool) -> Callable[[Path], EvalResult]:
    # verl calls the reward function many times per process: one warm judge per process, not one per call.
    if not _node_judge:
        _node_judge.append(judge_evaluator("cuda", allow_unconfined=allow_unconfined))
    return _node_judge[0]


# ---------------------------------------------------------------------------------------------- train


@dataclass
class GrpoSettings:
    """What `run_grpo` trains: the policy (local path or hub id), the task dataset, and TRL's main knobs."""

    model: str
    tasks: Path  # a synth dataset folder or its tasks.jsonl
    output_dir: Path
    max_steps: int = 100
    learning_rate: float = 1e-6
    num_generations: int = 4
    batch_size: int = 4
    max_completion_length: int = 4096
    devices: tuple[str, ...] = ("cuda",)
    allow_unconfined: bool = False  # judge where Landlock does not confine the sandboxes (unverified rewards)


def grpo_dataset(tasks_path: Path) -> Any:
    """The warm-up prompts of a synth dataset as a `datasets.Dataset` with columns prompt and task_code."""
    from datasets import Dataset

    from kernelpilot.train.synth_dataset import read_tasks

    tasks = read_tasks(tasks_path)
    return Dataset.from_list([{"prompt": warmup_prompt(task.code), "task_code": task.code} for task in tasks])


def run_grpo(
    settings: GrpoSettings, reward: Callable | None = None, tokenizer: Any = None, model: Any = None
) -> list[dict[str, Any]]:
    """GRPO warm-up with TRL's GRPOTrainer; returns the logged history (rewards, losses). Saves to `output_dir`.

    Rewarded by the judge (no `reward` given), it refuses a system without Landlock first, before anything loads,
    unless `settings.allow_unconfined`."""
    from kernelpilot.train.rft import require_training_engine, trainer_arguments

    if reward is None and not settings.allow_unconfined:
        from kernelpilot.harness.judge import require_landlock

        require_landlock()
    require_training_engine("trl", "datasets", "transformers")
    from trl import GRPOConfig, GRPOTrainer

    reward_fn = reward or HarnessReward(partial(judge_evaluator, allow_unconfined=settings.allow_unconfined),
                                        settings.devices)  # fmt: skip
    config = GRPOConfig(
        **trainer_arguments(settings),
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
    )
    trainer = GRPOTrainer(
        model=model or settings.model,
        reward_funcs=[reward_fn],
        args=config,
        train_dataset=grpo_dataset(settings.tasks),
        processing_class=tokenizer,
    )
    try:
        trainer.train()
    finally:
        if isinstance(reward_fn, HarnessReward):
            reward_fn.close()
    trainer.save_model(str(settings.output_dir))
    return trainer.state.log_history
