"""Lowering of the normalisation and pooling layers: layer norm over the trailing dims, group norm, batch norm with
running statistics (eval mode, as the judge runs Model) or with the batch's own (instance norm), and max and
average pooling. Each is an entry of lowering.py's reduction table, built on OpLowering's public methods: a layer or
group norm is one row kernel (Welford statistics, then the normalised row), a batch norm in eval mode an
elementwise expression over per-channel parameters, with batch statistics a row kernel per channel, and a pooling
a row kernel whose rows are its windows."""

from __future__ import annotations

import math
import operator
from dataclasses import replace
from typing import Any

from kernelpilot.policy.ir import Call, Const, Field, Guard, Leaf, Load, NotFusible, Reduce, Value, dtype_name, walk_reduces
from kernelpilot.policy.op_lowering import OpLowering
from kernelpilot.policy.strides import reindexed, unpermuted


def layer_norm(o: OpLowering) -> tuple:
    """native_layer_norm(x, normalized_shape, weight, bias, eps): each row spans the normalised trailing dims."""
    _, normalized_shape, weight, bias, eps = o.args
    dims = len(normalized_shape)
    expr, shape, ops = o.row_input(dims)
    stat = Reduce("welford", expr, shape, dims) if dims > 1 else Reduce("welford", expr, shape)
    length = math.prod(shape[len(shape) - dims :])
    mean = Field(stat, "mean")
    rstd = Call("rsqrt", (Call("add", (Call("div", (Field(stat, "m2"), Const(float(length), reduction_length=True))), Const(float(eps)))),))
    result = Call("mul", (Call("sub", (expr, mean)), rstd))
    for operand, op in ((weight, "mul"), (bias, "add")):
        if operand is not None:
            result = Call(op, (result, o.operand_expr(operand, False)))
    op = f"aten.{o.name}"
    row_shape = shape[: len(shape) - dims] + (1,) * dims
    return (
        Value(result, shape, o.dtype, ops + (op,)),
        Value(mean, row_shape, "float32", ops + (op,)),
        Value(rstd, row_shape, "float32", ops + (op,)),
    )


def group_norm(o: OpLowering) -> tuple:
    """One row per (sample, group): in NCHW the C/G channels x H*W positions of a group are contiguous."""
    item, weight, bias, batch, channels, _, groups, eps = o.args
    if isinstance(item, Value) and walk_reduces(item.expr):
        o.args[0] = o.builder.materialise(item)  # its statistics run over other rows than the groups'
    expr, shape, ops = o.row_input()
    spatial = shape[2:]
    rows_shape = (batch, groups, channels // groups) + spatial  # splits C of (N, C, *spatial) into (G, C/G)
    length = math.prod(rows_shape[2:])
    if not 0 < length < 2**31:  # columns are 32-bit in the kernels
        raise NotFusible("normalises empty groups" if not length else "normalises groups of 2^31 elements or more")
    stat = Reduce("welford", expr, rows_shape, dims=len(rows_shape) - 2)
    mean = Field(stat, "mean")
    rstd = Call("rsqrt", (Call("add", (Call("div", (Field(stat, "m2"), Const(float(length), reduction_length=True))), Const(float(eps)))),))
    result = Call("mul", (Call("sub", (expr, mean)), rstd))
    for operand, op in ((weight, "mul"), (bias, "add")):
        if operand is not None:
            result = Call(op, (result, o.operand_expr(channel_view(o, operand, len(spatial)), False)))
    op = f"aten.{o.name}"
    _, mean_meta, rstd_meta = o.node.meta["val"]
    return (
        Value(result, shape, o.dtype, ops + (op,)),
        Value(mean, (batch, groups), dtype_name(mean_meta.dtype), ops + (op,), rows=True),
        Value(rstd, (batch, groups), dtype_name(rstd_meta.dtype), ops + (op,), rows=True),
    )


def batch_norm(o: OpLowering) -> tuple:
    """native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps) in eval mode:
    (x - mean) * rsqrt(var + eps) * weight + bias, every parameter one value per channel (dim 1), so one
    elementwise expression that fuses with what comes before and after it."""
    item, weight, bias, mean, var, training, _, eps = o.args[:8]
    if len(o.shape) < 2:
        raise NotFusible("normalises a tensor without a channel dim")
    if training:
        return batch_statistics_norm(o, weight, bias, float(eps)), None, None
    spatial = len(o.shape) - 2
    rstd = o.elementwise("rsqrt", [o.elementwise("add", [channel_view(o, var, spatial), float(eps)])])
    result = o.elementwise("mul", [o.elementwise("sub", [item, channel_view(o, mean, spatial)]), rstd])
    if weight is not None:
        result = o.elementwise("mul", [result, channel_view(o, weight, spatial)])
    if bias is not None:
        result = o.elementwise("add", [result, channel_view(o, bias, spatial)])
    return result, None, None


def batch_statistics_norm(o: OpLowering, weight: Any, bias: Any, eps: float) -> Leaf:
    """Batch norm with the batch's own statistics (instance norm traces as this, on a (1, N*C, ...) view): each
    channel's mean and biased variance over the batch and spatial dims. One row kernel over the input read with the
    channel dim first (its rows span (N, *spatial); contiguous rows for instance norm, where N is 1), written in
    that order and viewed back. Running statistics, which training mode also updates, are writes into buffers that
    the trace shows as copy_, named there."""
    reduced = [0, *range(2, len(o.shape))]
    expr, shape, ops = o.permuted_input(reduced)
    dims = len(reduced)
    stat = Reduce("welford", expr, shape, dims)
    count = math.prod(shape[1:])
    rstd = Call("rsqrt", (Call("add", (Call("div", (Field(stat, "m2"), Const(float(count), reduction_length=True))), Const(eps))),))
    result = Call("mul", (Call("sub", (expr, Field(stat, "mean"))), rstd))
    for operand, op in ((weight, "mul"), (bias, "add")):
        if operand is not None:  # one value per channel, the first dim of the permuted shape
            result = Call(op, (result, Load(channel_view(o, operand, dims), shape)))
    written = o.builder.materialise(Value(result, shape, o.dtype, ops + (f"aten.{o.name}",)))
    return unpermuted(written, o.permutation(reduced))


def channel_view(o: OpLowering, operand: Any, spatial_dims: int) -> Leaf:
    """A (C,) parameter viewed as (C, 1, ...), so that it broadcasts over (N, C, *spatial) one value per channel."""
    leaf = o.builder.materialise(operand) if isinstance(operand, Value) else operand
    if not isinstance(leaf, Leaf):
        raise NotFusible("an affine parameter is the result of an unsupported op")
    padding = (1,) * spatial_dims
    return Leaf(leaf.source, leaf.shape + padding, leaf.strides + padding, leaf.offset)



def pool(o: OpLowering, maximum: bool) -> Value | tuple:
    """max_poolNd_with_indices(x, kernel, stride, padding, dilation, ceil_mode) and avg_poolNd(x, kernel, stride,
    padding, ceil_mode, count_include_pad, divisor_override): a row kernel whose rows are the windows, the input
    (or the elementwise expression that computes it) read over (*leading, *output, *kernel) through strides, so
    no window is copied. With padding, or a max's ceil_mode windows past the input, the input is read from memory
    through a guarded load, the padding's value where a window reaches outside it (no padded copy; an input
    computed in forward is written first). An average's ceil_mode windows past the input (their divisors clipped)
    are not generated."""
    item, kernel = o.args[0], list(o.args[1])
    spatial = len(kernel)
    stride = _sizes(o.arg(2, "stride", []) or kernel, spatial)
    padding = _sizes(o.arg(3, "padding", 0), spatial)
    dilation = _sizes(o.arg(4, "dilation", 1), spatial) if maximum else (1,) * spatial
    divisor = None if maximum else o.arg(6, "divisor_override", None)
    if maximum and any(user.target is operator.getitem and user.args[1] == 1 for user in o.node.users):
        raise NotFusible("uses the indices of max pooling; only its values are generated")
    lead, output = len(item.shape) - spatial, o.shape[len(o.shape) - spatial :]
    # ceil_mode's last windows may reach past the padded input: a max reads -inf there too.
    settings = zip(item.shape[lead:], output, stride, kernel, dilation, padding)
    past = tuple(max(0, (out - 1) * step + dil * (span - 1) + 1 - (size + 2 * pad))
                 for size, out, step, span, dil, pad in settings)  # fmt: skip
    if any(past) and not maximum:
        raise NotFusible("averages windows that reach past the input (ceil_mode), whose divisors are clipped")
    windows = item.shape[:lead] + tuple(output) + tuple(kernel)
    uses = [((d, 1),) for d in range(lead)]
    uses += [((lead + i, stride[i]),) for i in range(spatial)] + [((lead + i, dilation[i]),) for i in range(spatial)]
    if any(padding) or any(past):
        # Windows reaching into the padding read -inf for a max, 0 for an average that counts the padding (its
        # divisor stays the kernel size).
        if not maximum and not o.arg(5, "count_include_pad", True):
            raise NotFusible("averages windows over padding it does not count (count_include_pad=False)")
        checked = [(lead + i, step, dil, pad, size) for i, (size, step, dil, pad, extra)
                   in enumerate(zip(item.shape[lead:], stride, dilation, padding, past)) if pad or extra]  # fmt: skip
        expr, ops = _guarded_windows(_in_memory(o, item), windows, uses, checked, -math.inf if maximum else 0.0), ()
    else:
        expr, shape, ops = o.elementwise_input()
        expr = reindexed(expr, shape, windows, uses)
    stat = Field(Reduce("max" if maximum else "sum", expr, windows, spatial), "max" if maximum else "sum")
    result = stat if maximum else Call("div", (stat, Const(float(divisor or math.prod(kernel)), reduction_length=True)))
    value = o.row_value(result, windows, False, ops, spatial)
    return (value, None) if maximum else value


def _in_memory(o: OpLowering, item: Any) -> Leaf:
    """The pooled tensor in memory: a tensor read as it is, or a computed value written first (a guarded load fills
    where the window leaves the input, which an expression of several loads would need after it, not in each)."""
    if isinstance(item, Value) and isinstance(item.expr, Load) and item.expr.leaf.shape == item.shape:
        load = item.expr
        if load.window is None and load.guard is None and not load.rows:
            return load.leaf
    return o.written(item)


def _guarded_windows(item: Leaf, windows: tuple[int, ...], uses: list, checked: list, fill: float) -> Load:
    """The windows of a tensor in memory read in place over (*leading, *output, *kernel), each spatial coordinate
    out * stride + k * dilation - padding checked against the input (`fill` outside): no padded copy is written.
    `checked` holds (input dim, stride, dilation, padding, size) for each dim a window may leave."""
    start = [0] * len(item.shape)
    for dim, _, _, pad, _ in checked:
        start[dim] = -pad
    load = reindexed(Load(item, item.shape), item.shape, windows, uses, tuple(start))
    spatial = len(windows) - len(item.shape)  # the kernel's dims, after the output's
    # The output coordinate of input dim d is iteration coordinate d, its kernel coordinate d + the kernel's dims.
    checks = tuple((((dim, step), (dim + spatial, dil)), -pad, size) for dim, step, dil, pad, size in checked)
    return replace(load, guard=Guard(checks, fill))


def _sizes(value: Any, count: int) -> tuple[int, ...]:
    """A pooling setting as one size per spatial dim (an int, or a list of one or `count` ints)."""
    sizes = [value] if isinstance(value, int) else list(value)
    return tuple(sizes * count if len(sizes) == 1 else sizes)
