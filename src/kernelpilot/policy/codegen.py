"""Render an Analysis into workspace files from templates/policy/: per generated group a torch-free .cu (kernel and
launcher, or a cuBLASLt call for a matmul group, or a cuDNN call for a conv group) and a *_binding.cpp, plus model_new.py whose forward only calls
them.

Python decides the layout (dims merged where every access allows, 16-byte vectors where alignment allows, which
row data stays in registers) and emits the expressions as C statements; the templates hold every loop,
reduction, load and store. Shapes are known at generation time and become constants in the kernels, except a
batch (and sequence) that leading.py shows may vary: the kernels and library calls then take it at run time.
"""

from __future__ import annotations

import itertools
import keyword
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kernelpilot.policy.c_ops import C_OPS
from kernelpilot.policy.ir import Analysis, Call, Const, Expr, Gather, Group, Leaf, Load, Source
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
# An H100's SMs: a grid of fewer blocks leaves SMs idle.
SM_COUNT = 132
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
    ("argmax", "max"): "-INFINITY",
    ("argmax", "index"): "INFINITY",  # no column yet: any column is earlier
    ("argmin", "min"): "INFINITY",
    ("argmin", "index"): "INFINITY",
}
STAT_WORDS = {"sum": "sum", "max": "max", "min": "min", "online_softmax": "online softmax (max and sum of exp)",
              "welford": "Welford mean and variance",
              "softmax_weighted": "online softmax and a softmax-weighted sum",
              "argmax": "max and its first column", "argmin": "min and its first column"}  # fmt: skip
# "batch": the binding's name for the runtime batch (leading.py).
_CPP_RESERVED = {"out", "device", "batch", "m", "t", "stream", "int", "float", "double", "char", "new", "delete",
                 "this", "auto", "register", "default", "switch", "case", "template", "class", "struct", "const"}  # fmt: skip


@dataclass(frozen=True)
class LaunchConfig:
    """One launch geometry: threads per block (elementwise kernels) or per row (row kernels, which also set
    rows per block), and the vectors each thread has in flight per step.

    `shared_blocks` > 0 caches each row in shared memory, split over that many blocks of `threads` threads (a
    thread block cluster when more than one), for rows too long to cache in registers.

    `split_blocks` > 1 streams each row split over a cluster of that many blocks, which merge their statistics
    through distributed shared memory: for rows too few to give every SM a block.

    `persistent` launches one wave of resident blocks that loops over the work; otherwise one block per tile of
    work (the grid-stride loop then runs once), which lets the hardware schedule blocks as SMs free up.

    `min_blocks` > 1 (row kernels) asks ptxas, through `__launch_bounds__`, for few enough registers that this
    many blocks fit on an SM at once.
    """

    threads: int
    items: int = 1
    rows_per_block: int | None = None
    shared_blocks: int = 0
    split_blocks: int = 0
    persistent: bool = True
    min_blocks: int = 1

    @property
    def label(self) -> str:
        if self.shared_blocks:
            split = f"split over a cluster of {self.shared_blocks} blocks" if self.shared_blocks > 1 else "in one block"
            return f"row cached in shared memory, {split} of {self.threads} threads, {self.items} vector(s) in flight"
        grid = "" if self.persistent else ", one block per tile"
        if self.split_blocks:
            grid = f", each row streamed by a cluster of {self.split_blocks} blocks"
        if self.min_blocks > 1:
            grid += f", registers for {self.min_blocks} blocks per SM"
        if self.rows_per_block is None:
            return f"{self.threads} threads per block, {self.items} vector(s) in flight per thread{grid}"
        return (f"{self.threads} threads per row, {self.rows_per_block} row(s) per block, {self.items} vector(s) in "
                f"flight{grid}")  # fmt: skip


@dataclass(frozen=True)
class GeneratedFile:
    """A file to write into the workspace, by its path relative to the workspace root."""

    path: str
    content: str


def kernel_stem(group: Group) -> str:
    return f"policy_{group.name}"


def function_name(group: Group) -> str:
    """The name of the group's operator: `kp_ops.<name>` in model_new.py, torch.ops.<namespace>.<name>."""
    return f"policy_{group.name}"


def launcher_name(group: Group) -> str:
    return f"kp_policy_{group.name}_launch"


# --------------------------------------------------------------------------------------------- layout


@dataclass
class Layout:
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


def elementwise_layout(group: Group) -> Layout:
    shape, strides = merge_dims(group.shape, [a.strides for a in group.accesses])
    if not shape:  # a single element
        shape, strides = (1,), [(0,) for _ in strides]
    offsets = [a.offset for a in group.accesses]
    vector = [i for i, s in enumerate(strides) if s[-1] == 1]
    vec = vector_width([group.tensors[group.accesses[i].tensor].dtype for i in vector] + [group.output.dtype])
    fits = (
        all(s[-1] in (0, 1) for s in strides)
        and all(a.bounds is None for a in group.accesses)  # a windowed access loads element by element
        and (len(shape) == 1 or shape[-1] % vec == 0)
        and all(offsets[i] % vec == 0 and all(x % vec == 0 for x in strides[i][:-1]) for i in vector)
    )
    return Layout(shape, strides, offsets, vec if fits else 1)


def row_layout(group: Group) -> Layout:
    split = len(group.shape) - group.row_dims
    outer, outer_strides = merge_dims(group.shape[:split], [a.strides[:split] for a in group.accesses])
    row, row_strides = merge_dims(group.shape[split:], [a.strides[split:] for a in group.accesses])
    if not row:  # rows of one element
        row, row_strides = (1,), [(0,) for _ in group.accesses]
    strides = [o + r for o, r in zip(outer_strides, row_strides)]
    offsets = [a.offset for a in group.accesses]
    layout = Layout(outer + row, strides, offsets, 1, len(row))
    element = [i for i in range(len(strides)) if layout.along_row(i)]
    vectors = [i for i in element if not layout.vector_broadcast(i)]
    dtypes = [group.tensors[group.accesses[i].tensor].dtype for i in vectors]
    dtypes += [] if group.per_row else [group.output.dtype]
    vec = vector_width(dtypes) if dtypes else 1
    fits = (
        row[-1] % vec == 0
        and all(a.guard is None for a in group.accesses)  # a guarded access loads element by element
        and all(strides[i][-1] in (0, 1) for i in element)
        and all(offsets[i] % vec == 0 and all(x % vec == 0 for x in strides[i][:-1]) for i in vectors)
    )
    layout.vec = vec if fits else 1
    return layout


def row_access_context(group: Group, layout: Layout, index: int) -> dict[str, Any]:
    """What a row or scan template knows of access `index`: its tensor and C type, whether it moves along the row
    (and is constant along its innermost dim: one load per vector), and the offset terms of its row and column."""
    access = group.accesses[index]
    outer_dims = len(layout.shape) - layout.row_dims
    return {
        "index": index,
        "tensor": access.tensor,
        "ctype": CTYPES[group.tensors[access.tensor].dtype],
        "along_row": layout.along_row(index),
        "broadcast": layout.vector_broadcast(index),
        "offset": layout.offsets[index],
        "terms": index_terms(layout.shape[:outer_dims], layout.strides[index][:outer_dims]),
        "column_terms": column_terms(layout, index),
        "comment": access_comment(group, index, layout, "rows x row elements"),
    }


def column_terms(layout: Layout, index: int) -> list[dict[str, Any]]:
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
            return c_literal(expr.value)
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


def c_literal(value: float) -> str:
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    text = f"{float(value)!r}f"
    return f"({text})" if value < 0 else text


def element_loads(expr: Expr) -> list[Load]:
    """Loads an expression reads per element: not those inside row statistics (read by their own pass)."""
    found: dict[Load, None] = {}

    seen: set[Expr] = set()

    def visit(node: Expr) -> None:
        if node in seen:  # a shared subexpression: its loads are found already (a DAG has exponentially many paths)
            return
        seen.add(node)
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
    free_dims = {group.output: group.free_dims for group in groups}
    returned = [_returned_source(leaf, free_dims.get(leaf.source, 0)) for leaf in analysis.outputs]
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


# ------------------------------------------------------------------------- shared by the kernel contexts


def tensor_context(group: Group, vector_tensors: set[int]) -> list[dict[str, Any]]:
    return [
        {"index": i, "ctype": CTYPES[t.dtype], "vector": i in vector_tensors} for i, t in enumerate(group.tensors)
    ]


def dtype_context(group: Group, integer_reads: frozenset[int] = frozenset()) -> dict[str, Any]:
    """The dtypes a kernel converts from and to, so it defines only those conversions. `integer_reads` are the
    tensors it only reads as integers (class targets), which need no conversion."""
    dtypes = {t.dtype for i, t in enumerate(group.tensors) if i not in integer_reads}
    return {"dtypes": dtypes, "output_dtype": group.output.dtype}


def access_comment(group: Group, index: int, layout: Layout, space: str) -> str:
    source = group.tensors[group.accesses[index].tensor]
    strides = ", ".join(map(str, layout.strides[index]))
    return f"Access {index}: {describe_source(source)}, element strides ({strides}) over {space}"


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


def _returned_source(leaf: Leaf, free_dims: int = 0) -> str:
    """How forward returns a view of a result; `free_dims`: the result's first dims that are runtime sizes (the
    batch, and the sequence), which the view keeps (leading.py allows only such views then)."""
    name = f"out_{leaf.source.name}"
    if leaf.shape == leaf.source.shape:
        return name
    if free_dims:
        free = [f"{name}.shape[{dim}]" for dim in range(free_dims)]
        return f"{name}.view({', '.join([*free, *map(str, leaf.shape[free_dims:])])})"
    count = math.prod(leaf.shape)
    if leaf.offset or count != math.prod(leaf.source.shape):  # one value per row of a stacked output (merge.py)
        name = f"{name}.view(-1)[{leaf.offset}:{leaf.offset + count}]"
    return f"{name}.view({', '.join(map(str, leaf.shape))}{',' if len(leaf.shape) == 1 else ''})"


def describe_source(source: Source) -> str:
    kind = {"input": "forward argument", "parameter": "parameter", "group": "result of"}.get(source.kind, source.kind)
    return f"{kind} {source.name} ({source.dtype}, {'x'.join(map(str, source.shape)) or 'scalar'})"

