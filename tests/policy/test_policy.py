"""The built-in policy: partitioning on meta tensors, generated sources, and its tool calls over a conversation.

The partition is checked for meaning, not only shape: `evaluate` runs each group's expression with torch on the
CPU (loads as strided views, statistics as torch reductions) and the result must equal Model's output. The CUDA
itself is compiled with nvcc here and verified on a GPU by the `gpu` tests.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from kernelpilot.policy.analysis import analyze
from kernelpilot.policy.codegen import (
    ITEM_SIZES,
    LaunchConfig,
    column_terms,
    elementwise_layout,
    index_terms,
    row_layout,
)
from kernelpilot.policy.cpu_spec import viewed
from kernelpilot.policy.families import launch_candidates, render_all, render_kernel
from kernelpilot.policy.ir import Analysis, Call, Const, Field, Group, walk
from kernelpilot.policy.matmul import MatmulConfig, matmul_context
from kernelpilot.problem import load_problem

from kp_testing import EXAMPLES, nonempty
from policy_testing import (
    CANCELLING_OPERANDS,
    CANCELLING_PRODUCTS,
    ONLINE_SOFTMAX_EXAMPLES,
    SMALL_PROBLEMS,
    SUPPORTED_EXAMPLES,
    analysed,
    check_against_model,
    forward_problem,
    matmul_zoo_problem,
    offset_from_terms,
    only_group,
    small_problem,
    unsupported_problem,
    weighted_softmax_sum_problem,
    write_problem,
    zoo_problem,
)


# ------------------------------------------------------------------------------------ analysis: examples


def test_softmax_long_rows_is_one_online_softmax_row_kernel():
    group = only_group(analysed(EXAMPLES / "softmax_long_rows.py"))
    assert group.kind == "row" and not group.per_row
    assert (group.rows, group.row_length) == (2048, 393216)
    assert [r.kind for r in group.reduces()] == ["online_softmax"]


def test_layernorm_is_one_welford_row_kernel_reading_weight_and_bias():
    group = only_group(analysed(EXAMPLES / "layernorm.py"))
    assert [r.kind for r in group.reduces()] == ["welford"]
    assert [(t.kind, t.name) for t in group.tensors] == [("input", "x"), ("parameter", "norm.weight"), ("parameter", "norm.bias")]
    weight_access = next(a for a in group.accesses if group.tensors[a.tensor].name == "norm.weight")
    assert weight_access.strides == (0, 0, 1)  # one weight per column, the same for every row


def test_rmsnorm_written_out_is_one_row_kernel_with_a_sum_of_squares():
    group = only_group(analysed(EXAMPLES / "rmsnorm.py"))
    (reduce,) = group.reduces()
    assert reduce.kind == "sum" and reduce.value == Call("square", (reduce.value.args[0],))
    assert group.ops == ["aten.pow", "aten.mean", "aten.add", "aten.rsqrt", "aten.mul", "aten.mul"]


def test_silu_scale_shift_is_one_elementwise_kernel_with_the_constants_baked_in():
    group = only_group(analysed(EXAMPLES / "silu_scale_shift.py"))
    assert group.kind == "elementwise"
    constants = {node.value for node in _nodes(group) if isinstance(node, Const)}
    assert constants == {1.7, -0.25}


@pytest.mark.parametrize("name", ["logsumexp", "row_mean"])
def test_row_reductions_to_one_value_per_row(name):
    group = only_group(analysed(EXAMPLES / f"{name}.py"))
    assert group.per_row and group.output.shape == (group.rows,)


def test_l2_normalize_is_a_sum_of_squares_and_a_divide():
    group = only_group(analysed(EXAMPLES / "l2_normalize.py"))
    assert [r.kind for r in group.reduces()] == ["sum"] and not group.per_row


def test_broadcast_scale_and_shift_read_one_value_per_channel():
    group = only_group(analysed(EXAMPLES / "frozen_batchnorm_residual_relu.py"))
    strides = {group.tensors[a.tensor].name: a.strides for a in group.accesses}
    assert strides["scale"] == strides["shift"] == (0, 1, 0, 0)
    layout = elementwise_layout(group)
    assert layout.shape == (32, 256, 96 * 96) and layout.vec == 4  # H and W merged; float4 along them


def test_softmax_then_mask_fuses_the_broadcast_mask_into_the_row_kernel():
    group = only_group(analysed(EXAMPLES / "softmax_then_mask.py"))
    mask = next(a for a in group.accesses if group.tensors[a.tensor].name == "keep_mask")
    assert mask.strides == (0, 0, 1024, 1)
    assert row_layout(group).shape == (16 * 16, 1024, 1024)  # batch and heads merged; the mask needs the query dim


def test_bf16_elementwise_uses_eight_wide_vectors():
    group = only_group(analysed(EXAMPLES / "geglu_bf16.py"))
    assert group.output.dtype == "bfloat16" and elementwise_layout(group).vec == 8


def test_linear_bias_relu_is_one_matmul_with_bias_and_relu_in_its_epilogue():
    group = only_group(analysed(EXAMPLES / "linear_bias_relu.py"))
    assert group.kind == "matmul" and group.ops == ["aten.addmm", "aten.relu"]
    matmul = group.matmul
    assert (matmul.bias.source.name, matmul.activation, matmul.residual) == ("linear.bias", "relu", None)
    assert matmul.b.source.name == "linear.weight" and matmul.b.strides == (1, 8192)  # weight.t(), no copy


def test_bf16_mlp_up_projection_folds_bias_and_tanh_gelu_through_the_linear_views():
    group = only_group(analysed(EXAMPLES / "mlp_up_gelu_bf16.py"))
    assert group.matmul.epilogue() == "bias, GELU (tanh)" and group.output.shape == (4, 2048, 16384)
    assert group.matmul.mnk == (8192, 16384, 4096) and group.output.dtype == "bfloat16"


def test_bf16_out_projection_takes_the_residual_as_cublaslt_c():
    group = only_group(analysed(EXAMPLES / "out_proj_residual_bf16.py"))
    assert group.matmul.epilogue() == "bias, residual" and group.matmul.residual.source.name == "residual"


def test_coordinate_mlp_layer_is_one_memory_bound_matmul_with_bias_and_relu_in_its_epilogue():
    group = only_group(analysed(EXAMPLES / "coordinate_mlp_relu_fp16.py"))
    assert group.kind == "matmul" and group.matmul.mnk == (1048576, 256, 64)
    assert (group.matmul.epilogue(), group.output.dtype) == ("bias, ReLU", "float16")
    assert group.matmul.bias.source.name == "layer.bias"


def test_lora_update_takes_its_scale_as_alpha_and_the_frozen_output_as_cublaslt_c():
    analysis = analysed(EXAMPLES / "lora_residual_bf16.py")
    assert analysis.supported, analysis.blockers()
    down, up = analysis.groups
    assert (down.kind, down.matmul.mnk, down.matmul.epilogue()) == ("matmul", (8192, 16, 4096), "")
    assert (up.kind, up.matmul.mnk, up.matmul.alpha) == ("matmul", (8192, 4096, 16), 2.0)
    assert up.matmul.residual.source.name == "base_out" and up.matmul.bias is None
    assert up.matmul.a.source.name == down.name  # the rank-16 intermediate, read in place
    source = render_kernel(up, launch_candidates(up)[0]).content
    assert "const float alpha = 2.0f;" in source and "const float beta = 1.0f;" in source
    assert "D = 2 * (A @ B) + C" in source


def test_exact_gelu_after_a_matmul_is_a_fused_kernel_reading_its_output():
    matmul, gelu = analysed(EXAMPLES / "matmul_gelu.py").groups
    assert matmul.kind == "matmul" and matmul.matmul.epilogue() == ""
    assert gelu.kind == "elementwise" and gelu.ops == ["aten.gelu"] and gelu.tensors == [matmul.output]


def test_small_mlp_block_is_a_matmul_then_one_row_kernel():
    matmul, row = analysed(EXAMPLES / "small_mlp_block.py").groups
    assert matmul.matmul.epilogue() == "bias"  # the erf GELU is not cuBLASLt's: it joins the LayerNorm kernel
    assert row.kind == "row" and row.ops == ["aten.gelu", "aten.add", "aten.native_layer_norm"]


def test_unsupported_ops_are_named(tmp_path):
    analysis = analysed(unsupported_problem(tmp_path))
    assert not analysis.supported
    blockers = analysis.blockers()
    assert blockers.startswith("Not supported by the built-in policy: ") and "aten.cumsum" in blockers


def test_group_norm_is_one_welford_row_kernel_per_sample_and_group():
    group = only_group(analysed(EXAMPLES / "group_norm.py"))
    assert [r.kind for r in group.reduces()] == ["welford"] and not group.per_row
    assert (group.rows, group.row_length) == (32 * 32, 8 * 64 * 64)  # a group: 8 channels x 64x64, contiguous in NCHW
    assert group.shape == (32, 32, 8, 64, 64) and group.row_dims == 3  # C split into groups x channels per group
    strides = {group.tensors[a.tensor].name: a.strides for a in group.accesses}
    assert strides["norm.weight"] == strides["norm.bias"] == (0, 8, 1, 0, 0)  # channel = group * 8 + channel in group


def test_group_norm_weight_is_one_load_per_vector_along_contiguous_rows():
    group = only_group(analysed(EXAMPLES / "group_norm.py"))
    layout = row_layout(group)
    assert layout.shape == (32, 32, 8, 4096) and layout.row_dims == 2 and layout.vec == 4  # H and W merged
    x, weight, bias = range(3)
    assert not layout.vector_broadcast(x) and layout.vector_broadcast(weight) and layout.vector_broadcast(bias)
    assert column_terms(layout, x) == [{"size": 32768, "stride": 1, "last": True}]
    assert offset_from_terms(4096 * 5 + 17, 0, column_terms(layout, weight)) == 5  # column -> channel in group


def test_group_norm_silu_fuses_the_epilogue():
    group = only_group(analysed(EXAMPLES / "group_norm_silu.py"))
    assert group.ops == ["aten.native_group_norm", "aten.silu"] and group.row_length == 20 * 32 * 32


# ---------------------------------------------------------------------- analysis: meaning, on CPU tensors

LINEAR = "self.linear = nn.Linear(24, 16)"
# name: (forward, inputs, __init__, the epilogues of its matmul groups, the kinds of all its groups)
MATMUL_PROBLEMS = {
    "linear_relu": ("def forward(self, x):\n    return torch.relu(self.linear(x))", "torch.randn(8, 24)", LINEAR,
                    ["bias, ReLU"], ["matmul"]),
    "linear_tanh_gelu_3d": ("def forward(self, x):\n    return F.gelu(self.linear(x), approximate='tanh')",
                            "torch.randn(2, 5, 24)", LINEAR, ["bias, GELU (tanh)"], ["matmul"]),
    "residual_before_relu": ("def forward(self, x, r):\n    return torch.relu(r + x @ self.w)", "torch.randn(8, 24), torch.randn(8, 16)",
                             "self.w = nn.Parameter(torch.randn(24, 16))", ["residual, ReLU"], ["matmul"]),
    "residual_after_relu": ("def forward(self, x, r):\n    return torch.relu(self.linear(x)) + r", "torch.randn(8, 24), torch.randn(8, 16)",
                            LINEAR, ["bias, ReLU"], ["matmul", "elementwise"]),
    "erf_gelu": ("def forward(self, x):\n    return F.gelu(self.linear(x))", "torch.randn(8, 24)", LINEAR,
                 ["bias"], ["matmul", "elementwise"]),
    "column_bias": ("def forward(self, a, b, c):\n    return torch.relu(a @ b + c)", "torch.randn(8, 24), torch.randn(24, 16), torch.randn(8, 1)",
                    "", [""], ["matmul", "elementwise"]),
    "bias_of_another_dtype": ("def forward(self, a, b, c):\n    return a @ b + c", "torch.randn(8, 24).half(), torch.randn(24, 16).half(), torch.randn(16)",
                              "", [""], ["matmul", "elementwise"]),
    "product_read_twice": ("def forward(self, a, b):\n    y = a @ b\n    return torch.relu(y), y", "torch.randn(8, 24), torch.randn(24, 16)",
                           "", [""], ["matmul", "elementwise"]),
    "bmm_of_a_transpose": ("def forward(self, a, b):\n    return torch.bmm(a, b.transpose(1, 2))", "torch.randn(3, 8, 24), torch.randn(3, 16, 24)",
                           "", [""], ["matmul"]),
    "matmul_of_a_slice": ("def forward(self, a, b):\n    return a[:, 4:] @ b[1:]", "torch.randn(8, 28), torch.randn(25, 16)",
                          "", [""], ["matmul"]),
    "matmul_of_a_computed_value": ("def forward(self, a, b):\n    return torch.relu(torch.exp(a) @ b.t() + 1.5)",
                                   "torch.randn(8, 24), torch.randn(16, 24)", "", [""], ["elementwise", "matmul", "elementwise"]),
    "bf16_linear_residual": ("def forward(self, x, r):\n    return self.linear(x) + r",
                             "torch.randn(8, 24).bfloat16(), torch.randn(8, 16).bfloat16()",
                             "self.linear = nn.Linear(24, 16).to(torch.bfloat16)", ["bias, residual"], ["matmul"]),
    # A number times the bare product is cuBLASLt's alpha; after a bias it is not (alpha would scale A @ B alone).
    "scaled_product_plus_residual": ("def forward(self, x, r):\n    return r + (x @ self.w) * 0.5", "torch.randn(8, 24), torch.randn(8, 16)",
                                     "self.w = nn.Parameter(torch.randn(24, 16))", ["scale 0.5, residual"], ["matmul"]),
    "scaled_before_relu": ("def forward(self, a, b):\n    return torch.relu(3.0 * (a @ b) * 0.5)", "torch.randn(8, 24), torch.randn(24, 16)",
                           "", ["scale 1.5, ReLU"], ["matmul"]),
    "scaled_after_bias": ("def forward(self, x):\n    return self.linear(x) * 3.0", "torch.randn(8, 24)", LINEAR,
                          ["bias"], ["matmul", "elementwise"]),
    "scaled_by_a_tensor": ("def forward(self, a, b, s):\n    return (a @ b) * s", "torch.randn(8, 24), torch.randn(24, 16), torch.randn(1)",
                           "", [""], ["matmul", "elementwise"]),
    "lora_bf16_3d": ("def forward(self, x, base):\n    return base + self.b(self.a(x)) * 2.0",
                     "torch.randn(2, 5, 24).bfloat16(), torch.randn(2, 5, 16).bfloat16()",
                     "self.a = nn.Linear(24, 4, bias=False).to(torch.bfloat16)\nself.b = nn.Linear(4, 16, bias=False).to(torch.bfloat16)",
                     ["", "scale 2, residual"], ["matmul", "matmul"]),
}  # fmt: skip
LOW_PRECISION_MATMULS = {"bias_of_another_dtype", "bf16_linear_residual", "lora_bf16_3d"}


def matmul_problem(folder: Path, name: str) -> Path:
    forward, inputs, init, *_ = MATMUL_PROBLEMS[name]
    return write_problem(folder, name, forward, inputs, init)


def test_zoo_of_layouts_computes_what_the_model_computes(tmp_path):
    analysis = check_against_model(zoo_problem(tmp_path), atol=1e-2)  # bf16 outputs round
    kinds = [g.kind for g in analysis.groups]
    assert len(kinds) == 17 and kinds.count("elementwise") == 5


@pytest.mark.parametrize("name", sorted(SMALL_PROBLEMS))
def test_groups_compute_what_the_model_computes(tmp_path, name):
    check_against_model(small_problem(tmp_path, name))


def test_group_norm_epilogue_reads_the_residual_split_into_groups(tmp_path):
    group = only_group(analysed(small_problem(tmp_path, "prologue_group_norm_silu_residual")))
    assert group.shape == (2, 2, 4, 3, 4) and group.ops[-2:] == ["aten.silu", "aten.add"]
    strides = {group.tensors[a.tensor].name: a.strides for a in group.accesses}
    assert strides["r"] == strides["x"] == (96, 48, 12, 4, 1)


def test_group_norm_statistics_are_one_value_per_row(tmp_path):
    analysis = analysed(small_problem(tmp_path, "group_norm_statistics"))
    # The returned mean and rstd share their statistics: one kernel writes both, returned as its two rows.
    assert [(g.kind, g.per_row) for g in analysis.groups] == [("row", False), ("row", True)]
    assert [g.output.shape for g in analysis.groups] == [(2, 8, 3, 3), (2, 8)]  # [values, rows]
    assert [leaf.offset for leaf in analysis.outputs[1:]] == [0, 8]


@pytest.mark.parametrize("name", sorted(MATMUL_PROBLEMS))
def test_matmul_groups_compute_what_the_model_computes(tmp_path, name):
    *_, epilogues, kinds = MATMUL_PROBLEMS[name]
    analysis = check_against_model(matmul_problem(tmp_path, name), atol=1e-2 if name in LOW_PRECISION_MATMULS else 1e-5)
    assert [g.kind for g in analysis.groups] == kinds
    assert [g.matmul.epilogue() for g in analysis.groups if g.kind == "matmul"] == epilogues


def test_matmul_zoo_computes_what_the_model_computes(tmp_path):
    analysis = check_against_model(matmul_zoo_problem(tmp_path), atol=1e-2)  # bf16 and fp16 outputs round
    assert [g.kind for g in analysis.groups].count("matmul") == 6
    transposed = [g.matmul for g in analysis.groups if g.kind == "matmul" and g.matmul.a.strides == (1, 64)]
    assert transposed and transposed[0].a.offset == 96 * 64  # a[1].t(): read in place, no copy


# ------------------------------------------------------------------ analysis: rounding-faithful matmuls


def test_faithful_lora_writes_the_bf16_product_then_scales_and_adds_in_one_elementwise_kernel():
    analysis = analysed(EXAMPLES / "lora_residual_bf16.py", faithful=True)
    assert analysis.supported, analysis.blockers()
    down, up, update = analysis.groups
    assert [down.matmul.epilogue(), up.matmul.epilogue()] == ["", ""]  # no alpha, no C: eager's bf16 product
    assert up.matmul.alpha == 1.0 and up.matmul.residual is None and up.output.dtype == "bfloat16"
    assert (update.kind, update.ops, update.output.dtype) == ("elementwise", ["aten.mul", "aten.add"], "bfloat16")
    assert {(t.kind, t.name) for t in update.tensors} == {("group", up.name), ("input", "base_out")}
    assert {node.value for node in _nodes(update) if isinstance(node, Const)} == {2.0}
    assert analysis.outputs[0].source.name == update.name


def test_faithful_out_projection_keeps_its_linear_bias_and_adds_the_residual_in_an_elementwise_kernel():
    analysis = analysed(EXAMPLES / "out_proj_residual_bf16.py", faithful=True)
    projection, residual_add = analysis.groups
    # addmm's bias stays: eager's addmm adds it before its one rounding too.
    assert projection.matmul.epilogue() == "bias" and projection.matmul.residual is None
    assert (residual_add.kind, residual_add.ops) == ("elementwise", ["aten.add"])
    assert {t.name for t in residual_add.tensors} == {projection.name, "residual"}


@pytest.mark.parametrize("name", ["linear_bias_relu", "matmul_gelu", "small_mlp_block", "mlp_up_gelu_bf16",
                                  "coordinate_mlp_relu_fp16", "layernorm", "conv2d_relu_bias"])  # fmt: skip
def test_faithful_analysis_changes_nothing_without_a_half_precision_scale_or_add_after_a_product(name):
    """fp32 products, and the bias and activation folds of half-precision ones, are kept as they are."""
    path = EXAMPLES / f"{name}.py"
    assert analysed(path, faithful=True) == analysed(path)


@pytest.mark.parametrize("name", ["scaled_product_plus_residual", "scaled_before_relu", "linear_relu"])
def test_faithful_analysis_keeps_fp32_epilogues(tmp_path, name):
    path = matmul_problem(tmp_path, name)
    assert analysed(path, faithful=True) == analysed(path)


@pytest.mark.parametrize("name", sorted(LOW_PRECISION_MATMULS))
def test_faithful_matmul_groups_compute_what_the_model_computes(tmp_path, name):
    analysis = check_against_model(matmul_problem(tmp_path, name), atol=1e-2, faithful=True)
    matmuls = [g.matmul for g in analysis.groups if g.kind == "matmul"]
    assert all(m.residual is None and m.alpha == 1.0 for m in matmuls)


@pytest.mark.parametrize("name", sorted(CANCELLING_PRODUCTS))
def test_faithful_analysis_rounds_the_product_as_eager_where_the_fused_epilogue_cannot(tmp_path, name):
    returned, residual = CANCELLING_PRODUCTS[name]
    path = forward_problem(tmp_path, name, "a, b, r", returned, CANCELLING_OPERANDS + residual)
    with pytest.raises(AssertionError, match="Mismatched elements: 128 / 128"):
        check_against_model(path, atol=1e-2)
    check_against_model(path, atol=1e-2, faithful=True)


@pytest.mark.parametrize("name", ["linear_relu", "linear_tanh_gelu_3d", "bmm_of_a_transpose", "matmul_of_a_slice"])
def test_cublaslt_layouts_read_the_operands_as_the_product_needs(tmp_path, name):
    """cuBLASLt's column-major layouts and ops, applied to the operands' memory, give D^T = B^T A^T."""
    (group,) = [g for g in analysed(matmul_problem(tmp_path, name)).groups if g.kind == "matmul"]
    context = matmul_context(group, MatmulConfig(0))
    memory = {(s.kind, s.name): torch.randn(s.shape, dtype=torch.float64) for s in group.tensors}

    def column_major(operand: dict) -> torch.Tensor:
        source = group.tensors[operand["tensor"]]
        flat = memory[(source.kind, source.name)].flatten()
        size, stride = (context["batch"], operand["rows"], operand["cols"]), (operand["batch_stride"], 1, operand["ld"])
        stored = torch.as_strided(flat, size, stride, operand["offset_bytes"] // ITEM_SIZES[source.dtype])
        return stored.transpose(1, 2) if operand["op"] == "CUBLAS_OP_T" else stored

    transposed_product = column_major(context["lt_a"]) @ column_major(context["lt_b"])  # per batch: m x n
    assert transposed_product.shape[1:] == (context["m"], context["n"])
    expected = viewed(group.matmul.a, memory) @ viewed(group.matmul.b, memory)
    torch.testing.assert_close(transposed_product.transpose(1, 2).reshape(expected.shape), expected)


def test_a_second_level_statistic_reads_the_first(tmp_path):
    group = only_group(analysed(small_problem(tmp_path, "two_pass_variance")))
    inner, outer = group.reduces()
    assert any(isinstance(node, Field) and node.reduce == inner for node in walk(outer.value))


def test_transposed_rows_are_read_with_a_stride_and_no_vectors(tmp_path):
    group = only_group(analysed(small_problem(tmp_path, "softmax_of_a_transpose")))
    (access,) = group.accesses
    assert access.strides == (1, 5) and row_layout(group).vec == 1


def test_returned_input_is_copied_and_a_tuple_stays_a_tuple(tmp_path):
    analysis = analysed(small_problem(tmp_path, "returns_its_input_and_a_view"))
    assert analysis.output_container == "tuple"
    assert [g.ops for g in analysis.groups] == [["aten.sum"], ["copy"]]


@pytest.mark.parametrize(
    ("forward", "op"),
    [
        ("def forward(self, x):\n    return torch.sort(x, dim=-1)[0]", "aten.sort"),
        ("def forward(self, x):\n    return torch.topk(x, 2, dim=-1)[0]", "aten.topk"),
        ("def forward(self, x):\n    return (x.long() @ x.long()).float()", "aten.mm"),
        ("def forward(self, x):\n    return torch.addmm(x, x, x, beta=0.5)", "aten.addmm"),
        ("def forward(self, x):\n    return x.cumsum(-1)", "aten.cumsum"),
        ("def forward(self, x):\n    return x * x.sum().item()", "forward"),
    ],
)
def test_small_unsupported_forwards_name_the_op(tmp_path, forward, op):
    analysis = analysed(write_problem(tmp_path, "unsupported", forward, "torch.randn(4, 4)"))
    assert not analysis.supported and op in analysis.blockers()


# ---------------------------------------------------------------------------------------------- codegen


@pytest.mark.parametrize(
    ("sizes", "strides"),
    [((32, 256, 9216), (0, 1, 0)), ((4, 6, 5), (30, 5, 1)), ((4, 6, 5), (0, 0, 0)), ((3, 7), (1, 3)), ((8, 2, 3), (2, 1, 0))],
)
def test_index_terms_reach_every_element_where_its_strides_say(sizes, strides):
    terms = index_terms(sizes, strides)
    count = math.prod(sizes)
    for index in [*range(0, count, max(1, count // 4999)), count - 1]:
        position = []
        rest = index
        for size in reversed(sizes):
            position.append(rest % size)
            rest //= size
        expected = sum(p * s for p, s in zip(reversed(position), strides))
        assert offset_from_terms(index, 0, terms) == expected


def test_launch_candidates_are_distinct_and_fit_a_block():
    for name in SUPPORTED_EXAMPLES:
        for group in nonempty(analysed(EXAMPLES / f"{name}.py").generated_groups, name):
            candidates = launch_candidates(group)
            # At most 8, but 12 for a convolution: four NCHW algorithms, four legacy NHWC ones, four graph-API ones.
            most = 12 if group.kind == "conv" else 8
            assert 2 <= len(candidates) <= most and len(set(candidates)) == len(candidates)
            if group.kind == "matmul":
                assert candidates == [MatmulConfig(i) for i in range(4)]  # the heuristic's best four, in order
                continue
            if group.kind == "conv":
                continue  # cuDNN's ranked algorithms (tests/policy/test_policy_conv.py)
            for config in nonempty(candidates, "launch candidates"):
                assert config.threads * (getattr(config, "rows_per_block", None) or 1) <= 1024


def test_long_rows_are_cached_in_a_cluster_and_short_rows_in_registers(tmp_path):
    (group,) = analysed(EXAMPLES / "softmax_long_rows.py").groups
    clustered, *streamed = launch_candidates(group)
    assert clustered.shared_blocks == 8 and all(config.shared_blocks == 0 for config in streamed)
    long_rows = render_kernel(group, clustered).content
    assert "__cluster_dims__(kClusterBlocks, 1, 1)" in long_rows and "constexpr int kClusterBlocks = 8;" in long_rows
    assert "cluster.map_shared_rank(" in long_rows and "constexpr int kCacheBytes = 196608;" in long_rows
    assert "too long for registers" in render_kernel(group, streamed[0]).content
    cached = render_kernel(*_first(analysed(EXAMPLES / "layernorm.py"))).content
    assert "cached in registers" in cached and "welford_add(" in cached and "cluster" not in cached


def test_rows_read_once_are_streamed_not_cached_in_shared_memory(tmp_path):
    path = write_problem(tmp_path, "long_logsumexp", "def forward(self, x):\n    return torch.logsumexp(x, dim=-1)",
                         "torch.randn(64, 300000)")
    (group,) = analysed(path).groups
    assert all(config.shared_blocks == 0 for config in launch_candidates(group))


def test_rows_too_long_for_eight_blocks_are_streamed(tmp_path):
    path = write_problem(tmp_path, "huge_softmax", "def forward(self, x):\n    return torch.softmax(x, dim=-1)",
                         "torch.randn(4, 1 << 20)")
    (group,) = analysed(path).groups
    assert all(config.shared_blocks == 0 for config in launch_candidates(group))


def per_element_bodies(source: str) -> list[str]:
    """The bodies of a kernel's per-element loops, `for (int j = 0; j < VEC; ++j) { ... }`."""
    bodies = []
    for match in re.finditer(r"for \(int j = 0; j < VEC; \+\+j\) \{", source):
        depth, end = 1, match.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(source[end], 0)
            end += 1
        bodies.append(source[match.end() : end - 1])
    return bodies


# logits_entropy_bf16's row became one softmax-weighted pass (96f1d3d): it has no online softmax statistic, and this
# test checked nothing there (test_policy_logprobs.py checks that pass); token_logprobs_bf16 has one.
CHUNKED_SOFTMAX_EXAMPLES = [name for name in ONLINE_SOFTMAX_EXAMPLES if name != "logits_entropy_bf16"]
CHUNKED_SOFTMAX_EXAMPLES.append("token_logprobs_bf16")


@pytest.mark.parametrize("name", CHUNKED_SOFTMAX_EXAMPLES)
def test_online_softmax_moves_once_per_chunk_with_no_branch_per_element(name):
    groups = analysed(EXAMPLES / f"{name}.py").generated_groups
    assert any(reduce.kind == "online_softmax" for group in groups for reduce in group.reduces()), "no online softmax"
    for group in groups:
        softmaxes = [f"st{i}" for i, reduce in enumerate(group.reduces()) if reduce.kind == "online_softmax"]
        for config in launch_candidates(group) if softmaxes else []:
            source = render_kernel(group, config).content
            assert "online_add(" not in source
            bodies = per_element_bodies(source)
            for stat in softmaxes:
                # Per element: the chunk's max in one loop, then one exp and one add from the shift in the next.
                maxes = [b for b in bodies if f"{stat}_chunk_max = fmaxf({stat}_chunk_max, " in b]
                sums = [b for b in bodies if re.search(rf"{stat}_sum \+= __expf\(\w+ - {stat}_shift\);", b)]
                assert maxes and len(maxes) == len(sums)
                assert all("if (" not in b and "?" not in b and "online_" not in b for b in maxes + sums)
                # Once per chunk, outside the per-element loops.
                rescale = f"const float {stat}_shift = online_rescale({stat}_max, {stat}_sum, {stat}_chunk_max);"
                assert source.count(rescale) == 1 and not any(rescale in b for b in bodies)
            # A streamed vector is loaded whether or not it is inside the span (the use is guarded, not the load).
            assert not re.search(r"if \(col < span\) \{\s*load_elements", source)


def test_long_streamed_rows_have_candidates_that_share_an_sm():
    for name in ("distill_kl_bf16", "logits_entropy_bf16", "cross_entropy_bf16_vocab128k", "softmax_long_rows"):
        group = analysed(EXAMPLES / f"{name}.py").groups[0]
        candidates = launch_candidates(group)
        assert 4 <= len(candidates) <= 6
        # 512 x 2 (x 4 for fp32) and 256 x 4 ask for registers for two blocks per SM; a 1024-thread block cannot.
        assert LaunchConfig(256, 4, 1, persistent=False, min_blocks=2) in candidates
        assert any(c.threads == 512 and c.min_blocks == 2 and not c.persistent for c in candidates)
        assert all(c.min_blocks == 1 for c in candidates if c.threads == 1024 or c.shared_blocks)
        # The one-wave candidate is the 512-thread team that shares its SM.
        (one_wave,) = [c for c in candidates if c.persistent and not c.shared_blocks]
        assert (one_wave.threads, one_wave.min_blocks) == (512, 2)
        source = render_kernel(group, one_wave).content
        assert "__launch_bounds__(kThreads, kMinBlocks)" in source and "constexpr int kMinBlocks = 2;" in source
        assert "registers for 2 blocks per SM" in source
        # Streamed teams that share an SM come first, the smallest first (run D); the 1024-thread team last.
        streamed = [c for c in candidates if not c.shared_blocks and not c.persistent]
        assert streamed[0] == LaunchConfig(256, 4, 1, persistent=False, min_blocks=2)
        assert streamed[-1].threads == 1024 and "kMinBlocks" not in render_kernel(group, streamed[-1]).content


def test_short_rows_ask_for_no_blocks_per_sm():
    for name in ("softmax_then_mask", "layernorm", "group_norm"):
        for group in nonempty(analysed(EXAMPLES / f"{name}.py").generated_groups, name):
            assert all(config.min_blocks == 1 for config in launch_candidates(group))


def test_registers_for_two_blocks_are_asked_only_where_the_loads_in_flight_fit(tmp_path):
    # Three bf16 rows streamed at once: 512 threads x 2 vectors x 8 x 3 = 48 floats in flight, over a 64-register
    # share with the reserve; 256 threads x 4 vectors (96 floats) fit in 128 registers.
    path = forward_problem(tmp_path, "three_rows", "a, b, c", "torch.softmax(a.float() + b.float() + c.float(), -1)",
                           ", ".join(["torch.randn(64, 128256).to(torch.bfloat16)"] * 3))  # fmt: skip
    (group,) = analysed(path).groups
    candidates = launch_candidates(group)
    assert LaunchConfig(256, 4, 1, persistent=False, min_blocks=2) in candidates
    assert all(c.min_blocks == 1 for c in candidates if c.threads == 512)


def test_a_mask_every_row_reads_again_is_kept_in_l2_and_the_rows_are_not():
    (group,) = analysed(EXAMPLES / "softmax_then_mask.py").groups
    for config in nonempty(launch_candidates(group), "launch candidates"):
        source = render_kernel(group, config).content
        assert "createpolicy.fractional.L2::evict_last.b64" in source
        # The [1024, 1024] mask, read again by each of the 256 batch-and-head slices of the scores.
        assert "load_elements<VEC, false>(row1 + column_offset1(col), v1, l2_evict_last);" in source
        assert "load_elements<VEC, false>(row0 + column_offset0(col), cache0[c]);" in source  # scores: read once
    for name in ("distill_kl_bf16", "logits_entropy_bf16"):  # nothing there is read by more than one row
        assert "l2_evict_last" not in render_kernel(*_first_row(analysed(EXAMPLES / f"{name}.py"))).content


def test_a_broadcast_too_large_for_l2_is_not_kept(tmp_path):
    # A [2048, 4096] fp32 mask is 32 MB: kept last, it would crowd the rows streaming through a 50 MB L2.
    path = forward_problem(tmp_path, "large_mask", "s, m", "torch.softmax(s, dim=-1) * m",
                           "torch.randn(2, 2048, 4096), torch.rand(2048, 4096)")  # fmt: skip
    (group,) = analysed(path).groups
    assert "l2_evict_last" not in render_kernel(group, launch_candidates(group)[0]).content


def test_a_row_only_a_later_level_reads_is_filled_from_memory_before_level_0(tmp_path):
    (group,) = analysed(weighted_softmax_sum_problem(tmp_path)).groups
    clustered = launch_candidates(group)[0]
    assert clustered.shared_blocks > 1
    source = render_kernel(group, clustered).content
    prefill = source.split("The part of the row that a later level reads first")[1].split("// Level 0:")[0]
    assert "load_elements<VEC, false>(row1 + column_offset1(span_begin + col), buffer1[item]);" in prefill
    assert "store_shared<VEC>(cache1 + col, buffer1[item]);" in prefill and "load_shared" not in prefill


def test_generated_sources_include_no_torch_header():
    analysis = analysed(EXAMPLES / "layernorm.py")
    kernel, binding, model_new = render_all(load_problem(EXAMPLES / "layernorm.py"), analysis)
    assert kernel.path == "kernels/policy_g0.cu" and binding.path == "kernels/policy_g0_binding.cpp"
    assert "torch" not in "".join(line for line in kernel.content.splitlines() if line.startswith("#include"))
    assert "#include <torch/types.h>" in binding.content and "torch/extension.h" not in binding.content


def test_the_binding_registers_a_torch_op_whose_meta_call_returns_before_any_launch():
    analysis = analysed(EXAMPLES / "layernorm.py")
    binding = render_all(load_problem(EXAMPLES / "layernorm.py"), analysis)[1].content
    schema = 'KP_OP("policy_g0(Tensor x, Tensor norm_weight, Tensor norm_bias) -> Tensor", policy_g0);'
    assert binding.rstrip().endswith(schema)
    body = binding.split("torch::Tensor policy_g0(", 1)[1]
    allocated = body.index("torch::Tensor out = torch::empty(")
    meta_return = body.index("if (out.is_meta()) return out;")
    assert allocated < meta_return < body.index("CUDAGuard") < body.index("kp_policy_g0_launch(")
    assert "x.is_cuda() || x.is_meta()" in body and "t.sym_sizes() ==" in binding


def test_model_new_calls_only_the_generated_kernels(tmp_path):
    path = small_problem(tmp_path, "returns_its_input_and_a_view")
    files = {f.path: f.content for f in render_all(load_problem(path), analysed(path))}
    forward = files["model_new.py"].split("def forward(self, x):", 1)[1]
    assert "out_g0 = kp_ops.policy_g0(x)" in forward and "out_g1 = kp_ops.policy_g1(x)" in forward
    assert "return (out_g1, out_g0.view(2, 3))" in forward
    assert "torch." not in forward and "F." not in forward
    compile(files["model_new.py"], "model_new.py", "exec")


def test_model_new_reads_parameters_by_their_names():
    problem = load_problem(EXAMPLES / "layernorm.py")
    (model_new,) = [f for f in render_all(problem, analyze(problem)) if f.path == "model_new.py"]
    assert "kp_ops.policy_g0(x, self.norm.weight, self.norm.bias)" in model_new.content
    assert "def __init__(self, hidden, eps):" in model_new.content


def test_unsupported_analysis_is_not_rendered(tmp_path):
    problem = load_problem(unsupported_problem(tmp_path))
    with pytest.raises(ValueError, match="aten.cumsum"):
        render_all(problem, analyze(problem))


def test_group_norm_rows_are_cached_and_read_once():
    source = render_kernel(*_first(analysed(EXAMPLES / "group_norm.py"))).content
    assert "cached in registers" in source and "constexpr int kThreadsPerRow = 1024;" in source
    # One weight load per vector, evicted last from L2: every row reads the same weights.
    assert "load_elements<VEC, true>(row1 + column_offset1(col), v1, l2_evict_last);" in source


# -------------------------------------------------------------------------------------------------- helpers


def _first_row(analysis: Analysis) -> tuple[Group, LaunchConfig]:
    """The first row group of an analysis and its first launch candidate."""
    group = next(g for g in analysis.generated_groups if g.kind == "row")
    return group, launch_candidates(group)[0]


def _first(analysis: Analysis) -> tuple[Group, LaunchConfig]:
    (group,) = analysis.generated_groups
    return group, launch_candidates(group)[0]


def _nodes(group: Group) -> list:
    return walk(group.expr)
