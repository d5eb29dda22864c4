"""Column kernels: a sum, max or min over adjacent dims before the last, with its fused prologue and epilogue.

A column group's iteration shape is seen as (outer, reduced, inner), inner contiguous in the input. Each thread
owns one 16-byte vector of adjacent inner columns of one outer index and walks the reduced dim, so a warp reads
whole rows of adjacent memory. The reduced dim is split across the block's `splits` threads of a column (merged
in shared memory) and, when the columns alone cannot fill the GPU, across the blocks of a thread block cluster
(merged through distributed shared memory). Every merge runs in a fixed order, so results are deterministic.
This module picks the layout and launch candidates and fills templates/policy/column.cu.j2.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from kernelpilot.policy.codegen import (
    CTYPES,
    MAX_CLUSTER_BLOCKS,
    SM_COUNT,
    STAT_IDENTITIES,
    STAT_WORDS,
    Emitter,
    describe_source,
    dtype_context,
    element_loads,
    index_terms,
    kernel_stem,
    launcher_name,
    merge_dims,
    next_power_of_two,
    tensor_context,
    vector_width,
)
from kernelpilot.policy.ir import STAT_FIELDS, Field, Group, walk

# Threads that keep an H100 streaming from memory: half its resident threads, each with a few 16-byte loads in
# flight. Fewer columns than this split the reduced dim over a cluster.
BUSY_THREADS = SM_COUNT * 1024
# The block's partial statistics live in static shared memory, at most 48 KB.
STATIC_SHARED_BYTES = 48 * 1024


@dataclass(frozen=True)
class ColumnConfig:
    """One launch geometry of a column kernel (policy/columns.py): blocks of `columns` x `splits` threads, each
    thread owning one vector of adjacent inner columns; the `splits` threads of a column share its reduced dim,
    `cluster` blocks (a thread block cluster when more than one) split it again, and each thread has `items`
    vectors in flight."""

    columns: int
    splits: int
    cluster: int = 1
    items: int = 4

    @property
    def threads(self) -> int:
        return self.columns * self.splits

    @property
    def label(self) -> str:
        split = f", each column split over a cluster of {self.cluster} blocks" if self.cluster > 1 else ""
        return (f"{self.columns} column vector(s) x {self.splits} thread(s) along the reduced dim per block{split}, "
                f"{self.items} vector(s) in flight")  # fmt: skip


@dataclass
class ColumnLayout:
    """A column group's (outer, reduced, inner) dims, each merged where every access allows, each access's
    strides over the three parts, and the vector width along the innermost inner dim."""

    outer: tuple[int, ...]
    reduced: tuple[int, ...]
    inner: tuple[int, ...]
    strides: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
    offsets: list[int]
    vec: int

    @property
    def extents(self) -> tuple[int, int, int]:
        return math.prod(self.outer), math.prod(self.reduced), math.prod(self.inner)

    def per_column(self, index: int) -> bool:
        """True when access `index` is constant along the reduced dim: one load per column."""
        return not any(self.strides[index][1])


def column_layout(group: Group) -> ColumnLayout:
    end = len(group.shape) - group.inner_dims
    start = end - group.row_dims
    parts = []
    for low, high in ((0, start), (start, end), (end, len(group.shape))):
        sizes, strides = merge_dims(group.shape[low:high], [a.strides[low:high] for a in group.accesses])
        if not sizes:  # every dim of the part has size 1
            sizes, strides = (1,), [(0,) for _ in group.accesses]
        parts.append((sizes, strides))
    (outer, outer_strides), (reduced, reduced_strides), (inner, inner_strides) = parts
    strides = list(zip(outer_strides, reduced_strides, inner_strides))
    offsets = [a.offset for a in group.accesses]
    vectors = [i for i, s in enumerate(inner_strides) if s[-1] == 1]
    dtypes = [group.tensors[group.accesses[i].tensor].dtype for i in vectors] + [group.output.dtype]
    vec = vector_width(dtypes)
    fits = (
        inner[-1] % vec == 0
        and all(s[-1] in (0, 1) for s in inner_strides)
        and all(offsets[i] % vec == 0 and all(x % vec == 0 for x in (*strides[i][0], *strides[i][1], *strides[i][2][:-1]))
                for i in vectors)
    )  # fmt: skip
    return ColumnLayout(outer, reduced, inner, strides, offsets, vec if fits else 1)


# ----------------------------------------------------------------------------------------- candidates


def column_candidates(group: Group) -> list[ColumnConfig]:
    """A few block shapes and cluster splits worth timing, the expected best first."""
    layout = column_layout(group)
    outer, reduced, inner = layout.extents
    columns = outer * inner // layout.vec
    slots = len(group.reduces())
    width = min(32, next_power_of_two(columns))  # a warp across 32 vectors: 512 adjacent bytes per row

    def config(columns_per_block: int, threads: int, items: int, cluster: int | None = None) -> ColumnConfig:
        return _column_config(columns, reduced, slots, layout.vec, columns_per_block, threads, items, cluster)

    first = config(width, 256, 4)
    if first.cluster == MAX_CLUSTER_BLOCKS and _threads(columns, first) < BUSY_THREADS:
        # Few columns even with the widest split: more threads per block keep more loads in flight. Second, not
        # first: on an H100, channel_amax_bf16 ran 0.237 ms with it and 0.204 ms with 256 threads (BENCHMARKS.md).
        second = config(width, 1024, 2)
    else:
        second = config(width, 512, 2)
    narrower = config(max(1, width // 2), 256, 4)
    other_cluster = first.cluster * 2 if first.cluster < MAX_CLUSTER_BLOCKS else first.cluster // 2
    candidates = [first, second, narrower]
    if _splittable(reduced, first.splits, first.items, other_cluster):
        candidates.append(config(width, first.threads, first.items, other_cluster))
    return list(dict.fromkeys(candidates))


def _column_config(columns: int, reduced: int, slots: int, vec: int, width: int, threads: int, items: int,
                   cluster: int | None) -> ColumnConfig:  # fmt: skip
    """`width` columns per block, `threads` threads at most (no more splits than the reduced dim has values, and
    the partials within static shared memory), and the smallest cluster that keeps the GPU busy (or `cluster`)."""
    splits = max(1, min(threads // width, next_power_of_two(reduced)))
    while splits > 1 and slots * splits * width * vec * 4 > STATIC_SHARED_BYTES:
        splits //= 2
    if cluster is None:
        cluster = 1
        while (cluster < MAX_CLUSTER_BLOCKS and _splittable(reduced, splits, items, cluster * 2)
               and _threads(columns, ColumnConfig(width, splits, cluster, items)) < BUSY_THREADS):  # fmt: skip
            cluster *= 2
    return ColumnConfig(width, splits, cluster, items)


def _threads(columns: int, config: ColumnConfig) -> int:
    return math.ceil(columns / config.columns) * config.cluster * config.threads


def _splittable(reduced: int, splits: int, items: int, cluster: int) -> bool:
    """True when each of `cluster` blocks still gets at least one full step of the reduced dim."""
    return 1 <= cluster <= MAX_CLUSTER_BLOCKS and reduced >= cluster * splits * items


# ------------------------------------------------------------------------------------------ rendering


def column_context(group: Group, config: ColumnConfig) -> dict[str, Any]:
    """What column.cu.j2 needs: the extents, each access's offset terms per part, and the code of the prologue
    (per reduced element) and of the epilogue (per column, from the merged statistics)."""
    layout = column_layout(group)
    outer, reduced, inner = layout.extents
    reduces = group.reduces()
    for reduce in reduces:
        if reduce.kind not in ("sum", "max", "min") or any(isinstance(node, Field) for node in walk(reduce.value)):
            raise ValueError(f"group {group.name}: a column kernel computes sums, max and min of its input only")
    accesses = [_access(group, layout, i) for i in range(len(group.accesses))]
    counter = itertools.count()
    prologue_loads = {load for reduce in reduces for load in element_loads(reduce.value)}
    prologue = Emitter({load: f"e{group.loads[load]}" for load in prologue_loads}, counter)
    stats = []
    for k, reduce in enumerate(reduces):
        (field_name,) = STAT_FIELDS[reduce.kind]
        identity = STAT_IDENTITIES[(reduce.kind, field_name)]
        stats.append({"name": f"st{k}", "kind": reduce.kind, "field": field_name, "identity": identity,
                      "value": prologue.value(reduce.value), "slot": k})  # fmt: skip
    epilogue_loads = element_loads(group.expr)
    names = {load: f"e{group.loads[load]}" for load in epilogue_loads}
    names.update({Field(reduce, s["field"]): f"{s['name']}_{s['field']}" for reduce, s in zip(reduces, stats)})
    epilogue = Emitter(names, counter)
    result = epilogue.value(group.expr)
    epilogue_accesses = sorted({group.loads[load] for load in epilogue_loads})
    if any(not layout.per_column(i) for i in epilogue_accesses):
        raise ValueError(f"group {group.name}: its epilogue reads a tensor along the reduced dim")
    streamed = sorted({group.loads[load] for load in prologue_loads})
    vector_tensors = {a["tensor"] for a in accesses if not a["broadcast"]} if layout.vec > 1 else set()
    return {
        "description": group.describe(),
        "config": config,
        "outer": outer,
        "reduced": reduced,
        "inner": inner,
        "vec": layout.vec,
        "span": math.ceil(reduced / config.cluster),
        "accesses": accesses,
        "fixed": [accesses[i] for i in streamed if layout.per_column(i)],
        "streamed": [accesses[i] for i in streamed if not layout.per_column(i)],
        "epilogue_accesses": [accesses[i] for i in epilogue_accesses],
        "stats": stats,
        "stat_summary": ", ".join(dict.fromkeys(STAT_WORDS[reduce.kind] for reduce in reduces)),
        "prologue_code": prologue.lines,
        "epilogue_code": epilogue.lines,
        "result": result,
        "kernel": f"{kernel_stem(group)}_kernel",
        "launcher": launcher_name(group),
        "tensors": tensor_context(group, vector_tensors),
        "out_ctype": CTYPES[group.output.dtype],
        **dtype_context(group),
    }


def _access(group: Group, layout: ColumnLayout, index: int) -> dict[str, Any]:
    outer_strides, reduced_strides, inner_strides = layout.strides[index]
    source = group.tensors[group.accesses[index].tensor]
    space = f"({'x'.join(map(str, layout.outer))}, {'x'.join(map(str, layout.reduced))}, {'x'.join(map(str, layout.inner))})"
    return {
        "index": index,
        "tensor": group.accesses[index].tensor,
        "ctype": CTYPES[source.dtype],
        "offset": layout.offsets[index],
        "broadcast": inner_strides[-1] == 0,
        "outer_terms": index_terms(layout.outer, outer_strides),
        "reduced_terms": index_terms(layout.reduced, reduced_strides),
        "inner_terms": index_terms(layout.inner, inner_strides),
        "comment": f"Access {index}: {describe_source(source)}, element strides {outer_strides}, {reduced_strides}, "
        f"{inner_strides} over (outer, reduced, inner) = {space}",
    }

