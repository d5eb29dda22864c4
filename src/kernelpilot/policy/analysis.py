"""Capture a problem's forward on meta tensors and partition it into kernels the built-in policy can generate.

The forward is traced with `make_fx` on meta tensors (shapes and dtypes, no memory), which yields aten ops
whatever Python spelling the problem used. Walking the graph, elementwise ops are folded into expressions, and
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

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kernelpilot.policy.c_ops import C_OPS, INTERNAL_OPS
from kernelpilot.policy.convolution import PendingConv, convolution, fold_into_conv, settle_conv
from kernelpilot.policy.expectation import fold_expectations
from kernelpilot.policy.ir import (
    MATMUL_ALIGNMENT, MATMUL_DTYPES, Analysis, Call, Const, Conv, Expr, Field, Gather, Group, Leaf, Load, Matmul,
    NotFusible, Reduce, Source, Unsupported, Value, contiguous_strides, dtype_name, matrix_strides, walk, walk_reduces,
)  # fmt: skip
from kernelpilot.policy.merge import merge_row_outputs
from kernelpilot.policy.strides import broadcast_strides, resolve_accesses, splits

if TYPE_CHECKING:
    import torch

    from kernelpilot.problem import Problem

# Dtypes a generated kernel reads and writes (computing in float32 in between).
KERNEL_DTYPES = ("float32", "float16", "bfloat16", "bool")
# Dtypes a kernel only reads: int64 class targets, gathered from as integers and otherwise converted to float as
# torch's `.float()` does (exact below 2^24).
READ_ONLY_DTYPES = ("int64",)
LIBRARY_OPS = frozenset({"baddbmm", "addbmm", "matmul", "linear", "_convolution", "conv2d", "einsum"})
# Matrix products run by cuBLASLt (on MATMUL_DTYPES).
MATMUL_OPS = frozenset({"mm", "addmm", "bmm"})
# Output dtypes whose product eager rounds before the next op reads it, off by up to half an ulp (about 0.2% in
# bf16): folding that op into the epilogue, which rounds once, differs by that much (`analyze(faithful=True)`).
HALF_DTYPES = ("float16", "bfloat16")
VIEW_OPS = frozenset(
    {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "permute", "t", "transpose",
     "alias", "detach", "slice", "select", "as_strided", "expand_as", "flatten", "unflatten"}
)  # fmt: skip
# In-place ops generated as their functional form when they overwrite a value nothing else reads (`_out_of_place`).
_IN_PLACE = {"masked_fill_": "masked_fill"}
_ALIASES = {"clone": "identity", "contiguous": "identity", "lift_fresh_copy": "identity", "bitwise_not": "logical_not"}


# ------------------------------------------------------------------------------------------ analysis


def analyze(problem: Problem, faithful: bool = False) -> Analysis:
    """Trace `problem`'s forward on meta tensors and partition it into groups (see the module docstring).

    `faithful`: round a float16 or bfloat16 product as eager does, by writing it before a scale or an add after it
    (slower: the elementwise kernel reads it back). The default folds them into cuBLASLt's epilogue, which rounds
    the sum once; where the terms nearly cancel, eager's own rounding of the product can then exceed the tolerance
    (a LoRA update on the H100: BENCHMARKS.md, run D)."""
    import torch


    with torch.device("meta"):
        model = problem.make_model()
        inputs = problem.make_inputs()
    try:
        graph, sources, container = _trace(problem, model, inputs)
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
            env[node] = builder.unsupported(node, "a constant tensor created in forward")
        elif node.op == "output":
            outputs = [builder.output(env[item]) for item in node.args[0]]
    ignored = [name for name, value in zip(_forward_names(problem), inputs) if not isinstance(value, torch.Tensor)]
    # Merge first: per-row kernels sharing an online softmax become one, and then an expectation under that
    # softmax folds into the merged kernel's single pass (token log-probs plus entropy read each row once).
    groups, outputs = merge_row_outputs(builder.groups, outputs)
    groups = fold_expectations(groups)
    return Analysis(problem.name, groups, outputs, container, builder.unsupported_ops, ignored)


def _trace(problem: Problem, model: torch.nn.Module, inputs: list) -> tuple[Any, list[Source], str]:
    """The aten graph of forward on meta tensors, the Source of each placeholder, and its output container."""
    import torch
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import make_fx

    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    tensor_positions = [i for i, value in enumerate(inputs) if isinstance(value, torch.Tensor)]

    def forward(state: dict, *tensors: torch.Tensor) -> Any:
        arguments = list(inputs)
        for position, tensor in zip(tensor_positions, tensors):
            arguments[position] = tensor
        return functional_call(model, state, tuple(arguments))

    tensors = [inputs[i] for i in tensor_positions]
    returned = model(*inputs)
    if not (isinstance(returned, torch.Tensor) or _is_flat_tuple_of_tensors(returned)):
        raise TypeError(f"forward returns {type(returned).__name__}, not a tensor or a tuple of tensors")
    graph_module = make_fx(forward)(state, *tensors)
    graph_module.graph.eliminate_dead_code()
    names = _forward_names(problem)
    sources = [Source("parameter", name, tuple(t.shape), dtype_name(t.dtype)) for name, t in state.items()]
    sources += [Source("input", names[i], tuple(inputs[i].shape), dtype_name(inputs[i].dtype)) for i in tensor_positions]
    return graph_module.graph, sources, "tensor" if isinstance(returned, torch.Tensor) else type(returned).__name__


def _is_flat_tuple_of_tensors(value: Any) -> bool:
    import torch

    return type(value) in (tuple, list) and all(isinstance(item, torch.Tensor) for item in value)


def _forward_names(problem: Problem) -> list[str]:
    return list(problem.forward_signature().parameters)


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
        name = _op_name(node.target)
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
            built = _Ops(self, node, args, kwargs).build(name)
            if built is not None:
                return built
            return self.unsupported(node, "no template for this op", args)
        except NotFusible as err:
            return self.unsupported(node, str(err), args)

    def unsupported(self, node: Any, reason: str, args: list = ()) -> Any:
        """Record the op; its computed inputs are materialised (the plan shows them), its outputs become opaque."""
        self.unsupported_ops.append(Unsupported(f"aten.{_op_name(node.target)}", reason))
        for arg in args:
            if isinstance(arg, Value):
                self.materialise(arg)
            self.settle(arg)
        value = node.meta.get("val")
        if isinstance(value, (tuple, list)):
            return tuple(self._opaque(node, item, i) for i, item in enumerate(value))
        return self._opaque(node, value, 0)

    def _opaque(self, node: Any, value: Any, index: int) -> Leaf | None:
        import torch

        if not isinstance(value, torch.Tensor):
            return None
        return Leaf.whole(Source("unsupported", f"{node.name}[{index}]", tuple(value.shape), dtype_name(value.dtype)))

    def _view(self, node: Any, args: list, kwargs: dict) -> Any:
        target, value = node.target, args[0]
        if isinstance(value, Value):
            shape = tuple(node.meta["val"].shape)
            name = _op_name(target)
            reduces = walk_reduces(value.expr)
            broadcast_fits = not reduces or _fits_rows(shape, False, reduces[0])
            if name in ("alias", "detach") or (name == "expand" and not value.rows and broadcast_fits):
                return replace(value, shape=shape)  # a broadcast only changes how the value is indexed
            if value.rows and shape == value.shape + (1,) and not any(r.inner for r in reduces):
                return Value(_to_full(value.expr), shape, value.dtype, value.ops)  # reduce(keepdim=False)[..., None]
            if name != "as_strided" and _is_one_per_row(value) and shape == value.shape[:-1]:
                return replace(value, shape=shape, rows=True)  # reduce(keepdim=True).squeeze(-1), gather's too
            value = self.materialise(value)
        if not isinstance(value, Leaf):
            return self.unsupported(node, "a view of an unsupported result", args)
        viewed = target(value.meta(), *args[1:], **kwargs)
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

        `reader` is the op reading it, if one does (see `settle_conv`)."""

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
        if value.dtype not in KERNEL_DTYPES:
            raise NotFusible(f"writes {value.dtype} values")
        row_nodes = [node for node in walk(value.expr) if isinstance(node, (Reduce, Gather))]
        if len({node.space for node in row_nodes}) > 1:
            raise NotFusible("reductions over rows of different shapes in one expression")
        row_dims, inner_dims = 1, 0
        if row_nodes:
            if not _fits_rows(value.shape, value.rows, row_nodes[0]):
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


class _Ops:
    """Builds the Value of one fusible aten node, or returns None when there is no template for it."""

    def __init__(self, builder: GroupBuilder, node: Any, args: list, kwargs: dict):
        self.builder, self.node, self.args, self.kwargs = builder, node, args, kwargs
        value = node.meta.get("val")
        if isinstance(value, (tuple, list)):  # native_layer_norm, native_group_norm: (output, mean, rstd)
            value = value[0]
        self.shape = tuple(value.shape) if hasattr(value, "shape") else ()
        self.dtype = dtype_name(value.dtype) if hasattr(value, "dtype") else "float32"

    def build(self, name: str) -> Value | tuple | None:
        if name in _IN_PLACE:
            name = self._out_of_place(name)
        if name in _ALIASES:
            return self.elementwise(_ALIASES[name], self.args[:1])
        if name in _REDUCTIONS:
            return _REDUCTIONS[name](self)
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
        exprs = tuple(self._expr(item, rows) for item in operands)
        ops = tuple(op_name for item in operands if isinstance(item, Value) for op_name in item.ops)
        return Value(Call(op, exprs), self.shape, self.dtype, ops + (f"aten.{_op_name(self.node.target)}",), rows)

    def _separate_row_groups(self, operands: list) -> list:
        """Materialise operands whose reductions cannot share a kernel with the others or with this shape."""
        kept_space = None
        result = []
        for item in operands:
            if isinstance(item, Value) and walk_reduces(item.expr):
                reduce = walk_reduces(item.expr)[0]
                fits = kept_space in (None, reduce.space) and _fits_rows(self.shape, item.rows, reduce)
                if not fits:
                    item = self.builder.materialise(item)
                else:
                    kept_space = reduce.space
            result.append(item)
        return result

    def _expr(self, item: Any, rows: bool) -> Expr:
        if isinstance(item, Leaf):
            self._check_dtype(item.source.dtype)
            return Load(item, self.shape, rows)  # every operand of this op is broadcast to its output's shape
        if isinstance(item, Value):
            if item.rows == rows:
                return item.expr
            if rows and not walk_reduces(item.expr):
                return _to_rows(item.expr)
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

    def row_input(self) -> tuple[Expr, tuple[int, ...], tuple[str, ...]]:
        """The reduced argument as an expression over rows (its last dim), with its shape and ops."""
        item = self.args[0]
        reduces = walk_reduces(item.expr) if isinstance(item, Value) else []
        if isinstance(item, Value) and (item.rows or (reduces and reduces[0].space != (item.shape, 1, 0))):
            item = self.builder.materialise(item)
        expr, shape, ops = self._reduced_expr(item)
        if not shape:
            raise NotFusible("reduces a 0-d tensor")
        if not 0 < shape[-1] < 2**31:  # columns are 32-bit in the kernels
            raise NotFusible("reduces empty rows" if not shape[-1] else "reduces rows of 2^31 elements or more")
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
        if len(reduced) == ndim:  # sums, means, max and min over every dim are split by `whole_reduction`
            raise NotFusible(f"reduces all {ndim} dims of a {ndim}-d tensor, which is generated for sums, means, max "
                              "and min only; write a norm as x.abs().sum() or x.pow(2).sum().sqrt()")  # fmt: skip
        _check_column_dims(reduced, ndim, kind)
        expr, shape, ops = self.column_input()
        return expr, shape, ops, len(reduced), ndim - 1 - reduced[-1]

    def column_input(self) -> tuple[Expr, tuple[int, ...], tuple[str, ...]]:
        """The argument of a column reduction as an expression over its whole shape. A value holding reductions
        of its own is written first: one kernel reduces over one space, and a column kernel writes no rows."""
        item = self.args[0]
        if isinstance(item, Value) and (item.rows or walk_reduces(item.expr)):
            item = self.builder.materialise(item)
        expr, shape, ops = self._reduced_expr(item)
        if 0 in shape:
            raise NotFusible("reduces an empty tensor")
        return expr, shape, ops

    def reduction(self, kind: str, field_name: str, dims: Any, keepdim: bool, finish=None) -> Value:
        ndim = len(getattr(self.args[0], "shape", ()))
        if ndim > 1 and kind in COLUMN_STATS and len(_normalised_dims(dims, ndim)) == ndim:
            return self.whole_reduction(kind, keepdim, finish)
        expr, shape, ops, reduced, inner = self.reduced_input(dims, kind)
        stat = Field(Reduce(kind, expr, shape, reduced, inner), field_name)
        result = finish(stat, math.prod(shape[len(shape) - reduced - inner : len(shape) - inner])) if finish else stat
        return self._row_value(result, shape, keepdim, ops, reduced, inner)

    def whole_reduction(self, kind: str, keepdim: bool, finish=None) -> Value:
        """A sum, mean, max or min over every element of a tensor of two or more dims: each row's statistic (over
        its last dim) is written first, in float32, then a one-row kernel reduces those partial results, as the
        mean of row losses is (a few microseconds for 10^4 rows). Values that are already one per row (row
        losses) are written as they are and reduced in the one-row kernel alone."""
        item = self.args[0]
        if isinstance(item, Value) and item.rows:
            partials = self.builder.materialise(item)
        else:
            expr, shape, ops = self.row_input()
            partials = self.builder.materialise(Value(Field(Reduce(kind, expr, shape), kind), shape[:-1], "float32",
                                                      ops, rows=True))  # fmt: skip
        count, shape = math.prod(partials.shape), item.shape
        row_shape = (1,) * (len(shape) - 1) + (count,) if keepdim else (count,)
        flat = Leaf(partials.source, row_shape, contiguous_strides(row_shape), partials.offset)
        stat = Field(Reduce(kind, Load(flat, row_shape), row_shape), kind)
        return self._row_value(finish(stat, math.prod(shape)) if finish else stat, row_shape, keepdim, ())

    def _row_value(self, expr: Expr, shape: tuple[int, ...], keepdim: bool, ops: tuple[str, ...], dims: int = 1,
                   inner: int = 0) -> Value:  # fmt: skip
        op = f"aten.{_op_name(self.node.target)}"
        if self.dtype not in KERNEL_DTYPES and not self._counts_true_values():
            raise NotFusible(f"computes {self.dtype} values")
        return Value(expr, reduced_shape(shape, dims, inner, keepdim), self.dtype, ops + (op,), rows=not keepdim)

    def _counts_true_values(self) -> bool:
        """True for an int64 sum of a bool tensor of fewer than 2^24 elements: a count (cross-entropy's count of
        rows not ignored), summed in float32, exactly. It may feed float ops in the same kernel; a kernel never
        writes it (`_group_of` refuses int64 outputs)."""
        item = self.args[0]
        dtype = item.source.dtype if isinstance(item, Leaf) else getattr(item, "dtype", None)
        counted = math.prod(getattr(item, "shape", ()))
        return _op_name(self.node.target) == "sum" and self.dtype == "int64" and dtype == "bool" and counted < 2**24


def fuses_elementwise(name: str | None) -> bool:
    """True when `_Ops` folds the op `name` into an expression (elementwise ops and row reductions)."""
    if name is None:
        return False
    elementwise = name in _SPECIAL_ELEMENTWISE or (name in C_OPS and name not in INTERNAL_OPS)
    return elementwise or name in _ALIASES or name in _REDUCTIONS or name == "_to_copy"


def _sum(o: _Ops) -> Value:
    return o.reduction("sum", "sum", o.args[1] if len(o.args) > 1 else None, _arg(o, 2, "keepdim", False))


def _mean(o: _Ops) -> Value:
    keepdim = _arg(o, 2, "keepdim", False)
    return o.reduction("sum", "sum", o.args[1] if len(o.args) > 1 else None, keepdim, _divide_by_length)


def _amax(o: _Ops, kind: str) -> Value:
    return o.reduction(kind, kind, o.args[1] if len(o.args) > 1 else None, _arg(o, 2, "keepdim", False))


def _max_or_min(o: _Ops, kind: str) -> Value | tuple:
    """max/min(x) over every element, (values, indices) = max/min(x, dim), or the elementwise max/min(x, other)."""
    if len(o.args) == 1:
        return o.reduction(kind, kind, None, False)
    if not isinstance(o.args[1], int):
        return o.elementwise("maximum" if kind == "max" else "minimum", o.args[:2])
    if any(user.target is operator.getitem and user.args[1] == 1 for user in o.node.users):
        raise NotFusible(f"uses the indices of {kind}(dim); only its values are generated (amax/amin)")
    return o.reduction(kind, kind, o.args[1], _arg(o, 2, "keepdim", False)), None


def _vector_norm(o: _Ops) -> Value:
    order = float(_arg(o, 1, "ord", 2.0))
    dims, keepdim = _arg(o, 2, "dim", None), _arg(o, 3, "keepdim", False)
    kind = "max" if math.isinf(order) and order > 0 else "sum"
    if order not in (1.0, 2.0) and kind != "max":
        raise NotFusible(f"a vector norm of order {order:g}")
    expr, shape, ops, reduced, inner = o.reduced_input(dims, kind)
    if order == 2.0:
        norm = Call("sqrt", (Field(Reduce("sum", Call("mul", (expr, expr)), shape, reduced, inner), "sum"),))
    else:
        norm = Field(Reduce(kind, Call("abs", (expr,)), shape, reduced, inner), kind)
    return o._row_value(norm, shape, keepdim, ops, reduced, inner)


def _variance(o: _Ops, root: bool) -> Value:
    dims = _arg(o, 1, "dim", None)
    correction = o.kwargs.get("correction", 1.0)
    correction = 1.0 if correction is None else float(correction)
    keepdim = bool(o.kwargs.get("keepdim", False))

    def finish(m2: Field, length: int) -> Expr:
        variance = Call("div", (m2, Const(max(length - correction, 0.0))))
        return Call("sqrt", (variance,)) if root else variance

    return o.reduction("welford", "m2", dims, keepdim, finish)


def _logsumexp(o: _Ops) -> Value:
    dims, keepdim = o.args[1], _arg(o, 2, "keepdim", False)
    expr, shape, ops = o.row_input()
    o.last_dim_only(dims, len(shape))
    stat = Reduce("online_softmax", expr, shape)
    return o._row_value(Call("logsumexp_finish", (Field(stat, "max"), Field(stat, "sum"))), shape, keepdim, ops)


def _softmax(o: _Ops, log: bool) -> Value:
    expr, shape, ops = o.row_input()
    o.last_dim_only(o.args[1], len(shape))
    stat = Reduce("online_softmax", expr, shape)
    maximum, total = Field(stat, "max"), Field(stat, "sum")
    if log:
        result = Call("sub", (expr, Call("add", (maximum, Call("log", (total,))))))
    else:
        result = Call("mul", (Call("exp_fast", (Call("sub", (expr, maximum)),)), Call("reciprocal", (total,))))
    op = f"aten.{_op_name(o.node.target)}"
    return Value(result, shape, o.dtype, ops + (op,))


def _layer_norm(o: _Ops) -> tuple:
    _, normalized_shape, weight, bias, eps = o.args
    expr, shape, ops = o.row_input()
    if len(normalized_shape) != 1:
        raise NotFusible("normalises over more than the last dimension")
    stat = Reduce("welford", expr, shape)
    mean = Field(stat, "mean")
    rstd = Call("rsqrt", (Call("add", (Call("div", (Field(stat, "m2"), Const(float(shape[-1])))), Const(float(eps)))),))
    result = Call("mul", (Call("sub", (expr, mean)), rstd))
    for operand, op in ((weight, "mul"), (bias, "add")):
        if operand is not None:
            result = Call(op, (result, o._expr(operand, False)))
    op = f"aten.{_op_name(o.node.target)}"
    row_shape = shape[:-1] + (1,)
    return (
        Value(result, shape, o.dtype, ops + (op,)),
        Value(mean, row_shape, "float32", ops + (op,)),
        Value(rstd, row_shape, "float32", ops + (op,)),
    )


def _group_norm(o: _Ops) -> tuple:
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
    rstd = Call("rsqrt", (Call("add", (Call("div", (Field(stat, "m2"), Const(float(length)))), Const(float(eps)))),))
    result = Call("mul", (Call("sub", (expr, mean)), rstd))
    for operand, op in ((weight, "mul"), (bias, "add")):
        if operand is not None:
            result = Call(op, (result, _per_channel(o, operand, len(spatial))))
    op = f"aten.{_op_name(o.node.target)}"
    _, mean_meta, rstd_meta = o.node.meta["val"]
    return (
        Value(result, shape, o.dtype, ops + (op,)),
        Value(mean, (batch, groups), dtype_name(mean_meta.dtype), ops + (op,), rows=True),
        Value(rstd, (batch, groups), dtype_name(rstd_meta.dtype), ops + (op,), rows=True),
    )


def _per_channel(o: _Ops, operand: Any, spatial_dims: int) -> Expr:
    """A (C,) weight or bias as an expression over (N, C, *spatial): viewed as (C, 1, ...) to broadcast."""
    leaf = o.builder.materialise(operand) if isinstance(operand, Value) else operand
    if not isinstance(leaf, Leaf):
        raise NotFusible("an affine parameter is the result of an unsupported op")
    padding = (1,) * spatial_dims
    return o._expr(Leaf(leaf.source, leaf.shape + padding, leaf.strides + padding, leaf.offset), False)


# nll_loss_forward's reduction argument (at::Reduction); 1 is 'mean'.
_REDUCTION_NONE, _REDUCTION_SUM = 0, 2


def _nll_loss(o: _Ops) -> tuple[Value, Value]:
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
    op = f"aten.{_op_name(o.node.target)}"
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


def _gather(o: _Ops) -> Value:
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
    op = f"aten.{_op_name(o.node.target)}"
    return Value(Gather(values, Load(index, rows + (1,)), None, shape), rows + (1,), o.dtype, ops + (op,))


# Statistics a column kernel computes (sum, mean and norms are sums; amax, amin, max and min are max and min).
COLUMN_STATS = ("sum", "max", "min")


def _normalised_dims(dims: Any, ndim: int) -> list[int]:
    """The dims a reduction's `dim` argument names, non-negative and sorted; None or [] names every dim."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted({d % ndim for d in dims}) if ndim else []


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
    "linalg_vector_norm": _vector_norm,
    "var": lambda o: _variance(o, root=False),
    "std": lambda o: _variance(o, root=True),
    "logsumexp": _logsumexp,
    "_softmax": lambda o: _softmax(o, log=False),
    "_log_softmax": lambda o: _softmax(o, log=True),
    "native_layer_norm": _layer_norm,
    "native_group_norm": _group_norm,
    "nll_loss_forward": _nll_loss,
    "gather": _gather,
}


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
    "masked_fill": lambda a, k: ("where", [a[1], a[2], a[0]]),
    "where": lambda a, k: ("where", a[:3]),
}


def _cast_op(dtype: Any) -> str:
    import torch

    return {torch.bfloat16: "to_bfloat16", torch.float16: "to_float16", torch.bool: "to_bool"}.get(dtype, "identity")


# ------------------------------------------------------------------------------------------- helpers


def _to_rows(expr: Expr) -> Expr:
    """A reduction-free expression re-read as living in a keepdim=False result's shape."""
    if isinstance(expr, Load):
        return replace(expr, rows=True)
    if isinstance(expr, Call):
        return Call(expr.op, tuple(_to_rows(arg) for arg in expr.args))
    return expr


def _to_full(expr: Expr) -> Expr:
    """The inverse of `_to_rows`, for a keepdim=False result given its last dim back."""
    if isinstance(expr, Load) and expr.rows:
        return Load(expr.leaf, expr.use_shape + (1,))
    if isinstance(expr, Call):
        return Call(expr.op, tuple(_to_full(arg) for arg in expr.args))
    return expr


def _is_one_per_row(value: Value) -> bool:
    """True for a keepdim-shaped row result, (..., 1) over rows of one dim: a reduction's or a gather's."""
    row_nodes = [node for node in walk(value.expr) if isinstance(node, (Reduce, Gather))]
    if value.rows or not row_nodes or row_nodes[0].dims != 1 or row_nodes[0].inner:
        return False
    return value.shape == row_nodes[0].shape[:-1] + (1,)


def _fits_rows(shape: tuple[int, ...], rows: bool, reduce: Reduce | Gather) -> bool:
    """True when a value of `shape` can be computed in the kernel of `reduce`: one number per element of its
    iteration shape (or of a shape that one splits), or one per row (a column kernel: only one per column)."""
    if rows:
        return shape == reduced_shape(reduce.shape, reduce.dims, reduce.inner, keepdim=False)
    kept = reduced_shape(reduce.shape, reduce.dims, reduce.inner, keepdim=True)
    return shape == kept or (not reduce.inner and splits(shape, reduce.shape))


def _lookup(arg: Any, env: dict) -> Any:
    from torch.fx import Node

    if isinstance(arg, Node):
        return env[arg]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_lookup(item, env) for item in arg)
    return arg


def _arg(o: _Ops, position: int, name: str, default: Any) -> Any:
    if len(o.args) > position:
        return o.args[position]
    return o.kwargs.get(name, default)


def _op_name(target: Any) -> str:
    packet = getattr(target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(target, "__name__", str(target))


def _unique(sources: Any) -> list[Source]:
    return list(dict.fromkeys(sources))
