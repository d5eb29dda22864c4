"""`train rollout`: the agent over a synth dataset's tasks against a policy endpoint, one judge per device at once.

Each task becomes a problem file and a workspace under the output folder and runs through `kernelpilot.optimize`
exactly as `kernelpilot optimize` would (a vLLM server of the checkpoint is `--model openai/<name> --api-base URL`).
The transcript in each workspace holds every turn with its judge results and rewards; `rollouts.jsonl` lists one
line per task. A task whose workspace already holds a finished session is skipped, so a rerun resumes.

The judges must be confined by Landlock, since these rewards train a policy: without Landlock nothing starts, and
a sandbox that says it is not confined ends the rollouts (UnconfinedJudgeError), unless `allow_unconfined`.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kernelpilot.config import Settings

ROLLOUTS_FILE = "rollouts.jsonl"


@dataclass
class Rollout:
    """One task's episode: where its transcript is, how it ended, and the judge's best reward in it."""

    task_id: str
    workspace: str
    session: str | None
    status: str
    reward: int
    turns: int
    skipped: bool = False


def run_rollouts(
    tasks_path: Path,
    out_dir: Path,
    settings: Settings,
    devices: Sequence[str],
    on_rollout: Callable[[Rollout], None] | None = None,
    *,
    allow_unconfined: bool = False,
) -> list[Rollout]:
    """Run the agent on every task, `len(devices)` at a time (each on its own device); returns them in task order.

    An error that ends one episode (UnconfinedJudgeError, no GPU, ...) stops the others from starting a new task
    and is raised once the episodes under way have ended; the rollouts finished so far are in `rollouts.jsonl`.
    """
    from kernelpilot.harness.judge import require_landlock
    from kernelpilot.train.synth_dataset import read_tasks

    if not allow_unconfined:
        require_landlock()  # before the tasks are read or any episode starts
    tasks = read_tasks(tasks_path)
    out_dir = Path(out_dir)
    (out_dir / "tasks").mkdir(parents=True, exist_ok=True)
    pending: queue.Queue = queue.Queue()
    for index, task in enumerate(tasks):
        problem = out_dir / "tasks" / f"{task.task_id}.py"
        problem.write_text(task.code, encoding="utf-8")
        pending.put((index, task.task_id, problem))
    results: list[Rollout | None] = [None] * len(tasks)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(device: str) -> None:
        while not errors:
            try:
                index, task_id, problem = pending.get_nowait()
            except queue.Empty:
                return
            try:
                rollout = rollout_task(task_id, problem, out_dir / "workspaces" / task_id,
                                       dataclasses.replace(settings, device=device), allow_unconfined=allow_unconfined)  # fmt: skip
            except BaseException as err:  # noqa: BLE001 - raised in the caller's thread, after the others stop
                with lock:
                    errors.append(err)
                return
            with lock:
                results[index] = rollout
                _append_line(out_dir / ROLLOUTS_FILE, rollout)
                if on_rollout is not None:
                    on_rollout(rollout)

    threads = [threading.Thread(target=worker, args=(device,), name=f"kp-rollout-{device}") for device in devices]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [rollout for rollout in results if rollout is not None]


def rollout_task(task_id: str, problem: Path, workspace: Path, settings: Settings, *,
                 allow_unconfined: bool = False) -> Rollout:  # fmt: skip
    """One episode of the agent on one task, or the record of the finished one already in `workspace`; its judge
    must be confined unless `allow_unconfined`."""
    from kernelpilot.agent.session import SESSIONS_DIR
    from kernelpilot.optimize import optimize

    finished = finished_session(workspace)
    if finished is not None:
        return dataclasses.replace(finished, task_id=task_id, skipped=True)
    # The best candidate stays in the workspace: output inside it means nothing is copied elsewhere.
    run_settings = dataclasses.replace(settings, workspace=workspace, output=workspace / "model_new.py")
    result = optimize(problem, run_settings, allow_unconfined=allow_unconfined)
    best = result.summary.best
    session = workspace / SESSIONS_DIR / f"{result.summary.session_id}.jsonl"
    return Rollout(
        task_id,
        str(workspace),
        str(session),
        result.summary.status,
        best.reward if best is not None else -1,
        result.summary.turns,
    )


def finished_session(workspace: Path) -> Rollout | None:
    """The newest session of `workspace` that ran to an end, as a rollout record; None when there is none. A
    session an error broke off (status "error": the judge refused an unconfined sandbox, no GPU, ...) did not run
    to an end: a rerun runs the task again."""
    from kernelpilot.agent.session import list_sessions

    if not Path(workspace).is_dir():  # not started yet
        return None
    ended = [info for info in list_sessions(workspace) if info.status not in ("unfinished", "error")]
    if not ended:
        return None
    info = ended[-1]
    return Rollout(
        "", str(workspace), str(info.path), info.status, info.reward if info.reward is not None else -1, info.turns
    )


def _append_line(path: Path, rollout: Rollout) -> None:
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(dataclasses.asdict(rollout)) + "\n")
