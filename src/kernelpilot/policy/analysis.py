"""Partition a problem's forward into kernels the built-in policy can generate: the grouping stage, between the
trace (trace.py: the aten graph on meta tensors) and the kernel families (families.py).

Walking the graph, each aten op is lowered to IR (lowering.py's tables; ir.py's nodes), elementwise ops are folded
into expressions, and
reductions along the last dimension become `Reduce` nodes inside those expressions, so an expression with its
prologue, reductions and epilogue is one kernel. A value is written to memory ("materialised" into a `Group`)
only where it must be: a forward output, the input of a matrix op or of an op the policy has no template for
(listed in `Analysis.unsupported`).

Matrix products (mm, addmm, bmm on float32, float16, bfloat16) become "matmul" groups, one cuBLASLt call each.
The product stays pending while the ops after it fit cuBLASLt's epilogue, D = act(A @ B + C + bias): a bias
along the last dim, a whole output-shaped residual added before the activation, then ReLU or tanh-GELU. The
first op that does not fit materialises it, and the elementwise/row machinery reads its output like any
tensor. With `faithful`, a half-precision product takes no scale or add after it: it is written in its dtype
first, as eager writes it, and they become an elementwise kernel (see `_fold_into_matmul`). Convolutions become
"conv" groups, one cuDNN call each, the same way (see convolution.py). Other matrix ops (baddbmm, ...) are
"library" groups the policy does not generate.

A row may span several trailing dims of a kernel's iteration shape: group norm iterates over (N, G, C/G, H, W)
and reduces each (sample, group) over the last three, while the tensors around it are indexed over (N, C, H, W),
a shape that the iteration shape splits (C into G, C/G).

A sum, mean, max or min (or a vector norm) over adjacent dims before the last is a "column" group: its iteration
shape is the input's, seen as (outer, reduced, inner), and a `Reduce` with `inner` > 0 reduces the middle part
for every (outer, inner) position. Elementwise ops on its input and on its result fuse into the same kernel; a
result broadcast back over the reduced dims is written first (a column kernel writes one value per column).

A sum, mean, max or min over every dim of a tensor of two or more dims is a row statistic written per row, then
the same statistic of those partial results in a one-row kernel (the batch mean of a loss). After the walk, a sum
weighted by a softmax of the same row (entropy, a KL divergence) joins the softmax's own pass (expectation.py),
and per-row kernels that share a row statistic are merged into one kernel writing several values per row
(merge.py).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kernelpilot.policy.convolution import PendingConv, convolution, fold_into_conv, settle_conv
from kernelpilot.policy.expectation import fold_expectations
from kernelpilot.policy.ir import (
    MATMUL_ALIGNMENT, MATMUL_DTYPES, Analysis, Call, Const, Conv, Expr, Gather, Group, Leaf, Load, Matmul, NotFusible,
    Reduce, Scan,
    Source, Unsupported, Value, contiguous_strides, dtype_name, is_index, matrix_strides, rebuilt, walk,
    walk_reduces, windowed,
)  # fmt: skip
from kernelpilot.policy.leading import mark_runtime_leading
from kernelpilot.policy.lowering import fuses_elementwise, lower
from kernelpilot.policy.op_lowering import KERNEL_DTYPES, fits_rows, op_name
from kernelpilot.policy.merge import merge_row_outputs
from kernelpilot.policy.strides import broadcast_strides, resolve_accesses, splits
from kernelpilot.policy.trace import MAX_FORWARD_OPS, ForwardTooLong, forward_names, meta_model_and_inputs, trace

if TYPE_CHECKING:
    from kernelpilot.problem import Problem

LIBRARY_OPS = frozenset({"baddbmm", "addbmm", "matmul", "linear", "_convolution", "conv2d", "einsum"})
# Matrix products run by cuBLASLt (on MATMUL_DTYPES).
MATMUL_OPS = frozenset({"mm", "addmm", "bmm"})
# Output dtypes whose product eager rounds before the next op reads it, off by up to half an ulp (about 0.2% in
# bf16): folding that op into the epilogue, which rounds once, differs by that much (`analyze(faithful=True)`).
HALF_DTYPES = ("float16", "bfloat16")
VIEW_OPS = frozenset(
    {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "permute", "t", "transpose",
     "alias", "detach", "slice", "select", "as_strided", "expand_as", "flatten", "unflatten", "split",
     "split_with_sizes", "unbind", "chunk", "narrow", "diagonal", "unfold"}
)  # fmt: skip


# ------------------------------------------------------------------------------------------ analysis


def analyze(problem: Problem, faithful: bool = False) -> Analysis:
    """Trace `problem`'s forward on meta tensors and partition it into groups (see the module docstring).

    `faithful`: round a float16 or bfloat16 product as eager does, by writing it before a scale or an add after it
    (slower: the elementwise kernel reads it back). The default folds them into cuBLASLt's epilogue, which rounds
    the sum once; where the terms nearly cancel, eager's own rounding of the product can then exceed the tolerance
    (a LoRA update on the H100: BENCHMARKS.md, run D)."""
    import torch

    try:
        model, inputs = meta_model_and_inputs(problem)
        graph, sources, container = trace(problem, model, inputs)
    except ForwardTooLong:
        reason = (f"runs more than {MAX_FORWARD_OPS} aten ops, as a loop unrolled over a long sequence does (a "
                  "recurrent network's); the policy analyses forwards up to that size")  # fmt: skip
        return Analysis(problem.name, [], [], "tensor", [Unsupported("forward", reason)])
    except Exception as err:  # noqa: BLE001 - any failure to trace means the policy cannot handle the forward
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}".rstrip(": ")
        return Analysis(problem.name, [], [], "tensor", [Unsupported("forward", f"cannot be traced on meta tensors: {reason[:160]}")])
    builder = GroupBuilder(faithful)
    env: dict[Any, Any] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = Leaf.whole(sources[len(env)])
        elif node.op == "call_function":
            env[node] = builder.visit(node, env)
        elif node.op == "get_attr":
            env[node] = builder.constant(node, getattr(graph.owning_module, node.target, None))
        elif node.op == "output":
            outputs = [builder.output(env[item]) for item in node.args[0]]
    ignored = [name for name, value in zip(forward_names(problem), inputs) if not isinstance(value, torch.Tensor)]
    # Merge first: per-row kernels sharing an online softmax become one, and then an expectation under that
    # softmax folds into the merged kernel's single pass (token log-probs plus entropy read each row once).
    groups, outputs = merge_row_outputs(builder.groups, outputs)
    groups = fold_expectations(groups)
    mark_runtime_leading(groups, outputs)
    return Analysis(problem.name, groups, outputs, container, builder.unsupported_ops, ignored)


class GroupBuilder:
    """Walks aten nodes, folding fusible ops into Values and materialising Groups where memory is needed."""

    def __init__(self, faithful: bool = False) -> None:
        self.faithful = faithful  # see `analyze`
        self.groups: list[Group] = []
        self.unsupported_ops: list[Unsupported] = []
        self._materialised: dict[Value | Matmul | Conv, Leaf] = {}

    # ---------------------------------------------------------------------------------- node kinds

    def visit(self, node: Any, env: dict) -> Any:

        if node.target is operator.getitem:
            return env[node.args[0]][node.args[1]]
        name = op_name(node.target)
        args = [_lookup(arg, env) for arg in node.args]
        kwargs = {key: _lookup(value, env) for key, value in node.kwargs.items()}
        try:
            if any(isinstance(arg, _PendingMatmul) for arg in args):
                folded = _fold_into_matmul(node, name, args, kwargs, self.faithful)
                if folded is not None:
                    return folded
            if any(isinstance(arg, PendingConv) for arg in args):
                folded = fold_into_conv(node, name, args)
                if folded is not None:
                    return folded
            args = [self.settle(arg, reader=name) for arg in args]
            if name in VIEW_OPS:
                return self._view(node, args, kwargs)
            if name in MATMUL_OPS:
                return self._matmul(node, name, args, kwargs)
            if name == "convolution":
                return convolution(self, node, args)
            if name in LIBRARY_OPS:
                return self._library(node, name, args)
            built = lower(self, node, args, kwargs, name)
            if built is not None:
                return built
            return self.unsupported(node, "no template for this op", args)
        except NotFusible as err:
            return self.unsupported(node, str(err), args)

    def unsupported(self, node: Any, reason: str, args: list = ()) -> Any:
        """Record the op; its computed inputs are materialised (the plan shows them), its outputs become opaque."""
        self.unsupported_ops.append(Unsupported(f"aten.{op_name(node.target)}", reason))
        for arg in args:
            if isinstance(arg, Value):
                self.materialise(arg)
            self.settle(arg)
        value = node.meta.get("val")
        if isinstance(value, (tuple, list)):
            return tuple(self._opaque(node, item, i) for i, item in enumerate(value))
        return self._opaque(node, value, 0)

    def constant(self, node: Any, tensor: Any) -> Value | Leaf | None:
        """A tensor forward creates from a number (torch.tensor(0.5)): the trace keeps it, with its value, and it
        is that number in the kernels. Larger constants have no memory a kernel could read."""
        import torch

        if isinstance(tensor, torch.Tensor) and not tensor.is_meta and tensor.numel() == 1:
            return Value(Const(float(tensor.item())), tuple(tensor.shape), dtype_name(tensor.dtype), ())
        return self.unsupported(node, "a constant tensor created in forward")

    def _opaque(self, node: Any, value: Any, index: int) -> Leaf | None:
        import torch

        if not isinstance(value, torch.Tensor):
            return None
        return Leaf.whole(Source("unsupported", f"{node.name}[{index}]", tuple(value.shape), dtype_name(value.dtype)))

    def _view(self, node: Any, args: list, kwargs: dict) -> Any:
        target, value = node.target, args[0]
        several = isinstance(node.meta["val"], (tuple, list))  # split, unbind: several views of one tensor
        reshaped = op_name(target) not in ("alias", "detach")  # a windowed load is read over its own shape only
        if isinstance(value, Value) and (several or (windowed(value.expr) and reshaped)):
            value = self.materialise(value)
        if isinstance(value, Value):
            shape = tuple(node.meta["val"].shape)
            name = op_name(target)
            reduces = walk_reduces(value.expr)
            broadcast_fits = not reduces or fits_rows(shape, False, reduces[0])
            if name in ("alias", "detach") or (name == "expand" and not value.rows and broadcast_fits):
                return replace(value, shape=shape)  # a broadcast only changes how the value is indexed
            row_dims = reduces[0].dims if reduces else 1
            if value.rows and shape == value.shape + (1,) * row_dims and not any(r.inner for r in reduces):
                # reduce(keepdim=False)[..., None] (one None per reduced dim)
                return Value(_to_full(value.expr, row_dims), shape, value.dtype, value.ops)
            if name != "as_strided" and _is_one_per_row(value) and shape == value.shape[:-1]:
                return replace(value, shape=shape, rows=True)  # reduce(keepdim=True).squeeze(-1), gather's too
            value = self.materialise(value)
        if not isinstance(value, Leaf):
            return self.unsupported(node, "a view of an unsupported result", args)
        viewed = target(value.meta(), *args[1:], **kwargs)
        if isinstance(viewed, (tuple, list)):
            return tuple(Leaf(value.source, tuple(v.shape), tuple(v.stride()), v.storage_offset()) for v in viewed)
        return Leaf(value.source, tuple(viewed.shape), tuple(viewed.stride()), viewed.storage_offset())

    def _library(self, node: Any, name: str, args: list) -> Leaf:
        tensors = [self.materialise(arg) if isinstance(arg, Value) else arg for arg in args]
        leaves = [arg for arg in tensors if isinstance(arg, Leaf)]
        value = node.meta["val"]
        output = Source("group", f"g{len(self.groups)}", tuple(value.shape), dtype_name(value.dtype))
        self.groups.append(Group(output.name, "library", [f"aten.{name}"], _unique(leaf.source for leaf in leaves), output))
        return Leaf.whole(output)

    # ------------------------------------------------------------------------------------ matmuls

    def _matmul(self, node: Any, name: str, args: list, kwargs: dict) -> _PendingMatmul:
        """mm(a, b), bmm(a, b) or addmm(input, a, b) as a pending cuBLASLt call (see `_fold_into_matmul`)."""
        value = node.meta["val"]
        dtype = dtype_name(value.dtype)
        if dtype not in MATMUL_DTYPES:
            raise NotFusible(f"multiplies {dtype} matrices; generated matmuls take float32, float16 or bfloat16")
        a, b = (self._matrix_operand(arg) for arg in (args[-2:] if name == "addmm" else args[:2]))
        if 0 in a.shape or 0 in b.shape:
            raise NotFusible("multiplies an empty matrix")
        matmul = Matmul(a, b, tuple(value.shape), dtype, (f"aten.{name}",))
        if name == "addmm":
            if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
                raise NotFusible("addmm with beta or alpha other than 1; only their default of 1 is generated")
            addend = self.materialise(args[0]) if isinstance(args[0], Value) else args[0]
            matmul = _with_addend(matmul, addend)
            if matmul is None:
                raise NotFusible(f"adds a {list(args[0].shape)} tensor that is neither a bias along the last dim "
                                  "nor a whole output-shaped tensor, the two forms cuBLASLt's epilogue adds")  # fmt: skip
        return _PendingMatmul(matmul, len(node.users))

    def _matrix_operand(self, item: Any) -> Leaf:
        """A matrix operand cuBLASLt can read in place; a computed value or an unusual view is copied first."""
        if isinstance(item, Leaf) and item.source.dtype not in MATMUL_DTYPES:
            raise NotFusible(f"multiplies {item.source.dtype} matrices; generated matmuls take float32, float16 or bfloat16")
        return self.library_operand(item, _readable_in_place, "multiplies")

    def library_operand(self, item: Any, readable: Callable[[Leaf], bool], verb: str) -> Leaf:
        """An operand a library call reads: a tensor in memory when `readable` says the library can read it in
        place, or else a copy (a computed value, or a view the library cannot describe) written first."""
        if isinstance(item, Leaf) and (item.source.kind == "unsupported" or readable(item)):
            return item
        if isinstance(item, Leaf):
            item = Value(Load(item, item.shape), item.shape, item.source.dtype, ("copy",))
        if not isinstance(item, Value):
            raise NotFusible(f"{verb} the result of an unsupported op")
        return self.materialise(item)

    def settle(self, item: Any, reader: str | None = None) -> Any:
        """A pending matmul or convolution as its output (the group is written now); anything else as it is.

        `reader` is the op reading it, if one does (see `settle_conv`). A list (cat's inputs) is settled item by
        item."""

        if isinstance(item, list):
            return [self.settle(element, reader) for element in item]
        if isinstance(item, PendingConv):
            return settle_conv(self, item, fuses_elementwise(reader))
        if not isinstance(item, _PendingMatmul):
            return item
        matmul = item.matmul
        return self.library_call("matmul", matmul, [matmul.a, matmul.b, matmul.bias, matmul.residual], matmul=matmul)

    def library_call(self, kind: str, call: Matmul | Conv, operands: list[Leaf | None], **what: Any) -> Leaf:
        """The output of a matmul or conv group computing `call` (one group per distinct call)."""
        if call not in self._materialised:
            output = Source("group", f"g{len(self.groups)}", call.shape, call.dtype)
            tensors = _unique(leaf.source for leaf in operands if leaf is not None)
            self.groups.append(Group(output.name, kind, list(call.ops), tensors, output, call.shape, **what))
            self._materialised[call] = Leaf.whole(output)
        return self._materialised[call]

    # ------------------------------------------------------------------------------ materialising

    def output(self, value: Any) -> Leaf | None:
        """What forward returns: a Value is written by a new group; a tensor that is not a whole group output, or
        is a strided view of one, is copied by a new group, so forward returns fresh contiguous tensors."""
        value = self.settle(value)
        if isinstance(value, Leaf) and value.source.kind != "unsupported" and not _is_plain_view(value):
            value = Value(Load(value, value.shape), value.shape, value.source.dtype, ("copy",))
        if isinstance(value, Value):
            return self.materialise(value)
        return value

    def materialise(self, value: Value) -> Leaf:
        """The group computing `value` into a new contiguous tensor (one per distinct value).

        A value no single kernel can compute is recorded as unsupported and comes back as an opaque tensor.
        """
        if value in self._materialised:
            return self._materialised[value]
        try:
            group = self._group_of(value)
        except NotFusible as err:
            self.unsupported_ops.append(Unsupported(value.ops[-1] if value.ops else "forward", str(err)))
            return Leaf.whole(Source("unsupported", f"value{len(self._materialised)}", value.shape, value.dtype))
        self.groups.append(group)
        leaf = Leaf.whole(group.output)
        self._materialised[value] = leaf
        return leaf

    def _group_of(self, value: Value) -> Group:
        if value.dtype not in KERNEL_DTYPES and not (value.dtype == "int64" and is_index(value.expr)):
            raise NotFusible(f"writes {value.dtype} values")
        row_nodes = [node for node in walk(value.expr) if isinstance(node, (Reduce, Gather))]
        if len({node.space for node in row_nodes}) > 1:
            raise NotFusible("reductions over rows of different shapes in one expression")
        row_dims, inner_dims = 1, 0
        if isinstance(value.expr, Scan):  # a running sum: lowering.py writes it alone, elementwise loads only
            kind, shape, per_row = "scan", value.expr.shape, False
        elif row_nodes:
            if not fits_rows(value.shape, value.rows, row_nodes[0]):
                raise NotFusible("a row reduction broadcast to a different shape")
            shape, row_dims, inner_dims = row_nodes[0].space
            kind = "column" if inner_dims else "row"
            per_row = value.rows or inner_dims > 0 or not splits(value.shape, shape)
        else:
            kind, shape, per_row = "elementwise", value.shape, False
        output = Source("group", f"g{len(self.groups)}", value.shape, value.dtype)
        group = Group(output.name, kind, list(value.ops), [], output, shape, value.expr, per_row=per_row,
                      row_dims=row_dims, inner_dims=inner_dims)  # fmt: skip
        resolve_accesses(group)
        if not group.tensors:
            raise NotFusible("an output that reads no tensor")
        return group


@dataclass(frozen=True)
class _PendingMatmul:
    """A matmul not yet written, so the ops after it may still join its epilogue; `users`: nodes reading it."""

    matmul: Matmul
    users: int


# Views that keep a pending matmul's output contiguous (the epilogue then sees the new shape).
_RESHAPES = frozenset({"view", "_unsafe_view", "reshape", "alias", "detach"})


def _fold_into_matmul(node: Any, name: str, args: list, kwargs: dict, faithful: bool = False) -> _PendingMatmul | None:
    """The pending matmul in `args` with this op joined to its epilogue, or None when cuBLASLt cannot do it.

    Only a matmul nothing else reads can take an op: another reader needs the value without it. With `faithful`, a
    half-precision product takes no add (a residual, or a bias added after mm) and no scale: eager rounds the
    product before them. addmm's own bias stays in the epilogue (eager's addmm adds it before its one rounding
    too), and so do ReLU (exact on a rounded input) and tanh-GELU (its slope is at most 1.13, so the rounding it
    sees moves its result by about an ulp, with nothing left to cancel against).
    """
    pending = next(arg for arg in args if isinstance(arg, _PendingMatmul))
    matmul = pending.matmul
    value = node.meta.get("val")
    shape = tuple(getattr(value, "shape", ()))
    if pending.users != 1 or dtype_name(getattr(value, "dtype", None)) != matmul.dtype:
        return None
    if name in _RESHAPES:
        if shape[-1:] != matmul.shape[-1:]:
            return None  # the bias and residual rules assume the last dim is N
        return _PendingMatmul(replace(matmul, shape=shape), len(node.users))
    if shape != matmul.shape or matmul.activation is not None:
        return None  # an op after the activation, or one that broadcasts the product, is not in the epilogue
    if faithful and matmul.dtype in HALF_DTYPES and name in ("add", "mul"):
        return None
    if name == "add" and kwargs.get("alpha", 1) == 1 and len(args) == 2 and args[0] is not args[1]:
        (addend,) = [arg for arg in args if arg is not pending]
        folded = _with_addend(matmul, addend) if isinstance(addend, Leaf) else None
    elif name == "mul" and _scalar_factor(args, pending) is not None and not (matmul.bias or matmul.residual):
        # Only the bare product takes the factor: cuBLASLt's alpha scales A @ B, not the bias or C added to it.
        folded = replace(matmul, alpha=matmul.alpha * _scalar_factor(args, pending))
    elif name == "relu" or (name == "gelu" and kwargs.get("approximate", "none") == "tanh"):
        folded = replace(matmul, activation="relu" if name == "relu" else "gelu_tanh")
    else:
        folded = None
    if folded is None:
        return None
    return _PendingMatmul(replace(folded, ops=matmul.ops + (f"aten.{name}",)), len(node.users))


def _scalar_factor(args: list, pending: _PendingMatmul) -> float | None:
    """The Python number a `mul` multiplies the pending product by, or None when the other factor is a tensor."""
    others = [arg for arg in args if arg is not pending]
    if len(args) != 2 or len(others) != 1 or isinstance(others[0], bool) or not isinstance(others[0], (int, float)):
        return None
    return float(others[0])


def _with_addend(matmul: Matmul, addend: Any) -> Matmul | None:
    """`matmul` plus `addend` in its epilogue: as the residual (a whole output-shaped tensor) or as the bias (a
    vector along the last dim); None when it is neither, has another dtype, or that slot is taken."""
    if not isinstance(addend, Leaf) or addend.source.dtype != matmul.dtype or addend.offset != 0:
        return None
    try:
        strides = broadcast_strides(addend.shape, addend.strides, matmul.shape)
    except NotFusible:
        return None
    if strides == contiguous_strides(matmul.shape) and matmul.residual is None:
        return replace(matmul, residual=addend)
    if strides[-1:] == (1,) and not any(strides[:-1]) and matmul.bias is None:
        return replace(matmul, bias=addend)
    return None


def _readable_in_place(leaf: Leaf) -> bool:
    """True when cuBLASLt can read the view as it is: a matrix with unit stride along one of its two dims and
    aligned as the generated matmuls ask (MATMUL_ALIGNMENT bytes)."""
    if matrix_strides(leaf.shape[-2:], leaf.strides[-2:]) is None:
        return False
    item_size = {"float32": 4, "float16": 2, "bfloat16": 2}[leaf.source.dtype]
    return (leaf.offset * item_size) % MATMUL_ALIGNMENT == 0


def _is_plain_view(leaf: Leaf) -> bool:
    """True for a group output, or a reshape of one that needs no copy."""
    return leaf.source.kind == "group" and leaf.offset == 0 and leaf.strides == contiguous_strides(leaf.shape)


# ------------------------------------------------------------------------------------------- helpers


def _to_full(expr: Expr, dims: int) -> Expr:
    """The inverse of `to_rows`, for a keepdim=False result given its last `dims` dims back."""

    def rule(node: Expr) -> Expr | None:
        if isinstance(node, Load) and node.rows:
            return Load(node.leaf, node.use_shape + (1,) * dims)
        return None if isinstance(node, Call) else node  # Calls are rebuilt; anything else stays as it is

    return rebuilt(expr, rule)


def _is_one_per_row(value: Value) -> bool:
    """True for a keepdim-shaped row result, (..., 1) over rows of one dim: a reduction's or a gather's."""
    row_nodes = [node for node in walk(value.expr) if isinstance(node, (Reduce, Gather))]
    if value.rows or not row_nodes or row_nodes[0].dims != 1 or row_nodes[0].inner:
        return False
    return value.shape == row_nodes[0].shape[:-1] + (1,)


def _lookup(arg: Any, env: dict) -> Any:
    from torch.fx import Node

    if isinstance(arg, Node):
        return env[arg]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_lookup(item, env) for item in arg)
    return arg


def _unique(sources: Any) -> list[Source]:
    return list(dict.fromkeys(sources))
