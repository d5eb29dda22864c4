"""A torch dispatch mode that refuses a host allocation before it is made when it would take the tensors made under
it past a byte budget: code that cannot run on meta tensors is run on the CPU, but never blindly at full size."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map


class HostBudgetExceeded(Exception):
    """An operation would have taken the live tensors made under a HostBudget past its budget."""

    def __init__(self, needed_bytes: int, budget_bytes: int):
        super().__init__(f"{needed_bytes} bytes needed, {budget_bytes} allowed")
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes


class HostBudget(TorchDispatchMode):
    """Run each aten call on meta tensors first to learn the bytes it returns; raise HostBudgetExceeded when those
    and the tensors made earlier and still alive exceed `budget_bytes`, else run it for real.

    A call with no meta kernel (`.item()` among them) runs unchecked; views and in-place calls allocate nothing.
    """

    def __init__(self, budget_bytes: int):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.live_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        planned = _planned_bytes(func, args, kwargs)
        if planned is not None and self.live_bytes + planned > self.budget_bytes:
            raise HostBudgetExceeded(self.live_bytes + planned, self.budget_bytes)
        result = func(*args, **kwargs)
        if not _aliases(func):
            for tensor in _tensors(result):
                self._track(tensor)
        return result

    def _track(self, tensor: torch.Tensor) -> None:
        size = tensor.untyped_storage().nbytes() if tensor.device.type == "cpu" else 0
        self.live_bytes += size
        weakref.finalize(tensor, self._release, size)

    def _release(self, size: int) -> None:
        self.live_bytes -= size


def _planned_bytes(func: Any, args: tuple, kwargs: dict) -> int | None:
    """The bytes `func` would return, from running it on meta tensors; None when it cannot run there."""
    if _aliases(func):
        return 0
    meta_args, meta_kwargs = tree_map(_to_meta, (args, kwargs))
    if "device" in meta_kwargs or any(argument.name == "device" for argument in func._schema.arguments):
        if _device_of(kwargs) in (None, "cpu"):
            meta_kwargs["device"] = torch.device("meta")
    if "generator" in meta_kwargs:  # a CPU generator cannot draw meta tensors, and the sizes do not depend on it
        meta_kwargs["generator"] = None
    try:
        return sum(tensor.nbytes for tensor in _tensors(func(*meta_args, **meta_kwargs)))
    except Exception:  # noqa: BLE001 - no meta kernel, or data-dependent: the call runs unchecked
        return None


def _to_meta(item: Any) -> Any:
    return item.to("meta") if isinstance(item, torch.Tensor) and item.device.type == "cpu" else item


def _device_of(kwargs: dict) -> str | None:
    device = kwargs.get("device")
    return None if device is None else torch.device(device).type


def _aliases(func: Any) -> bool:
    """Whether `func` returns views of or writes into its arguments (so allocates no new storage)."""
    return any(result.alias_info is not None for result in func._schema.returns)


def _tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
