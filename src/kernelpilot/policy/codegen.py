"""Render an Analysis into workspace files from templates/policy/: per generated group a torch-free .cu (kernel and
launcher, or a cuBLASLt call for a matmul group, or a cuDNN call for a conv group) and a *_binding.cpp, plus model_new.py whose forward only calls
them.

Python decides the layout (dims merged where every access allows, 16-byte vectors where alignment allows, which
row data stays in registers) and emits the expressions as C statements; the templates hold every loop,
reduction, load and store. Shapes are known at generation time and become constants in the kernels.
"""

from __future__ import annotations

import itertools
import keyword
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kernelpilot.policy.c_ops import C_OPS
from kernelpilot.policy.ir import (
    EPILOGUE_ACTIVATIONS,
    MATMUL_ALIGNMENT,
    STAT_FIELDS,
    Analysis,
    Call,
    Const,
    Expr,
    Field,
    Gather,
    Group,
    Leaf,
    Load,
    Reduce,
    Source,
    Stack,
    matrix_strides,
    walk,
)
from kernelpilot.resources import template_environment

if TYPE_CHECKING:
    from kernelpilot.problem import Problem

CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "bool": "bool", "int64": "int64_t"}
SCALAR_TYPES = {"float32": "torch::kFloat32", "float16": "torch::kFloat16", "bfloat16": "torch::kBFloat16",
                "bool": "torch::kBool", "int64": "torch::kInt64"}  # fmt: skip
ITEM_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "bool": 1, "int64": 8}
CUDA_DATA_TYPES = {"float32": "CUDA_R_32F", "float16": "CUDA_R_16F", "bfloat16": "CUDA_R_16BF"}
# cuBLASLt's epilogue for (adds a bias, activation).
EPILOGUES = {
    (False, None): "CUBLASLT_EPILOGUE_DEFAULT", (True, None): "CUBLASLT_EPILOGUE_BIAS",
    (False, "relu"): "CUBLASLT_EPILOGUE_RELU", (True, "relu"): "CUBLASLT_EPILOGUE_RELU_BIAS",
    (False, "gelu_tanh"): "CUBLASLT_EPILOGUE_GELU", (True, "gelu_tanh"): "CUBLASLT_EPILOGUE_GELU_BIAS",
}  # fmt: skip
# Heuristic algorithms a matmul group times, and the workspace it gives them (what torch gives cuBLASLt on Hopper).
MATMUL_CANDIDATES = 4
MATMUL_WORKSPACE_BYTES = 32 * 1024 * 1024
# Ranked cuDNN algorithms a conv group times (the heuristic's best first).
CONV_CANDIDATES = 4
VECTOR_BYTES = 16
# Floats of a row one thread may keep in registers across passes; beyond this the row is streamed again.
REGISTER_BUDGET = 64
# A block's threads share an SM's 65536 registers (1024 threads: 64 each), and each thread needs about this many
# besides its cached row (pointers, indices, statistics, the epilogue's temporaries) to run without spilling.
REGISTERS_PER_BLOCK = 65536
REGISTER_RESERVE = 32
# Bytes of a row one block may cache in shared memory (an H100 block may opt into 227 KB; the reductions' own
# shared memory needs a little), and the most blocks that may share a row: the portable thread block cluster size.
SHARED_CACHE_BYTES = 192 * 1024
MAX_CLUSTER_BLOCKS = 8
# Data that many rows of a row kernel read (a broadcast mask, a norm's weight) is loaded with L2's evict-last
# policy when it is at most this large: a sixth of an H100's 50 MB L2, so the rows streaming through still have room.
L2_KEPT_BYTES = 8 * 1024 * 1024
STAT_IDENTITIES = {
    ("sum", "sum"): "0.0f",
    ("max", "max"): "-INFINITY",
    ("min", "min"): "INFINITY",
    ("online_softmax", "max"): "-INFINITY",
    ("online_softmax", "sum"): "0.0f",
    ("welford", "count"): "0.0f",
    ("welford", "mean"): "0.0f",
    ("welford", "m2"): "0.0f",
    ("softmax_weighted", "max"): "-INFINITY",
    ("softmax_weighted", "sum"): "0.0f",
    ("softmax_weighted", "weighted"): "0.0f",
}
STAT_WORDS = {"sum": "sum", "max": "max", "min": "min", "online_softmax": "online softmax (max and sum of exp)",
              "welford": "Welford mean and variance",
              "softmax_weighted": "online softmax and a softmax-weighted sum"}  # fmt: skip
_CPP_RESERVED = {"out", "device", "m", "t", "stream", "int", "float", "double", "char", "new", "delete", "this",
                 "auto", "register", "default", "switch", "case", "template", "class", "struct", "const"}  # fmt: skip


@dataclass(frozen=True)
class LaunchConfig:
    """One launch geometry: threads per block (elementwise kernels) or per row (row kernels, which also set
    rows per block), and the vectors each thread has in flight per step.

    `shared_blocks` > 0 caches each row in shared memory, split over that many blocks of `threads` threads (a
    thread block cluster when more than one), for rows too long to cache in registers.

    `persistent` launches one wave of resident blocks that loops over the work; otherwise one block per tile of
    work (the grid-stride loop then runs once), which lets the hardware schedule blocks as SMs free up.

    `min_blocks` > 1 (row kernels) asks ptxas, through `__launch_bounds__`, for few enough registers that this
    many blocks fit on an SM at once.
    """

    threads: int
    items: int = 1
    rows_per_block: int | None = None
    shared_blocks: int = 0
    persistent: bool = True
    min_blocks: int = 1

    @property
    def label(self) -> str:
        if self.shared_blocks:
            split = f"split over a cluster of {self.shared_blocks} blocks" if self.shared_blocks > 1 else "in one block"
            return f"row cached in shared memory, {split} of {self.threads} threads, {self.items} vector(s) in flight"
        grid = "" if self.persistent else ", one block per tile"
        if self.min_blocks > 1:
            grid += f", registers for {self.min_blocks} blocks per SM"
        if self.rows_per_block is None:
            return f"{self.threads} threads per block, {self.items} vector(s) in flight per thread{grid}"
        return (f"{self.threads} threads per row, {self.rows_per_block} row(s) per block, {self.items} vector(s) in "
                f"flight{grid}")  # fmt: skip


@dataclass(frozen=True)
class MatmulConfig:
    """Which of cuBLASLt's heuristic algorithms a matmul group runs: the `algorithm`-th result, best first."""

    algorithm: int

    @property
    def label(self) -> str:
        return f"cuBLASLt heuristic algorithm {self.algorithm + 1} of {MATMUL_CANDIDATES}"


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


@dataclass(frozen=True)
class ConvConfig:
    """Which of cuDNN's ranked forward algorithms a conv group runs: the `algorithm`-th usable one, best first.

    `fused_relu`: the ReLU runs in the call, which cuDNN allows with one algorithm only (implicit precomputed GEMM).
    `channels_last`: cuDNN convolves NHWC copies of the input and weight, and a generated kernel writes the NHWC
    result back as the NCHW output with the bias and ReLU applied (templates/policy/channels_last.cuh.j2).
    `graph` (NHWC only): through cuDNN's graph API, `algorithm` then ranks the engine configurations of its
    heuristics (templates/policy/cudnn_graph.cuh.j2) rather than the legacy API's algorithms.
    """

    algorithm: int
    fused_relu: bool = False
    channels_last: bool = False
    graph: bool = False

    @property
    def label(self) -> str:
        if self.fused_relu:
            return "cuDNN NCHW, its implicit precomputed GEMM algorithm (the only one with a fused ReLU)"
        layout = "NHWC" if self.channels_last else "NCHW"
        ranked = "graph API engine configuration" if self.graph else "heuristic algorithm"
        label = f"cuDNN {layout}, {ranked} {self.algorithm + 1} of {CONV_CANDIDATES}"
        return label + " (input and weight transposed to NHWC, output back to NCHW)" * self.channels_last


KernelConfig = LaunchConfig | MatmulConfig | ColumnConfig | ConvConfig


@dataclass(frozen=True)
class GeneratedFile:
    """A file to write into the workspace, by its path relative to the workspace root."""

    path: str
    content: str


def kernel_stem(group: Group) -> str:
    return f"policy_{group.name}"


def function_name(group: Group) -> str:
    """The name of the group's function in kp_kernels."""
    return f"policy_{group.name}"


def launcher_name(group: Group) -> str:
    return f"kp_policy_{group.name}_launch"


# --------------------------------------------------------------------------------------------- layout


@dataclass
class _Layout:
    """A group's iteration space after merging dims, each access's strides over it, and the vector width.

    In a row group's layout the last `row_dims` dims are the row (several where an access needs them apart, like
    group norm's weight, one per channel of C/G x H*W); a vector never crosses the innermost of them.
    """

    shape: tuple[int, ...]
    strides: list[tuple[int, ...]]
    offsets: list[int]
    vec: int
    row_dims: int = 0

    def along_row(self, index: int) -> bool:
        """True when access `index` moves along the row (an element access), False when it is one value per row."""
        return any(self.strides[index][len(self.shape) - self.row_dims :])

    def vector_broadcast(self, index: int) -> bool:
        """True when an element access is constant along the innermost row dim: one load serves a whole vector."""
        return self.along_row(index) and self.strides[index][-1] == 0


def merge_dims(shape: tuple[int, ...], strides: list[tuple[int, ...]]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Drop size-1 dims and merge neighbours that every access walks as one dim (fewer divisions per index)."""
    keep = [d for d, size in enumerate(shape) if size != 1]
    merged_shape: list[int] = []
    merged: list[list[int]] = [[] for _ in strides]
    for d in keep:
        mergeable = merged_shape and all(s[d] * shape[d] == m[-1] for s, m in zip(strides, merged))
        if mergeable:
            merged_shape[-1] *= shape[d]
            for s, m in zip(strides, merged):
                m[-1] = s[d]
        else:
            merged_shape.append(shape[d])
            for s, m in zip(strides, merged):
                m.append(s[d])
    return tuple(merged_shape), [tuple(m) for m in merged]


def vector_width(dtypes: list[str]) -> int:
    return VECTOR_BYTES // max(ITEM_SIZES[dtype] for dtype in dtypes)


def elementwise_layout(group: Group) -> _Layout:
    shape, strides = merge_dims(group.shape, [a.strides for a in group.accesses])
    if not shape:  # a single element
        shape, strides = (1,), [(0,) for _ in strides]
    offsets = [a.offset for a in group.accesses]
    vector = [i for i, s in enumerate(strides) if s[-1] == 1]
    vec = vector_width([group.tensors[group.accesses[i].tensor].dtype for i in vector] + [group.output.dtype])
    fits = (
        all(s[-1] in (0, 1) for s in strides)
        and (len(shape) == 1 or shape[-1] % vec == 0)
        and all(offsets[i] % vec == 0 and all(x % vec == 0 for x in strides[i][:-1]) for i in vector)
    )
    return _Layout(shape, strides, offsets, vec if fits else 1)


def row_layout(group: Group) -> _Layout:
    split = len(group.shape) - group.row_dims
    outer, outer_strides = merge_dims(group.shape[:split], [a.strides[:split] for a in group.accesses])
    row, row_strides = merge_dims(group.shape[split:], [a.strides[split:] for a in group.accesses])
    if not row:  # rows of one element
        row, row_strides = (1,), [(0,) for _ in group.accesses]
    strides = [o + r for o, r in zip(outer_strides, row_strides)]
    offsets = [a.offset for a in group.accesses]
    layout = _Layout(outer + row, strides, offsets, 1, len(row))
    element = [i for i in range(len(strides)) if layout.along_row(i)]
    vectors = [i for i in element if not layout.vector_broadcast(i)]
    dtypes = [group.tensors[group.accesses[i].tensor].dtype for i in vectors]
    dtypes += [] if group.per_row else [group.output.dtype]
    vec = vector_width(dtypes) if dtypes else 1
    fits = (
        row[-1] % vec == 0
        and all(strides[i][-1] in (0, 1) for i in element)
        and all(offsets[i] % vec == 0 and all(x % vec == 0 for x in strides[i][:-1]) for i in vectors)
    )
    layout.vec = vec if fits else 1
    return layout


def column_terms(layout: _Layout, index: int) -> list[dict[str, Any]]:
    """Offset terms of access `index` for a column (a flat index over the row dims), its own dims merged."""
    row = layout.shape[len(layout.shape) - layout.row_dims :]
    sizes, (strides,) = merge_dims(row, [layout.strides[index][len(layout.shape) - layout.row_dims :]])
    return index_terms(sizes, strides)


def index_terms(sizes: tuple[int, ...], strides: tuple[int, ...]) -> list[dict[str, Any]]:
    """Offset terms of a flat index over `sizes`, innermost first, up to the outermost dim with a stride."""
    terms = [{"size": size, "stride": stride, "last": False} for size, stride in zip(reversed(sizes), reversed(strides))]
    if terms:
        # The outermost dim needs no modulo: the index is already below its size there.
        terms[-1]["last"] = True
    while terms and terms[-1]["stride"] == 0:
        terms.pop()  # outer dims the access does not move along need no arithmetic at all
    return terms


# ----------------------------------------------------------------------------------------- candidates


def matmul_candidates(group: Group) -> list[MatmulConfig]:
    """cuBLASLt's best heuristic algorithms, in its order."""
    return [MatmulConfig(index) for index in range(MATMUL_CANDIDATES)]


def elementwise_candidates(group: Group) -> list[LaunchConfig]:
    """Three tile shapes, then one wave of resident blocks looping over the work."""
    # One block per tile first: on an H100 it beat the one-wave grid-stride loop on every elementwise example
    # timed (by 4-6%, BENCHMARKS.md); the one-wave grid stays as the last try.
    tiles = [LaunchConfig(threads, items, persistent=False) for threads, items in ((256, 2), (128, 4), (512, 1))]
    return [*tiles, LaunchConfig(256, 2)]


def row_candidates(group: Group) -> list[LaunchConfig]:
    """Team sizes around four vectors per thread, the cluster-cached row, and the one-wave loop (POLICY.md)."""
    layout = row_layout(group)
    vectors = group.row_length // layout.vec
    # About four vectors per thread; a warp-sized or smaller team for short rows, a whole block for long ones.
    preferred = min(1024, max(4, next_power_of_two(math.ceil(vectors / 4))))
    if not group.reduces():
        preferred = 32  # no statistics: a row is read at its gathered column only, by one thread

    teams = dict.fromkeys(t for t in (preferred, preferred // 2, preferred * 2) if 4 <= t <= 1024)
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
    else:
        one_wave_team = candidates[0]
    # The one-wave loop of a team that shares its SM where there is one (for token log-probs a one-wave 512-thread
    # grid beat every tile grid before the two-blocks-per-SM teams existed); otherwise of the first.
    candidates.append(replace(one_wave_team, persistent=True))
    return list(dict.fromkeys(candidates))


def _row_config(group: Group, layout: _Layout, threads: int, items: int) -> LaunchConfig:
    rows_per_block = max(1, 256 // threads)
    # At most 16 floats of loads in flight per access: 8-wide (16-bit) vectors halve the items, not the bytes.
    config = LaunchConfig(threads, max(1, min(items, 16 // layout.vec)), rows_per_block)
    return LaunchConfig(threads, 1, rows_per_block) if _cached(group, layout, config) else config


def _with_min_blocks(group: Group, layout: _Layout, config: LaunchConfig, blocks: int) -> LaunchConfig:
    """`config` asking for registers for `blocks` blocks per SM, where the floats a thread streams at once (its
    vectors in flight, for every access of the widest pass) plus the usual reserve fit that share without spilling;
    otherwise `config` as it is."""
    block_threads = config.threads * (config.rows_per_block or 1)
    share = REGISTERS_PER_BLOCK // (block_threads * blocks)
    in_flight = config.items * layout.vec * max(len(accesses) for accesses in _pass_accesses(group, layout))
    return replace(config, min_blocks=blocks) if REGISTER_RESERVE + in_flight <= share else config


def _cached(group: Group, layout: _Layout, config: LaunchConfig) -> bool:
    """True when the row data the statistics read fits in registers, so memory is read once."""
    if config.shared_blocks:
        return False
    vectors_per_thread = math.ceil(group.row_length // layout.vec / config.threads)
    block_threads = config.threads * (config.rows_per_block or 1)
    budget = min(REGISTER_BUDGET, REGISTERS_PER_BLOCK // block_threads - REGISTER_RESERVE)
    return vectors_per_thread * layout.vec * len(_stat_accesses(group, layout)) <= budget


def _shared_config(group: Group, layout: _Layout) -> LaunchConfig | None:
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


def _span(row_length: int, blocks: int, vec: int) -> int:
    """Columns of a row each of `blocks` blocks covers: whole vectors, the last block taking what is left (odd
    vocabularies such as 50,257 split unevenly)."""
    return math.ceil(row_length / (blocks * vec)) * vec


def _pass_accesses(group: Group, layout: _Layout) -> list[list[int]]:
    """The element accesses each pass over the row reads: one pass per statistics level, then the output's."""
    program = _RowProgram(group, layout, {i for i in range(len(layout.strides)) if layout.along_row(i)})
    return [level["accesses"] for level in program.levels] + [program.output["accesses"]]


def _passes(group: Group, layout: _Layout) -> dict[int, int]:
    """How many passes over the row (one per statistics level, one for the output) read each access."""
    counts: dict[int, int] = {}
    for accesses in _pass_accesses(group, layout):
        for index in accesses:
            counts[index] = counts.get(index, 0) + 1
    return counts


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ------------------------------------------------------------------------------------ C expressions

# The statements of a Gather (gather_column is defined in row.cu.j2): its column, each load varying along the row
# read at that column, and the result, 0 for a row whose target is the ignored index (where the gather ignores one).
GATHER_C = {
    "column": "const int64_t {name} = gather_column({index});",
    "load": "const float {name} = to_float(row{access}[column_offset{access}(static_cast<int>({column}))]);",
    "select": "const float {name} = {index} == {ignore} ? 0.0f : {value};",
}
# Renders one load of a gathered expression at a column (by its name): the statement, or None for a load that
# does not vary along the row (already named).
GatheredLoad = Callable[[Load, str, str], "str | None"]


class Emitter:
    """Writes expressions as `const float` statements, each distinct node once.

    `gathered` renders the loads of a Gather's value (row kernels only, where the row pointers exist).
    """

    def __init__(self, names: dict[Expr, str], counter: itertools.count, gathered: GatheredLoad | None = None,
                 lines: list[str] | None = None):  # fmt: skip
        self.names = dict(names)
        self.counter = counter
        self.gathered = gathered
        self.lines: list[str] = [] if lines is None else lines

    def value(self, expr: Expr) -> str:
        if expr in self.names:
            return self.names[expr]
        if isinstance(expr, Const):
            return _literal(expr.value)
        if isinstance(expr, Gather):
            return self._gather(expr)
        if not isinstance(expr, Call):
            raise ValueError(f"no value for {type(expr).__name__} here")
        arguments = [self.value(arg) for arg in expr.args]
        name = f"t{next(self.counter)}"
        self.lines.append(f"const float {name} = {C_OPS[expr.op].format(*arguments)};")
        self.names[expr] = name
        return name

    def _gather(self, gather: Gather) -> str:
        """The gathered value in statements of its own: its loads and nodes mean the target column only here."""
        if self.gathered is None:
            raise ValueError("a gather outside a row kernel")
        index = self.value(gather.index)
        column = f"c{next(self.counter)}"
        self.lines.append(GATHER_C["column"].format(name=column, index=index))
        names = dict(self.names)
        for load in element_loads(gather.value):
            name = f"g{next(self.counter)}"
            statement = self.gathered(load, name, column)
            if statement is not None:
                self.lines.append(statement)
                names[load] = name
        value = Emitter(names, self.counter, self.gathered, self.lines).value(gather.value)
        if gather.ignore is None:
            self.names[gather] = value
            return value
        name = f"t{next(self.counter)}"
        self.lines.append(GATHER_C["select"].format(name=name, index=index, ignore=gather.ignore, value=value))
        self.names[gather] = name
        return name


def _literal(value: float) -> str:
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    text = f"{float(value)!r}f"
    return f"({text})" if value < 0 else text


def element_loads(expr: Expr) -> list[Load]:
    """Loads an expression reads per element: not those inside row statistics (read by their own pass)."""
    found: dict[Load, None] = {}

    def visit(node: Expr) -> None:
        if isinstance(node, Load):
            found[node] = None
        elif isinstance(node, Call):
            for arg in node.args:
                visit(arg)

    visit(expr)
    return list(found)


# ------------------------------------------------------------------------------------------ rendering


def render_model_new(problem: Problem, analysis: Analysis) -> GeneratedFile:
    """model_new.py: Model's constructor and state_dict, and a forward calling the generated kernels."""
    from kernelpilot.workspace import render_model_new as render_with_body

    groups = analysis.generated_groups
    calls = [
        {"result": _result_name(group), "function": function_name(group), "arguments": [_python_source(t) for t in group.tensors]}
        for group in groups
    ]
    returned = [_returned_source(leaf) for leaf in analysis.outputs]
    if analysis.output_container == "tensor":
        returned_text = returned[0]
    elif analysis.output_container == "list":
        returned_text = f"[{', '.join(returned)}]"
    else:
        returned_text = f"({', '.join(returned)}{',' if len(returned) == 1 else ''})"
    kernels = "kernel" if len(groups) == 1 else "kernels"
    body = template_environment("templates").get_template("policy/forward.py.j2").render(
        summary=f"{len(groups)} generated {kernels} ({'; '.join(', '.join(dict.fromkeys(g.ops)) for g in groups)})",
        calls=calls,
        returned=returned_text,
        ignored=analysis.ignored_arguments,
    )
    return GeneratedFile("model_new.py", render_with_body(problem, forward_body=body.rstrip("\n")))


# ---------------------------------------------------------------------------------- kernel contexts


def tensor_context(group: Group, vector_tensors: set[int]) -> list[dict[str, Any]]:
    return [
        {"index": i, "ctype": CTYPES[t.dtype], "vector": i in vector_tensors} for i, t in enumerate(group.tensors)
    ]


def dtype_context(group: Group, integer_reads: frozenset[int] = frozenset()) -> dict[str, Any]:
    """The dtypes a kernel converts from and to, so it defines only those conversions. `integer_reads` are the
    tensors it only reads as integers (class targets), which need no conversion."""
    dtypes = {t.dtype for i, t in enumerate(group.tensors) if i not in integer_reads}
    return {"dtypes": dtypes, "output_dtype": group.output.dtype}


def _access_comment(group: Group, index: int, layout: _Layout, space: str) -> str:
    source = group.tensors[group.accesses[index].tensor]
    strides = ", ".join(map(str, layout.strides[index]))
    return f"Access {index}: {describe_source(source)}, element strides ({strides}) over {space}"


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
                "comment": _access_comment(group, i, layout, "x".join(map(str, layout.shape))),
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


def _stat_accesses(group: Group, layout: _Layout) -> list[int]:
    """Element accesses (those varying along the row) that some row statistic reads."""
    indices = {group.loads[load] for reduce in group.reduces() for operand in reduce.operands
               for load in element_loads(operand)}  # fmt: skip
    return sorted(i for i in indices if layout.along_row(i))


def row_context(group: Group, config: LaunchConfig) -> dict[str, Any]:
    layout = row_layout(group)
    cached = _cached(group, layout, config)
    shared = config.shared_blocks > 0
    stat_accesses = set(_stat_accesses(group, layout))
    span = _span(group.row_length, max(config.shared_blocks, 1), layout.vec)
    outer_dims = len(layout.shape) - layout.row_dims
    accesses = []
    for i, access in enumerate(group.accesses):
        accesses.append(
            {
                "index": i,
                "tensor": access.tensor,
                "ctype": CTYPES[group.tensors[access.tensor].dtype],
                "along_row": layout.along_row(i),
                "broadcast": layout.vector_broadcast(i),
                "integer": group.tensors[access.tensor].dtype == "int64",
                "cached": cached and i in stat_accesses,
                "kept_in_l2": _read_by_many_rows(group, layout, i),
                "shared": shared and i in stat_accesses,
                "cache_offset": sorted(stat_accesses).index(i) * span if shared and i in stat_accesses else 0,
                "offset": layout.offsets[i],
                "terms": index_terms(layout.shape[:outer_dims], layout.strides[i][:outer_dims]),
                "column_terms": column_terms(layout, i),
                "comment": _access_comment(group, i, layout, "rows x row elements"),
            }
        )
    element = [a for a in accesses if a["along_row"]]
    program = _RowProgram(group, layout, {a["index"] for a in element})
    # Shared-memory caches fill while the first pass reads them; those it does not read fill before it.
    first_pass = set(program.levels[0]["accesses"]) if program.levels else set()
    for a in accesses:
        a["fill_in_level0"] = a["index"] in first_pass
    vector_tensors = {a["tensor"] for a in element if not a["broadcast"]} if layout.vec > 1 else set()
    return {
        "description": group.describe(),
        "config": config,
        "rows": group.rows,
        "row_length": group.row_length,
        "threads_per_row": config.threads,
        "rows_per_block": config.rows_per_block,
        "vec": layout.vec,
        "cached": cached,
        "shared": shared,
        "cluster": max(config.shared_blocks, 1),
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
        "gathers": any(isinstance(node, Gather) for node in walk(group.expr)),
        "kept_in_l2": any(a["kept_in_l2"] for a in element),
        **dtype_context(group, _integer_reads(accesses)),
    }


def _read_by_many_rows(group: Group, layout: _Layout, index: int) -> bool:
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


def matmul_context(group: Group, config: MatmulConfig) -> dict[str, Any]:
    """What matmul.cu.j2 needs: cuBLASLt's problem (m, n, k, batch), each operand's layout and op, the epilogue."""
    matmul = group.matmul
    m, n, k = matmul.mnk
    index = {source: i for i, source in enumerate(group.tensors)}
    product = "A @ B" if matmul.alpha == 1.0 else f"{matmul.alpha:g} * (A @ B)"
    formula = product + " + C" * bool(matmul.residual) + " + bias" * bool(matmul.bias)
    if matmul.activation:
        formula = f"{EPILOGUE_ACTIVATIONS[matmul.activation]}({formula})"
    return {
        "description": group.describe(),
        "config": config,
        "candidates": MATMUL_CANDIDATES,
        "alignment": MATMUL_ALIGNMENT,
        "formula": formula,
        "data_type": CUDA_DATA_TYPES[matmul.dtype],
        "epilogue": EPILOGUES[(matmul.bias is not None, matmul.activation)],
        "alpha": _literal(matmul.alpha),
        # cuBLASLt's m, n: the transposed product's (see the template's header).
        "m": n,
        "n": m,
        "k": k,
        "batch": matmul.batch,
        "lt_a": _lt_operand(matmul.b, "B", index[matmul.b.source]),
        "lt_b": _lt_operand(matmul.a, "A", index[matmul.a.source]),
        "bias": index[matmul.bias.source] if matmul.bias else None,
        "residual": index[matmul.residual.source] if matmul.residual else None,
        "tensor_count": len(group.tensors),
        "launcher": launcher_name(group),
    }


def _lt_operand(leaf: Leaf, role: str, tensor: int) -> dict[str, Any]:
    """Our row-major operand X (R x C) as cuBLASLt's column-major operand X^T (C x R).

    A row-major X in memory is already X^T column-major (no transpose); a transposed view of X (unit stride
    down its rows, such as a Linear weight's `.t()`) is X column-major, which cuBLASLt transposes (CUBLAS_OP_T).
    """
    rows, cols = leaf.shape[-2:]
    transposed, leading = matrix_strides(leaf.shape[-2:], leaf.strides[-2:])
    stored = (rows, cols) if transposed else (cols, rows)
    how = "transposed by cuBLASLt" if transposed else "read as it is"
    return {
        "tensor": tensor,
        "name": f"our {role}",
        "offset_bytes": leaf.offset * ITEM_SIZES[leaf.source.dtype],
        "op": "CUBLAS_OP_T" if transposed else "CUBLAS_OP_N",
        "rows": stored[0],
        "cols": stored[1],
        "ld": leading,
        "batch_stride": leaf.strides[0] if len(leaf.shape) == 3 else 0,
        "comment": f"our {role}, {describe_source(leaf.source)}, {rows}x{cols} with strides "
        f"({', '.join(map(str, leaf.strides))}): column-major {stored[0]}x{stored[1]}, {how}",
    }


class _RowProgram:
    """A row group's expressions split by where they run: per row (hoisted) or per element, level by level.

    A statistic's level is one more than the highest level of the statistics its input uses, so each level is
    one pass over the row (registers when cached) followed by one reduction.
    """

    def __init__(self, group: Group, layout: _Layout, element_accesses: set[int]):
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
        if not isinstance(expr, Call):
            return
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


# ------------------------------------------------------------------------------------- Python sources


def argument_names(sources: list[Source]) -> list[str]:
    """C++ parameter names for the binding: the tensors' own names, made identifiers and unique."""
    names: list[str] = []
    for source in sources:
        name = re.sub(r"\W", "_", source.name)
        if not name or name[0].isdigit() or name in _CPP_RESERVED or name in names:
            name = f"t{len(names)}_{name}"
        names.append(name)
    return names


def _result_name(group: Group) -> str:
    return f"out_{group.name}"


def _python_source(source: Source) -> str:
    """How ModelNew.forward refers to a tensor: an argument, a parameter or buffer, or an earlier result."""
    if source.kind == "input":
        return source.name
    if source.kind == "group":
        return f"out_{source.name}"
    parts = source.name.split(".")
    if all(part.isidentifier() and not keyword.iskeyword(part) for part in parts):
        return "self." + source.name
    module, _, attribute = source.name.rpartition(".")
    return f"getattr(self.get_submodule({module!r}), {attribute!r})"


def _returned_source(leaf: Leaf) -> str:
    name = f"out_{leaf.source.name}"
    if leaf.shape == leaf.source.shape:
        return name
    count = math.prod(leaf.shape)
    if leaf.offset or count != math.prod(leaf.source.shape):  # one value per row of a stacked output (merge.py)
        name = f"{name}.view(-1)[{leaf.offset}:{leaf.offset + count}]"
    return f"{name}.view({', '.join(map(str, leaf.shape))}{',' if len(leaf.shape) == 1 else ''})"


def describe_source(source: Source) -> str:
    kind = {"input": "forward argument", "parameter": "parameter", "group": "result of"}.get(source.kind, source.kind)
    return f"{kind} {source.name} ({source.dtype}, {'x'.join(map(str, source.shape)) or 'scalar'})"


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= size
    return tuple(reversed(strides))
