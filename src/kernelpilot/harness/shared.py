"""Tensors the trusted side lends to the sandbox: inputs it may read, output slots it may write.

Data crosses the trust boundary in one direction only as code-free bytes: the trusted side allocates every
tensor the sandbox touches and sends the sandbox a *reference* to it (a JSON-able dict); the sandbox replies with
JSON alone, never a pickle, so nothing it sends can run code on the trusted side.

- On a GPU a tensor is allocated in a private memory pool (`torch.cuda.MemPool`), so the CUDA IPC handle the
  sandbox opens maps that tensor's segment and no neighbour of it: reference outputs and other judge data live in
  the default pool, out of the sandbox's reach. The reference is torch's own IPC reduction of the tensor, pickled
  by the trusted side and unpickled by the sandbox (that direction is safe).
- On the CPU (tests, `--device cpu`) a tensor is a file in a folder of the trusted side's, mapped shared by both.

`actual_from` reads the sandbox's JSON description of its outputs back on the trusted side, over the slots it
wrote: the values compared are only ever the slots'.
"""

from __future__ import annotations

import base64
import io
import itertools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

SHARED_DIR_ENV = "KERNELPILOT_SHARED_DIR"  # where the trusted side puts shared tensors' files (CPU), if set

# dtypes a shared tensor may have, by name: the reference names one of these and nothing else.
DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    )
}  # fmt: skip


# Above this many bytes lent, closing an arena hands its memory back to the device at once (the next step, or
# another process of the judge's, may need it): the sandboxes' mappings are collected and the pool's blocks freed.
RELEASE_BYTES = 1 << 30

# Shared CUDA tensors by key, in the process that allocated them (a sandbox process never finds its keys here).
_THIS_PROCESS: dict[str, torch.Tensor] = {}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SharedArena:
    """Allocates tensors the sandbox can map; frees them (and their files) on close. Trusted side only."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._counter = itertools.count()
        self._folder: Path | None = None
        self._pool = None
        self._keys: list[str] = []
        self.nbytes = 0
        if self.device.type == "cuda":
            self._pool = torch.cuda.MemPool()
        else:
            self._folder = Path(tempfile.mkdtemp(prefix="kernelpilot-shared-", dir=os.environ.get(SHARED_DIR_ENV)))

    def empty_strided(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
        """An uninitialised shared tensor with this layout, and the reference the sandbox opens it by."""
        if dtype_name(dtype) not in DTYPES:
            raise TypeError(f"a {dtype} tensor cannot cross to the sandbox")
        if self._pool is not None:
            with torch.cuda.use_mem_pool(self._pool):
                tensor = torch.empty_strided(shape, stride, dtype=dtype, device=self.device)
            self.nbytes += tensor.untyped_storage().nbytes()
            key = f"{os.getpid()}-{next(self._counter)}-{id(self)}"
            _THIS_PROCESS[key] = tensor  # CUDA IPC cannot open a handle in the process that made it (tests in process)
            self._keys.append(key)
            return tensor, {"kind": "cuda", "key": key, "pickle": _pickled(tensor)}
        span = _storage_elements(shape, stride)
        path = self._folder / f"t{next(self._counter)}.bin"
        nbytes = max(span * dtype.itemsize, 1)
        storage = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        tensor = storage[: span * dtype.itemsize].view(dtype).as_strided(shape, stride)
        reference = {"kind": "file", "path": str(path), "nbytes": nbytes, "dtype": dtype_name(dtype),
                     "shape": list(shape), "stride": list(stride)}  # fmt: skip
        return tensor, reference

    def like(self, tensor: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """A shared tensor with `tensor`'s shape, strides (dense when it has overlaps) and dtype, uninitialised."""
        stride = tensor.stride() if _is_non_overlapping(tensor) else _dense_strides(tensor.shape)
        return self.empty_strided(tuple(tensor.shape), tuple(stride), tensor.dtype)

    def copy_of(self, tensor: torch.Tensor) -> tuple[torch.Tensor, dict]:
        shared, reference = self.like(tensor)
        shared.copy_(tensor)
        return shared, reference

    def close(self) -> None:
        for key in self._keys:
            _THIS_PROCESS.pop(key, None)
        self._keys.clear()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
        if self._pool is not None:
            self._pool = None
            # Blocks a sandbox mapped stay held for it until collected, and a released pool's blocks stay cached
            # until emptied: without both, each multi-GB arena would stay in this process.
            torch.cuda.ipc_collect()
            if self.nbytes > RELEASE_BYTES:
                torch.cuda.empty_cache()
        self.nbytes = 0

    def __enter__(self) -> SharedArena:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def share_tree(arena: SharedArena, tree: Any) -> tuple[Any, Any]:
    """(shared copy of `tree`, its JSON-able description): tensors become shared copies, plain values stay."""
    if isinstance(tree, torch.Tensor):
        shared, reference = arena.copy_of(tree)
        return shared, {"t": "tensor", "ref": reference}
    if isinstance(tree, (tuple, list)):
        pairs = [share_tree(arena, item) for item in tree]
        kind = "tuple" if isinstance(tree, tuple) else "list"
        shared_items = [shared for shared, _ in pairs]
        return (tuple(shared_items) if kind == "tuple" else shared_items), {"t": kind, "items": [d for _, d in pairs]}
    if isinstance(tree, dict):
        pairs = {key: share_tree(arena, item) for key, item in tree.items()}
        if not all(isinstance(key, str) for key in pairs):
            raise TypeError("only dicts with string keys can cross to the sandbox")
        return {k: s for k, (s, _) in pairs.items()}, {"t": "dict", "items": {k: d for k, (_, d) in pairs.items()}}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree, {"t": "value", "v": tree}
    if isinstance(tree, torch.dtype):
        return tree, {"t": "dtype", "v": dtype_name(tree)}
    raise TypeError(f"an input of type {type(tree).__name__} cannot cross to the sandbox")


# ------------------------------------------------------------------------------------ the sandbox's side


def open_reference(reference: dict) -> torch.Tensor:
    """The tensor a reference names, mapped in this (the sandbox's) process."""
    if reference["kind"] == "cuda":
        local = _THIS_PROCESS.get(str(reference.get("key")))
        if local is not None:
            return local
        import importlib
        import pickle

        importlib.import_module("torch.multiprocessing")  # the CUDA IPC rebuild functions the pickle names
        return pickle.loads(base64.b64decode(reference["pickle"]))
    dtype = DTYPES[reference["dtype"]]
    shape, stride = tuple(reference["shape"]), tuple(reference["stride"])
    span = _storage_elements(shape, stride)
    storage = torch.from_file(reference["path"], shared=True, size=reference["nbytes"], dtype=torch.uint8)
    return storage[: span * dtype.itemsize].view(dtype).as_strided(shape, stride)


def open_tree(description: Any) -> Any:
    """The inputs a `share_tree` description names (the sandbox's side)."""
    kind = description["t"]
    if kind == "tensor":
        return open_reference(description["ref"])
    if kind in ("tuple", "list"):
        items = [open_tree(item) for item in description["items"]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {key: open_tree(item) for key, item in description["items"].items()}
    if kind == "dtype":
        return DTYPES[description["v"]]
    return description["v"]


# ------------------------------------------------------------------------------------------ helpers


def _pickled(tensor: torch.Tensor) -> str:
    import importlib
    from multiprocessing.reduction import ForkingPickler

    importlib.import_module("torch.multiprocessing")  # registers torch's IPC reductions with ForkingPickler

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(tensor)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _storage_elements(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    if any(size == 0 for size in shape):
        return 0
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride))


def _dense_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def _is_non_overlapping(tensor: torch.Tensor) -> bool:
    """True when no two elements share memory (a dense or sliced layout; not an expand or a broadcast view)."""
    dims = sorted((step, size) for size, step in zip(tensor.shape, tensor.stride()) if size > 1)
    reach = 1
    for step, size in dims:
        if step < reach:
            return False
        reach = step * size
    return True


def actual_from(structure: Any, slots: list[torch.Tensor]) -> Any:
    """The model's outputs as the trusted side sees them: the slots it wrote, in the structure it reported.

    A tensor leaf the sandbox could not copy (another shape, dtype or device) becomes a meta tensor of what was
    reported, so the comparison names the difference; the values compared are only ever the slots'.
    """
    kind = structure.get("t") if isinstance(structure, dict) else None
    if kind == "tensor":
        index = structure.get("i")
        if structure.get("copied") and isinstance(index, int) and 0 <= index < len(slots):
            return slots[index]
        dtype = DTYPES.get(str(structure.get("dtype")), torch.uint8)
        shape = [int(size) for size in structure.get("shape", [])]
        return _Reported(torch.empty(shape, dtype=dtype, device="meta"), str(structure.get("device")))
    if kind in ("tuple", "list"):
        items = [actual_from(item, slots) for item in structure.get("items", [])]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {key: actual_from(item, slots) for key, item in dict(structure.get("items", {})).items()}
    if kind == "value":
        return structure.get("v")
    return _Other(str(structure.get("type", "unknown")) if isinstance(structure, dict) else "unknown")


class _Reported(torch.Tensor):
    """A reported output the sandbox did not copy: shape and dtype only (and the device it was on)."""

    @staticmethod
    def __new__(cls, meta: torch.Tensor, device: str):
        tensor = meta.as_subclass(cls)
        tensor.reported_device = device
        return tensor


class _Other:
    def __init__(self, type_name: str):
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<{self.type_name}>"
