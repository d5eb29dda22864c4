"""UNTRUSTED side: the kernels a candidate's forward launches, traced for the candidate sandbox's whole life.

A profiler started only for one "profiled" call can be seen by the candidate (`torch.autograd.profiler` says when
one is on), so a candidate could compute honestly in that call and with torch's kernels everywhere else (with the
dispatch modes popped, the op recorder sees nothing either). Here one profiler session is on from before the
candidate is imported until the sandbox ends: every forward runs with a profiler on, checked, timed or profiled.
Kernel collection is switched on only around the forwards the judge asks to trace (every checked call, the
profiled call, a sample of the timed runs the trusted side picks), so the sandbox's own work (input draws, slot
copies, L2 flushes) is never mistaken for the candidate's and untraced timed runs pay no tracing cost.

Reading the collected kernels ends the session and starts the next one at once, between requests, when no candidate
code runs. What this reports is advice like the rest of the sandbox's reports: a candidate can reach this process's
objects and silence it; the judge's verdict on correctness and time does not rest on it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch

from kernelpilot.results import KernelTime


class KernelTrace:
    """A profiler session that stays on, collecting GPU kernels only inside `collecting()`."""

    def __init__(self, device: torch.device):
        from torch.profiler import ProfilerActivity

        self.device = device
        self._activities = [ProfilerActivity.CUDA]
        try:  # where torch's warning on every switch of collection goes (the sandbox's log would fill with it)
            self._null = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            self._null = None
        self._session: Any = None
        self._names: list[str] = []  # kernels collected so far and not yet taken
        self._start()

    def _start(self) -> None:
        from torch.profiler import profile

        self._session = profile(activities=self._activities)
        self._session.__enter__()
        self._switch(False)

    @contextmanager
    def collecting(self) -> Iterator[None]:
        """Collect the kernels launched inside the block (on every stream; the device is synchronised at its end)."""
        self._switch(True)
        try:
            yield
        finally:
            torch.cuda.synchronize(self.device)
            self._switch(False)

    def take_names(self, *, read: bool = True) -> list[str]:
        """Every kernel name collected and not yet taken, in start order. `read=False` takes only what an earlier
        stop read (right after `paused`), sparing the session's restart."""
        if read:
            self._stop()
            self._start()
        names, self._names = self._names, []
        return names

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No session of this trace inside the block, so a profiler of its own can run there (the profiled call,
        the bench's kernel breakdown); what was collected before is kept for the next `take_names`."""
        self._stop()
        try:
            yield
        finally:
            self._start()

    def close(self) -> None:
        """End the session (a sandbox never does: its session ends with it)."""
        self._stop()

    def _stop(self) -> None:
        # Collection back on before the session ends: kineto reads the kernels collected earlier only from a session
        # that stops collecting (seen on torch 2.11: a session stopped while toggled off reported none).
        # Nothing is launched in between: this runs in the sandbox's request handling, the device synchronised.
        self._switch(True)
        session, self._session = self._session, None
        session.__exit__(None, None, None)
        on_gpu = torch.autograd.DeviceType.CUDA
        kernels = [e for e in session.profiler.kineto_results.events() if e.device_type() == on_gpu and is_kernel_event(e)]
        self._names.extend(e.name() for e in sorted(kernels, key=lambda e: e.start_ns()))

    def _switch(self, on: bool) -> None:
        """Collection on or off, without torch's warning that toggling GPU activity alone may mis-correlate CPU and
        GPU events (this trace reads no CPU events)."""
        if self._null is None:
            self._session.toggle_collection_dynamic(on, self._activities)
            return
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(self._null, 2)
            self._session.toggle_collection_dynamic(on, self._activities)
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def is_kernel_event(event: Any) -> bool:
    """A GPU kernel, not a copy, a memset or the GPU side of a `record_function` range."""
    return not event.name().startswith(("Memcpy", "Memset", "[memory]", "kernelpilot::"))


# The most kernels a profile reports, longest first.
TOP_KERNELS = 10


def profile_kernels(model: Callable[..., Any], inputs: list, *, device: str, top: int = TOP_KERNELS) -> list[KernelTime]:
    """The kernels of one call, longest first: GPU kernels on CUDA, operators by self time on the CPU."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        model(*inputs)
        if on_cuda:
            torch.cuda.synchronize()
    wanted = DeviceType.CUDA if on_cuda else DeviceType.CPU
    rows = [row for row in prof.key_averages() if row.device_type == wanted]

    def micros(row) -> float:
        return row.device_time_total if on_cuda else row.self_cpu_time_total

    rows.sort(key=micros, reverse=True)
    return [KernelTime(name=row.key, total_ms=micros(row) / 1e3, calls=row.count) for row in rows[:top]]
