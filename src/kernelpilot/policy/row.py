"""The row family: one kernel per group of rows reducing over the last dim(s) (statistics in registers, or the
row cached in a thread block cluster's shared memory), its launch candidates and its template context."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any

from kernelpilot.policy.codegen import (
    CTYPES,
    GATHER_C,
    ITEM_SIZES,
    MAX_CLUSTER_BLOCKS,
    REGISTER_BUDGET,
    REGISTER_RESERVE,
    REGISTERS_PER_BLOCK,
    SHARED_CACHE_BYTES,
    SM_COUNT,
    STAT_IDENTITIES,
    STAT_WORDS,
    Emitter,
    LaunchConfig,
    Layout,
    c_literal,
    dtype_context,
    element_loads,
    kernel_stem,
    launcher_name,
    next_power_of_two,
    row_access_context,
    row_layout,
    tensor_context,
)
from kernelpilot.policy.leading import describe_leading
from kernelpilot.policy.ir import STAT_FIELDS, Call, Const, Expr, Field, Gather, Group, Guard, Load, Reduce, Stack, walk

# Data that many rows of a row kernel read (a broadcast mask, a norm's weight) is loaded with L2's evict-last
# policy when it is at most this large: a sixth of an H100's 50 MB L2, so the rows streaming through still have room.
L2_KEPT_BYTES = 8 * 1024 * 1024
# Rows of at most this many vectors also get a one-thread team (after the expected best), when there are at least
# MANY_ROWS of them: about one resident thread each on an H100's 132 SMs x 2048 threads. (32: a 3x3x3 pooling
# window, 27 elements read one by one, is one.)
SHORT_ROW_VECTORS = 32
MANY_ROWS = 1 << 18
# A row split over a cluster gives each block at least this many bytes to read: four 16-byte vectors for each of
# 1024 threads.
SPLIT_BYTES = 1024 * 4 * 16


def row_candidates(group: Group) -> list[LaunchConfig]:
    """Team sizes around four vectors per thread, the cluster-cached row, and the one-wave loop (POLICY.md)."""
    layout = row_layout(group)
    vectors = group.row_length // layout.vec
    # About four vectors per thread; a warp-sized or smaller team for short rows, a whole block for long ones.
    preferred = min(1024, max(4, next_power_of_two(math.ceil(vectors / 4))))
    if not group.reduces():
        preferred = 32  # no statistics: a row is read at its gathered column only, by one thread

    teams = dict.fromkeys(t for t in (preferred, preferred // 2, preferred * 2) if 4 <= t <= 1024)
    if group.reduces() and vectors <= SHORT_ROW_VECTORS and group.rows >= MANY_ROWS:
        # A row this short (a pooling window) may cost its team more in shuffles than in loads: one thread walks it,
        # where there are rows enough for one thread each to fill the GPU.
        teams[1] = None
    # One block per group of rows (as for elementwise kernels, it beat the one-wave loop on most row examples timed,
    # not on long rows with a gathered target); the one-wave loop stays as the last try.
    candidates = [replace(_row_config(group, layout, threads, items=4), persistent=False) for threads in teams]
    if not _cached(group, layout, candidates[0]):
        # A streamed row waits at block barriers once per pass; with registers for two blocks per SM, one block
        # loads while another reduces (a 1024-thread block has an SM to itself). For long rows, also a 256-thread
        # team with four vectors in flight: as many bytes in flight per SM as 512 x 2, in twice the blocks.
        if preferred >= 512:
            candidates.append(LaunchConfig(256, 4, 1, persistent=False))
        candidates = [_with_min_blocks(group, layout, config, 2) for config in candidates]
        # Teams that share their SM first, the smallest first: on the H100 (BENCHMARKS.md, run D) 256 x 4 with two
        # blocks per SM was the fastest streamed candidate on 6 of 7 long bf16 rows and 512 x 2 on the 7th, while
        # the 1024-thread team, once first, was the slowest on all 7 (by 7-26%).
        # (The one-wave loop below still takes the 512-thread team, the one measured against the tile grids.)
        one_wave_team = next((c for c in candidates if c.min_blocks > 1), candidates[0])
        candidates.sort(key=lambda config: (config.min_blocks == 1, config.threads))
        shared = _shared_config(group, layout)
        # Caching in shared memory reads the row once instead of once per pass: expected best, so first.
        candidates = [shared, *candidates] if shared else candidates
        split = _split_config(group, layout)
        if split and not (shared and shared.shared_blocks >= split.split_blocks):
            # Expected best where one block (or a smaller cluster) per row would leave most SMs idle.
            idle = group.rows * (shared.shared_blocks if shared else 1) * 2 <= SM_COUNT
            candidates.insert(0 if idle else 1, split)
    else:
        one_wave_team = candidates[0]
    if group.reduces() and group.rows >= MANY_ROWS and _interleaved(group, layout):
        # Rows read with a stride whose neighbours lie next to each other (an argmax over a middle dim, a softmax
        # over channels): a team reads one element per row at a time, scattered; a one-thread team walks its row
        # while a warp's 32 loads land on 32 adjacent rows, one contiguous run. Second, after the expected best: not
        # yet timed on a GPU (KernelBench L1 52, an argmin over dim 1, ran at 0.19x of torch.compile with teams).
        candidates.insert(1, replace(_row_config(group, layout, 1, items=8), persistent=False))
    # The one-wave loop of a team that shares its SM where there is one (for token log-probs a one-wave 512-thread
    # grid beat every tile grid before the two-blocks-per-SM teams existed); otherwise of the first.
    candidates.append(replace(one_wave_team, persistent=True))
    return list(dict.fromkeys(candidates))


def _interleaved(group: Group, layout: Layout) -> bool:
    """True when every access along the row reads it with a stride and the next row starts at the next element (the
    last dim before the row has stride 1): rows interleaved in memory, as a middle dim's are."""
    outer = len(layout.shape) - layout.row_dims - 1
    element = [i for i in range(len(layout.strides)) if layout.along_row(i)]
    return outer >= 0 and bool(element) and all(
        layout.strides[i][-1] not in (0, 1) and layout.strides[i][outer] == 1 for i in element)  # fmt: skip


def _row_config(group: Group, layout: Layout, threads: int, items: int) -> LaunchConfig:
    rows_per_block = max(1, 256 // threads)
    # At most 16 floats of loads in flight per access: 8-wide (16-bit) vectors halve the items, not the bytes.
    config = LaunchConfig(threads, max(1, min(items, 16 // layout.vec)), rows_per_block)
    return LaunchConfig(threads, 1, rows_per_block) if _cached(group, layout, config) else config


def _with_min_blocks(group: Group, layout: Layout, config: LaunchConfig, blocks: int) -> LaunchConfig:
    """`config` asking for registers for `blocks` blocks per SM, where the floats a thread streams at once (its
    vectors in flight, for every access of the widest pass) plus the usual reserve fit that share without spilling;
    otherwise `config` as it is."""
    block_threads = config.threads * (config.rows_per_block or 1)
    share = REGISTERS_PER_BLOCK // (block_threads * blocks)
    in_flight = config.items * layout.vec * max(len(accesses) for accesses in _pass_accesses(group, layout))
    return replace(config, min_blocks=blocks) if REGISTER_RESERVE + in_flight <= share else config


def _cached(group: Group, layout: Layout, config: LaunchConfig) -> bool:
    """True when the row data the statistics read fits in registers, so memory is read once."""
    if config.shared_blocks or config.split_blocks:
        return False
    vectors_per_thread = math.ceil(group.row_length // layout.vec / config.threads)
    block_threads = config.threads * (config.rows_per_block or 1)
    budget = min(REGISTER_BUDGET, REGISTERS_PER_BLOCK // block_threads - REGISTER_RESERVE)
    return vectors_per_thread * layout.vec * len(_stat_accesses(group, layout)) <= budget


def _shared_config(group: Group, layout: Layout) -> LaunchConfig | None:
    """The fewest blocks (1 to 8, a cluster when more than one) whose shared memory holds the part of a row the
    statistics read, when some pass reads it again; None when no split fits or nothing would be read twice."""
    cached = _stat_accesses(group, layout)
    if not cached or max(_passes(group, layout).get(i, 0) for i in cached) < 2:
        return None
    blocks = 1
    while blocks <= MAX_CLUSTER_BLOCKS:
        span = _span(group.row_length, blocks, layout.vec)
        if (blocks - 1) * span < group.row_length and span * 4 * len(cached) <= SHARED_CACHE_BYTES:
            # About eight vectors per thread: enough loads in flight, few enough threads to stay busy.
            threads = min(1024, max(32, next_power_of_two(math.ceil(span // layout.vec / 8))))
            return LaunchConfig(threads, 4, 1, shared_blocks=blocks)
        blocks *= 2
    return None


def _split_config(group: Group, layout: Layout) -> LaunchConfig | None:
    """For rows too few to give every SM a block: each row streamed by a cluster of the fewest blocks (2 to 8) that
    gives every SM one, merging its statistics through distributed shared memory; None where rows are many enough
    or too short to share out."""
    if not group.reduces() or group.rows >= SM_COUNT:
        return None
    blocks = 2
    while blocks < MAX_CLUSTER_BLOCKS and group.rows * blocks < SM_COUNT:
        blocks *= 2
    column_bytes = sum(ITEM_SIZES[group.tensors[access.tensor].dtype]
                       for i, access in enumerate(group.accesses) if layout.along_row(i))  # fmt: skip
    if _span(group.row_length, blocks, layout.vec) * column_bytes < SPLIT_BYTES:
        return None
    return LaunchConfig(1024, max(1, min(4, 16 // layout.vec)), 1, split_blocks=blocks, persistent=False)


def _span(row_length: int, blocks: int, vec: int) -> int:
    """Columns of a row each of `blocks` blocks covers: whole vectors, the last block taking what is left (odd
    vocabularies such as 50,257 split unevenly)."""
    return math.ceil(row_length / (blocks * vec)) * vec


def _pass_accesses(group: Group, layout: Layout) -> list[list[int]]:
    """The element accesses each pass over the row reads: one pass per statistics level, then the output's."""
    program = RowProgram(group, layout, {i for i in range(len(layout.strides)) if layout.along_row(i)})
    return [level["accesses"] for level in program.levels] + [program.output["accesses"]]


def _passes(group: Group, layout: Layout) -> dict[int, int]:
    """How many passes over the row (one per statistics level, one for the output) read each access."""
    counts: dict[int, int] = {}
    for accesses in _pass_accesses(group, layout):
        for index in accesses:
            counts[index] = counts.get(index, 0) + 1
    return counts


def _stat_accesses(group: Group, layout: Layout) -> list[int]:
    """Element accesses (those varying along the row) that some row statistic reads."""
    indices = {group.loads[load] for reduce in group.reduces() for operand in reduce.operands
               for load in element_loads(operand)}  # fmt: skip
    return sorted(i for i in indices if layout.along_row(i))


def row_launch_context(group: Group, config: LaunchConfig) -> dict[str, Any]:
    """What a row or scan template knows of its rows and launch: how many (per index of a runtime batch), how long,
    and the team and rows of a block."""
    return {
        "description": group.describe(),
        "config": config,
        "rows": group.rows,
        "leading": group.leading_free,
        "batch_rows": group.rows // group.free_count if group.leading_free else None,
        "shapes": describe_leading(group),
        "row_length": group.row_length,
        "threads_per_row": config.threads,
        "rows_per_block": config.rows_per_block,
    }


def row_context(group: Group, config: LaunchConfig) -> dict[str, Any]:
    layout = row_layout(group)
    cached = _cached(group, layout, config)
    shared = config.shared_blocks > 0
    stat_accesses = set(_stat_accesses(group, layout))
    cluster = max(config.shared_blocks, config.split_blocks, 1)
    span = _span(group.row_length, cluster, layout.vec)
    accesses = []
    for i, access in enumerate(group.accesses):
        accesses.append(
            {
                **row_access_context(group, layout, i),
                "integer": group.tensors[access.tensor].dtype == "int64",
                "cached": cached and i in stat_accesses,
                "kept_in_l2": _read_by_many_rows(group, layout, i),
                "shared": shared and i in stat_accesses,
                "cache_offset": sorted(stat_accesses).index(i) * span if shared and i in stat_accesses else 0,
                "guard": _guard_context(group, access.guard),
            }
        )
    element = [a for a in accesses if a["along_row"]]
    program = RowProgram(group, layout, {a["index"] for a in element})
    # Shared-memory caches fill while the first pass reads them; those it does not read fill before it.
    first_pass = set(program.levels[0]["accesses"]) if program.levels else set()
    for a in accesses:
        a["fill_in_level0"] = a["index"] in first_pass
    vector_tensors = {a["tensor"] for a in element if not a["broadcast"]} if layout.vec > 1 else set()
    return {
        **row_launch_context(group, config),
        "vec": layout.vec,
        "cached": cached,
        "shared": shared,
        "cluster": cluster,
        "span": span,
        "cache_bytes": span * 4 * len(stat_accesses) if shared else 0,
        "rereads": len(program.levels) > 1 or not group.per_row,  # an uncached row is read once per pass
        "all_accesses": accesses,
        "element_accesses": element,
        "row_accesses": [a for a in accesses if not a["along_row"]],
        "levels": [{**level, "accesses": [accesses[i] for i in level["accesses"]]} for level in program.levels],
        "prefill": [a for a in element if a["shared"] and not a["fill_in_level0"]],
        "max_slots": max((sum(len(s["fields"]) for s in level["stats"]) for level in program.levels), default=0),
        "stat_summary": ", ".join(dict.fromkeys(STAT_WORDS[r.kind] for r in group.reduces())),
        "output": {**program.output, "accesses": [accesses[i] for i in program.output["accesses"]]},
        "per_row": group.per_row,
        "kernel": f"{kernel_stem(group)}_kernel",
        "launcher": launcher_name(group),
        "tensors": tensor_context(group, vector_tensors),
        "out_ctype": CTYPES[group.output.dtype],
        "stat_kinds": {reduce.kind for reduce in group.reduces()},
        "indexed": bool({reduce.kind for reduce in group.reduces()} & {"argmax", "argmin"}),
        "gathers": any(isinstance(node, Gather) for node in walk(group.expr)),
        "kept_in_l2": any(a["kept_in_l2"] for a in element),
        **dtype_context(group, _integer_reads(accesses)),
    }


def _guard_context(group: Group, guard: Guard | None) -> dict[str, Any] | None:
    """A guarded access's checks for the template: each coordinate of the iteration shape a check names, taken from
    the flat row index (an outer dim) or the flat column index (a dim of the row), its divisor and size there."""
    if guard is None:
        return None
    split = len(group.shape) - group.row_dims

    def term(dim: int, factor: int) -> dict[str, Any]:
        outer = dim < split
        divisor = math.prod(group.shape[dim + 1 : split if outer else len(group.shape)])
        return {"outer": outer, "divisor": divisor, "size": group.shape[dim], "factor": factor}

    checks = [{"terms": [term(dim, factor) for dim, factor in terms], "low": low, "size": size}
              for terms, low, size in guard.checks]  # fmt: skip
    return {"checks": checks, "fill": c_literal(guard.fill)}


def _read_by_many_rows(group: Group, layout: Layout, index: int) -> bool:
    """True for an element access that other rows read again (it does not move along some outer dim, like a
    [queries, keys] mask under [batch, heads, queries, keys] scores) and that is small enough to keep in L2."""
    outer = len(layout.shape) - layout.row_dims
    strides = layout.strides[index]
    if not layout.along_row(index) or all(strides[d] for d in range(outer) if layout.shape[d] > 1):
        return False
    elements = math.prod(size for size, stride in zip(layout.shape, strides) if stride)
    return elements * ITEM_SIZES[group.tensors[group.accesses[index].tensor].dtype] <= L2_KEPT_BYTES


def _integer_reads(accesses: list[dict[str, Any]]) -> frozenset[int]:
    """Tensors a row kernel reads only as integers: int64 targets, one per row."""
    read_as_floats = {a["tensor"] for a in accesses if not (a["integer"] and not a["along_row"])}
    return frozenset({a["tensor"] for a in accesses} - read_as_floats)


class RowProgram:
    """A row group's expressions split by where they run: per row (hoisted) or per element, level by level.

    A statistic's level is one more than the highest level of the statistics its input uses, so each level is
    one pass over the row (registers when cached) followed by one reduction.
    """

    def __init__(self, group: Group, layout: Layout, element_accesses: set[int]):
        self.group = group
        self.layout = layout
        self.element_accesses = element_accesses
        self.counter = itertools.count()
        reduces = group.reduces()
        self.stat_names = {reduce: f"st{i}" for i, reduce in enumerate(reduces)}
        row_names: dict[Expr, str] = {
            load: f"r{index}" for load, index in group.loads.items() if index not in element_accesses
        }
        for reduce, name in self.stat_names.items():
            for field_name in STAT_FIELDS[reduce.kind]:
                row_names[Field(reduce, field_name)] = f"{name}_{field_name}"
        self.row = Emitter(row_names, self.counter, self._gathered_load)
        self._invariant: dict[Expr, bool] = {}
        self._hoisted: set[Expr] = set()  # a node hoisted once has all its per-row parts emitted
        levels = self._levels(reduces)
        count = max(levels.values(), default=-1) + 1  # none for a row read only at gathered columns
        self.levels = [self._level(k, [r for r in reduces if levels[r] == k]) for k in range(count)]
        self.output = self._output()

    def _gathered_load(self, load: Load, name: str, column: str) -> str | None:
        index = self.group.loads[load]
        if index not in self.element_accesses:
            return None
        return GATHER_C["load"].format(name=name, access=index, column=column)

    def _levels(self, reduces: list[Reduce]) -> dict[Reduce, int]:
        levels: dict[Reduce, int] = {}
        for reduce in reduces:  # inner statistics come first in walk order
            used = [node.reduce for operand in reduce.operands for node in walk(operand) if isinstance(node, Field)]
            levels[reduce] = 1 + max((levels[r] for r in used), default=-1)
        return levels

    def _row_invariant(self, expr: Expr) -> bool:
        if expr not in self._invariant:
            if isinstance(expr, Load):
                self._invariant[expr] = self.group.loads[expr] not in self.element_accesses
            elif isinstance(expr, Call):
                self._invariant[expr] = all(self._row_invariant(arg) for arg in expr.args)
            else:
                self._invariant[expr] = isinstance(expr, (Const, Field, Gather))  # a Gather is one value per row
        return self._invariant[expr]

    def _hoist(self, expr: Expr) -> None:
        """Emit the largest per-row subexpressions of `expr` once per row."""
        if not isinstance(expr, Call) or expr in self._hoisted:
            return
        self._hoisted.add(expr)
        if self._row_invariant(expr):
            self.row.value(expr)
        else:
            for arg in expr.args:
                self._hoist(arg)

    def _element_emitter(self, roots: list[Expr]) -> tuple[Emitter, list[int]]:
        loads = sorted({self.group.loads[load] for root in roots for load in element_loads(root)} & self.element_accesses)
        names = dict(self.row.names)
        names.update({load: f"e{index}" for load, index in self.group.loads.items() if index in loads})
        return Emitter(names, self.counter), loads

    def _level(self, index: int, reduces: list[Reduce]) -> dict[str, Any]:
        start = len(self.row.lines)
        for reduce in reduces:
            for operand in reduce.operands:
                self._hoist(operand)
        row_code = self.row.lines[start:]
        emitter, loads = self._element_emitter([operand for reduce in reduces for operand in reduce.operands])
        # The "max" phase of a chunked online softmax computes only the softmax inputs (nvcc warns of, and the
        # reader would wonder about, values computed there for the other statistics and never used).
        chunked = [reduce.value for reduce in reduces if reduce.kind == "online_softmax"]
        max_emitter, max_loads = self._element_emitter(chunked)
        stats, slot = [], 0
        for reduce in reduces:
            fields = [{"name": f, "identity": STAT_IDENTITIES[(reduce.kind, f)]} for f in STAT_FIELDS[reduce.kind]]
            name = self.stat_names[reduce]
            value = emitter.value(reduce.value)
            weighted = emitter.value(reduce.weighted) if reduce.weighted is not None else None
            max_value = max_emitter.value(reduce.value) if reduce.kind == "online_softmax" else None
            stats.append({"name": name, "kind": reduce.kind, "value": value, "weighted": weighted, "fields": fields,
                          "slot": slot, "max_value": max_value})  # fmt: skip
            slot += len(fields)
        comment = ", ".join(STAT_WORDS[reduce.kind] for reduce in reduces)
        return {"row_code": row_code, "element_code": emitter.lines, "stats": stats, "accesses": loads, "comment": comment,
                "max_code": max_emitter.lines, "max_accesses": max_loads}  # fmt: skip

    def _output(self) -> dict[str, Any]:
        expr = self.group.expr
        start = len(self.row.lines)
        if self.group.per_row:
            # Merged groups write several values per row (merge.py), the others one.
            values = [self.row.value(value) for value in (expr.values if isinstance(expr, Stack) else (expr,))]
            return {"row_code": self.row.lines[start:], "element_code": [], "values": values, "accesses": []}
        self._hoist(expr)
        row_code = self.row.lines[start:]
        emitter, loads = self._element_emitter([expr])
        value = emitter.value(expr)
        return {"row_code": row_code, "element_code": emitter.lines, "value": value, "accesses": loads}
