"""Synthesis filters in worker processes: one per device, each task with a timeout, a hang or crash drops only it.

A synthesised task is untrusted code (a pathological composition can hang a kernel or abort the process), so
`check_task` runs in a long-lived spawned process per device that keeps torch imported. A task that outlives its
timeout gets the worker killed and reported as `timeout`; a worker that dies reports `crash`; either way the next
task starts a fresh worker.
"""

from __future__ import annotations

import importlib
import multiprocessing
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from kernelpilot.train.filters import Verdict, check_task


# Seconds a fresh worker may take to start (spawn, import torch) before its first task's own timeout begins.
STARTUP_TIMEOUT_S = 180.0
_READY = "ready"


def _serve(connection: Any, device: str, options: dict[str, Any]) -> None:
    importlib.import_module("torch")  # before the worker says it is ready: a task's timeout covers only the task

    connection.send(_READY)
    while True:
        code = connection.recv()
        if code is None:
            return
        connection.send(asdict(check_task(code, device=device, **options)))


class FilterWorker:
    """One device's filter process; `check` returns the task's verdict, or a timeout/crash verdict."""

    def __init__(self, device: str, options: dict[str, Any], timeout_s: float):
        self.device, self.options, self.timeout_s = device, options, timeout_s
        self._process: Any = None
        self._connection: Any = None

    def check(self, code: str) -> Verdict:
        try:
            self._ensure_started()
        except (EOFError, ConnectionError, OSError, TimeoutError) as err:
            self._kill()
            return Verdict(False, "crash", f"the filter process did not start ({err or type(err).__name__})")
        self._connection.send(code)
        try:
            if not self._connection.poll(self.timeout_s):
                self._kill()
                return Verdict(False, "timeout", f"no verdict within {self.timeout_s:g} s")
            return Verdict(**self._connection.recv())
        except (EOFError, ConnectionError, OSError):
            self._process.join(timeout=5)  # the pipe closes before the process is reaped
            exit_code = self._process.exitcode
            self._kill()
            return Verdict(False, "crash", f"the filter process died (exit code {exit_code})")

    def close(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._connection.send(None)
            self._process.join(timeout=10)
        self._kill()

    def _ensure_started(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        context = multiprocessing.get_context("spawn")  # a forked CUDA context is unusable
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, self.device, self.options), daemon=True)
        self._process.start()
        child.close()
        if not self._connection.poll(STARTUP_TIMEOUT_S):
            raise TimeoutError(f"no sign of life within {STARTUP_TIMEOUT_S:g} s")
        if self._connection.recv() != _READY:
            raise ConnectionError("its first message was not the ready signal")

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
        self._process = None


def check_tasks(
    codes: Iterable[str],
    devices: Sequence[str],
    options: dict[str, Any],
    timeout_s: float,
    on_verdict: Callable[[int, Verdict], None] | None = None,
) -> list[Verdict]:
    """The verdicts of `codes`, in order, checked on all `devices` at once (one worker process each)."""
    codes = list(codes)
    free = [FilterWorker(device, options, timeout_s) for device in devices]
    verdicts: list[Verdict | None] = [None] * len(codes)

    def check(index: int) -> None:
        worker = free.pop()  # a thread's worker comes back before the thread takes the next task
        try:
            verdicts[index] = worker.check(codes[index])
        finally:
            free.append(worker)
        if on_verdict is not None:
            on_verdict(index, verdicts[index])

    workers = list(free)
    try:
        with ThreadPoolExecutor(max_workers=len(devices)) as pool:
            list(pool.map(check, range(len(codes))))
    finally:
        for worker in workers:
            worker.close()
    return [verdict for verdict in verdicts if verdict is not None]
