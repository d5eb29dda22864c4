"""Which generated groups take their leading dims (the batch, and a sequence after it) as runtime sizes.

A kernel generated at batch B is right at any batch B' when the leading dim only repeats the same work: every
tensor that moves along it (a carrier) is read slab by slab, slab b of the output from slab b of each carrier (a
slab: everything behind one index of dim 0), and nothing else in the kernel depends on B. Then the launcher takes
B' at run time, the binding checks that the carriers agree on it (their other dims, and every other tensor, stay
fixed), and the output is allocated with it. Everything that is not proved so keeps B fixed, which the binding
then checks as before: a fixed kernel fails loudly at another batch, a wrong one would not.

A matmul (cuBLASLt, not batched) takes it where its M rows are the leading dims' slabs: our A, any residual and the
output are whole contiguous tensors read in order, B (the weight) and the bias do not move along them, and each of
A, the residual and the output holds the same count of rows in its first one or two dims: x of a Linear over
(batch, features) or (batch, tokens, features), or a chain through an intermediate flattened to (batch x tokens,
rank), as a LoRA's down projection writes and its up projection reads. The launcher then builds cuBLASLt's plan
for each M it meets, and the binding checks that the tensors agree on their row count.

A batched (strided) matmul takes the batch where the output's dim 0 is each carrier's dim 0 and the batch count
is that batch times a constant (heads: (batch, heads, M, N) through one strided batch of batch x heads matrices):
each of A, B and the residual either stays put along the batch (stride 0, a shared weight) or reads its matrices
of batch index b inside its slab b, at a constant offset there. The launcher builds cuBLASLt's plan (layouts with
the batch count) for each batch it meets. A cuDNN convolution (forward, NCHW or NHWC, legacy or graph API, and
transposed) takes N where its input is a whole tensor whose dim 0 is N: the weight and bias do not move along it,
and the launcher builds its descriptors, plan and workspace size for each N it meets.

What keeps it fixed: a family other than elementwise, row, scan, matmul and conv (column reductions); a leading dim
that a row kernel reduces; a carrier read at a fixed position along it (x[0] broadcast over the batch) or reaching
outside its slab; a cat, pad or triangle whose window cuts the leading dim; stacked per-row values (merge.py),
whose layout is [values, rows]; a returned view that reshapes dim 0; an elementwise vector width that a runtime
numel could break; and a constant equal to B or 1/B in the expression (`x / x.shape[0]` is traced to a number;
a reduction's own length, which the lowering marks, is not one).

Dim 1 (a sequence: tokens of (batch, tokens, features)) is a runtime size too where the same holds of the pair:
the batch is free, a fixed dim follows dim 1 (it is not reduced, and a 2-d tensor's dim 1 is its features), and
every access walks dims 0 and 1 as one dim (a carrier in order, with dim 1 of the iteration's size; anything else
broadcast over both: a positional table of (tokens, features) keeps dim 1 fixed). The kernel then sees one
runtime count, batch x sequence, exactly as it sees a batch; the binding checks the pair and allocates with both.
"""

from __future__ import annotations

import math

from kernelpilot.policy.codegen import elementwise_layout
from kernelpilot.policy.ir import Access, Const, Group, Leaf, Stack, contiguous_strides, walk

FAMILIES_WITH_RUNTIME_LEADING = ("elementwise", "row", "scan", "matmul", "conv")


def mark_runtime_leading(groups: list[Group], returned: list[Leaf]) -> None:
    """Set `free_dims` on each group (2 where batch and sequence may be runtime sizes, 1 where the batch alone may,
    else 0) and `carrier_dims`, the free leading dims of each of its tensors (see the module docstring)."""
    for group in groups:
        if group.kind == "matmul":
            prefixes = _batched_matmul_batch if group.matmul.batch > 1 else _matmul_prefixes
            group.free_dims, group.carrier_dims = prefixes(group, returned)
            continue
        if group.kind == "conv":
            group.free_dims, group.carrier_dims = _conv_batch(group, returned)
            continue
        free = 0
        if group.kind in FAMILIES_WITH_RUNTIME_LEADING and _leading_may_vary(group, returned):
            free = 2 if _sequence_may_vary(group, returned) else 1
        moving = {access.tensor for access in group.accesses if access.strides[0] != 0}
        group.free_dims = free
        group.carrier_dims = tuple(free if index in moving else 0 for index in range(len(group.tensors)))


def describe_leading(group: Group) -> str:
    """One sentence for the generated files' comments: which dims are free and which are fixed."""
    shape = group.output.shape
    if not group.leading_free:
        return f"Every dim is fixed at generation time ({'x'.join(map(str, shape)) or 'a scalar'})."
    if group.free_dims == 2:
        rest = "x".join(map(str, shape[2:]))
        return (f"Dims 0 and 1 (the batch and the sequence, {shape[0]}x{shape[1]} when generated) are runtime sizes; "
                f"the others are fixed at {rest}.")
    if len(shape) == 1:
        return f"The output's one dim (the batch, {shape[0]} when generated) is a runtime size."
    rest = "x".join(map(str, shape[1:]))
    return f"Dim 0 (the batch, {shape[0]} when generated) is a runtime size; the others are fixed at {rest}."


def _leading_may_vary(group: Group, returned: list[Leaf]) -> bool:
    if not group.shape or group.shape[0] < 2 or isinstance(group.expr, Stack):
        return False
    batch = group.shape[0]
    if not _output_in_slabs(group, batch) or _mentions(group, (batch,)):
        return False
    if group.kind in ("row", "scan") and len(group.shape) - group.row_dims < 1:
        return False  # the leading dim is part of the row: reduced (or scanned) over
    if group.kind == "elementwise":
        layout = elementwise_layout(group)
        if (math.prod(group.shape) // batch) % layout.vec:
            return False
    moving = [a for a in group.accesses if a.strides[0] != 0]
    carriers = {a.tensor for a in moving}
    if not moving or any(a.tensor in carriers and a.strides[0] == 0 for a in group.accesses):
        return False
    if not all(_reads_its_slab(group, access, batch) for access in moving):
        return False
    return all(_keeps_dims(leaf, 1) for leaf in returned if leaf.source == group.output)


def _matmul_prefixes(group: Group, returned: list[Leaf]) -> tuple[int, tuple[int, ...]]:
    """(the output's free leading dims, each tensor's) for a plain matmul whose M rows follow them, else all 0."""
    fixed = (0, (0,) * len(group.tensors))
    matmul, out = group.matmul, tuple(group.output.shape)
    m, n, k = matmul.mnk
    moving = [leaf for leaf in (matmul.a, matmul.residual) if leaf is not None]
    sources = {leaf.source for leaf in moving}
    if matmul.batch != 1 or math.prod(out) != m * n or any(leaf.source in sources for leaf in (matmul.b, matmul.bias) if leaf):
        return fixed
    if not _whole(matmul.a, m, k) or (matmul.residual is not None and not _whole(matmul.residual, m, n)):
        return fixed
    for free in (2, 1):
        count = math.prod(out[:free])
        if len(out) <= free or min(out[:free]) < 2 or m % count:
            continue
        prefixes = {leaf.source: _prefix_of(tuple(leaf.source.shape), count, free, out) for leaf in moving}
        if None in prefixes.values() or (free == 2 and 2 not in prefixes.values()):
            continue  # the output's two dims are allocated from a tensor that has them
        sizes = {count, *out[:free], *(size for s in sources for size in s.shape[: prefixes[s]])}
        if any(math.isclose(matmul.alpha, size) or math.isclose(matmul.alpha, 1 / size) for size in sizes):
            continue  # a size traced to a number (`x @ w / x.shape[0]`)
        if all(_keeps_dims(leaf, free) for leaf in returned if leaf.source == group.output):
            return free, tuple(prefixes.get(source, 0) for source in group.tensors)
    return fixed


def _batched_matmul_batch(group: Group, returned: list[Leaf]) -> tuple[int, tuple[int, ...]]:
    """(1, each tensor's free dims) for a strided-batch matmul whose batch count is the output's dim 0 times a
    constant and whose moving operands read each batch index's matrices inside their own slab, else all 0."""
    fixed = (0, (0,) * len(group.tensors))
    matmul, out = group.matmul, tuple(group.output.shape)
    m, n, _ = matmul.mnk
    if len(out) < 2 or out[0] < 2 or matmul.batch % out[0] or math.prod(out) != matmul.batch * m * n:
        return fixed
    batch, per = out[0], matmul.batch // out[0]  # per: matrices per batch index (heads)
    operands = [leaf for leaf in (matmul.a, matmul.b) if leaf is not None]
    moving = [leaf for leaf in operands if leaf.strides[0] != 0]
    carriers = {leaf.source for leaf in moving} | ({matmul.residual.source} if matmul.residual else set())
    still = [leaf for leaf in operands if leaf.strides[0] == 0] + ([matmul.bias] if matmul.bias else [])
    if not moving or any(leaf.source in carriers for leaf in still):
        return fixed
    if not all(_matrices_in_slabs(leaf, batch, per) for leaf in moving):
        return fixed
    residual = matmul.residual
    if residual is not None and not (residual.offset == 0 and residual.source.shape[:1] == (batch,)
                                     and math.prod(residual.source.shape) == math.prod(out)):  # fmt: skip
        return fixed  # C is read as the output is written: a whole tensor, slab b for batch index b
    if any(math.isclose(matmul.alpha, size) or math.isclose(matmul.alpha, 1 / size) for size in (batch, matmul.batch)):
        return fixed  # a size traced to a number (`q @ k / q.shape[0]`)
    if not all(_keeps_dims(leaf, 1) for leaf in returned if leaf.source == group.output):
        return fixed
    return 1, tuple(int(source in carriers) for source in group.tensors)


def _matrices_in_slabs(leaf: Leaf, batch: int, per: int) -> bool:
    """The `per` matrices of batch index b of a 3-d operand lie in slab b of its source: dim 0 of the source is the
    batch, `per` matrices span one slab, and every element of one matrix lies within its stride from its start."""
    source = leaf.source
    if len(leaf.shape) != 3 or not source.shape or source.shape[0] != batch or any(s < 0 for s in leaf.strides):
        return False
    if leaf.strides[0] * per != math.prod(source.shape[1:]) or leaf.offset < 0:
        return False
    last = leaf.offset + sum((size - 1) * stride for size, stride in zip(leaf.shape[1:], leaf.strides[1:]))
    return last < leaf.strides[0]


def _conv_batch(group: Group, returned: list[Leaf]) -> tuple[int, tuple[int, ...]]:
    """(1, each tensor's free dims) for a convolution whose input is a whole tensor with N as its dim 0 (the
    output's), read by no other operand, else all 0. cuDNN reads image n of the input for image n of the output."""
    fixed = (0, (0,) * len(group.tensors))
    conv, out = group.conv, tuple(group.output.shape)
    source = conv.input.source
    whole = conv.input.offset == 0 and math.prod(source.shape) == math.prod(conv.input.shape)
    if out[0] < 2 or conv.input.shape[0] != out[0] or source.shape[:1] != out[:1] or not whole:
        return fixed
    if any(leaf.source == source for leaf in (conv.weight, conv.bias) if leaf is not None):
        return fixed
    if not all(_keeps_dims(leaf, 1) for leaf in returned if leaf.source == group.output):
        return fixed
    return 1, tuple(int(tensor == source) for tensor in group.tensors)


def _prefix_of(shape: tuple[int, ...], count: int, free: int, out: tuple[int, ...]) -> int | None:
    """How many leading dims of a moving tensor (1 or 2, the output's `free` first) hold the output's `count` rows,
    with a fixed dim after them; two that match the output's own two where it has two free."""
    for dims in (free, 3 - free):
        if len(shape) <= dims or min(shape[:dims]) < 2 or math.prod(shape[:dims]) != count:
            continue
        if dims == 2 and free == 2 and shape[:2] != out[:2]:
            continue
        return dims
    return None


def _whole(leaf: Leaf, rows: int, cols: int) -> bool:
    """`leaf` is its whole source read in order, rows of `cols` (as (rows, cols) or in the source's shape)."""
    source = leaf.source
    return (
        leaf.offset == 0
        and bool(leaf.shape)
        and leaf.shape[-1] == cols
        and math.prod(leaf.shape) == rows * cols
        and all(a == b for size, a, b in zip(leaf.shape, leaf.strides, contiguous_strides(leaf.shape)) if size > 1)
        and bool(source.shape)
        and math.prod(source.shape) == rows * cols
    )


def _output_in_slabs(group: Group, batch: int) -> bool:
    """The output is written contiguously over the rows (or elements) of the iteration shape, dim 0 first."""
    shape = group.output.shape
    written = math.prod(group.shape[: len(group.shape) - group.row_dims]) if group.per_row else math.prod(group.shape)
    return bool(shape) and shape[0] == batch and math.prod(shape) == written


def _mentions(group: Group, sizes: tuple[int, ...]) -> bool:
    """A constant of the expression equals one of `sizes` or its inverse: a size traced to a number. A reduction's
    own length is not one (it counts reduced dims, never the free leading ones), however it compares."""
    constants = {node.value for node in walk(group.expr) if isinstance(node, Const) and not node.reduction_length}
    return any(math.isclose(value, size) or math.isclose(value, 1 / size) for value in constants for size in sizes)


def _sequence_may_vary(group: Group, returned: list[Leaf]) -> bool:
    """With the batch free: dim 1 may be a runtime size too (the module docstring's second paragraph)."""
    shape = group.shape
    kept = len(shape) - (group.row_dims if group.kind in ("row", "scan") else 0)  # dims not reduced or scanned
    if len(shape) < 3 or kept < 2 or shape[1] < 2 or tuple(group.output.shape[:2]) != tuple(shape[:2]):
        return False
    if _mentions(group, (shape[1], shape[0] * shape[1])):
        return False
    if group.kind == "elementwise" and (math.prod(shape) // (shape[0] * shape[1])) % elementwise_layout(group).vec:
        return False
    for access in group.accesses:
        if access.strides[0] != shape[1] * access.strides[1]:
            return False  # dims 0 and 1 not walked as one: a tensor that moves along one of them only
        if access.strides[0] and not _reads_its_step(group, access):
            return False
    return all(_keeps_dims(leaf, 2) for leaf in returned if leaf.source == group.output)


def _reads_its_step(group: Group, access: Access) -> bool:
    """A carrier's (b, t) reads only its own slab (b, t): dim 1 of the tensor is the sequence, no window or check
    cuts it, and every element read lies inside the slab."""
    tensor, shape = group.tensors[access.tensor], group.shape
    if len(tensor.shape) < 3 or tensor.shape[1] != shape[1] or access.diagonal is not None:
        return False
    if access.bounds is not None and tuple(access.bounds[1]) != (0, shape[1]):
        return False
    if access.guard is not None:
        return all(dim > 1 for terms, _, _ in access.guard.checks for dim, _ in terms)
    return _within_slab(access, access.bounds or tuple((0, size) for size in shape), math.prod(tensor.shape[2:]), 2)


def _reads_its_slab(group: Group, access: Access, batch: int) -> bool:
    """Index b of the leading dim reads exactly slab b of the tensor (its dim 0 is the batch, walked in order),
    and every element it reads there lies inside that slab (inside the window, for a windowed access)."""
    tensor = group.tensors[access.tensor]
    slab = math.prod(tensor.shape[1:])
    if not tensor.shape or tensor.shape[0] != batch or access.strides[0] != slab:
        return False
    bounds = access.bounds or tuple((0, size) for size in group.shape)
    if bounds[0] != (0, batch) or (access.diagonal is not None and len(group.shape) == 2):
        return False  # a window (or a triangle's rows) that tells batch indices apart
    if any(stride < 0 for stride in access.strides):
        return False
    if access.guard is not None:  # it reads inside the tensor only: slab b, unless a check involves the batch
        return all(dim > 0 for terms, _, _ in access.guard.checks for dim, _ in terms)
    return _within_slab(access, bounds, slab, 1)


def _within_slab(access: Access, bounds: tuple, slab: int, first: int) -> bool:
    """Every element the access reads for one index of the dims before `first` lies in [0, slab) past that index's
    start: the offsets of the dims from `first` on, at their bounds' ends."""
    low = access.offset + sum(stride * start for stride, (start, _) in zip(access.strides[first:], bounds[first:]))
    high = access.offset + sum(stride * (end - 1) for stride, (_, end) in zip(access.strides[first:], bounds[first:]))
    return 0 <= low and high < slab


def _keeps_dims(leaf: Leaf, count: int) -> bool:
    """A returned view forward can write with its first `count` dims runtime sizes: a reshape of the others."""
    source = leaf.source
    return (
        leaf.offset == 0
        and len(leaf.shape) >= count
        and tuple(leaf.shape[:count]) == tuple(source.shape[:count])
        and math.prod(leaf.shape) == math.prod(source.shape)
        and all(a == b for size, a, b in zip(leaf.shape, leaf.strides, contiguous_strides(leaf.shape)) if size > 1)
    )
