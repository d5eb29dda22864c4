"""Lowering: each aten op of the traced graph becomes IR, through one table per concern: pointwise ops map onto
C_OPS names (directly, through `_ALIASES`, or through `_SPECIAL_ELEMENTWISE` for ops with settings), reductions
through `_REDUCTIONS` (sum, mean, amax, argmax, norms, var/std, logsumexp, softmax, losses, gather; the
normalisation and pooling layers of lowering_nn.py), copies into a new layout through `_COPIES` (lowering_copies.py).
Adding an op is an entry in one of those tables (and, for a new pointwise op, in C_OPS and its CPU spec)."""

from __future__ import annotations

import copy
import math
import operator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kernelpilot.policy.c_ops import C_OPS, INTERNAL_OPS
from kernelpilot.policy.ir import (
    Call, Const, Expr, Field, Gather, Leaf, Load, NotFusible, Reduce, Value, Window, contiguous_strides, dtype_name,
    is_index, rebuilt, walk, walk_reduces, windowed,
)  # fmt: skip
from kernelpilot.policy.lowering_copies import cat, constant_pad, repeat, triangle
from kernelpilot.policy.lowering_nn import batch_norm, group_norm, layer_norm, pool
from kernelpilot.policy.strides import permuted_expr, splits, unpermuted

if TYPE_CHECKING:
    from kernelpilot.policy.analysis import GroupBuilder

# Dtypes a generated kernel reads and writes (computing in float32 in between).
KERNEL_DTYPES = ("float32", "float16", "bfloat16", "bool")


# Dtypes a kernel only reads: int64 class targets, gathered from as integers and otherwise converted to float as
# torch's `.float()` does (exact below 2^24).
READ_ONLY_DTYPES = ("int64",)


# In-place ops generated as their functional form when they overwrite a value nothing else reads (`_out_of_place`).
# The trace is functionalised, so only the in-place ops of decompositions below it (cross-entropy's) remain.
_IN_PLACE = {"masked_fill_": "masked_fill"}


_ALIASES = {"clone": "identity", "contiguous": "identity", "lift_fresh_copy": "identity", "bitwise_not": "logical_not"}


class OpLowering:
    """Builds the Value of one fusible aten node, or returns None when there is no template for it."""

    def __init__(self, builder: GroupBuilder, node: Any, args: list, kwargs: dict):
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

    def build(self, name: str) -> Value | tuple | None:
        if name == "copy_":  # what functionalisation leaves of an in-place op on a forward argument or parameter
            raise NotFusible("writes in place into a forward argument, parameter or buffer, memory the caller owns")
        if name in _IN_PLACE:
            name = self._out_of_place(name)
        if name in _ALIASES and isinstance(self.args[0], Value) and isinstance(self.args[0].expr, Const):
            return self.args[0]  # a number made a tensor (lift_fresh_copy of a constant), of any dtype: still a number
        if name in _ALIASES:
            return self.elementwise(_ALIASES[name], self.args[:1])
        if name in _REDUCTIONS:
            return _REDUCTIONS[name](self)
        if name in _COPIES:
            return _COPIES[name](self)
        if name in ("full_like", "ones_like", "zeros_like", "full", "ones", "zeros", "scalar_tensor"):
            return self._constant(name)
        if name == "_to_copy":
            return self.elementwise(_cast_op(self.kwargs.get("dtype")), self.args[:1])
        special = _SPECIAL_ELEMENTWISE.get(name)
        if special is not None:
            op, operands = special(self.args, self.kwargs)
            return self.elementwise(op, operands)
        if name in C_OPS and name not in INTERNAL_OPS:
            return self.elementwise(name, self.args)
        return None

    def _out_of_place(self, name: str) -> str:
        """The functional op of an in-place one that decompositions write into a value they computed (cross-entropy
        with label smoothing zeroes ignored rows with masked_fill_): the same value when nothing else reads the
        overwritten tensor, which then exists only in the kernel."""
        if not isinstance(self.args[0], Value) or len(self.node.args[0].users) != 1:
            raise NotFusible(f"{name} overwrites a tensor that is read elsewhere or is not computed in forward")
        return _IN_PLACE[name]

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

    def _constant(self, name: str) -> Value:
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


def fuses_elementwise(name: str | None) -> bool:
    """True when `OpLowering` folds the op `name` into an expression (elementwise ops and row reductions)."""
    if name is None:
        return False
    elementwise = name in _SPECIAL_ELEMENTWISE or (name in C_OPS and name not in INTERNAL_OPS)
    return elementwise or name in _ALIASES or name in _REDUCTIONS or name == "_to_copy"


def _sum(o: OpLowering) -> Value:
    return o.reduction("sum", "sum", o.args[1] if len(o.args) > 1 else None, o.arg(2, "keepdim", False))


def _mean(o: OpLowering) -> Value:
    keepdim = o.arg(2, "keepdim", False)
    return o.reduction("sum", "sum", o.args[1] if len(o.args) > 1 else None, keepdim, _divide_by_length)


def _amax(o: OpLowering, kind: str) -> Value:
    return o.reduction(kind, kind, o.args[1] if len(o.args) > 1 else None, o.arg(2, "keepdim", False))


def _max_or_min(o: OpLowering, kind: str) -> Value | tuple:
    """max/min(x) over every element, (values, indices) = max/min(x, dim), or the elementwise max/min(x, other)."""
    if len(o.args) == 1:
        return o.reduction(kind, kind, None, False)
    if not isinstance(o.args[1], int):
        return o.elementwise("maximum" if kind == "max" else "minimum", o.args[:2])
    keepdim = o.arg(2, "keepdim", False)
    if any(user.target is operator.getitem and user.args[1] == 1 for user in o.node.users):
        # With its indices: both fields of one argmax (argmin) statistic, NaN and the first index as torch's.
        indices = o.derived(dtype="int64").reduction(f"arg{kind}", "index", o.args[1], keepdim)
        return o.reduction(f"arg{kind}", kind, o.args[1], keepdim), indices
    return o.reduction(kind, kind, o.args[1], keepdim), None


def _argmax(o: OpLowering, kind: str) -> Value | Leaf:
    """argmax/argmin(x, dim, keepdim): the first column of the max (min) along dim, NaN counting as both."""
    if o.arg(1, "dim", None) is None and len(o.args[0].shape) > 1:
        raise NotFusible(f"the {kind} of every element of a tensor of two or more dims; only along a dim")
    return o.reduction(kind, "index", o.arg(1, "dim", None), o.arg(2, "keepdim", False))


def _vector_norm(o: OpLowering) -> Value | Leaf:
    """linalg_vector_norm(x, ord, dim, keepdim) and norm(x, p, dim, keepdim): orders 1, 2 and inf."""
    order = o.arg(1, "ord", o.kwargs.get("p", 2.0))
    order = 2.0 if order is None else float(order)
    dims, keepdim = o.arg(2, "dim", None), o.arg(3, "keepdim", False)
    kind = "max" if math.isinf(order) and order > 0 else "sum"
    if order not in (1.0, 2.0) and kind != "max":
        raise NotFusible(f"a vector norm of order {order:g}")
    if order == 2.0:
        return o.reduction(kind, kind, dims, keepdim, lambda stat, _: Call("sqrt", (stat,)), _squared)
    return o.reduction(kind, kind, dims, keepdim, element=lambda expr: Call("abs", (expr,)))


def _squared(expr: Expr) -> Expr:
    return Call("mul", (expr, expr))


def _variance(o: OpLowering, root: bool) -> Value:
    dims = o.arg(1, "dim", None)
    correction = o.kwargs.get("correction", 1.0)
    correction = 1.0 if correction is None else float(correction)
    keepdim = bool(o.kwargs.get("keepdim", False))

    def finish(m2: Field, length: int) -> Expr:
        variance = Call("div", (m2, Const(max(length - correction, 0.0))))
        return Call("sqrt", (variance,)) if root else variance

    return o.reduction("welford", "m2", dims, keepdim, finish)


def _logsumexp(o: OpLowering) -> Value | Leaf:
    dims, keepdim = o.args[1], o.arg(2, "keepdim", False)
    return o.reduction("online_softmax", "max", dims, keepdim, _logsumexp_finish)


def _logsumexp_finish(maximum: Field, _: int) -> Expr:
    return Call("logsumexp_finish", (maximum, Field(maximum.reduce, "sum")))


def _softmax(o: OpLowering, log: bool, safe: bool = False) -> Value | Leaf:
    """softmax, log_softmax and SDPA's _safe_softmax (0, not NaN, on a row that is -inf throughout) over one dim:
    one row kernel; over a dim before the last, a row kernel of the permuted input, written and viewed back."""
    ndim = len(getattr(o.args[0], "shape", ()))
    dim = o.args[1] % ndim if ndim else o.args[1]
    if ndim < 2 or dim == ndim - 1:
        expr, shape, ops = o.row_input()
        o.last_dim_only(o.args[1], len(shape))
        return Value(_softmax_expr(expr, shape, log, safe), shape, o.dtype, ops + (f"aten.{o.name}",))
    expr, shape, ops = o.permuted_input([dim])
    value = Value(_softmax_expr(expr, shape, log, safe), shape, o.dtype, ops + (f"aten.{o.name}",))
    written = o.builder.materialise(value)
    return unpermuted(written, o.permutation([dim]))


def _softmax_expr(expr: Expr, shape: tuple[int, ...], log: bool, safe: bool) -> Expr:
    stat = Reduce("online_softmax", expr, shape)
    maximum, total = Field(stat, "max"), Field(stat, "sum")
    if log:
        return Call("sub", (expr, Call("add", (maximum, Call("log", (total,))))))
    result = Call("mul", (Call("exp_fast", (Call("sub", (expr, maximum)),)), Call("reciprocal", (total,))))
    if safe:
        result = Call("where", (Call("eq", (maximum, Const(-math.inf))), Const(0.0), result))
    return result


# nll_loss_forward's reduction argument (at::Reduction); 1 is 'mean'.
_REDUCTION_NONE, _REDUCTION_SUM = 0, 2


def _nll_loss(o: OpLowering) -> tuple[Value, Value]:
    """nll_loss_forward(log_probs, target, weight, reduction, ignore_index) -> (loss, total_weight).

    Each row's loss is minus its (weighted) log-probability at the target column, a `Gather`, so the log_softmax
    feeding it is never written: one row kernel reads the logits once. 'sum' and 'mean' reduce the row losses (and,
    for 'mean', the row weights) to a scalar in a second, one-row kernel: a few microseconds for 10^4 rows.
    """
    _, target, weight, reduction, ignore_index = o.args
    log_probs, shape, ops = o.row_input()
    if len(shape) != 2:
        raise NotFusible(f"a {len(shape)}-d input; only (batch, classes) log-probabilities are generated")
    if not (isinstance(target, Leaf) and target.source.dtype == "int64"):
        raise NotFusible("targets that are not an int64 tensor read from memory")
    if weight is not None and not isinstance(weight, Leaf):
        raise NotFusible("class weights computed in forward")
    if max(abs(ignore_index), shape[-1]) >= 2**24:
        raise NotFusible("an ignore_index or class count of 2^24 or more (targets are counted as floats)")
    op = f"aten.{op_name(o.node.target)}"
    rows = shape[:-1]
    index = Load(target, rows, rows=True)
    class_weight = None if weight is None else Load(weight, shape)
    loss = Call("neg", (log_probs,)) if class_weight is None else Call("neg", (Call("mul", (class_weight, log_probs)),))
    row_losses = Value(Gather(loss, index, ignore_index, shape), rows, o.dtype, ops + (op,), rows=True)
    if reduction == _REDUCTION_NONE:
        return row_losses, Value(Const(0.0), (), o.dtype, (op,))
    total = Field(Reduce("sum", Load(o.builder.materialise(row_losses), rows), rows), "sum")
    if class_weight is None:
        row_weights: Expr = Call("ne", (Load(target, rows), Const(float(ignore_index))))
    else:
        weights = Value(Gather(class_weight, index, ignore_index, shape), rows, o.dtype, (op,), rows=True)
        row_weights = Load(o.builder.materialise(weights), rows)
    total_weight = Field(Reduce("sum", row_weights, rows), "sum")
    result = total if reduction == _REDUCTION_SUM else Call("div", (total, total_weight))
    return Value(result, (), o.dtype, (op,), rows=True), Value(total_weight, (), o.dtype, (op,), rows=True)


def _gather(o: OpLowering) -> Value:
    """gather(input, dim, index) along the last dim with one column per row (index shaped (..., 1)): a `Gather`,
    so a log_softmax feeding it is never written and one row kernel reads the row once (selective log-softmax)."""
    _, dim, index = o.args[:3]
    values, shape, ops = o.row_input()
    if dim % len(shape) != len(shape) - 1:
        raise NotFusible(f"gathers along dim {dim}; only gathers along the last dimension are generated")
    if not (isinstance(index, Leaf) and index.source.dtype == "int64"):
        raise NotFusible("an index that is not an int64 tensor read from memory")
    rows = shape[:-1]
    if index.shape != rows + (1,):
        raise NotFusible(f"a {list(index.shape)} index into {list(shape)}; only one column per row, an index "
                          f"shaped {list(rows + (1,))}, is generated")  # fmt: skip
    op = f"aten.{op_name(o.node.target)}"
    return Value(Gather(values, Load(index, rows + (1,)), None, shape), rows + (1,), o.dtype, ops + (op,))


# smooth_l1_loss's reduction argument (at::Reduction); 1 is 'mean'.
_MEAN = 1


def _smooth_l1_loss(o: OpLowering, term: str) -> Value:
    """smooth_l1_loss(x, y, reduction, beta) and huber_loss(x, y, reduction, delta): elementwise terms of x - y,
    then their mean or sum over every element."""
    x, y = o.args[:2]
    reduction = o.arg(2, "reduction", _MEAN)
    setting = float(o.arg(3, "beta" if term == "smooth_l1" else "delta", 1.0))
    terms = o.derived(shape=torch_broadcast_shape(x, y))
    loss = terms.elementwise(term, [terms.elementwise("sub", [x, y]), setting])
    if reduction == _REDUCTION_NONE:
        return loss
    finish = _divide_by_length if reduction == _MEAN else None
    return o.derived(args=[loss]).reduction("sum", "sum", None, False, finish)


def torch_broadcast_shape(*items: Any) -> tuple[int, ...]:
    import torch

    return tuple(torch.broadcast_shapes(*(tuple(getattr(item, "shape", ())) for item in items)))


# Statistics a column kernel computes (sum, mean and norms are sums; amax, amin, max and min are max and min).
COLUMN_STATS = ("sum", "max", "min")


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


def _divide_by_length(total: Field, length: int) -> Expr:
    return Call("mul", (total, Const(1.0 / length)))


_REDUCTIONS = {
    "sum": _sum,
    "mean": _mean,
    "amax": lambda o: _amax(o, "max"),
    "amin": lambda o: _amax(o, "min"),
    "max": lambda o: _max_or_min(o, "max"),
    "min": lambda o: _max_or_min(o, "min"),
    "argmax": lambda o: _argmax(o, "argmax"),
    "argmin": lambda o: _argmax(o, "argmin"),
    "linalg_vector_norm": _vector_norm,
    "norm": _vector_norm,
    "smooth_l1_loss": lambda o: _smooth_l1_loss(o, "smooth_l1"),
    "huber_loss": lambda o: _smooth_l1_loss(o, "huber"),
    "var": lambda o: _variance(o, root=False),
    "std": lambda o: _variance(o, root=True),
    "logsumexp": _logsumexp,
    "_softmax": lambda o: _softmax(o, log=False),
    "_safe_softmax": lambda o: _softmax(o, log=False, safe=True),
    "_log_softmax": lambda o: _softmax(o, log=True),
    "native_layer_norm": layer_norm,
    "native_group_norm": group_norm,
    "native_batch_norm": batch_norm,
    "max_pool1d_with_indices": lambda o: pool(o, maximum=True),
    "max_pool2d_with_indices": lambda o: pool(o, maximum=True),
    "max_pool3d_with_indices": lambda o: pool(o, maximum=True),
    "avg_pool1d": lambda o: pool(o, maximum=False),
    "avg_pool2d": lambda o: pool(o, maximum=False),
    "avg_pool3d": lambda o: pool(o, maximum=False),
    "nll_loss_forward": _nll_loss,
    "gather": _gather,
}
# Ops that copy their input into a new layout.
_COPIES = {"repeat": repeat, "cat": cat, "stack": lambda o: cat(o, stack=True), "constant_pad_nd": constant_pad,
           "triu": lambda o: triangle(o, upper=True), "tril": lambda o: triangle(o, upper=False)}


def _scaled(args: list, kwargs: dict, op: str) -> tuple[str, list]:
    """add/sub with alpha: a + alpha * b."""
    alpha = kwargs.get("alpha", 1)
    if alpha == 1:
        return op, args[:2]
    return f"{op}_scaled", [args[0], args[1], alpha]


def _pow(args: list, kwargs: dict) -> tuple[str, list]:
    base, exponent = args[0], args[1]
    if isinstance(exponent, (int, float)) and not isinstance(exponent, bool):
        named = {2.0: "square", 0.5: "sqrt", -0.5: "rsqrt", 1.0: "identity", -1.0: "reciprocal"}.get(float(exponent))
        if named:
            return named, [base]
    return "pow", [base, exponent]


def _clamp(args: list, kwargs: dict) -> tuple[str, list]:
    low = args[1] if len(args) > 1 else kwargs.get("min")
    high = args[2] if len(args) > 2 else kwargs.get("max")
    if low is not None and high is not None:
        return "clamp", [args[0], low, high]
    if low is not None:
        return "maximum", [args[0], low]
    if high is not None:
        return "minimum", [args[0], high]
    return "identity", [args[0]]


def _div(args: list, kwargs: dict) -> tuple[str, list]:
    if kwargs.get("rounding_mode") is not None:
        raise NotFusible(f"division with rounding_mode={kwargs['rounding_mode']!r}")
    return "div", args[:2]


_SPECIAL_ELEMENTWISE = {
    "add": lambda a, k: _scaled(a, k, "add"),
    "sub": lambda a, k: _scaled(a, k, "sub"),
    "rsub": lambda a, k: _scaled([a[1], a[0]], k, "sub"),
    "div": _div,
    "pow": _pow,
    "clamp": _clamp,
    "clamp_min": lambda a, k: ("maximum", a[:2]),
    "clamp_max": lambda a, k: ("minimum", a[:2]),
    "hardtanh": lambda a, k: ("clamp", [a[0], a[1] if len(a) > 1 else -1.0, a[2] if len(a) > 2 else 1.0]),
    "relu6": lambda a, k: ("clamp", [a[0], 0.0, 6.0]),
    "leaky_relu": lambda a, k: ("leaky_relu", [a[0], a[1] if len(a) > 1 else 0.01]),
    "softplus": lambda a, k: ("softplus", [a[0], a[1] if len(a) > 1 else 1.0, a[2] if len(a) > 2 else 20.0]),
    "gelu": lambda a, k: ("gelu_tanh" if k.get("approximate", "none") == "tanh" else "gelu", a[:1]),
    "celu": lambda a, k: ("elu", [a[0], _celu_alpha(a, k), 1.0, 1.0 / _celu_alpha(a, k)]),
    "elu": lambda a, k: ("elu", [a[0], *[a[i] if len(a) > i else k.get(name, 1.0)
                                         for i, name in ((1, "alpha"), (2, "scale"), (3, "input_scale"))]]),
    "masked_fill": lambda a, k: ("where", [a[1], a[2], a[0]]),
    "where": lambda a, k: ("where", a[:3]),
}


def _celu_alpha(args: list, kwargs: dict) -> float:
    return float(args[1] if len(args) > 1 else kwargs.get("alpha", 1.0))


def _cast_op(dtype: Any) -> str:
    import torch

    return {torch.bfloat16: "to_bfloat16", torch.float16: "to_float16", torch.bool: "to_bool"}.get(dtype, "identity")


# ------------------------------------------------------------------------------------------- helpers


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
