"""Lowering: each aten op of the traced graph becomes IR, through one table per concern: pointwise ops map onto
C_OPS names (directly, through `_ALIASES`, or through `_SPECIAL_ELEMENTWISE` for ops with settings), reductions
through `_REDUCTIONS` (sum, mean, amax, argmax, norms, var/std, logsumexp, softmax, losses, gather; the
normalisation and pooling layers of lowering_nn.py), copies into a new layout through `_COPIES` (lowering_copies.py).
Adding an op is an entry in one of those tables (and, for a new pointwise op, in C_OPS and its CPU spec)."""

from __future__ import annotations

import math
import operator
from typing import Any

from kernelpilot.policy.c_ops import C_OPS, INTERNAL_OPS
from kernelpilot.policy.ir import Builder, Call, Const, Expr, Field, Gather, Leaf, Load, NotFusible, Reduce, Scan, Value
from kernelpilot.policy.lowering_copies import cat, constant_pad, repeat, triangle
from kernelpilot.policy.lowering_nn import batch_norm, group_norm, layer_norm, pool
from kernelpilot.policy.op_lowering import KERNEL_DTYPES, OpLowering, op_name
from kernelpilot.policy.strides import flipped, unpermuted


# In-place ops generated as their functional form when they overwrite a value nothing else reads (`_out_of_place`).
# The trace is functionalised, so only the in-place ops of decompositions below it (cross-entropy's) remain.
_IN_PLACE = {"masked_fill_": "masked_fill"}


_ALIASES = {"clone": "identity", "contiguous": "identity", "lift_fresh_copy": "identity", "bitwise_not": "logical_not"}


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
        variance = Call("div", (m2, Const(max(length - correction, 0.0), reduction_length=True)))
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




def _running(o: OpLowering, kind: str) -> Leaf:
    """cumsum(x, dim) and cumprod(x, dim): a scan kernel over rows along `dim` (moved last: strided loads), with the
    elementwise ops before it fused into its loads. It is written at once, so ops after it read it from memory; a
    running value over another dim is written in the permuted order and viewed back. Read back through a flip
    along `dim` (a reverse cumsum, `x.flip(d).cumsum(d).flip(d)`), it is scanned from the row's end instead and
    returned flipped, so the flips cancel: one pass, forward loads."""
    if o.dtype in ("float16", "bfloat16"):
        # Eager's CUDA scan accumulates in the tensor's own dtype (pytorch/pytorch#180150): a float accumulation
        # differs from it by several ulps of the running value, beyond the tolerance (measured on an H200).
        raise NotFusible(f"computes a running {kind} in {o.dtype}, which eager accumulates in {o.dtype} on a GPU; "
                         "generated scans accumulate in float32 and would not match it")  # fmt: skip
    if o.dtype not in KERNEL_DTYPES:
        raise NotFusible(f"computes a running {kind} in {o.dtype}; generated scans write float32")
    ndim = len(o.args[0].shape)
    dim = [o.args[1] % ndim] if ndim else []
    if not dim:
        raise NotFusible("runs over a 0-d tensor")
    expr, shape, ops = o.permuted_input(dim)
    users = list(o.node.users)
    reverse = len(users) == 1 and op_name(users[0].target) == "flip" and _flip_dims(users[0], ndim) == dim
    if reverse:
        expr = flipped(expr, shape, [len(shape) - 1])
    written = o.builder.materialise(Value(Scan(kind, expr, shape, reverse), shape, o.dtype, ops + (f"aten.{o.name}",)))
    result = unpermuted(written, o.permutation(dim))
    if not reverse:
        return result
    return Value(flipped(Load(result, result.shape), result.shape, dim), result.shape, o.dtype, ())


def _flip_dims(node: Any, ndim: int) -> list[int]:
    return sorted(d % ndim for d in node.args[1])


def _flip(o: OpLowering) -> Value | Leaf:
    """flip(x, dims): x read through negative strides along `dims` (an expression's every load). What it gives
    back is a tensor in memory read as it is (a flip of a flipped scan: lowering.py's `_running`) stays that tensor."""
    expr, shape, ops = o.elementwise_input()
    result = flipped(expr, shape, _flip_dims(o.node, len(shape)))
    if isinstance(result, Load) and result.leaf.shape == shape and all(s >= 0 for s in result.leaf.strides):
        return result.leaf
    return Value(result, shape, o.dtype, ops + ("aten.flip",))


def _divide_by_length(total: Field, length: int) -> Expr:
    return Call("mul", (total, Const(1.0 / length, reduction_length=True)))


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
    "cumsum": lambda o: _running(o, "sum"),
    "cumprod": lambda o: _running(o, "prod"),
}
# Ops that copy their input into a new layout.
_COPIES = {"flip": _flip, "repeat": repeat, "cat": cat, "stack": lambda o: cat(o, stack=True), "constant_pad_nd": constant_pad,
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


def lower(builder: Builder, node: Any, args: list, kwargs: dict, name: str) -> Value | tuple | None:
    """The IR of the aten node `node` (op `name`) through the tables below, or None when none has it."""
    o = OpLowering(builder, node, args, kwargs)
    if name == "copy_":  # what functionalisation leaves of an in-place op on a forward argument or parameter
        raise NotFusible("writes in place into a forward argument, parameter or buffer, memory the caller owns")
    if name in _IN_PLACE:
        name = _out_of_place(o, name)
    if name in _ALIASES and isinstance(o.args[0], Value) and isinstance(o.args[0].expr, Const):
        return o.args[0]  # a number made a tensor (lift_fresh_copy of a constant), of any dtype: still a number
    if name in _ALIASES:
        return o.elementwise(_ALIASES[name], o.args[:1])
    if name in _REDUCTIONS:
        return _REDUCTIONS[name](o)
    if name in _COPIES:
        return _COPIES[name](o)
    if name in ("full_like", "ones_like", "zeros_like", "full", "ones", "zeros", "scalar_tensor"):
        return o.constant(name)
    if name == "_to_copy":
        return o.elementwise(_cast_op(o.kwargs.get("dtype")), o.args[:1])
    special = _SPECIAL_ELEMENTWISE.get(name)
    if special is not None:
        op, operands = special(o.args, o.kwargs)
        return o.elementwise(op, operands)
    if name in C_OPS and name not in INTERNAL_OPS:
        return o.elementwise(name, o.args)
    return None


def _out_of_place(o: OpLowering, name: str) -> str:
    """The functional op of an in-place one that decompositions write into a value they computed (cross-entropy
    with label smoothing zeroes ignored rows with masked_fill_): the same value when nothing else reads the
    overwritten tensor, which then exists only in the kernel."""
    if not isinstance(o.args[0], Value) or len(o.node.args[0].users) != 1:
        raise NotFusible(f"{name} overwrites a tensor that is read elsewhere or is not computed in forward")
    return _IN_PLACE[name]
