"""TRUSTED side: the inputs of timed runs, drawn here and lent to the model's process, with the L2 flushed here.

A timed run's wall time on this side's clock is the only figure of it the model's process cannot change; the
time it reports is checked against that (timing.py). The more of a run's protocol this side does itself, before
it starts its clock, the less the wall time holds besides the model's own work, and the finer that check can be.
So this side draws each run's fresh inputs (`problem.make_inputs(device, seed)`, the same call the reference's
check makes), copies them into tensors it lent the model's process once (`bind`), evicts the L2 by writing a
buffer twice its size, and synchronises its device, all before the run's request is sent. The model's process
then only runs forward on the lent tensors, times it and copies the outputs out. (Before, each process drew its
own inputs and flushed its own L2 inside the run: about 2-3 ms of each run on an H200, whose run-to-run wander
hid a candidate reporting 1/1000 of a 0.3-0.6 ms call.)

Inputs whose layout changes from one seed to the next (another shape, another plain value) are lent anew for that
run, and from then on every run's request carries the description of the tensors lent for it (both processes
timed on them read the right ones).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kernelpilot.harness.shared import SharedArena, share_tree


class TimedInputs:
    """Fresh inputs per run in tensors lent to the model's processes (their `bind` maps them)."""

    def __init__(self, problem: Any, arena: SharedArena, device: torch.device, seed: int):
        self.problem, self.arena, self.device = problem, arena, device
        self.shared, self.description = share_tree(arena, problem.make_inputs(device, seed))
        self.flush = l2_flush_buffer(_index(device)) if device.type == "cuda" else None
        self.varies = False  # the layout changed once: each run names its tensors

    def feed(self, seed: int) -> dict[str, Any]:
        """Write the inputs drawn from `seed` into the lent tensors, flush the L2 and wait for the device; the
        run request's extra arguments (the tensors' description once the layout has changed, else none)."""
        fresh = self.problem.make_inputs(self.device, seed)
        if not _copy_into(self.shared, fresh):
            self.shared, self.description = share_tree(self.arena, fresh)
            self.varies = True
        del fresh
        extra = {"inputs": self.description} if self.varies else {}
        if self.flush is not None:
            self.flush.zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the model's process reads them on its own streams
        return extra


def _copy_into(shared: Any, fresh: Any) -> bool:
    """Copy `fresh`'s tensors into `shared`'s; False (nothing or part copied) where their layouts differ."""
    if isinstance(shared, torch.Tensor) or isinstance(fresh, torch.Tensor):
        if not (isinstance(shared, torch.Tensor) and isinstance(fresh, torch.Tensor)):
            return False
        if shared.shape != fresh.shape or shared.dtype != fresh.dtype or shared.device != fresh.device:
            return False
        shared.copy_(fresh)
        return True
    if isinstance(shared, (tuple, list)) and type(shared) is type(fresh) and len(shared) == len(fresh):
        return all(_copy_into(a, b) for a, b in zip(shared, fresh))
    if isinstance(shared, dict) and isinstance(fresh, dict) and shared.keys() == fresh.keys():
        return all(_copy_into(shared[key], fresh[key]) for key in shared)
    return type(shared) is type(fresh) and shared == fresh


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def l2_flush_buffer(device_index: int) -> torch.Tensor:
    """A buffer twice the GPU's L2, one per GPU and process: writing it evicts whatever was cached (the inputs just
    written included). The judge's own timer (clock.py) flushes with it too."""
    l2_bytes = torch.cuda.get_device_properties(device_index).L2_cache_size
    return torch.empty(2 * l2_bytes // 4, dtype=torch.int32, device=f"cuda:{device_index}")
