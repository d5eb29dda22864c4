"""Access strides: where each Load of a group reads its tensor, as strides over the group's iteration shape
(splitting a dim the iteration shape splits, broadcasting the dims a tensor lacks). Run once a group is final.
Also: an elementwise expression re-read over its shape with the dims permuted or reversed (flip: negative strides),
and a permuted result's view back."""

from __future__ import annotations

import math

from kernelpilot.policy.ir import (
    Access, Call, Const, Expr, Group, Leaf, Load, NotFusible, contiguous_strides, rebuilt, walk,
)  # fmt: skip


def resolve_accesses(group: Group) -> None:
    """Give each distinct tensor view the group loads its strides over the group's iteration shape."""
    accesses: dict[Access, int] = {}
    for node in walk(group.expr):
        if not isinstance(node, Load):
            continue
        source = node.leaf.source
        if source not in group.tensors:
            group.tensors.append(source)
        if group.kind not in ("elementwise", "row", "scan") and any(s < 0 for s in node.leaf.strides):
            raise NotFusible("reads a reversed (flipped) tensor in a kernel that is not elementwise, row or scan")
        if node.guard is not None:
            if group.kind != "row" or node.use_shape != group.shape or node.rows:
                raise NotFusible("reads a pooling window over implicit padding in a kernel that is not its row kernel")
            strides, offset = strides_in(node, group.shape, group.inner_dims)
            access = Access(group.tensors.index(source), strides, offset, guard=node.guard)
        elif node.window is None:
            strides, offset = strides_in(node, group.shape, group.inner_dims)
            access = Access(group.tensors.index(source), strides, offset)
        else:
            access = _windowed_access(node, group, group.tensors.index(source))
        group.loads[node] = accesses.setdefault(access, len(accesses))
    group.accesses = list(accesses)


def _windowed_access(load: Load, group: Group, tensor: int) -> Access:
    """A windowed load's access in an elementwise group over its use shape: the leaf's strides, the offset moved
    back by the origin, and the range of coordinates the leaf covers in each dim."""
    leaf, window = load.leaf, load.window
    if group.kind != "elementwise" or load.rows or group.shape != load.use_shape or len(leaf.shape) != len(group.shape):
        raise NotFusible("reads a windowed tensor (a cat's input, a padded tensor) in a kernel that is not elementwise")
    offset = leaf.offset - sum(origin * stride for origin, stride in zip(window.origin, leaf.strides))
    bounds = tuple((origin, origin + size) for origin, size in zip(window.origin, leaf.shape))
    return Access(tensor, leaf.strides, offset, bounds, window.fill, window.diagonal)


def strides_in(load: Load, shape: tuple[int, ...], inner: int = 0) -> tuple[tuple[int, ...], int]:
    """The element strides of `load` over `shape`: its leaf broadcast to its use, then its use into `shape`,
    which either broadcasts it or splits its dims (group norm's (N, C, H, W) into (N, G, C/G, H, W)).

    `inner`: how many trailing dims of `shape` follow the reduced dims (a column reduction's)."""
    leaf = load.leaf
    use_strides = broadcast_strides(leaf.shape, leaf.strides, load.use_shape)
    use_shape = load.use_shape
    if load.rows:  # a keepdim=False result: its reduced dims come back as size-1 dims, before the inner ones
        row_dims, at = len(shape) - len(use_shape), len(use_shape) - inner
        use_shape = use_shape[:at] + (1,) * row_dims + use_shape[at:]
        use_strides = use_strides[:at] + (0,) * row_dims + use_strides[at:]
    split = _split_strides(use_shape, use_strides, shape) if math.prod(use_shape) == math.prod(shape) else None
    return split if split is not None else broadcast_strides(use_shape, use_strides, shape), leaf.offset


def _split_strides(shape: tuple[int, ...], strides: tuple[int, ...], target: tuple[int, ...]) -> tuple[int, ...] | None:
    """Strides over `target` of a (shape, strides) view when `target` only splits its dims into consecutive
    factors (C into G, C/G; size-1 dims aside), or None when it does not."""
    dims = iter([(size, stride) for size, stride in zip(shape, strides) if size != 1])
    result: list[int] = []
    remaining, stride = 1, 0
    for size in target:
        if size == 1:
            result.append(0)
            continue
        if remaining == 1:
            remaining, stride = next(dims, (1, 0))
        if remaining % size:
            return None
        remaining //= size
        result.append(stride * remaining)
    return tuple(result) if remaining == 1 and next(dims, None) is None else None


def splits(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """True when `target` is `shape` with some dims split into consecutive factors (or `shape` itself)."""
    return _split_strides(shape, contiguous_strides(shape), target) is not None


def broadcast_strides(shape: tuple[int, ...], strides: tuple[int, ...], target: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a (shape, strides) view broadcast, numpy-style, to `target`."""
    if len(shape) > len(target):
        raise NotFusible(f"broadcasts a {list(shape)} tensor into {list(target)}")
    padding = len(target) - len(shape)
    result = [0] * padding
    for size, stride, wanted in zip(shape, strides, target[padding:]):
        if size == wanted:
            result.append(stride if size != 1 else 0)
        elif size == 1:
            result.append(0)
        else:
            raise NotFusible(f"broadcasts a {list(shape)} tensor into {list(target)}")
    return tuple(result)


def permuted_expr(expr: Expr, shape: tuple[int, ...], order: list[int]) -> Expr:
    """An elementwise expression over `shape` re-read over the permuted shape (dim i of the result is dim order[i]
    of `shape`): each load reads the same element through permuted strides."""
    return reindexed(expr, shape, tuple(shape[d] for d in order), [((d, 1),) for d in order])


def reindexed(expr: Expr, shape: tuple[int, ...], new_shape: tuple[int, ...],
              uses: list[tuple[tuple[int, int], ...]], start: tuple[int, ...] | None = None) -> Expr:  # fmt: skip
    """An elementwise expression over `shape` (no statistics, no per-row loads) read over `new_shape`, whose
    coordinate j moves coordinate d of `shape` by f for each (d, f) in uses[j], from coordinate `start` of `shape`
    (its origin by default): a permutation, a pooling's windows (an output position moves its dim by the stride, a
    kernel position by the dilation), or a flip (-1 from the last index). Each load reads through the strides
    that follow."""

    def rule(node: Expr) -> Expr | None:
        if isinstance(node, Load) and not node.rows and node.window is None and node.guard is None:
            strides, offset = strides_in(node, shape)
            offset += sum(at * stride for at, stride in zip(start or (), strides))
            new_strides = tuple(sum(strides[d] * factor for d, factor in moves) for moves in uses)
            return Load(Leaf(node.leaf.source, new_shape, new_strides, offset), new_shape)
        if isinstance(node, Call):
            return None
        if isinstance(node, Const):
            return node
        raise NotFusible("re-reads an expression that holds a row statistic or a window over another shape")

    return rebuilt(expr, rule)


def flipped(expr: Expr, shape: tuple[int, ...], dims: list[int]) -> Expr:
    """An elementwise expression over `shape` read with the `dims` reversed: each load reads through a negative
    stride there, from the other end. Flipping twice gives back the same loads."""
    uses = [((d, -1 if d in dims else 1),) for d in range(len(shape))]
    return reindexed(expr, shape, shape, uses, tuple(size - 1 if d in dims else 0 for d, size in enumerate(shape)))


def unpermuted(leaf: Leaf, order: list[int]) -> Leaf:
    """The view of a contiguous result computed over a permuted shape (dim i was dim order[i]) in the original
    order of its dims."""
    strides = contiguous_strides(leaf.shape)
    shape, result = [0] * len(order), [0] * len(order)
    for position, dim in enumerate(order):
        shape[dim], result[dim] = leaf.shape[position], strides[position]
    plain = contiguous_strides(tuple(shape))
    if all(size == 1 or a == b for size, a, b in zip(shape, result, plain)):
        result = list(plain)  # only size-1 dims moved (instance norm's): the result is contiguous as it is
    return Leaf(leaf.source, tuple(shape), tuple(result), leaf.offset)
