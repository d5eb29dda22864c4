"""Fold a row sum weighted by a softmax of the same row into the pass that computes the softmax's statistics.

Entropy, sum_i p_i * log p_i, and a KL divergence, sum_i p_i * (log p_i - log q_i), are sums over a row weighted
by p = softmax(a) of that row. Analysed op by op, the weight p_i = exp(a_i - max) / sum needs the softmax's
statistics, so the sum is a second statistics level: a second pass over the row. But a sum of the form

    sum_i exp(a_i - m) * k * (g_i + c)    (m: the max of the online softmax over the same a_i;
                                           k, c: constant per row; g_i: elementwise in the row)

equals k * (w + c * s), with s = sum_i exp(a_i - m) and w = sum_i exp(a_i - m) * g_i. The pair (s, w) is
accumulated with the running max in one pass, both rescaled by exp(m_old - m_new) when the max grows: Milakov &
Gimelshein's online softmax extended to a weighted sum. `fold_expectations` rewrites each such sum into a
"softmax_weighted" statistic (max, sum, weighted) that also stands in for the online softmax it extends, so the
kernel reads the row once. The constant part c (-logsumexp(a) in entropy, logsumexp(b) - logsumexp(a) in a KL) is
split off algebraically and multiplied by s rather than assumed to have weights summing to exactly 1.

Only exact matches are folded: the weight must be exp(a - m), exp(a - (m + log s)) (a log-softmax's exp, also as
logsumexp's finish) or either times or over row constants (a softmax's 1 / s), where a is exactly the input of an
online softmax of the row; g must not read that statistic, and must need no statistic of its level or later (so
the fold never adds a level). Anything else keeps its two passes, and the results differ by fp32 rounding only.

A plain row sum of g + c (c constant per row, from a statistic of the sum's pass) becomes sum(g) + n * c when g
needs no such statistic, which moves it a pass earlier (`_first_shifted_sum`; label smoothing's log-softmax sum).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from kernelpilot.policy.ir import Call, Const, Expr, Field, Gather, Group, Load, Reduce, rebuilt, walk
from kernelpilot.policy.strides import resolve_accesses, strides_in

# Statistics whose max and sum of exp(value - max) a softmax weight may read.
_SOFTMAX_KINDS = ("online_softmax", "softmax_weighted")
_EXPONENTIALS = ("exp", "exp_fast")


def fold_expectations(groups: list[Group]) -> list[Group]:
    """`groups` with every softmax-weighted row sum of a row group folded into its softmax's pass."""
    return [_folded(group) if group.kind == "row" else group for group in groups]


@dataclass(frozen=True)
class _Weighted:
    """A row sum's value as scale * exp(value of `softmax` - its max) * (element + constant).

    `scale` and `constant` are per-row expressions (None for 1 and 0), `element` varies along the row (None for 0).
    """

    softmax: Reduce
    scale: Expr | None
    element: Expr | None
    constant: Expr | None


def _folded(group: Group) -> Group:
    expr = group.expr
    while True:
        match = _first_match(group, expr)
        if match is not None:
            expr = _rewritten(expr, *match)
            continue
        shifted = _first_shifted_sum(group, expr)
        if shifted is None:
            break
        expr = _substituted(expr, *shifted)
    if expr == group.expr:
        return group
    folded = replace(group, expr=expr, tensors=[], accesses=[], loads={})
    resolve_accesses(folded)
    return folded


def _first_match(group: Group, expr: Expr) -> tuple[Reduce, _Weighted] | None:
    """The first sum of `expr` (inner ones first) that folds into its softmax's pass, and how it splits."""
    invariant = _RowInvariance(group)
    reduces = [node for node in walk(expr) if isinstance(node, Reduce)]
    levels = _levels(reduces)
    for reduce in reduces:
        if reduce.kind != "sum":
            continue
        weighted = _weighted(reduce.value, invariant)
        if weighted is None or weighted.softmax.space != reduce.space:
            continue
        element_reads = {node for node in walk(weighted.element) if isinstance(node, Reduce)}
        # The new statistic runs in the softmax's pass: its element part may read only earlier levels' statistics,
        # never the softmax's own (that would make the statistic depend on itself).
        if weighted.softmax in element_reads or any(levels[r] >= levels[weighted.softmax] for r in element_reads):
            continue
        return reduce, weighted
    return None


def _first_shifted_sum(group: Group, expr: Expr) -> tuple[dict[Expr, Expr], dict] | None:
    """The first row sum of `expr` of the form sum_i (g_i + c), c constant per row and read from a statistic of
    the sum's own pass or later, rewritten as sum_i g_i + n * c: a pass earlier, as g needs no later statistic.

    The sum of a log-softmax over the row (label smoothing's) is sum_i x_i - n * logsumexp(x): it joins the
    softmax's pass instead of re-reading the row after it. Mathematically equal; in fp32 the two round differently
    (both sum n terms), and infinities and NaNs propagate alike."""
    invariant = _RowInvariance(group)
    reduces = [node for node in walk(expr) if isinstance(node, Reduce)]
    levels = _levels(reduces)
    for reduce in reduces:
        if reduce.kind != "sum" or reduce.inner or levels[reduce] == 0:
            continue
        element, constant = _split(reduce.value, invariant)
        if element is None or constant is None:
            continue
        element_reads = [node.reduce for node in walk(element) if isinstance(node, Field)]
        if any(levels[r] >= levels[reduce] - 1 for r in element_reads):
            continue  # the element part needs the same statistics: nothing to gain
        total = Reduce("sum", element, reduce.shape, reduce.dims, reduce.inner)
        count = Const(float(math.prod(reduce.shape[len(reduce.shape) - reduce.dims :])), reduction_length=True)
        return {Field(reduce, "sum"): Call("add", (Field(total, "sum"), Call("mul", (count, constant))))}, {}
    return None


def _levels(reduces: list[Reduce]) -> dict[Reduce, int]:
    """Each statistic's pass: one more than the latest pass of the statistics it reads (as codegen's row program)."""
    levels: dict[Reduce, int] = {}
    for reduce in reduces:  # walk order: the statistics a statistic reads come before it
        used = [node.reduce for operand in reduce.operands for node in walk(operand) if isinstance(node, Field)]
        levels[reduce] = 1 + max((levels[r] for r in used), default=-1)
    return levels


def _rewritten(expr: Expr, total: Reduce, weighted: _Weighted) -> Expr:
    """`expr` with the sum `total` read from a softmax_weighted statistic that replaces its online softmax."""
    softmax = weighted.softmax
    moves: dict[Expr, Expr] = {}
    if weighted.element is None:
        # Only a per-row constant is weighted: the sum of the weights is the softmax's own sum of exp.
        folded = Field(softmax, "sum")
    else:
        statistic = Reduce("softmax_weighted", softmax.value, softmax.shape, softmax.dims, softmax.inner,
                           weighted=weighted.element)  # fmt: skip
        if softmax.kind == "online_softmax":
            # The new statistic computes the same max and sum (up to fp32 rounding): the online softmax is not needed.
            moves = {Field(softmax, name): Field(statistic, name) for name in ("max", "sum")}
        folded = Field(statistic, "weighted")
        if weighted.constant is not None:
            folded = Call("add", (folded, Call("mul", (weighted.constant, Field(statistic, "sum")))))
    if weighted.constant is not None and weighted.element is None:
        folded = Call("mul", (weighted.constant, folded))
    if weighted.scale is not None:
        folded = Call("mul", (weighted.scale, folded))
    folded = _substituted(folded, moves, {})
    return _substituted(expr, {**moves, Field(total, "sum"): folded}, {})


def _substituted(expr: Expr, fields: dict[Expr, Expr], done: dict[Expr, Expr]) -> Expr:
    """`expr` with the Fields in `fields` replaced, wherever they occur (statistics reading them included)."""
    return rebuilt(expr, fields.get, done)


# ------------------------------------------------------------------------------------------ matching


class _RowInvariance:
    """Whether an expression is one value per row of the group: constants, statistics, gathers and loads that do
    not move along the row."""

    def __init__(self, group: Group):
        self.group = group
        self._known: dict[Expr, bool] = {}

    def __call__(self, expr: Expr) -> bool:
        if expr not in self._known:
            if isinstance(expr, Load):
                strides, _ = strides_in(expr, self.group.shape, self.group.inner_dims)
                self._known[expr] = not any(strides[len(strides) - self.group.row_dims :])
            elif isinstance(expr, Call):
                self._known[expr] = all(self(arg) for arg in expr.args)
            else:
                self._known[expr] = isinstance(expr, (Const, Field, Gather))
        return self._known[expr]


def _weighted(expr: Expr, invariant: _RowInvariance) -> _Weighted | None:
    """`expr` as scale * exp(a - m) * g (see `_Weighted`), or None when it has no such form."""
    weight = _softmax_weight(expr, invariant)
    if weight is not None:
        softmax, scale = weight
        return _Weighted(softmax, scale, None, Const(1.0))
    if not isinstance(expr, Call):
        return None
    if expr.op in ("identity", "neg"):
        term = _weighted(expr.args[0], invariant)
        if term is None or expr.op == "identity":
            return term
        return _times(term, lambda g: Call("neg", (g,)), invariant)
    if expr.op == "mul":
        for inner, other in ((0, 1), (1, 0)):
            term = _weighted(expr.args[inner], invariant)
            if term is not None:
                factor = expr.args[other]
                return _times(term, lambda g: factor if g == Const(1.0) else Call("mul", _ordered(g, factor, inner)),
                              invariant)  # fmt: skip
    if expr.op == "div":
        term = _weighted(expr.args[0], invariant)
        if term is not None:
            return _times(term, lambda g: Call("div", (g, expr.args[1])), invariant)
    return None


def _ordered(term: Expr, other: Expr, position: int) -> tuple[Expr, Expr]:
    """(term, other) with `term` at `position`: a product keeps its operands' order (the same rounding)."""
    return (term, other) if position == 0 else (other, term)


def _times(term: _Weighted, apply: Callable[[Expr], Expr], invariant: _RowInvariance) -> _Weighted:
    """`term` with its g replaced by apply(g), split anew into element + constant."""
    if term.element is None:
        g = term.constant if term.constant is not None else Const(0.0)
    else:
        g = term.element if term.constant is None else Call("add", (term.element, term.constant))
    element, constant = _split(apply(g), invariant)
    return replace(term, element=element, constant=constant)


def _softmax_weight(expr: Expr, invariant: _RowInvariance) -> tuple[Reduce, Expr | None] | None:
    """`expr` as exp(a - m) * scale for the softmax statistic over a (scale None for 1), or None."""
    if not isinstance(expr, Call):
        return None
    if expr.op in _EXPONENTIALS and isinstance(expr.args[0], Call) and expr.args[0].op == "sub":
        value, shift = expr.args[0].args
        return _shifted_by_statistic(value, shift)
    if expr.op in ("mul", "div"):
        for inner, other in [(0, 1), (1, 0)] if expr.op == "mul" else [(0, 1)]:
            weight = _softmax_weight(expr.args[inner], invariant)
            if weight is None or not invariant(expr.args[other]):
                continue
            softmax, scale = weight
            if expr.op == "div":
                factor = Call("div", (scale if scale is not None else Const(1.0), expr.args[other]))
            else:
                factor = expr.args[other] if scale is None else Call("mul", (scale, expr.args[other]))
            return softmax, factor
    return None


def _shifted_by_statistic(value: Expr, shift: Expr) -> tuple[Reduce, Expr | None] | None:
    """exp(value - shift) as exp(value - m) * scale when `shift` is m, or m + log(s), of a softmax over `value`."""
    if isinstance(shift, Field) and shift.name == "max":
        softmax, scale = shift.reduce, None
    elif isinstance(shift, Call) and shift.op in ("add", "logsumexp_finish"):
        maximum, log_sum = shift.args
        if shift.op == "add":
            if not (isinstance(log_sum, Call) and log_sum.op == "log"):
                return None
            log_sum = log_sum.args[0]
        # logsumexp_finish(m, s) is m + log(s) but for an empty row (m = -inf), where both forms give NaN weights.
        if not (isinstance(maximum, Field) and maximum.name == "max" and log_sum == Field(maximum.reduce, "sum")):
            return None
        softmax, scale = maximum.reduce, Call("reciprocal", (log_sum,))
    else:
        return None
    if softmax.kind not in _SOFTMAX_KINDS or softmax.value != value:
        return None
    return softmax, scale


def _split(expr: Expr, invariant: _RowInvariance) -> tuple[Expr | None, Expr | None]:
    """`expr` as element + constant: the part varying along the row and the per-row part (None for 0)."""
    if invariant(expr):
        return None, expr
    if not isinstance(expr, Call):
        return expr, None
    if expr.op == "identity":  # (kept where nothing splits off, so the element is the node the softmax reads)
        element, constant = _split(expr.args[0], invariant)
        return (expr, None) if constant is None else (element, constant)
    if expr.op in ("add", "sub"):
        (left_element, left_constant), (right_element, right_constant) = (_split(arg, invariant) for arg in expr.args)
        return _combined(expr.op, left_element, right_element), _combined(expr.op, left_constant, right_constant)
    if expr.op == "neg":
        element, constant = _split(expr.args[0], invariant)
        return _negated(element), _negated(constant)
    # A product with, or a quotient by, a per-row factor scales both parts.
    scaled = [(0, 1), (1, 0)] if expr.op == "mul" else [(0, 1)] if expr.op == "div" else []
    for inner, other in scaled:
        if invariant(expr.args[other]):
            element, constant = _split(expr.args[inner], invariant)
            factor = expr.args[other]
            return tuple(
                None if part is None else Call(expr.op, _ordered(part, factor, inner)) for part in (element, constant)
            )  # type: ignore[return-value]
    return expr, None


def _combined(op: str, left: Expr | None, right: Expr | None) -> Expr | None:
    """left + right or left - right, where None is 0."""
    if right is None:
        return left
    if left is None:
        return right if op == "add" else Call("neg", (right,))
    return Call(op, (left, right))


def _negated(expr: Expr | None) -> Expr | None:
    return None if expr is None else Call("neg", (expr,))
