"""One aten node being lowered to IR: its arguments, output shape and dtype, and the steps every lowering shares
(elementwise calls over broadcast operands, reduced expressions, row groups); plus the shape rules they use.

`lowering.py` holds the tables that choose a lowering per op and calls them with an `OpLowering`; the table entries
in `lowering.py`, `lowering_nn.py` and `lowering_copies.py` read it. The group builder (`analysis.GroupBuilder`) is
seen here only through `ir.Builder`, so nothing below analysis imports it."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Any

from kernelpilot.policy.ir import (
    Builder, Call, Const, Expr, Field, Gather, Leaf, Load, NotFusible, Reduce, Value, Window, contiguous_strides, dtype_name,
    is_index, rebuilt, walk, walk_reduces, windowed,
)  # fmt: skip
from kernelpilot.policy.strides import permuted_expr, splits


# Dtypes a generated kernel reads and writes (computing in float32 in between).
KERNEL_DTYPES = ("float32", "float16", "bfloat16", "bool")

# Dtypes a kernel only reads: int64 class targets, gathered from as integers and otherwise converted to float as
# torch's `.float()` does (exact below 2^24).
READ_ONLY_DTYPES = ("int64",)

# Statistics a column kernel computes (sum, mean and norms are sums; amax, amin, max and min are max and min).
COLUMN_STATS = ("sum", "max", "min")


class OpLowering:
    """Builds the Value of one fusible aten node, or returns None when there is no template for it."""

    def __init__(self, builder: Builder, node: Any, args: list, kwargs: dict):
        self.builder, self.node, self.args, self.kwargs = builder, node, args, kwargs
        self.name = op_name(node.target)
        value = node.meta.get("val")
        if isinstance(value, (tuple, list)):  # native_layer_norm, native_group_norm: (output, mean, rstd)
            value = value[0]
        self.shape = tuple(value.shape) if hasattr(value, "shape") else ()
        self.dtype = dtype_name(value.dtype) if hasattr(value, "dtype") else "float32"

    def arg(self, position: int, name: str, default: Any) -> Any:
        """The node's argument at `position`, or its keyword `name`, or `default` when the call left it out."""
        if len(self.args) > position:
            return self.args[position]
        return self.kwargs.get(name, default)

    def value_of(self, expr: Expr) -> Value:
        """`expr` as this node's value (its shape and dtype), when a kernel can write that dtype."""
        if self.dtype not in KERNEL_DTYPES:
            raise NotFusible(f"computes {self.dtype} values")
        return Value(expr, self.shape, self.dtype, (f"aten.{self.name}",))

    def derived(self, args: list | None = None, shape: tuple[int, ...] | None = None,
                dtype: str | None = None) -> OpLowering:  # fmt: skip
        """This node's lowering with other arguments, another output shape or dtype: a step of an op lowered as
        several (a loss's per-element values, then their mean; max(dim)'s indices)."""
        step = copy.copy(self)
        step.args = list(self.args if args is None else args)
        step.shape = self.shape if shape is None else shape
        step.dtype = self.dtype if dtype is None else dtype
        return step

    # --------------------------------------------------------------------------------- elementwise

    def elementwise(self, op: str, operands: list) -> Value:
        """`op` applied to `operands` (Leaves, Values, numbers), broadcast to this node's shape."""
        if self.dtype not in KERNEL_DTYPES:
            raise NotFusible(f"computes {self.dtype} values")
        operands = self._separate_row_groups(operands)
        rows = any(isinstance(item, Value) and item.rows for item in operands)
        exprs = tuple(self.operand_expr(item, rows) for item in operands)
        ops = tuple(op_name for item in operands if isinstance(item, Value) for op_name in item.ops)
        return Value(Call(op, exprs), self.shape, self.dtype, ops + (f"aten.{op_name(self.node.target)}",), rows)

    def _separate_row_groups(self, operands: list) -> list:
        """Materialise operands whose reductions cannot share a kernel with the others or with this shape."""
        kept_space = None
        result = []
        for item in operands:
            if isinstance(item, Value) and walk_reduces(item.expr):
                reduce = walk_reduces(item.expr)[0]
                fits = kept_space in (None, reduce.space) and fits_rows(self.shape, item.rows, reduce)
                if not fits:
                    item = self.builder.materialise(item)
                else:
                    kept_space = reduce.space
            result.append(item)
        return result

    def operand_expr(self, item: Any, rows: bool) -> Expr:
        """`item` (a Leaf, a Value or a number) as an expression over this node's shape (over its rows: `rows`)."""
        if isinstance(item, Leaf):
            self._check_dtype(item.source.dtype)
            return Load(item, self.shape, rows)  # every operand of this op is broadcast to its output's shape
        if isinstance(item, Value):
            if item.rows == rows:
                return item.expr
            if rows and not walk_reduces(item.expr):
                return to_rows(item.expr)
            raise NotFusible("mixes a keepdim=False reduction with full rows")
        if isinstance(item, bool) or isinstance(item, (int, float)):
            return Const(float(item))
        if item is None:
            raise NotFusible("an argument is the result of an unsupported op")
        raise NotFusible(f"an argument of type {type(item).__name__}")

    def _check_dtype(self, dtype: str) -> None:
        if dtype not in KERNEL_DTYPES + READ_ONLY_DTYPES:
            raise NotFusible(f"reads a {dtype} tensor")

    def constant(self, name: str) -> Value:
        value = {"ones_like": 1.0, "zeros_like": 0.0, "ones": 1.0, "zeros": 0.0}.get(name)
        if value is None:
            value = float(self.args[1] if name in ("full_like", "full") else self.args[0])
        return Value(Const(value), self.shape, self.dtype, (f"aten.{name}",))

    # ---------------------------------------------------------------------------------- reductions

    def row_input(self, dims: int = 1) -> tuple[Expr, tuple[int, ...], tuple[str, ...]]:
        """The reduced argument as an expression over rows (its last `dims` dims), with its shape and ops."""
        item = self.args[0]
        reduces = walk_reduces(item.expr) if isinstance(item, Value) else []
        if isinstance(item, Value) and (item.rows or (reduces and reduces[0].space != (item.shape, dims, 0))
                                        or windowed(item.expr)):  # fmt: skip
            item = self.builder.materialise(item)
        expr, shape, ops = self._reduced_expr(item)
        if len(shape) < dims or not shape:
            raise NotFusible("reduces a 0-d tensor")
        length = math.prod(shape[len(shape) - dims :])
        if not 0 < length < 2**31:  # columns are 32-bit in the kernels
            raise NotFusible("reduces empty rows" if not length else "reduces rows of 2^31 elements or more")
        return expr, shape, ops

    def _reduced_expr(self, item: Any) -> tuple[Expr, tuple[int, ...], tuple[str, ...]]:
        """A reduction's argument (a tensor read from memory, or a fused value) as an expression, shape and ops."""
        if isinstance(item, Leaf):
            self._check_dtype(item.source.dtype)
            return Load(item, item.shape), item.shape, ()
        if isinstance(item, Value):
            return item.expr, item.shape, item.ops
        raise NotFusible("reduces the result of an unsupported op")

    def last_dim_only(self, dims: Any, ndim: int) -> None:
        """Raise unless `dims` names exactly the last dimension."""
        if _normalised_dims(dims, ndim) != [ndim - 1]:
            shown = ", ".join(str(d) for d in ([dims] if isinstance(dims, int) else dims or range(ndim)))
            raise NotFusible(f"reduces dim {shown}; only last-dimension reductions are generated")

    def reduced_input(self, dims: Any, kind: str) -> tuple[Expr, tuple[int, ...], tuple[str, ...], int, int]:
        """The argument of a `kind` reduction over `dims` as an expression, with its shape and ops, and how many
        dims are reduced and how many follow them: (1, 0) for the last dim (a row reduction), (k, m) for k
        adjacent dims before the last m (a column reduction)."""
        ndim = len(getattr(self.args[0], "shape", ()))
        reduced = _normalised_dims(dims, ndim)
        if ndim == 0 or reduced == [ndim - 1]:
            expr, shape, ops = self.row_input()
            return expr, shape, ops, 1, 0
        if len(reduced) == ndim:  # sums, means, max, min and norms over every dim are split by `whole_reduction`
            raise NotFusible(f"reduces all {ndim} dims of a {ndim}-d tensor, which is generated for sums, means, max, "
                              "min and norms only")  # fmt: skip
        if reduced == list(range(ndim - len(reduced), ndim)):  # the trailing dims: each row spans them
            expr, shape, ops = self.row_input(len(reduced))
            return expr, shape, ops, len(reduced), 0
        _check_column_dims(reduced, ndim, kind)
        expr, shape, ops = self.column_input()
        return expr, shape, ops, len(reduced), ndim - 1 - reduced[-1]

    def column_input(self) -> tuple[Expr, tuple[int, ...], tuple[str, ...]]:
        """The argument of a column reduction as an expression over its whole shape. A value holding reductions
        of its own is written first: one kernel reduces over one space, and a column kernel writes no rows."""
        item = self.args[0]
        if isinstance(item, Value) and (item.rows or walk_reduces(item.expr) or windowed(item.expr)):
            item = self.builder.materialise(item)
        expr, shape, ops = self._reduced_expr(item)
        if 0 in shape:
            raise NotFusible("reduces an empty tensor")
        return expr, shape, ops

    def reduction(self, kind: str, field_name: str, dims: Any, keepdim: bool, finish=None,
                  element=None) -> Value | Leaf:  # fmt: skip
        """A `kind` statistic over `dims` (`field_name` of it), optionally of element(x) and finished by
        finish(stat, count): over the last dim(s) a row kernel, over adjacent dims before the last a column kernel,
        over every dim a row kernel then a one-row kernel, over other dims a row kernel of the permuted input."""
        ndim = len(getattr(self.args[0], "shape", ()))
        reduced = _normalised_dims(dims, ndim)
        if ndim > 1 and kind in COLUMN_STATS and len(reduced) == ndim:
            return self.whole_reduction(kind, keepdim, finish, element)
        if ndim > 1 and len(reduced) < ndim and not _reducible_where_they_lie(reduced, ndim, kind):
            return self.permuted_reduction(kind, field_name, reduced, keepdim, finish, element)
        expr, shape, ops, reduced, inner = self.reduced_input(dims, kind)
        stat = Field(Reduce(kind, element(expr) if element else expr, shape, reduced, inner), field_name)
        result = finish(stat, math.prod(shape[len(shape) - reduced - inner : len(shape) - inner])) if finish else stat
        return self.row_value(result, shape, keepdim, ops, reduced, inner)

    def whole_reduction(self, kind: str, keepdim: bool, finish=None, element=None) -> Value:
        """A sum, mean, max or min (of element(x)) over every element of a tensor of two or more dims: each row's
        statistic (over its last dim) is written first, in float32, then a one-row kernel reduces those partial
        results, as the mean of row losses is (a few microseconds for 10^4 rows). Values that are already one per
        row (row losses) are written as they are and reduced in the one-row kernel alone."""
        item = self.args[0]
        if isinstance(item, Value) and item.rows:
            partials, per_element = self.builder.materialise(item), element
        else:
            expr, shape, ops = self.row_input()
            row_stat = Field(Reduce(kind, element(expr) if element else expr, shape), kind)
            partials = self.builder.materialise(Value(row_stat, shape[:-1], "float32", ops, rows=True))
            per_element = None  # the partial results are statistics of element(x) already
        count, shape = math.prod(partials.shape), item.shape
        row_shape = (1,) * (len(shape) - 1) + (count,) if keepdim else (count,)
        flat = Load(Leaf(partials.source, row_shape, contiguous_strides(row_shape), partials.offset), row_shape)
        stat = Field(Reduce(kind, per_element(flat) if per_element else flat, row_shape), kind)
        return self.row_value(finish(stat, math.prod(shape)) if finish else stat, row_shape, keepdim, ())

    def permuted_reduction(self, kind: str, field_name: str, reduced: list[int], keepdim: bool, finish=None,
                           element=None) -> Value | Leaf:  # fmt: skip
        """A reduction over dims no kernel reduces where they lie (not the trailing dims, nor, for a variance or a
        softmax statistic, adjacent dims before the last): the input read with those dims moved last (strided
        loads), so each row spans them. The result is one value per kept position, in their order; a keepdim
        result is written and viewed with its size-1 dims back."""
        expr, shape, ops = self.permuted_input(reduced)
        count = len(reduced)
        stat = Field(Reduce(kind, element(expr) if element else expr, shape, count), field_name)
        result = finish(stat, math.prod(shape[len(shape) - count :])) if finish else stat
        value = self.row_value(result, shape, False, ops, count)
        if not keepdim:
            return value
        written = self.builder.materialise(value)
        return Leaf(written.source, self.shape, contiguous_strides(self.shape), written.offset)

    def permuted_input(self, reduced: list[int]) -> tuple[Expr, tuple[int, ...], tuple[str, ...]]:
        """The argument with the `reduced` dims moved last (in their order) as an expression over that permuted
        shape, with the shape and ops. A value holding statistics of its own is written first."""
        expr, shape, ops = self.elementwise_input()
        order = self.permutation(reduced)
        expr, shape = permuted_expr(expr, shape, order), tuple(shape[d] for d in order)
        if 0 in shape:
            raise NotFusible("reduces an empty tensor")
        if math.prod(shape[len(shape) - len(reduced) :]) >= 2**31:  # columns are 32-bit in the kernels
            raise NotFusible("reduces rows of 2^31 elements or more")
        return expr, shape, ops

    def elementwise_input(self) -> tuple[Expr, tuple[int, ...], tuple[str, ...]]:
        """The argument as an elementwise expression over its shape (a value holding statistics is written first,
        so that the expression can be re-read over another shape), with the shape and ops."""
        item = self.args[0]
        if isinstance(item, Value) and (item.rows or any(isinstance(n, (Reduce, Gather)) or getattr(n, "window", None)
                                                         for n in walk(item.expr))):  # fmt: skip
            item = self.builder.materialise(item)
        return self._reduced_expr(item)

    def written(self, item: Any) -> Leaf:
        """`item` as a tensor in memory: a value is written by its group first."""
        leaf = self.builder.materialise(item) if isinstance(item, Value) else item
        if not isinstance(leaf, Leaf):
            raise NotFusible("reads the result of an unsupported op")
        self._check_dtype(leaf.source.dtype)
        return leaf

    def padded_copy(self, item: Any, low: tuple[int, ...], high: tuple[int, ...], fill: float) -> Leaf:
        """`item` written with `low` and `high` more elements before and after it in each dim, holding `fill`."""
        leaf = self.written(item)
        shape = tuple(size + before + after for size, before, after in zip(leaf.shape, low, high))
        load = Load(leaf, shape, window=Window(tuple(low), float(fill)))
        return self.builder.materialise(Value(load, shape, leaf.source.dtype, (f"aten.{self.name}",)))

    def permutation(self, reduced: list[int]) -> list[int]:
        """The order of the argument's dims with the `reduced` dims moved last."""
        ndim = len(self.args[0].shape)
        return [d for d in range(ndim) if d not in reduced] + list(reduced)

    def row_value(self, expr: Expr, shape: tuple[int, ...], keepdim: bool, ops: tuple[str, ...], dims: int = 1,
                   inner: int = 0) -> Value:  # fmt: skip
        op = f"aten.{op_name(self.node.target)}"
        if self.dtype not in KERNEL_DTYPES and not self._counts_true_values() and not is_index(expr):
            raise NotFusible(f"computes {self.dtype} values")
        return Value(expr, reduced_shape(shape, dims, inner, keepdim), self.dtype, ops + (op,), rows=not keepdim)

    def _counts_true_values(self) -> bool:
        """True for an int64 sum of a bool tensor of fewer than 2^24 elements: a count (cross-entropy's count of
        rows not ignored), summed in float32, exactly. It may feed float ops in the same kernel; a kernel never
        writes it (`_group_of` refuses int64 outputs)."""
        item = self.args[0]
        dtype = item.source.dtype if isinstance(item, Leaf) else getattr(item, "dtype", None)
        counted = math.prod(getattr(item, "shape", ()))
        return op_name(self.node.target) == "sum" and self.dtype == "int64" and dtype == "bool" and counted < 2**24


def _normalised_dims(dims: Any, ndim: int) -> list[int]:
    """The dims a reduction's `dim` argument names, non-negative and sorted; None or [] names every dim."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted({d % ndim for d in dims}) if ndim else []


def _reducible_where_they_lie(reduced: list[int], ndim: int, kind: str) -> bool:
    """True when a row kernel (the trailing dims) or a column kernel (adjacent dims before the last, for the
    statistics it computes) reduces `reduced` in the tensor's own layout."""
    adjacent = reduced == list(range(reduced[0], reduced[-1] + 1))
    return adjacent and (reduced[-1] == ndim - 1 or kind in COLUMN_STATS)


def _check_column_dims(reduced: list[int], ndim: int, kind: str) -> None:
    """Raise unless `reduced` are adjacent dims before the last, reduced by a statistic column kernels compute."""
    shown = ", ".join(map(str, reduced))
    adjacent = reduced == list(range(reduced[0], reduced[-1] + 1))
    if reduced[-1] == ndim - 1 or not adjacent:
        raise NotFusible(f"reduces dims {shown} of a {ndim}-d tensor: generated reductions run over the last dim "
                          "alone or over adjacent dims before it; permute the input so that the reduced dims are "
                          "adjacent")  # fmt: skip
    if kind not in COLUMN_STATS:
        raise NotFusible(f"a variance over dim {shown}, which is not the last; column reductions generate sums, "
                          "means, norms, max and min only")  # fmt: skip


def reduced_shape(shape: tuple[int, ...], dims: int, inner: int, keepdim: bool) -> tuple[int, ...]:
    """The shape of a reduction over the `dims` dims of `shape` before its last `inner` ones."""
    start, end = len(shape) - dims - inner, len(shape) - inner
    return shape[:start] + ((1,) * dims if keepdim else ()) + shape[end:]


def to_rows(expr: Expr) -> Expr:
    """A reduction-free expression re-read as living in a keepdim=False result's shape."""

    def rule(node: Expr) -> Expr | None:
        if isinstance(node, Load):
            return replace(node, rows=True)
        return None if isinstance(node, Call) else node  # Calls are rebuilt; anything else stays as it is

    return rebuilt(expr, rule)


def fits_rows(shape: tuple[int, ...], rows: bool, reduce: Reduce | Gather) -> bool:
    """True when a value of `shape` can be computed in the kernel of `reduce`: one number per element of its
    iteration shape (or of a shape that one splits), or one per row (a column kernel: only one per column)."""
    if rows:
        return shape == reduced_shape(reduce.shape, reduce.dims, reduce.inner, keepdim=False)
    kept = reduced_shape(reduce.shape, reduce.dims, reduce.inner, keepdim=True)
    return shape == kept or (not reduce.inner and splits(shape, reduce.shape))


def op_name(target: Any) -> str:
    packet = getattr(target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(target, "__name__", str(target))
