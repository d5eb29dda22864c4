"""The elementwise family: one pass over a chain of pointwise ops, one block per tile of work (or one wave of
resident blocks looping over it), its launch candidates and its template context. Windowed accesses (a cat's
inputs, a padded tensor) check the range of each coordinate and load element by element."""

from __future__ import annotations

import itertools
import math
from typing import Any

from kernelpilot.policy.codegen import (
    CTYPES,
    Emitter,
    LaunchConfig,
    access_comment,
    c_literal,
    dtype_context,
    elementwise_layout,
    index_terms,
    kernel_stem,
    launcher_name,
    tensor_context,
)
from kernelpilot.policy.ir import Access, Group
from kernelpilot.policy.leading import describe_leading


def elementwise_candidates(group: Group) -> list[LaunchConfig]:
    """Three tile shapes, then one wave of resident blocks looping over the work."""
    # One block per tile first: on an H100 it beat the one-wave grid-stride loop on every elementwise example
    # timed (by 4-6%, BENCHMARKS.md); the one-wave grid stays as the last try.
    tiles = [LaunchConfig(threads, items, persistent=False) for threads, items in ((256, 2), (128, 4), (512, 1))]
    return [*tiles, LaunchConfig(256, 2)]


def elementwise_context(group: Group, config: LaunchConfig) -> dict[str, Any]:
    layout = elementwise_layout(group)
    contiguous = _contiguous(layout.shape)
    accesses = []
    for i, access in enumerate(group.accesses):
        strides = layout.strides[i]
        accesses.append(
            {
                "index": i,
                "tensor": access.tensor,
                "linear": strides == contiguous and layout.offsets[i] == 0,
                "broadcast": strides[-1] == 0,
                "offset": layout.offsets[i],
                "terms": index_terms(layout.shape, strides),
                "comment": access_comment(group, i, layout, "x".join(map(str, layout.shape))),
                "window": _window(group, access),
            }
        )
    emitter = Emitter({load: f"e{index}" for load, index in group.loads.items()}, itertools.count())
    result = emitter.value(group.expr)
    vector_tensors = {a["tensor"] for a in accesses if not a["broadcast"]} if layout.vec > 1 else set()
    return {
        "description": group.describe(),
        "shape_text": "x".join(map(str, group.shape)) or "a scalar",
        "config": config,
        "numel": math.prod(layout.shape),
        "leading": group.leading_free,
        "batch_numel": math.prod(layout.shape) // group.free_count if group.leading_free else None,
        "shapes": describe_leading(group),
        "vec": layout.vec,
        "accesses": accesses,
        "code": emitter.lines,
        "result": result,
        "kernel": f"{kernel_stem(group)}_kernel",
        "launcher": launcher_name(group),
        "tensors": tensor_context(group, vector_tensors),
        "out_ctype": CTYPES[group.output.dtype],
        **dtype_context(group),
    }


def _window(group: Group, access: Access) -> dict[str, Any] | None:
    """A windowed access's range checks: for each dim it does not cover whole, the flat index's coordinate there
    (a divisor and a size, over the group's own shape) and its range; its diagonal (triu, tril); and the value it
    reads outside."""
    if access.bounds is None:
        return None
    checks, divisor = [], 1
    for size, (start, end) in reversed(list(zip(group.shape, access.bounds))):
        if start > 0 or end < size:
            checks.append({"divisor": divisor, "size": size, "start": start, "end": end})
        divisor *= size
    diagonal = None
    if access.diagonal is not None:
        k, upper = access.diagonal
        diagonal = {"k": k, "op": ">=" if upper else "<=", "cols": group.shape[-1], "rows": group.shape[-2]}
    return {"checks": checks, "fill": c_literal(access.fill), "diagonal": diagonal}


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= size
    return tuple(reversed(strides))
