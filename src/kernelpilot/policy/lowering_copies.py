"""Lowering of the ops that copy tensors into a new layout: repeat, cat and stack, constant padding, triu and tril.
Each is an entry of lowering.py's copy table, built on OpLowering's public methods. A cat's inputs, a padded tensor
and a triangle are windowed loads (ir.Window) of one elementwise kernel; inputs computed in forward are written
first."""

from __future__ import annotations

from kernelpilot.policy.ir import Call, Const, Leaf, Load, NotFusible, Value, Window, contiguous_strides
from kernelpilot.policy.op_lowering import OpLowering


def repeat(o: OpLowering) -> Leaf:
    """x.repeat(r0, r1, ...): a copy of x over (r0, s0, r1, s1, ...), its repeats read with stride 0, viewed as
    (r0 * s0, r1 * s1, ...)."""
    item, repeats = o.args[0], list(o.args[1])
    leaf = o.builder.materialise(item) if isinstance(item, Value) else item
    if not isinstance(leaf, Leaf):
        raise NotFusible("repeats the result of an unsupported op")
    padding = len(repeats) - len(leaf.shape)
    sizes, strides = (1,) * padding + leaf.shape, (0,) * padding + leaf.strides
    shape = tuple(item for r, size in zip(repeats, sizes) for item in (r, size))
    spread = Leaf(leaf.source, shape, tuple(item for stride in strides for item in (0, stride)), leaf.offset)
    written = o.builder.materialise(Value(Load(spread, shape), shape, o.dtype, (f"aten.{o.name}",)))
    return Leaf(written.source, o.shape, contiguous_strides(o.shape), written.offset)


def cat(o: OpLowering, stack: bool = False) -> Value:
    """cat(tensors, dim) (stack: of the tensors unsqueezed at dim): one elementwise kernel in which each input is a
    windowed load at its place along dim, 0 elsewhere, and the output their sum (one term is not 0 anywhere).
    Inputs computed in forward are written first; an input of zeros (`zeros_like`: an exclusive cumsum's first
    column) adds nothing and is not read."""
    tensors, dim = o.args[0], o.arg(1, "dim", 0)
    dim %= len(o.shape)
    terms, start = [], 0
    for item in tensors:
        if isinstance(item, Value) and item.expr == Const(0.0) and len(item.shape) + stack == len(o.shape):
            start += 1 if stack else item.shape[dim]
            continue
        leaf = o.written(item)
        if stack:
            viewed = leaf.meta().unsqueeze(dim)
            leaf = Leaf(leaf.source, tuple(viewed.shape), tuple(viewed.stride()), leaf.offset)
        if len(leaf.shape) != len(o.shape):  # a legacy empty 1-d input, which cat skips
            continue
        origin = tuple(start if d == dim else 0 for d in range(len(o.shape)))
        if leaf.shape[dim]:
            terms.append(Load(leaf, o.shape, window=Window(origin)))
        start += leaf.shape[dim]
    if not terms:
        raise NotFusible("joins empty tensors")
    expr = terms[0]
    for term in terms[1:]:
        expr = Call("add", (expr, term))
    return o.value_of(expr)


def triangle(o: OpLowering, upper: bool) -> Value:
    """triu(x, k) / tril(x, k): x where column - row >= k (<= k for tril) in its last two dims, 0 elsewhere: a
    windowed load with that diagonal."""
    leaf = o.written(o.args[0])
    if len(leaf.shape) < 2:
        raise NotFusible("takes a triangle of a tensor of fewer than two dims")
    window = Window((0,) * len(leaf.shape), 0.0, (int(o.arg(1, "diagonal", 0)), upper))
    return o.value_of(Load(leaf, o.shape, window=window))


def constant_pad(o: OpLowering) -> Leaf:
    """constant_pad_nd(x, pad, value): pad holds (before, after) pairs from the last dim backwards."""
    item, pad, fill = o.args[0], list(o.args[1]), float(o.arg(2, "value", 0.0))
    if any(size < 0 for size in pad):
        raise NotFusible("crops a tensor (negative padding)")
    ndim = len(o.shape)
    low, high = [0] * ndim, [0] * ndim
    for k in range(len(pad) // 2):
        low[ndim - 1 - k], high[ndim - 1 - k] = pad[2 * k], pad[2 * k + 1]
    return o.padded_copy(item, tuple(low), tuple(high), fill)
