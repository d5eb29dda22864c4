"""The built-in policy's analysis: a problem traced on meta tensors and partitioned into groups (the examples'
groups, their reductions, accesses and epilogues; unsupported ops named), the rounding-faithful form of
half-precision matmuls, and cuBLASLt's view of a matmul group's operands.

The partition is checked for meaning, not only shape: `evaluate` (policy/cpu_spec.py) runs each group's expression
with torch on the CPU (loads as strided views, statistics as torch reductions) and the result must equal Model's
output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernelpilot.policy.codegen import ITEM_SIZES, column_terms, elementwise_layout, row_layout
from kernelpilot.policy.cpu_spec import viewed
from kernelpilot.policy.families import launch_candidates, render_kernel
from kernelpilot.policy.ir import Call, Const, Field, Group, walk
from kernelpilot.policy.matmul import MatmulConfig, matmul_context

from kp_testing import EXAMPLES
from policy_testing import (
    CANCELLING_OPERANDS,
    CANCELLING_PRODUCTS,
    SMALL_PROBLEMS,
    analysed,
    check_against_model,
    forward_problem,
    matmul_zoo_problem,
    offset_from_terms,
    only_group,
    small_problem,
    unsupported_problem,
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
    assert blockers.startswith("Not supported by the built-in policy: ") and "aten.sort" in blockers


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
        ("def forward(self, x):\n    return x.roll(1, -1)", "aten.roll"),
        ("def forward(self, x):\n    return x * x.sum().item()", "forward"),
    ],
)
def test_small_unsupported_forwards_name_the_op(tmp_path, forward, op):
    analysis = analysed(write_problem(tmp_path, "unsupported", forward, "torch.randn(4, 4)"))
    assert not analysis.supported and op in analysis.blockers()


# -------------------------------------------------------------------------------------------------- helpers


def _nodes(group: Group) -> list:
    return walk(group.expr)
