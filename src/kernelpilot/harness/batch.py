"""Judging many workspaces at once: work spread over devices, one worker thread per device, results in order.

`kernelpilot eval DIR` on a folder of workspaces and `kernelpilot suite` both go through `spread`: each lane (a
device) gets a thread that pulls the next item from a shared queue, so a slow item never holds up the others.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from kernelpilot.errors import WorkspaceError
from kernelpilot.results import EvalResult

if TYPE_CHECKING:
    from rich.console import Console

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
        thread.join()
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


@contextmanager
def eval_progress(console: Console, total: int, enabled: bool = True) -> Iterator[Callable[[Path, EvalResult], None] | None]:
    """A progress bar over `total` workspaces; yields the per-workspace callback that advances it."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("judging"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("", total=total)
        lock = threading.Lock()  # lanes finish concurrently

        def advance(workspace: Path, result: EvalResult) -> None:
            with lock:
                progress.update(task, advance=1, description=f"last: {workspace.name} (reward {result.reward})")

        yield advance


def render_batch(console: Console, folder: Path, results: Sequence[EvalResult]) -> None:
    """One row per workspace: correct, candidate time, speedups and reward; the errors underneath."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"kernelpilot eval · {folder}", title_justify="left")
    for column in ("workspace", "correct", "candidate ms", "vs eager", "vs compile", "reward"):
        table.add_column(column, justify="left" if column == "workspace" else "right")
    for result in results:
        bench = result.bench if result.bench is not None and result.bench.ok else None
        correct = result.verify is not None and result.verify.ok
        table.add_row(
            escape(_relative(folder, result.workspace)),
            "[green]yes[/]" if correct else "[red]no[/]",
            f"{bench.candidate.median_ms:.4g}" if bench is not None and bench.candidate is not None else "–",
            _ratio(bench.speedup_vs_eager if bench is not None else None),
            _ratio(bench.speedup_vs_compile if bench is not None else None),
            str(result.reward),
        )
    console.print(table)
    for result in results:
        if result.error_kind:
            line = f"{_relative(folder, result.workspace)}: {result.error_kind}: {_first_line(result.message)}"
            console.print(f"[red]{escape(line)}[/]", highlight=False, soft_wrap=True)


def _relative(folder: Path, workspace: str) -> str:
    try:
        return str(Path(workspace).relative_to(folder.resolve()))
    except ValueError:
        return workspace


def _ratio(speedup: float | None) -> str:
    return "–" if speedup is None else f"{speedup:.2f}x"


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else ""

