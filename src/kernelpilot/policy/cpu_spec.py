"""The executable spec of the policy's IR on the CPU: what every entry of C_OPS means (TORCH_OPS, as torch
functions over float64 tensors), and an interpreter that runs an Analysis's groups with torch.

The tests hold C_OPS to this spec (each C expression, compiled by the host compiler, agrees with its entry here)
and hold the analysis to the problem (its groups, run here, compute Model's output). It describes what a kernel
computes, not how: statistics are torch reductions, loads are strided views, one rounding per group output.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernelpilot.policy.ir import Access, Analysis, Call, Const, Field, Gather, Group, Load, Matmul, Reduce, Scan, Stack

TORCH_OPS: dict[str, Callable[..., torch.Tensor]] = {
    "neg": torch.neg, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2,
    "log1p": torch.log1p, "expm1": torch.expm1, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "abs": torch.abs,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": torch.relu, "silu": F.silu, "erf": torch.erf,
    "sin": torch.sin, "cos": torch.cos, "reciprocal": torch.reciprocal, "square": lambda x: x * x,
    "floor": torch.floor, "ceil": torch.ceil, "identity": lambda x: x, "logical_not": lambda x: (x == 0).double(),
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "hardsigmoid": F.hardsigmoid,
    "hardswish": F.hardswish, "mish": F.mish,
    "elu": lambda x, alpha, scale, input_scale: torch.where(x > 0, scale * x,
                                                            scale * alpha * torch.expm1(x * input_scale)),
    "to_bfloat16": lambda x: x.float().to(torch.bfloat16).double(),
    "to_float16": lambda x: x.float().to(torch.float16).double(), "to_bool": lambda x: (x != 0).double(),
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
    "minimum": torch.minimum, "pow": torch.pow,
    "gt": lambda a, b: (a > b).double(), "lt": lambda a, b: (a < b).double(), "ge": lambda a, b: (a >= b).double(),
    "le": lambda a, b: (a <= b).double(), "eq": lambda a, b: (a == b).double(), "ne": lambda a, b: (a != b).double(),
    "logical_and": lambda a, b: ((a != 0) & (b != 0)).double(),
    "logical_or": lambda a, b: ((a != 0) | (b != 0)).double(),
    "leaky_relu": lambda x, slope: torch.where(x > 0, x, x * slope),
    "softplus": lambda x, beta, threshold: torch.where(x * beta > threshold, x, torch.log1p(torch.exp(x * beta)) / beta),
    "where": lambda c, a, b: torch.where(c != 0, a, b),
    "clamp": lambda x, low, high: torch.minimum(torch.maximum(x, low), high),
    "add_scaled": lambda a, b, alpha: a + alpha * b, "sub_scaled": lambda a, b, alpha: a - alpha * b,
    "xlogy": lambda x, y: torch.where((x == 0) & ~y.isnan(), 0.0, x * torch.log(y)),
    "smooth_l1": lambda d, beta: torch.where(d.abs() < beta, 0.5 * d.abs() * d.abs() / beta, d.abs() - 0.5 * beta),
    "huber": lambda d, delta: torch.where(d.abs() < delta, 0.5 * d.abs() * d.abs(), delta * (d.abs() - 0.5 * delta)),
    "exp_fast": torch.exp,
    "logsumexp_finish": lambda m, s: torch.where(m == -math.inf, m, m + torch.log(s)),
}  # fmt: skip


def evaluate(analysis: Analysis, tensors: dict[tuple[str, str], torch.Tensor]) -> list[torch.Tensor]:
    """Run the analysis' groups with torch (float64) on the CPU; return forward's outputs."""
    memory = dict(tensors)
    for group in analysis.groups:
        memory[("group", group.name)] = evaluate_group(group, memory)
    return [
        torch.as_strided(memory[("group", leaf.source.name)], leaf.shape, leaf.strides, leaf.offset)
        for leaf in analysis.outputs
    ]


def evaluate_group(group: Group, memory: dict) -> torch.Tensor:
    if group.kind == "matmul":
        return evaluate_matmul(group.matmul, memory)
    if group.kind == "conv":
        return evaluate_conv(group.conv, memory)
    values: dict = {}

    def value(node):
        if node in values:
            return values[node]
        if isinstance(node, Load):
            access = group.accesses[group.loads[node]]
            source = group.tensors[access.tensor]
            flat = memory[(source.kind, source.name)].double().flatten()
            if access.guard is not None or any(stride < 0 for stride in access.strides):
                result = guarded(flat, group.shape, access)
            elif access.bounds is None:
                result = torch.as_strided(flat, group.shape, access.strides, access.offset)
            else:
                result = windowed(flat, group.shape, access)
        elif isinstance(node, Const):
            result = torch.tensor(node.value, dtype=torch.float64)
        elif isinstance(node, Call):
            result = TORCH_OPS[node.op](*[value(arg) for arg in node.args])
        elif isinstance(node, Field):
            reduce = node.reduce
            weighted = None if reduce.weighted is None else value(reduce.weighted).expand(reduce.shape)
            result = statistic(reduce, node.name, value(reduce.value).expand(reduce.shape), weighted)
        elif isinstance(node, Gather):
            result = gathered(node, value(node.value).expand(node.shape), value(node.index).expand(node.shape))
        elif isinstance(node, Scan):  # a running sum or product along the row
            running = torch.cumsum if node.kind == "sum" else torch.cumprod
            operand = value(node.value).expand(node.shape)
            if node.reverse:
                result = running(operand.flip(-1), dim=-1).flip(-1)
            else:
                result = running(operand, dim=-1)
        elif isinstance(node, Stack):  # several values per row, written one after another
            result = torch.stack([value(item).expand(group.shape) for item in node.values])
        values[node] = result
        return result

    stacked = (len(group.expr.values),) if isinstance(group.expr, Stack) else ()
    result = value(group.expr).expand(*stacked, *group.shape)
    if group.per_row:  # one value per row or column: the first along the reduced dims
        start = result.dim() - group.row_dims - group.inner_dims
        result = result[(slice(None),) * start + (slice(0, 1),) * group.row_dims]
    # A kernel writes its output contiguously; later groups and outputs view that memory.
    return result.reshape(group.output.shape).to(getattr(torch, group.output.dtype)).contiguous()


def windowed(flat: torch.Tensor, shape: tuple[int, ...], access: Access) -> torch.Tensor:
    """A windowed access over `shape`: the tensor's elements inside its bounds, its fill value elsewhere."""
    result = torch.full(shape, access.fill, dtype=torch.float64)
    inside = [(max(start, 0), min(end, size)) for (start, end), size in zip(access.bounds, shape)]
    if any(start >= end for start, end in inside):
        return result
    region = tuple(slice(start, end) for start, end in inside)
    offset = access.offset + sum(start * stride for (start, _), stride in zip(inside, access.strides))
    result[region] = torch.as_strided(flat, [end - start for start, end in inside], access.strides, offset)
    if access.diagonal is not None:
        k, upper = access.diagonal
        kept = torch.ones(shape[-2:], dtype=torch.bool)
        kept = kept.triu(k) if upper else kept.tril(k)
        result = torch.where(kept, result, torch.tensor(access.fill, dtype=torch.float64))
    return result


def guarded(flat: torch.Tensor, shape: tuple[int, ...], access: Access) -> torch.Tensor:
    """An access over `shape` through index arithmetic (as_strided takes no negative strides: a flipped access):
    the element its strides reach where every check of its guard holds, the guard's fill elsewhere."""
    coordinates = torch.meshgrid(*[torch.arange(size) for size in shape], indexing="ij")
    index = access.offset + sum(c * stride for c, stride in zip(coordinates, access.strides))
    inside = torch.ones(shape, dtype=torch.bool)
    for terms, low, size in access.guard.checks if access.guard is not None else ():
        coordinate = low + sum(coordinates[j] * factor for j, factor in terms)
        inside &= (coordinate >= 0) & (coordinate < size)
    values = flat[torch.as_tensor(index).clamp(0, flat.numel() - 1)]
    fill = access.guard.fill if access.guard is not None else 0.0
    return torch.where(inside, values, torch.tensor(fill, dtype=torch.float64))


def gathered(gather: Gather, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each row of `rows` at its target column (index is constant along a row); 0 where the target is ignored."""
    target = index[..., :1]
    picked = rows.gather(-1, target.long().clamp(0, rows.shape[-1] - 1))
    return picked if gather.ignore is None else torch.where(target == gather.ignore, 0.0, picked)


def viewed(leaf, memory: dict) -> torch.Tensor:
    return torch.as_strided(memory[(leaf.source.kind, leaf.source.name)].double().flatten(), leaf.shape, leaf.strides, leaf.offset)


def evaluate_matmul(matmul: Matmul, memory: dict) -> torch.Tensor:
    """What cuBLASLt's call computes: act(alpha * (a @ b) + residual + bias), rounded once to the output dtype."""
    result = matmul.alpha * (viewed(matmul.a, memory) @ viewed(matmul.b, memory)).reshape(matmul.shape)
    for addend in (matmul.residual, matmul.bias):
        if addend is not None:
            result = result + viewed(addend, memory)
    if matmul.activation:
        result = TORCH_OPS[matmul.activation](result)
    return result.to(getattr(torch, matmul.dtype)).contiguous()


def evaluate_conv(conv, memory: dict) -> torch.Tensor:
    """What cuDNN's call computes: act(convolution(input, weight) + bias), rounded once to the output dtype."""
    bias = viewed(conv.bias, memory) if conv.bias is not None else None
    weight = viewed(conv.weight, memory)
    output_padding = list(conv.output_padding) if conv.transposed else [0] * len(conv.stride)
    result = torch.convolution(viewed(conv.input, memory), weight, bias, list(conv.stride), list(conv.padding),
                               list(conv.dilation), conv.transposed, output_padding, conv.groups)  # fmt: skip
    if conv.activation:
        result = TORCH_OPS[conv.activation](result)
    return result.to(getattr(torch, conv.dtype)).contiguous()


def statistic(reduce: Reduce, name: str, values: torch.Tensor, weighted: torch.Tensor | None = None) -> torch.Tensor:
    """One number per row (or column), shaped to broadcast over the reduce's iteration shape (its reduced dims
    kept as 1s). `weighted`: what a softmax_weighted statistic weighs by exp(values - max)."""
    end = values.dim() - reduce.inner
    dims = tuple(range(end - reduce.dims, end))
    maximum = values.amax(dims, keepdim=True)
    mean = values.mean(dims, keepdim=True)
    return {
        ("softmax_weighted", "max"): lambda: maximum,
        ("softmax_weighted", "sum"): lambda: (values - maximum).exp().sum(dims, keepdim=True),
        ("softmax_weighted", "weighted"): lambda: ((values - maximum).exp() * weighted).sum(dims, keepdim=True),
        ("sum", "sum"): lambda: values.sum(dims, keepdim=True),
        ("max", "max"): lambda: maximum,
        ("min", "min"): lambda: values.amin(dims, keepdim=True),
        ("online_softmax", "max"): lambda: maximum,
        ("online_softmax", "sum"): lambda: (values - maximum).exp().sum(dims, keepdim=True),
        ("welford", "mean"): lambda: mean,
        ("welford", "m2"): lambda: ((values - mean) ** 2).sum(dims, keepdim=True),
        ("argmax", "max"): lambda: maximum,
        ("argmin", "min"): lambda: values.amin(dims, keepdim=True),
        ("argmax", "index"): lambda: _first_index(values, dims, largest=True),
        ("argmin", "index"): lambda: _first_index(values, dims, largest=False),
    }[(reduce.kind, name)]()


def _first_index(values: torch.Tensor, dims: tuple[int, ...], largest: bool) -> torch.Tensor:
    """The first column (over the flattened `dims`) of the largest (smallest) value, NaN first, as torch's argmax."""
    flat = values.flatten(dims[0], dims[-1])
    index = flat.argmax(dims[0], keepdim=True) if largest else flat.argmin(dims[0], keepdim=True)
    return index.reshape(index.shape[: dims[0]] + (1,) * len(dims) + index.shape[dims[0] + 1 :]).double()
