"""Convolutions through cuDNN: aten.convolution as a "conv" group, and what templates/policy/conv.cu.j2 needs.

A forward convolution (1 to 3 spatial dims, any stride, padding, dilation and groups, an optional bias) on
float32, float16 or bfloat16 tensors is one cuDNN call (the legacy API of cudnn_cnn.h). Like a matmul it stays
pending while the op after it fits the call: a ReLU after a biased convolution joins it as
cudnnConvolutionBiasActivationForward's activation. cuDNN runs a fused ReLU only with its implicit precomputed
GEMM algorithm, so a ReLU followed by more elementwise work is given back to the elementwise kernel that does
that work anyway (`settle_conv`), leaving cuDNN free to pick among its algorithms; only a ReLU whose result is
read as it is (returned, viewed, or fed to a matrix op) stays in the call.

A 1-d or 2-d convolution also gets NHWC candidates (`channels_last_applies`): generated tiled transposes
(templates/policy/channels_last.cuh.j2) copy the input and weight into channels-last scratch, cuDNN convolves in
NHWC, where Hopper's tensor-core kernels need no transform of their own, and the write-back to the NCHW output the
forward returns adds the bias and applies a fused ReLU, so cuDNN may run any algorithm there. The weight is copied
on every call rather than cached: it is small, and the harness builds a new model with new weights each trial.
The NHWC convolution runs through the legacy API's ranked algorithms or, as further candidates, through cuDNN's
graph API (cudnn_graph.h), whose heuristics are what torch's own convolutions use: on an H100 those reach a Hopper
(sm90) kernel for this layout that the legacy candidates, as measured, do not appear to run (BENCHMARKS.md).

N is a runtime size where leading.py proves it (the input a whole tensor whose dim 0 is N): the descriptors, the
plan (legacy or graph API) and the workspace size are then built per N, and the NHWC copies sized by it.

A transposed convolution is cuDNN's backward data of the convolution with its settings (NCHW, the legacy API's
ranked algorithms), written as it is; its bias is added by the elementwise kernel that reads its output. Inputs
and weights that are not contiguous (or whose offset is off 16 bytes) are copied by an elementwise group first,
as matmul operands are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kernelpilot.policy.codegen import CONV_CANDIDATES, CTYPES, ITEM_SIZES, launcher_name
from kernelpilot.policy.ir import (
    MATMUL_DTYPES, Builder, Call, Conv, Leaf, Load, NotFusible, Value, contiguous_strides, dtype_name,
)  # fmt: skip
from kernelpilot.policy.leading import describe_leading

if TYPE_CHECKING:
    from kernelpilot.policy.ir import Group

# Operand dtypes cuDNN convolves here, as cuBLASLt multiplies (float32 accumulation in every case).
CONV_DTYPES = MATMUL_DTYPES
# Byte alignment of every operand; a view off it is copied first (vectorised algorithms want 16 bytes).
CONV_ALIGNMENT = 16
CUDNN_DATA_TYPES = {"float32": "CUDNN_DATA_FLOAT", "float16": "CUDNN_DATA_HALF", "bfloat16": "CUDNN_DATA_BFLOAT16"}
# The most workspace an algorithm may ask for: beyond this (FFT on large images) the next algorithm runs.
CONV_MAX_WORKSPACE_BYTES = 1 << 30


@dataclass(frozen=True)
class ConvConfig:
    """Which of cuDNN's ranked forward algorithms a conv group runs: the `algorithm`-th usable one, best first.

    `fused_relu`: the ReLU runs in the call, which cuDNN allows with one algorithm only (implicit precomputed GEMM).
    `channels_last`: cuDNN convolves NHWC copies of the input and weight, and a generated kernel writes the NHWC
    result back as the NCHW output with the bias and ReLU applied (templates/policy/channels_last.cuh.j2).
    `graph` (NHWC only): through cuDNN's graph API, `algorithm` then ranks the engine configurations of its
    heuristics (templates/policy/cudnn_graph.cuh.j2) rather than the legacy API's algorithms.
    """

    algorithm: int
    fused_relu: bool = False
    channels_last: bool = False
    graph: bool = False

    @property
    def label(self) -> str:
        if self.fused_relu:
            return "cuDNN NCHW, its implicit precomputed GEMM algorithm (the only one with a fused ReLU)"
        layout = "NHWC" if self.channels_last else "NCHW"
        ranked = "graph API engine configuration" if self.graph else "heuristic algorithm"
        label = f"cuDNN {layout}, {ranked} {self.algorithm + 1} of {CONV_CANDIDATES}"
        return label + " (input and weight transposed to NHWC, output back to NCHW)" * self.channels_last


@dataclass(frozen=True)
class PendingConv:
    """A convolution not yet written, so a ReLU after it may still join the call; `users`: nodes reading it."""

    conv: Conv
    users: int


# ------------------------------------------------------------------------------------------ analysis


def convolution(builder: Builder, node: Any, args: list) -> PendingConv | Leaf | Value:
    """aten.convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)."""
    source, weight, bias, stride, padding, dilation, transposed, output_padding, groups = args
    value = node.meta["val"]
    dtype = dtype_name(value.dtype)
    if dtype not in CONV_DTYPES:
        raise NotFusible(f"convolves {dtype} tensors; generated convolutions take float32, float16 or bfloat16")
    if not 3 <= value.dim() <= 5:
        raise NotFusible(f"a convolution over {value.dim() - 2} spatial dims; cuDNN convolutions here take 1 to 3")
    if 0 in value.shape or 0 in getattr(source, "shape", ()):
        raise NotFusible("convolves an empty tensor")
    for name, shape in (("input", getattr(source, "shape", ())), ("weight", getattr(weight, "shape", ())),
                        ("output", tuple(value.shape))):  # fmt: skip
        if math.prod(shape) >= 2**31:
            raise NotFusible(f"a convolution whose {name} has 2^31 elements or more, beyond cuDNN's int dims")
    if transposed:
        return _transposed(builder, node, args)
    operands = [_operand(builder, item, dtype) if item is not None else None for item in (source, weight, bias)]
    conv = Conv(*operands[:2], tuple(value.shape), dtype, ("aten.convolution",), tuple(stride), tuple(padding),
                tuple(dilation), int(groups), bias=operands[2])  # fmt: skip
    return PendingConv(conv, len(node.users))


def _transposed(builder: Builder, node: Any, args: list) -> Leaf | Value:
    """A transposed convolution: cuDNN's backward data, written now (no epilogue), and its bias, one value per
    output channel, added by the elementwise kernel that reads it, as torch adds it after cuDNN's call."""
    source, weight, bias, stride, padding, dilation, _, output_padding, groups = args
    value = node.meta["val"]
    shape, dtype = tuple(value.shape), dtype_name(value.dtype)
    conv = Conv(_operand(builder, source, dtype), _operand(builder, weight, dtype), shape, dtype, ("aten.convolution",),
                tuple(stride), tuple(padding), tuple(dilation), int(groups), transposed=True,
                output_padding=tuple(output_padding))  # fmt: skip
    output = builder.library_call("conv", conv, [conv.input, conv.weight], conv=conv)
    if bias is None:
        return output
    bias = builder.materialise(bias) if isinstance(bias, Value) else bias
    if not isinstance(bias, Leaf):
        raise NotFusible("a bias computed by an unsupported op")
    padding_dims = (1,) * (len(shape) - 2)
    channel = Leaf(bias.source, bias.shape + padding_dims, bias.strides + padding_dims, bias.offset)
    return Value(Call("add", (Load(output, shape), Load(channel, shape))), shape, dtype, ("aten.convolution",))


def _operand(builder: Builder, item: Any, dtype: str) -> Leaf:
    """An operand cuDNN can read in place (contiguous, aligned); a computed value or another view is copied."""
    if isinstance(item, Leaf) and item.source.dtype != dtype:
        raise NotFusible(f"convolves a {item.source.dtype} tensor into {dtype}; cuDNN takes one dtype for all")
    return builder.library_operand(item, _readable_in_place, "convolves")


def _readable_in_place(leaf: Leaf) -> bool:
    aligned = (leaf.offset * ITEM_SIZES[leaf.source.dtype]) % CONV_ALIGNMENT == 0
    return aligned and leaf.strides == contiguous_strides(leaf.shape)


def fold_into_conv(node: Any, name: str, args: list) -> PendingConv | None:
    """The pending convolution in `args` with a ReLU joined to it, or None when the op is not that ReLU.

    cudnnConvolutionBiasActivationForward needs a bias, and only a convolution nothing else reads may take it.
    """
    pending = next(arg for arg in args if isinstance(arg, PendingConv))
    conv = pending.conv
    value = node.meta.get("val")
    if name != "relu" or pending.users != 1 or conv.bias is None or conv.activation is not None:
        return None
    if dtype_name(getattr(value, "dtype", None)) != conv.dtype:
        return None
    return PendingConv(replace(conv, activation="relu", ops=conv.ops + ("aten.relu",)), len(node.users))


def settle_conv(builder: Builder, pending: PendingConv, epilogue_follows: bool) -> Leaf | Value:
    """The convolution's output; a folded ReLU read by an op that is fused into an elementwise or row kernel
    anyway goes to that kernel (relu(Load(conv))), so cuDNN may run any algorithm (see the module docstring)."""
    conv = pending.conv
    if epilogue_follows and conv.activation == "relu":
        plain = replace(conv, activation=None, ops=conv.ops[:-1])
        output = builder.library_call("conv", plain, [plain.input, plain.weight, plain.bias], conv=plain)
        return Value(Call("relu", (Load(output, output.shape),)), conv.shape, conv.dtype, ("aten.relu",))
    return builder.library_call("conv", conv, [conv.input, conv.weight, conv.bias], conv=conv)


# ---------------------------------------------------------------------------------------- generation


def conv_candidates(group: Group) -> list[ConvConfig]:
    """The ranked algorithms worth timing, NCHW first, then NHWC where `channels_last_applies`: the legacy API's,
    then the graph API's engine configurations.

    In NCHW a fused ReLU has one algorithm (implicit precomputed GEMM), other convolutions the top few. In NHWC the
    ReLU runs in the generated write-back kernel, so the top few run in every case. The order is the order in which
    they were built and measured (the graph API's not yet on a GPU); the search times all of them.
    """
    conv = group.conv
    nchw = [ConvConfig(0, fused_relu=True)] if conv.activation else [ConvConfig(i) for i in range(CONV_CANDIDATES)]
    if conv.transposed:
        return nchw
    if not channels_last_applies(conv):
        return nchw
    nhwc = [ConvConfig(i, channels_last=True, graph=graph) for graph in (False, True) for i in range(CONV_CANDIDATES)]
    return nchw + nhwc


def channels_last_applies(conv: Conv) -> bool:
    """NHWC candidates for 1-d (run as 2-d) and 2-d convolutions, with any stride, dilation and groups: the layout
    torch's channels-last convolutions run with on cuDNN. 3-d convolutions stay NCHW until NDHWC is verified on a
    GPU. Transposed convolutions stay NCHW."""
    return len(conv.shape) <= 4 and not conv.transposed


def conv_context(group: Group, config: ConvConfig) -> dict[str, Any]:
    """What conv.cu.j2 needs: cuDNN's NCHW-style dims (a 1-d convolution as 2-d over a height of 1), the
    convolution's settings, the epilogue and where each operand is; for an NHWC candidate, the three transposes
    (channels_last.cuh.j2) around the call."""
    conv = group.conv
    if config.channels_last and not channels_last_applies(conv):
        raise ValueError(f"group {group.name}: NHWC candidates are generated for 1-d and 2-d convolutions only")
    if config.graph and not config.channels_last:
        raise ValueError(f"group {group.name}: graph-API candidates are generated for NHWC (channels_last) only")
    lift = (1,) if len(conv.shape) == 3 else ()  # cuDNN wants at least 4-d tensors
    index = {source: i for i, source in enumerate(group.tensors)}

    def dims(shape: tuple[int, ...]) -> list[int]:
        return [*shape[:2], *lift, *shape[2:]]

    def operand(leaf: Leaf) -> dict[str, Any]:
        return {"tensor": index[leaf.source], "offset_bytes": leaf.offset * ITEM_SIZES[leaf.source.dtype]}

    formula = ("conv_transpose(x, w)" if conv.transposed else "conv(x, w)") + " + bias" * bool(conv.bias)
    formula = f"ReLU({formula})" if conv.activation else formula
    for name, value in (("input", conv.input.shape), ("weight", conv.weight.shape), ("output", conv.shape)):
        if math.prod(value) >= 2**31:
            raise ValueError(f"group {group.name}: the convolution's {name} has 2^31 elements or more, beyond cuDNN's int dims")
    return {
        "description": group.describe(),
        "config": config,
        "transposed": conv.transposed,
        "candidates": 1 if config.fused_relu else CONV_CANDIDATES,
        "formula": formula,
        "data_type": CUDNN_DATA_TYPES[conv.dtype],
        "float32": conv.dtype == "float32",
        "lifted": bool(lift),
        "input_dims": dims(conv.input.shape),
        "weight_dims": dims(conv.weight.shape),
        "output_dims": dims(conv.shape),
        "stride": [*lift, *conv.stride],
        "padding": [0] * len(lift) + list(conv.padding),
        "dilation": [*lift, *conv.dilation],
        "groups": conv.groups,
        "input": operand(conv.input),
        "weight": operand(conv.weight),
        "bias": operand(conv.bias) if conv.bias else None,
        "activation": "CUDNN_ACTIVATION_RELU" if conv.activation == "relu" else "CUDNN_ACTIVATION_IDENTITY",
        "alignment": CONV_ALIGNMENT,
        "max_workspace_bytes": CONV_MAX_WORKSPACE_BYTES,
        "tensor_count": len(group.tensors),
        "launcher": launcher_name(group),
        "workspace_query": workspace_query_name(group),
        # N as a runtime size (leading.py): descriptors, plans and the workspace size are built per N.
        "leading": group.leading_free,
        "shapes": describe_leading(group),
        **_channels_last_context(conv, config),
    }


def _channels_last_context(conv: Conv, config: ConvConfig) -> dict[str, Any]:
    """The NHWC candidate's transposes, each a batch of rows x cols matrices turned into cols x rows: the input
    (N of C x spatial), the weight (K of C/groups x kernel) and the NHWC output back (N of spatial x K), which
    also adds the bias and applies the ReLU; common.cuh.j2's conversions for the conv's dtype. The images' count
    is N as generated (where N is a runtime size, the transposes take each call's)."""
    if not config.channels_last:
        return {"channels_last": False}
    batch, channels, *spatial = conv.input.shape
    out_channels, group_channels, *kernel = conv.weight.shape
    return {
        "channels_last": True,
        "ctype": CTYPES[conv.dtype],
        "dtypes": {conv.dtype},
        "output_dtype": conv.dtype,
        "relu": conv.activation == "relu",
        "transposes": {
            "input": {"batch": batch, "rows": channels, "cols": math.prod(spatial)},
            "weight": {"batch": out_channels, "rows": group_channels, "cols": math.prod(kernel)},
            "output": {"batch": conv.shape[0], "rows": math.prod(conv.shape[2:]), "cols": conv.shape[1]},
        },
    }


def workspace_query_name(group: Group) -> str:
    """The .cu function the binding asks for the workspace the chosen algorithm needs."""
    return f"{launcher_name(group)}_workspace_bytes"


def conv_binding_context(group: Group) -> dict[str, Any]:
    """A conv group's launcher asks for the workspace its algorithm needs, and takes torch's TF32 switch for
    cuDNN convolutions (float32 only: the math a reference convolution runs with)."""
    allow_tf32 = "at::globalContext().allowTF32CuDNN(at::Float32Op::CONV)" if group.conv.dtype == "float32" else "false"
    setting = {"type": "bool", "name": "allow_tf32", "value": allow_tf32,
               "comment": "TF32 for float32 convolutions, as torch.backends.cudnn.allow_tf32 says"}  # fmt: skip
    return {"workspace_query": workspace_query_name(group), "settings": [setting]}
