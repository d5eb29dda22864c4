"""Merge per-row row kernels that share row statistics into one kernel writing several values per row.

Cross-entropy plus a z-loss asks for each row's target log-probability and for its logsumexp: two per-row values
from the same online-softmax statistics of the same logits row. Analysed one op at a time they are two row
kernels, each reading the logits from memory; merged, one kernel reads each row once and writes both values,
stacked (its output is [values, rows]: value k of every row at [k, row]). The groups reading the old outputs
read views of the stacked one, and the merged kernel runs where the first of the two did. A value forward returns
(an RL trainer's token log-probabilities and entropies) is returned as its rows of the stacked output, a
contiguous view.
"""

from __future__ import annotations

from dataclasses import replace

from kernelpilot.policy.ir import Expr, Group, Leaf, Load, Source, Stack, rebuilt
from kernelpilot.policy.strides import resolve_accesses

# Kinds of group whose reads are Loads in an expression, which `_relocate` can point at the stacked output.
_EXPRESSION_KINDS = ("elementwise", "row", "column")


def merge_row_outputs(groups: list[Group], returned: list[Leaf]) -> tuple[list[Group], list[Leaf]]:
    """`groups` with every pair of per-row row groups that share a row statistic merged (see the module
    docstring), and the tensors forward returns (`returned`) where they now are."""
    groups, returned = list(groups), list(returned)
    first = 0
    while first < len(groups):
        later = next((j for j in range(first + 1, len(groups)) if _mergeable(groups, first, j)), None)
        if later is None:
            first += 1
        else:
            groups, moves = _merged(groups, first, later)
            returned = [_moved(leaf, moves) for leaf in returned]
    return groups, returned


def _mergeable(groups: list[Group], first: int, later: int) -> bool:
    a, b = groups[first], groups[later]
    same_rows = all(g.kind == "row" and g.per_row and not g.inner_dims for g in (a, b)) and (
        (a.shape, a.row_dims, a.output.dtype) == (b.shape, b.row_dims, b.output.dtype)
    )
    if not same_rows or not set(a.reduces()) & set(b.reduces()):
        return False
    earlier_outputs = {g.output for g in groups[:first]}
    # The later group moves up to the first one's place: it may read only what exists there.
    if any(t.kind not in ("input", "parameter") and t not in earlier_outputs for t in b.tensors):
        return False
    outputs = {a.output, b.output}
    readers = [g for g in groups if outputs & set(g.tensors)]
    return all(g.kind in _EXPRESSION_KINDS for g in readers)


def _merged(groups: list[Group], first: int, later: int) -> tuple[list[Group], dict[Source, tuple[Source, int]]]:
    """The groups with `later` merged into `first`, and where each old output's values now start."""
    a, b = groups[first], groups[later]
    values = _stacked(a) + _stacked(b)
    output = Source("group", a.name, (len(values), a.rows), a.output.dtype)
    # Where each old output's values now start in the stacked one.
    moves = {a.output: (output, 0), b.output: (output, len(_stacked(a)) * a.rows)}
    merged = Group(a.name, "row", a.ops + b.ops, [], output, a.shape, Stack(values), per_row=True, row_dims=a.row_dims)
    resolve_accesses(merged)
    result = []
    for index, group in enumerate(groups):
        if index == first:
            result.append(merged)
        elif index != later:
            result.append(_reading_moved(group, moves))
    return result, moves


def _moved(leaf: Leaf, moves: dict[Source, tuple[Source, int]]) -> Leaf:
    """A view of a moved output as the same elements of the stacked one: its rows, still contiguous."""
    if leaf.source not in moves:
        return leaf
    source, start = moves[leaf.source]
    return replace(leaf, source=source, offset=leaf.offset + start)


def _stacked(group: Group) -> tuple[Expr, ...]:
    return group.expr.values if isinstance(group.expr, Stack) else (group.expr,)


def _reading_moved(group: Group, moves: dict[Source, tuple[Source, int]]) -> Group:
    """`group` reading the moved outputs where they now are; unchanged when it reads none of them."""
    if not set(moves) & set(group.tensors):
        return group
    relocated = replace(group, expr=_relocate(group.expr, moves, {}), tensors=[], accesses=[], loads={})
    resolve_accesses(relocated)
    return relocated


def _relocate(expr: Expr, moves: dict[Source, tuple[Source, int]], done: dict[Expr, Expr]) -> Expr:
    """`expr` with its loads of moved tensors reading the same elements at their new place."""

    def moved(node: Expr) -> Expr | None:
        if not (isinstance(node, Load) and node.leaf.source in moves):
            return None
        source, start = moves[node.leaf.source]
        return replace(node, leaf=replace(node.leaf, source=source, offset=node.leaf.offset + start))

    return rebuilt(expr, moved, done)
