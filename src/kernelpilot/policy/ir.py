"""The policy's IR: tensors (Source, Leaf), expressions (Load and its Window, Const, Call, Reduce, Field, Gather,
Stack), groups (one generated kernel or library call each: Group with its Matmul or Conv), the Analysis of a problem,
and the tree utilities every later stage uses (walk, rebuilt). Nothing here knows about aten, tracing or CUDA text."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Protocol, Union

if TYPE_CHECKING:
    import torch

# Activations cuBLASLt's epilogue computes exactly as torch does (its GELU is the tanh approximation).
EPILOGUE_ACTIVATIONS = {"relu": "ReLU", "gelu_tanh": "GELU (tanh)"}
# Byte alignment the generated matmuls ask cuBLASLt's algorithms for; an operand view off it is copied first.
MATMUL_ALIGNMENT = 16
# Matrix products run by cuBLASLt, on these operand dtypes (all computed in plain float32: no TF32, as torch).
MATMUL_DTYPES = ("float32", "float16", "bfloat16")


class NotFusible(Exception):
    """An op whose arguments cannot be folded into one kernel; the message says why."""


def hashed_once(cls: type) -> type:
    """A frozen dataclass whose hash, the dataclass's own (of its fields), is computed once per object and kept.

    Expressions are DAGs: layer norm's (x - mean(x)) * rstd(x) reads x three times, and x is the previous layer's
    result. The dataclass hash recomputes a node's children on every path to them, which doubles with every such
    layer (a six-layer transformer took minutes to analyse); kept, it is computed once per node."""
    names = tuple(item.name for item in fields(cls))

    def __hash__(self: Any) -> int:
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, name) for name in names))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self: Any) -> dict:
        # Another process hashes strings differently: a copy computes its hash again.
        return {key: value for key, value in self.__dict__.items() if key != "_hash"}

    cls.__hash__ = __hash__
    cls.__getstate__ = __getstate__
    return cls


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class Source:
    """A whole tensor a kernel reads or writes: a forward argument, a parameter or buffer, or a group's output."""

    kind: str  # "input" | "parameter" | "group" | "unsupported"
    name: str  # forward argument name, state_dict name, or group name
    shape: tuple[int, ...]
    dtype: str  # "float32", "bfloat16", ...


@dataclass(frozen=True)
class Leaf:
    """A view of a contiguous `Source`: its shape, element strides and offset."""

    source: Source
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    @classmethod
    def whole(cls, source: Source) -> Leaf:
        return cls(source, source.shape, contiguous_strides(source.shape))

    def meta(self) -> torch.Tensor:
        """A meta tensor with this view's shape, strides and offset, to re-run view ops on."""
        import torch

        base = torch.empty(max(math.prod(self.source.shape), 1), dtype=getattr(torch, self.source.dtype), device="meta")
        return base.as_strided(self.shape, self.strides, self.offset)


# ----------------------------------------------------------------------------------------- expressions


@dataclass(frozen=True)
class Window:
    """Where a windowed load reads: `leaf`'s element (c - origin) at coordinate c of the use, where that lies in
    the leaf (0 <= c - origin < leaf's shape, dim by dim), and `fill` elsewhere: one input of a cat at its place
    along the joined dim (fill 0), a padded tensor (fill the padding value). `diagonal` (k, upper) also keeps only
    the elements on or above (triu) or on or below (tril) the k-th diagonal of the last two dims."""

    origin: tuple[int, ...]
    fill: float = 0.0
    diagonal: tuple[int, bool] | None = None


@dataclass(frozen=True)
class Guard:
    """Where a guarded load reads: only where every check holds, `fill` elsewhere. A check (terms, low, size) holds
    where low + the sum of factor * coordinate j of the use, over its (j, factor) terms, lies in [0, size): a pooling
    window over implicit padding reads input coordinate out * stride + k * dilation - padding, inside the input."""

    checks: tuple[tuple[tuple[tuple[int, int], ...], int, int], ...]
    fill: float


@hashed_once
@dataclass(frozen=True)
class Load:
    """One element of `leaf`, broadcast into the shape of the op that used it (`use_shape`).

    `rows` marks a use inside a keepdim=False reduction's result, whose shape lacks the reduced last dim.
    `window`: a windowed load (see Window; its leaf has as many dims as `use_shape`, and only elementwise kernels
    over `use_shape` read it). `guard`: a guarded load (see Guard; only row kernels over `use_shape` read it).
    """

    leaf: Leaf
    use_shape: tuple[int, ...]
    rows: bool = False
    window: Window | None = None
    guard: Guard | None = None


@hashed_once
@dataclass(frozen=True)
class Const:
    value: float
    # The length of a reduction the lowering divides by (a mean's, a variance's, a norm's or a pooling window's
    # count), or its inverse: a fixed size, so leading.py never takes it for a batch or sequence traced to a number.
    reduction_length: bool = False


@hashed_once
@dataclass(frozen=True)
class Call:
    op: str  # a key of C_OPS
    args: tuple[Expr, ...]


@hashed_once
@dataclass(frozen=True)
class Reduce:
    """A statistic of `value` over each row: the `dims` dims of `shape` before its last `inner` dims (the last
    `dims` dims when `inner` is 0; a column reduction otherwise, one statistic per (outer, inner) position).

    A "softmax_weighted" statistic is an online softmax of `value` that also sums exp(value - max) * `weighted`
    in the same pass (expectation.py)."""

    kind: str  # "sum" | "max" | "min" | "online_softmax" (max and sum of exp) | "welford" (mean and m2)
    # | "softmax_weighted" (max, sum of exp, and sum of exp times `weighted`)
    # | "argmax" / "argmin" (the max or min and the first column holding it; NaN counts as the max and the min)
    value: Expr
    shape: tuple[int, ...]
    dims: int = 1
    inner: int = 0
    weighted: Expr | None = None  # softmax_weighted only: the per-element value its weights multiply

    @property
    def operands(self) -> tuple[Expr, ...]:
        """The per-element expressions the statistic reads: its value, and what a softmax_weighted one weighs."""
        return (self.value,) if self.weighted is None else (self.value, self.weighted)

    @property
    def space(self) -> tuple[tuple[int, ...], int, int]:
        """The iteration shape, how many dims of it are reduced and how many follow them: statistics sharing it
        share a kernel."""
        return self.shape, self.dims, self.inner


@hashed_once
@dataclass(frozen=True)
class Field:
    """One number of a row statistic: sum, max, min; online_softmax: max, sum; welford: mean, m2;
    softmax_weighted: max, sum, weighted; argmax: max, index; argmin: min, index."""

    reduce: Reduce
    name: str


@hashed_once
@dataclass(frozen=True)
class Gather:
    """`value`, an expression over rows (the last dim of `shape`), at one column per row: `index`, the row's int64
    target (nll_loss) or column (gather along the last dim). Rows whose target is `ignore` give 0, as nll_loss's
    ignore_index does; None when no index is ignored (gather)."""

    value: Expr
    index: Load
    ignore: int | None
    shape: tuple[int, ...]
    dims = 1  # rows are the last dim, as a Reduce's `dims`
    inner = 0

    @property
    def space(self) -> tuple[tuple[int, ...], int, int]:
        return self.shape, self.dims, self.inner


@hashed_once
@dataclass(frozen=True)
class Scan:
    """A running statistic along the last dim of `shape`: element i of a row is value[0] op value[1] ... op
    value[i] ("sum": cumsum, "prod": cumprod), computed in float. Only the root of a scan group's expression: a
    scan kernel writes it as it is (lowering.py writes every running sum into its own group)."""

    kind: str  # "sum" | "prod"
    value: Expr  # elementwise over `shape`
    shape: tuple[int, ...]
    reverse: bool = False  # from the row's end: element i is value[i] op ... op value[n - 1]


@hashed_once
@dataclass(frozen=True)
class Stack:
    """Several one-value-per-row expressions of one row kernel, written one after another: the kernel's output
    holds `values[k]` for every row at [k, row] (see merge.py)."""

    values: tuple[Expr, ...]


Expr = Union[Load, Const, Call, Reduce, Field, Gather, Scan, Stack]
STAT_FIELDS = {
    "sum": ("sum",),
    "max": ("max",),
    "min": ("min",),
    "online_softmax": ("max", "sum"),
    "welford": ("count", "mean", "m2"),
    "softmax_weighted": ("max", "sum", "weighted"),
    "argmax": ("max", "index"),
    "argmin": ("min", "index"),
}


@hashed_once
@dataclass(frozen=True)
class Value:
    """A computed tensor not yet in memory: an expression and the shape and dtype torch gives it."""

    expr: Expr
    shape: tuple[int, ...]
    dtype: str
    ops: tuple[str, ...]  # the aten ops folded into it, for the plan
    rows: bool = False  # shaped like a keepdim=False reduction's result


# --------------------------------------------------------------------------------------------- groups


@dataclass(frozen=True)
class Matmul:
    """What a matmul group computes: act(a @ b + residual + bias) in one cuBLASLt call.

    `a` (M x K) and `b` (K x N) are views with unit stride along one of their two matrix dims (batched:
    a leading batch dim, any stride); `bias` has N values along the output's last dim; `residual` is a whole
    tensor of the output's shape (cuBLASLt's C with beta = 1). `shape` is the output's shape as forward sees
    it: contiguous, its last dim N. `alpha` scales the product alone (cuBLASLt's alpha): a number forward
    multiplies the product by before anything is added to it, such as a LoRA branch's alpha / rank.
    """

    a: Leaf
    b: Leaf
    shape: tuple[int, ...]
    dtype: str
    ops: tuple[str, ...]
    bias: Leaf | None = None
    residual: Leaf | None = None
    activation: str | None = None  # a key of EPILOGUE_ACTIVATIONS
    alpha: float = 1.0

    @property
    def batch(self) -> int:
        return self.a.shape[0] if len(self.a.shape) == 3 else 1

    @property
    def mnk(self) -> tuple[int, int, int]:
        return self.a.shape[-2], self.b.shape[-1], self.a.shape[-1]

    def epilogue(self) -> str:
        """The epilogue in words, e.g. "scale 2, bias, residual, GELU (tanh)"; "" when there is none."""
        parts = [f"scale {self.alpha:g}"] * (self.alpha != 1.0)
        parts += ["bias"] * bool(self.bias) + ["residual"] * bool(self.residual)
        return ", ".join(parts + ([EPILOGUE_ACTIVATIONS[self.activation]] if self.activation else []))


@dataclass(frozen=True)
class Conv:
    """What a conv group computes: act(convolution(input, weight) + bias) in one cuDNN call.

    `input` (N, C, *spatial) and `weight` (K, C/groups, *kernel) are contiguous views (offsets aligned to 16
    bytes); `bias` has K values; `shape` is the output's, (N, K, *spatial), contiguous. One to three spatial dims.
    `transposed`: a transposed convolution (weight (C, K/groups, *kernel)), cuDNN's backward data of the
    convolution with these settings; it takes no bias or activation (the bias is added by the kernel after it).
    """

    input: Leaf
    weight: Leaf
    shape: tuple[int, ...]
    dtype: str
    ops: tuple[str, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int = 1
    bias: Leaf | None = None
    activation: str | None = None  # "relu", only with a bias (cudnnConvolutionBiasActivationForward)
    transposed: bool = False
    output_padding: tuple[int, ...] = ()  # transposed only: extra output rows torch adds (what the shape shows)

    def epilogue(self) -> str:
        """The epilogue in words, e.g. "bias, ReLU"; "" when there is none."""
        return ", ".join(["bias"] * bool(self.bias) + (["ReLU"] if self.activation == "relu" else []))


@dataclass(frozen=True)
class Access:
    """How a kernel reads one of its tensors: element strides over the group's iteration shape, and an offset.

    A windowed access (`bounds`, one (start, end) per dim of the iteration shape) reads only where every
    coordinate lies in its range (and on the side of its `diagonal`), and is `fill` elsewhere; its offset may then be
    negative. A guarded access (`guard`) reads only where its checks hold, as negative an offset."""

    tensor: int  # index into Group.tensors
    strides: tuple[int, ...]
    offset: int
    bounds: tuple[tuple[int, int], ...] | None = None
    fill: float = 0.0
    diagonal: tuple[int, bool] | None = None  # see Window
    guard: Guard | None = None  # see Guard: its checks are over the group's iteration shape


@dataclass
class Group:
    """One kernel's worth of the forward, or one library call, in execution order."""

    name: str  # "g0", "g1", ...
    kind: str  # "elementwise" | "row" | "column" | "scan" | "matmul" | "conv" | "library"
    ops: list[str]
    tensors: list[Source]  # what it reads, in argument order
    output: Source
    shape: tuple[int, ...] = ()  # iteration shape; for row groups the last dim is the reduced row
    expr: Expr | None = None  # None for library groups
    accesses: list[Access] = field(default_factory=list)
    loads: dict[Load, int] = field(default_factory=dict)  # Load -> index into accesses
    per_row: bool = False  # a row group writing one value per row
    row_dims: int = 1  # how many trailing dims of `shape` one row spans (column groups: the reduced dims)
    matmul: Matmul | None = None  # what a matmul group computes
    inner_dims: int = 0  # column groups: how many trailing dims of `shape` follow the reduced ones
    conv: Conv | None = None  # what a conv group computes
    free_dims: int = 0  # how many leading dims of `shape` are runtime sizes: 1 the batch, 2 batch and sequence (leading.py)
    carrier_dims: tuple[int, ...] = ()  # per tensor: its leading dims that are runtime sizes (0: fixed) (leading.py)

    @property
    def leading_free(self) -> bool:
        """Dim 0 of `shape` (and maybe dim 1: `free_dims`) is a runtime size."""
        return self.free_dims > 0

    @property
    def free_count(self) -> int:
        """The product of the free dims' sizes when generated: the runtime count the kernel's launcher takes."""
        return math.prod(self.shape[: self.free_dims])

    @property
    def generated(self) -> bool:
        return self.kind in ("elementwise", "row", "column", "scan", "matmul", "conv")

    @property
    def rows(self) -> int:
        return math.prod(self.shape[: -self.row_dims]) if self.shape else 1

    @property
    def row_length(self) -> int:
        return math.prod(self.shape[-self.row_dims :]) if self.shape else 1

    def reduces(self) -> list[Reduce]:
        """The row statistics in the expression, each once, inner ones first."""
        return [node for node in walk(self.expr) if isinstance(node, Reduce)] if self.expr is not None else []

    def describe(self) -> str:
        ops = ", ".join(dict.fromkeys(self.ops)) or "a copy"
        shape = "x".join(map(str, self.shape or self.output.shape)) or "scalar"
        if self.kind == "library":
            return f"{ops}: a matrix op for cuBLAS/cuDNN (the built-in policy does not generate it)"
        if self.kind == "conv":
            return f"{ops}: {describe_conv(self.conv)}"
        if self.kind == "matmul":
            m, n, k = self.matmul.mnk
            batch = f"{self.matmul.batch} x " if self.matmul.batch > 1 else ""
            epilogue = self.matmul.epilogue()
            fused = f" with a fused {epilogue} epilogue" if epilogue else ""
            return f"{ops}: one cuBLASLt matmul, {batch}{m}x{k} @ {k}x{n}{fused} ({self.output.dtype})"
        if self.kind == "row":
            stacked = f", {len(self.expr.values)} values per row" if isinstance(self.expr, Stack) else ""
            return f"{ops}: one row kernel over {self.rows} rows of {self.row_length}{stacked} ({self.output.dtype})"
        if self.kind == "scan":
            return f"{ops}: one scan kernel over {self.rows} rows of {self.row_length} ({self.output.dtype})"
        if self.kind == "column":
            outer, reduced, inner = column_extents(self)
            return (f"{ops}: one column kernel reducing {reduced} values for each of {outer} x {inner} outputs "
                    f"({self.output.dtype})")  # fmt: skip
        return f"{ops}: one fused elementwise kernel over {shape} ({self.output.dtype})"


@dataclass(frozen=True)
class Unsupported:
    """An op the built-in policy cannot generate, and why."""

    op: str
    reason: str

    def __str__(self) -> str:
        return f"{self.op} ({self.reason})"


@dataclass
class Analysis:
    """The forward as groups in execution order, what it returns, and what the policy cannot do."""

    problem_name: str
    groups: list[Group]
    outputs: list[Leaf]  # what forward returns, each a contiguous view of a group's output
    output_container: str  # "tensor" | "tuple" | "list": how forward returns `outputs`
    unsupported: list[Unsupported]
    ignored_arguments: list[str] = field(default_factory=list)  # non-tensor forward arguments, baked in

    @property
    def supported(self) -> bool:
        """True when every group can be generated, so ModelNew.forward needs nothing but the kernels."""
        return not self.unsupported and all(group.generated for group in self.groups)

    @property
    def generated_groups(self) -> list[Group]:
        return [group for group in self.groups if group.generated]

    def blockers(self) -> str:
        """One sentence naming what keeps the forward from running on generated kernels alone ('' when nothing)."""
        reasons = [str(item) for item in self.unsupported]
        reasons += [f"{', '.join(group.ops)} (a matrix op: needs cuBLAS/cuDNN)" for group in self.groups if not group.generated]
        if not reasons:
            return ""
        return "Not supported by the built-in policy: " + "; ".join(dict.fromkeys(reasons)) + "."


def describe_conv(conv: Conv) -> str:
    """E.g. "one cuDNN convolution, 32x64x128x128 * 128x64x3x3 (padding 1) with a fused bias, ReLU epilogue"."""
    settings = [f"{name} {_sizes(values)}" for name, values, plain in
                (("stride", conv.stride, 1), ("padding", conv.padding, 0), ("dilation", conv.dilation, 1))
                if any(v != plain for v in values)]  # fmt: skip
    settings += [f"{conv.groups} groups"] if conv.groups > 1 else []
    shown = f" ({', '.join(settings)})" if settings else ""
    epilogue = conv.epilogue()
    fused = f" with a fused {epilogue} epilogue" if epilogue else ""
    shapes = f"{_shape(conv.input.shape)} * {_shape(conv.weight.shape)}"
    kind = "transposed convolution (its backward data)" if conv.transposed else "convolution"
    return f"one cuDNN {kind}, {shapes}{shown}{fused} ({conv.dtype})"


def _sizes(values: tuple[int, ...]) -> str:
    return str(values[0]) if len(set(values)) == 1 else "x".join(map(str, values))


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


# ------------------------------------------------------------------------------------------- helpers


def rebuilt(expr: Expr, rule: Callable[[Expr], Expr | None], done: dict[Expr, Expr] | None = None) -> Expr:
    """`expr` with each node that `rule` maps to a replacement replaced (the replacement is not visited again) and
    the others rebuilt from their rewritten parts. `done` memoises, so a shared subexpression is rewritten once."""
    done = {} if done is None else done
    if expr in done:
        return done[expr]
    result = rule(expr)
    if result is None:
        def again(node: Expr) -> Expr:
            return rebuilt(node, rule, done)

        if isinstance(expr, Call):
            result = Call(expr.op, tuple(again(arg) for arg in expr.args))
        elif isinstance(expr, Reduce):
            weighted = None if expr.weighted is None else again(expr.weighted)
            result = replace(expr, value=again(expr.value), weighted=weighted)
        elif isinstance(expr, Field):
            result = replace(expr, reduce=again(expr.reduce))
        elif isinstance(expr, Gather):
            result = replace(expr, value=again(expr.value), index=again(expr.index))
        elif isinstance(expr, Stack):
            result = Stack(tuple(again(value) for value in expr.values))
        elif isinstance(expr, Scan):
            result = replace(expr, value=again(expr.value))
        else:
            result = expr
    done[expr] = result
    return result


def walk(expr: Expr | None) -> list[Expr]:
    """Every node of `expr` once, children before parents (a Reduce after the nodes of its value)."""
    seen: dict[Expr, None] = {}

    def visit(node: Expr) -> None:
        if node in seen:
            return
        if isinstance(node, Call):
            for arg in node.args:
                visit(arg)
        elif isinstance(node, Reduce):
            for operand in node.operands:
                visit(operand)
        elif isinstance(node, Field):
            visit(node.reduce)
        elif isinstance(node, Gather):
            visit(node.value)
            visit(node.index)
        elif isinstance(node, Stack):
            for value in node.values:
                visit(value)
        elif isinstance(node, Scan):
            visit(node.value)
        seen[node] = None

    if expr is not None:
        visit(expr)
    return list(seen)


def walk_reduces(expr: Expr) -> list[Reduce]:
    return [node for node in walk(expr) if isinstance(node, Reduce)]


def is_index(expr: Expr) -> bool:
    """True for the column an argmax or argmin found: an int64 value a row kernel may write."""
    return isinstance(expr, Field) and expr.name == "index"


def windowed(expr: Expr | None) -> bool:
    """True when the expression holds a windowed load (see Window)."""
    return any(isinstance(node, Load) and node.window is not None for node in walk(expr))


def column_extents(group: Group) -> tuple[int, int, int]:
    """A column group's (outer, reduced, inner) element counts: its iteration shape seen as three dims."""
    end = len(group.shape) - group.inner_dims
    start = end - group.row_dims
    return math.prod(group.shape[:start]), math.prod(group.shape[start:end]), math.prod(group.shape[end:])


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def matrix_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[bool, int] | None:
    """(transposed, leading dimension) of a rows x cols view: row-major when its columns are adjacent (leading
    dimension: its row stride), transposed when its rows are; None when neither is."""
    rows, cols = shape
    if (cols == 1 or strides[1] == 1) and (rows == 1 or strides[0] >= cols):
        return False, strides[0] if rows > 1 else cols
    if (rows == 1 or strides[0] == 1) and (cols == 1 or strides[1] >= rows):
        return True, strides[1] if cols > 1 else rows
    return None


class Builder(Protocol):
    """What lowering and the library families ask of the group builder (`analysis.GroupBuilder`), so that no stage
    below analysis imports it."""

    def materialise(self, value: Value) -> Leaf:
        """The group computing `value` into a new contiguous tensor."""
        ...

    def library_operand(self, item: Any, readable: Callable[[Leaf], bool], verb: str) -> Leaf:
        """An operand a library call reads: in place when `readable`, else a copy written first."""
        ...

    def library_call(self, kind: str, call: Matmul | Conv, operands: list[Leaf | None], **what: Any) -> Leaf:
        """The output of a matmul or conv group computing `call`."""
        ...
