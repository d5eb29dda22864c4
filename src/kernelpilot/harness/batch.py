"""Judging many workspaces at once: work spread over devices, one worker thread per device, results in order.

`kernelpilot eval DIR` on a folder of workspaces and `kernelpilot suite` both go through `spread`: each lane (a
device) gets a thread that pulls the next item from a shared queue, so a slow item never holds up the others.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from kernelpilot.errors import WorkspaceError
from kernelpilot.results import EvalResult

if TYPE_CHECKING:
    from kernelpilot.harness.judge import Judge

Item = TypeVar("Item")
Lane = TypeVar("Lane")
Result = TypeVar("Result")


def spread(
    items: Sequence[Item],
    lanes: Sequence[Lane],
    run: Callable[[Lane, Item], Result],
    on_done: Callable[[Item, Result], None] | None = None,
) -> list[Result]:
    """`run(lane, item)` for every item, one thread per lane taking the next item; results in the items' order.

    With one lane everything runs in the calling thread, so Ctrl-C reaches the work itself. The first exception
    a lane raises stops the other lanes from taking new items and is raised here once they have finished.
    """
    if len(lanes) <= 1 or len(items) <= 1:
        return [_ran(run, lanes[0], item, on_done) for item in items]
    pending: queue.SimpleQueue[tuple[int, Item]] = queue.SimpleQueue()
    for index, item in enumerate(items):
        pending.put((index, item))
    results: list[Result | None] = [None] * len(items)
    failures: list[BaseException] = []

    def work(lane: Lane) -> None:
        while not failures:
            try:
                index, item = pending.get_nowait()
            except queue.Empty:
                return
            try:
                results[index] = _ran(run, lane, item, on_done)
            except BaseException as err:  # noqa: BLE001 - handed to the calling thread, which raises it
                failures.append(err)

    # Daemon threads: Ctrl-C ends the process instead of waiting for every lane's item to finish.
    threads = [threading.Thread(target=work, args=(lane,), daemon=True, name=f"lane-{i}") for i, lane in enumerate(lanes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            # Timed waits: a pending Ctrl-C is raised here within a tenth of a second, whether or not the
            # signal interrupted the wait itself (a test under load saw the main thread wait out the lanes).
            thread.join(timeout=0.1)
    if failures:
        raise failures[0]
    return results  # type: ignore[return-value] - every slot is filled when no lane failed


def _ran(run: Callable[[Lane, Item], Result], lane: Lane, item: Item, on_done: Callable[[Item, Result], None] | None) -> Result:
    result = run(lane, item)
    if on_done is not None:
        on_done(item, result)
    return result


def lane_devices(device: str | None, workers: int | None = None) -> list[str]:
    """The device of each parallel worker: by default one per visible GPU; `workers` of them on cpu or on cuda:N."""
    if device is not None and device != "cuda":
        return [device] * (workers or 1)
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        return ["cuda"]  # the judge refuses it in one sentence
    return [f"cuda:{index % count}" for index in range(workers or count)]


def find_workspaces(folder: Path) -> list[Path]:
    """The workspaces (folders made by `kernelpilot init`) under `folder`, sorted."""
    from kernelpilot.workspace import MANIFEST_PATH

    workspaces = sorted(manifest.parent.parent for manifest in folder.rglob(MANIFEST_PATH))
    if not workspaces:
        raise WorkspaceError(
            f"{folder} is not a workspace and holds none.",
            hint="Pass a folder made by `kernelpilot init PROBLEM.py`, or a folder of such folders.",
        )
    return workspaces


def is_folder_of_workspaces(target: Path) -> bool:
    """Whether `kernelpilot eval TARGET` means every workspace under TARGET rather than TARGET itself."""
    from kernelpilot.workspace import MANIFEST_PATH

    return target.is_dir() and not (target / MANIFEST_PATH).is_file()


def evaluate_workspaces(
    workspaces: Sequence[Path],
    devices: Sequence[str],
    *,
    trials: int = 5,
    atol: float = 1e-2,
    rtol: float = 1e-2,
    bench: bool = True,
    on_done: Callable[[Path, EvalResult], None] | None = None,
) -> list[EvalResult]:
    """Judge each workspace with one Judge per device (opened by its lane, so they start in parallel)."""
    from kernelpilot.harness.judge import Judge

    judges: dict[int, Judge] = {}  # by lane; each lane touches only its own entry

    def judge_one(lane: int, workspace: Path) -> EvalResult:
        if lane not in judges:
            judges[lane] = Judge(devices[lane])
        try:
            return judges[lane].evaluate(workspace, trials=trials, atol=atol, rtol=rtol, bench=bench)
        except WorkspaceError as err:  # this workspace is broken; the others can still be judged
            return EvalResult(problem_id="", workspace=str(workspace), error_kind="workspace", message=err.message)

    try:
        return spread(list(workspaces), range(len(devices)), judge_one, on_done)
    finally:
        for judge in judges.values():
            judge.close()
