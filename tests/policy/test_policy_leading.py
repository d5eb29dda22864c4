"""The batch (and the sequence after it) as runtime sizes (policy/leading.py): which groups take dim 0, or dims 0
and 1, at run time, that their kernels and bindings are the same code whatever sizes they were generated at, that a
reduced or otherwise entangled batch or sequence stays fixed, and (compile-only builds) that the bindings compile
and their meta path follows the sizes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kernelpilot.policy.families import launch_candidates, render_all, render_binding, render_kernel
from kernelpilot.problem import load_problem

from kp_testing import EXAMPLES, nonempty
from policy_testing import (
    RUNTIME_BATCH_EXAMPLES,
    RUNTIME_SEQUENCE_EXAMPLES,
    SUPPORTED_EXAMPLES,
    analysed,
    built_workspace,
    compile_each_cu,
    needs_nvcc,
    write_problem,
)

# (arguments, returned, inputs with the batch as {b}, __init__ lines): problems whose every group takes the batch
# at run time.
RUNTIME_BATCH = {
    "scaled_residual_relu": ("x, r", "torch.relu(x * self.scale + r)", "torch.randn({b}, 6, 32), torch.randn({b}, 6, 32)",
                             "self.scale = nn.Parameter(torch.rand(6, 1) + 0.5)"),
    "softmax": ("x", "torch.softmax(x, dim=-1)", "torch.randn({b}, 6, 32)", ""),
    "layernorm": ("x", "self.norm(x)", "torch.randn({b}, 3, 64)", "self.norm = nn.LayerNorm(64)"),
    "row_sums_unsqueezed": ("x", "x.sum(-1).unsqueeze(1)", "torch.randn({b}, 5, 24)", ""),
    "cat_along_features": ("x, y", "torch.cat([x, y * 2], dim=1)", "torch.randn({b}, 16), torch.randn({b}, 8)", ""),
    "logsumexp_plus_row_bias": ("x, b", "torch.logsumexp(x, dim=-1) + b", "torch.randn({b}, 50), torch.randn({b})", ""),
    # cuBLASLt: M is the batch (a Linear over rows) or the batch times the tokens (over (batch, tokens, features)).
    "linear_relu": ("x", "torch.relu(self.fc(x))", "torch.randn({b}, 32)", "self.fc = nn.Linear(32, 16)"),
    "linear_over_tokens_plus_residual": ("x, r", "self.fc(x) + r", "torch.randn({b}, 6, 32), torch.randn({b}, 6, 16)",
                                         "self.fc = nn.Linear(32, 16)"),
    # A strided batch of cuBLASLt matmuls: its batch count is the batch (times the heads of (batch, heads, ...)).
    "batched_matmul": ("x, y", "torch.bmm(x, y)", "torch.randn({b}, 8, 16), torch.randn({b}, 16, 8)", ""),
    "attention_scores": ("q, k", "q @ k.transpose(-2, -1) * 0.3", "torch.randn({b}, 2, 8, 16), torch.randn({b}, 2, 8, 16)", ""),
    "scores_of_a_fused_projection": ("x", "torch.bmm(x[..., :16], x[..., 16:32].transpose(1, 2))", "torch.randn({b}, 8, 48)", ""),
    "batched_matmul_by_a_shared_matrix": ("x", "torch.bmm(x, self.w.expand(x.shape[0], 16, 8))", "torch.randn({b}, 8, 16)",
                                          "self.w = nn.Parameter(torch.randn(16, 8))"),
    # cuDNN: N is each call's (descriptors, plans and workspace built per N), forward and transposed.
    "conv2d_relu": ("x", "torch.relu(self.conv(x))", "torch.randn({b}, 8, 12, 12)", "self.conv = nn.Conv2d(8, 16, 3, padding=1)"),
    "conv1d": ("x", "self.conv(x)", "torch.randn({b}, 8, 20)", "self.conv = nn.Conv1d(8, 6, 5, padding=2)"),
    "conv3d": ("x", "self.conv(x)", "torch.randn({b}, 4, 6, 6, 6)", "self.conv = nn.Conv3d(4, 8, 3, padding=1)"),
    "conv_transposed": ("x", "self.conv(x)", "torch.randn({b}, 8, 6, 6)", "self.conv = nn.ConvTranspose2d(8, 4, 3, stride=2)"),
}  # fmt: skip
# Problems where the batch must stay fixed, and why.
FIXED_BATCH = {
    "sum_over_batch": ("x", "x.sum(0)", "torch.randn({b}, 64)"),  # reduced by a column kernel
    "softmax_over_batch": ("x", "torch.softmax(x, dim=0)", "torch.randn({b}, 64)"),  # reduced by a row kernel
    "sum_of_a_vector": ("x", "x.sum()", "torch.randn({b})"),  # the whole batch is one row
    "divided_by_the_batch": ("x", "x / x.shape[0]", "torch.randn({b}, 64)"),  # the batch, traced to a number
    "divided_by_the_tokens": ("x", "x / x.shape[1]", "torch.randn({b}, {b}, 64)"),  # (b, b): also the sequence
    "first_row_broadcast": ("x", "x - x[0]", "torch.randn({b}, 64)"),  # a fixed row of a batched tensor
    "cat_along_batch": ("x, y", "torch.cat([x, y])", "torch.randn({b}, 16), torch.randn({b}, 16)"),
    "view_reshaping_the_batch": ("x", "x.sum(-1).view(2, -1)", "torch.randn({b}, 4)"),
    "triangle_of_a_matrix": ("x", "torch.triu(x) * 2", "torch.randn({b}, {b})"),
    "gram_matrix": ("x", "x @ x.t()", "torch.randn({b}, 64)"),  # the batch is M and N
    # A bmm over a batch that is not its tensors' dim 0, or over part of it.
    "bmm_of_a_transposed_batch": ("x, y", "torch.bmm(x.transpose(0, 1), y)", "torch.randn(8, {b}, 16), torch.randn({b}, 16, 8)"),
    "bmm_of_part_of_the_batch": ("x, y", "torch.bmm(x[:2], y)", "torch.randn({b}, 8, 16), torch.randn(2, 16, 8)"),
    "bmm_scaled_by_the_batch": ("x, y", "torch.bmm(x, y) * (1 / x.shape[0])", "torch.randn({b}, 8, 16), torch.randn({b}, 16, 8)"),
    "conv_of_part_of_the_batch": ("x", "self.conv(x[:2])", "torch.randn({b}, 8, 12, 12)", "self.conv = nn.Conv2d(8, 16, 3)"),
    "conv_of_one_image": ("x", "self.conv(x)", "torch.randn(1, 8, 12, 12)", "self.conv = nn.Conv2d(8, 16, 3)"),
    "matmul_of_a_transposed_input": ("x", "self.fc(x.t())", "torch.randn(32, {b})", "self.fc = nn.Linear(32, 16)"),
}  # fmt: skip
# (arguments, returned, inputs with the batch as {b} and the sequence as {t}, __init__ lines): problems whose every
# group takes the batch and the sequence at run time.
RUNTIME_SEQUENCE = {
    "scaled_residual_over_tokens": ("x, r", "torch.relu(x * self.scale + r)", "torch.randn({b}, {t}, 32), torch.randn({b}, {t}, 32)",
                                    "self.scale = nn.Parameter(torch.rand(32) + 0.5)"),
    "softmax_over_tokens": ("x", "torch.softmax(x, dim=-1)", "torch.randn({b}, {t}, 32)", ""),
    "rmsnorm_over_tokens": ("x", "x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w", "torch.randn({b}, {t}, 64)",
                            "self.w = nn.Parameter(torch.rand(64))"),
    "token_sums": ("x", "x.sum(-1)", "torch.randn({b}, {t}, 24)", ""),
    "linear_over_tokens_plus_residual": ("x, r", "self.fc(x) + r", "torch.randn({b}, {t}, 32), torch.randn({b}, {t}, 16)",
                                         "self.fc = nn.Linear(32, 16)"),
    # A LoRA: the down projection writes (batch x tokens, rank), the up projection reads it beside (batch, tokens, .).
    "lora_chain": ("x, r", "r + self.up(self.down(x)) * 0.5", "torch.randn({b}, {t}, 32), torch.randn({b}, {t}, 32)",
                   "self.down = nn.Linear(32, 4, bias=False)\nself.up = nn.Linear(4, 32, bias=False)"),
}  # fmt: skip
# Problems whose sequence must stay fixed (the batch may be free), and why.
FIXED_SEQUENCE = {
    "positional_table": ("x", "x + self.pos", "torch.randn({b}, {t}, 32)", "self.pos = nn.Parameter(torch.randn({t}, 32))"),
    "per_sequence_scale": ("x", "x * self.s", "torch.randn({b}, {t}, 32)", "self.s = nn.Parameter(torch.rand({t}, 1))"),
    "mean_over_tokens": ("x", "x.mean(1)", "torch.randn({b}, {t}, 32)", ""),  # the sequence is reduced
    "features_of_a_matrix": ("x", "torch.relu(x) * 3", "torch.randn({b}, 48)", ""),  # a 2-d tensor's dim 1: features
    "linear_over_rows": ("x", "self.fc(x)", "torch.randn({b}, 32)", "self.fc = nn.Linear(32, 16)"),
    "tokens_viewed_together": ("x", "x.sum(-1).view(x.shape[0], 2, -1)", "torch.randn({b}, {t}, 4)", ""),
}  # fmt: skip


def _problem(folder: Path, name: str, batch: int, table: dict, sequence: int = 6) -> Path:
    arguments, returned, inputs, *init = table[name]
    forward = f"def forward(self, {arguments}):\n    return {returned}"
    sizes = {"b": batch, "t": sequence}
    return write_problem(folder, f"{name}_{batch}_{sequence}", forward, inputs.format(**sizes),
                         init[0].format(**sizes) if init else "")  # fmt: skip


def _code(text: str) -> str:
    """Generated C++ without its comments, which name the shapes it was generated at."""
    return "\n".join(line for line in (re.sub(r"\s*//.*$", "", raw) for raw in text.splitlines()) if line.strip())


@pytest.mark.parametrize("name", sorted(RUNTIME_BATCH))
def test_runtime_batch_kernels_and_bindings_are_the_same_code_at_any_batch(tmp_path, name):
    # The strongest CPU check there is: the kernel and binding generated at batch 4 are, comments aside, those
    # generated at 3 and 8, so at any batch they compute what the policy generates for that batch. (Not at 2: the
    # constant 2 of `y * 2` could be the batch traced to a number, so there the batch stays fixed.)
    at = {b: analysed(_problem(tmp_path, name, b, RUNTIME_BATCH)).generated_groups for b in (3, 4, 8)}
    assert len({len(groups) for groups in at.values()}) == 1
    for index, group in enumerate(at[4]):
        assert group.leading_free, (group.name, group.kind)
        for config in launch_candidates(group):
            sources = {_code(render_kernel(at[b][index], config).content) for b in at}
            assert len(sources) == 1, (group.name, config.label)
        assert len({_code(render_binding(at[b][index]).content) for b in at}) == 1


@pytest.mark.parametrize("name", sorted(FIXED_BATCH))
def test_an_entangled_batch_stays_fixed_and_the_binding_pins_it(tmp_path, name):
    for group in nonempty(analysed(_problem(tmp_path, name, 4, FIXED_BATCH)).generated_groups, "generated groups"):
        assert not group.leading_free, group.name
        binding = render_binding(group).content
        assert "check_batched" not in binding and "int64_t leading" not in binding
        assert "Every dim is fixed at generation time" in binding
        first = re.search(r"check_tensor\((\w+), \"\w+\", [\w:]+, \{([\d, ]*)\}", binding)
        assert first and first.group(2).split(", ")[0] == str(group.tensors[0].shape[0])


def test_elementwise_launcher_takes_the_batch_and_the_binding_checks_only_agreement(tmp_path):
    group, = analysed(_problem(tmp_path, "scaled_residual_relu", 4, RUNTIME_BATCH)).generated_groups
    kernel = render_kernel(group, launch_candidates(group)[0]).content
    assert "void*out,int64_tleading,cudaStream_tstream)" in kernel.replace(" ", "")
    assert "constexpr int64_t kBatchNumel = 192;" in kernel  # 6 x 32 elements per batch index
    assert "kNumel" not in kernel and "Dim 0 (the batch, 4 when generated) is a runtime size" in kernel
    binding = render_binding(group).content
    assert 'check_batched(x, "x", torch::kFloat32, {6, 32}, 1, device);' in binding
    assert 'check_batched(r, "r", torch::kFloat32, {6, 32}, 1, device);' in binding
    assert 'check_tensor(scale, "scale", torch::kFloat32, {6, 1}, device);' in binding
    assert "TORCH_CHECK(r.sym_size(0) == batch" in binding and "const c10::SymInt batch = x.sym_size(0);" in binding
    assert "std::vector<c10::SymInt>{batch, c10::SymInt(6), c10::SymInt(32)}" in binding
    assert re.search(r"out\.data_ptr\(\),\s+x\.size\(0\),", binding)


def test_row_launcher_takes_the_batch_and_rows_follow_it(tmp_path):
    group, = analysed(_problem(tmp_path, "logsumexp_plus_row_bias", 4, RUNTIME_BATCH)).generated_groups
    assert group.kind == "row" and group.free_dims == 1
    for config in launch_candidates(group):
        kernel = render_kernel(group, config).content
        assert "constexpr int64_t kBatchRows = 1;" in kernel and not re.search(r"\bkRows\b", kernel)
        assert "const int64_t rows = leading * kBatchRows;" in kernel
    assert 'check_batched(x, "x", torch::kFloat32, {50}, 1, device);' in render_binding(group).content
    # Over (batch, tokens, features) the tokens are free too, and rows follow both.
    group, = analysed(_problem(tmp_path, "layernorm", 4, RUNTIME_BATCH)).generated_groups
    assert group.kind == "row" and group.free_dims == 2
    assert "constexpr int64_t kBatchRows = 1;" in render_kernel(group, launch_candidates(group)[0]).content
    assert 'check_batched(x, "x", torch::kFloat32, {64}, 2, device);' in render_binding(group).content


def test_matmul_launcher_builds_a_plan_per_m_and_the_binding_allocates_by_the_batch(tmp_path):
    group, = analysed(_problem(tmp_path, "linear_relu", 4, RUNTIME_BATCH)).generated_groups
    assert group.kind == "matmul" and group.free_dims == 1
    kernel = render_kernel(group, launch_candidates(group)[0]).content
    assert "constexpr int64_t kRowsPerBatch = 1;" in kernel  # M = 4 rows
    assert "const int64_t rows = leading * kRowsPerBatch;" in kernel and "plans[{device, rows}]" in kernel
    assert "std::call_once" not in kernel
    binding = render_binding(group).content
    assert 'check_batched(x, "x", torch::kFloat32, {32}, 1, device);' in binding
    assert 'check_tensor(fc_weight, "fc_weight", torch::kFloat32, {16, 32}, device);' in binding
    assert "std::vector<c10::SymInt>{batch, c10::SymInt(16)}" in binding
    assert re.search(r"kWorkspaceBytes,\s+x\.size\(0\),", binding)


def test_matmul_over_tokens_takes_batch_and_sequence(tmp_path):
    group, = analysed(_problem(tmp_path, "linear_over_tokens_plus_residual", 4, RUNTIME_SEQUENCE)).generated_groups
    assert group.kind == "matmul" and group.free_dims == 2
    kernel = render_kernel(group, launch_candidates(group)[0]).content
    assert "constexpr int64_t kRowsPerBatch = 1;" in kernel  # M = 24 = 4 x 6 tokens, each a row
    assert "plan.d = make_layout(16, rows, 16, 16 * rows);" in kernel
    binding = render_binding(group).content
    assert 'check_batched(x, "x", torch::kFloat32, {32}, 2, device);' in binding
    assert 'check_batched(r, "r", torch::kFloat32, {16}, 2, device);' in binding
    assert "const c10::SymInt sequence = x.sym_size(1);" in binding and "TORCH_CHECK(r.sym_size(1) == sequence" in binding
    assert "std::vector<c10::SymInt>{batch, sequence, c10::SymInt(16)}" in binding
    assert re.search(r"kWorkspaceBytes,\s+x\.size\(0\) \* x\.size\(1\),", binding)
    assert "Dims 0 and 1 (the batch and the sequence, 4x6 when generated) are runtime sizes" in binding


def test_a_chain_through_a_flattened_intermediate_takes_batch_and_sequence(tmp_path):
    down, up = analysed(_problem(tmp_path, "lora_chain", 4, RUNTIME_SEQUENCE)).generated_groups
    # The down projection reads x's (batch, tokens) and writes batch x tokens rows of rank 4.
    assert (down.free_dims, down.carrier_dims) == (1, (2, 0))
    binding = render_binding(down).content
    assert 'check_batched(x, "x", torch::kFloat32, {32}, 2, device);' in binding
    assert "std::vector<c10::SymInt>{batch * sequence, c10::SymInt(4)}" in binding
    assert re.search(r"kWorkspaceBytes,\s+x\.size\(0\) \* x\.size\(1\),", binding)
    # The up projection reads those rows beside r's (batch, tokens) and writes (batch, tokens, 32).
    assert up.free_dims == 2 and sorted(up.carrier_dims) == [0, 1, 2]
    binding = render_binding(up).content
    assert 'check_batched(g0, "g0", torch::kFloat32, {4}, 1, device);' in binding
    assert "must hold as many rows in their free dims" in binding
    assert "std::vector<c10::SymInt>{batch, sequence, c10::SymInt(32)}" in binding


def test_batched_matmul_builds_a_plan_per_batch_count_and_the_binding_allocates_by_the_batch(tmp_path):
    group, = analysed(_problem(tmp_path, "attention_scores", 4, RUNTIME_BATCH)).generated_groups
    assert (group.kind, group.matmul.batch, group.free_dims, group.carrier_dims) == ("matmul", 8, 1, (1, 1))
    kernel = render_kernel(group, launch_candidates(group)[0]).content
    assert "constexpr int64_t kMatricesPerBatch = 2;" in kernel  # the heads of each batch index
    assert "const int64_t batches = leading * kMatricesPerBatch;" in kernel and "plans[{device, batches}]" in kernel
    assert "plan.d = make_layout(8, 8, 8, 64, batch);" in kernel and "std::call_once" not in kernel
    binding = render_binding(group).content
    assert 'check_batched(q, "q", torch::kFloat32, {2, 8, 16}, 1, device);' in binding
    assert "TORCH_CHECK(k.sym_size(0) == batch" in binding
    assert "std::vector<c10::SymInt>{batch, c10::SymInt(2), c10::SymInt(8), c10::SymInt(8)}" in binding
    assert re.search(r"kWorkspaceBytes,\s+q\.size\(0\),", binding)
    assert "Dim 0 (the batch, 4 when generated) is a runtime size; the others are fixed at 2x8x8." in binding


def test_a_batched_matmul_by_a_shared_matrix_or_slices_of_one_tensor_carries_the_batch_where_it_moves(tmp_path):
    group, = analysed(_problem(tmp_path, "batched_matmul_by_a_shared_matrix", 4, RUNTIME_BATCH)).generated_groups
    assert group.matmul.b.strides[0] == 0 and group.carrier_dims == (1, 0)  # w is read for every batch index
    assert 'check_tensor(w, "w", torch::kFloat32, {16, 8}, device);' in render_binding(group).content
    group, = analysed(_problem(tmp_path, "scores_of_a_fused_projection", 4, RUNTIME_BATCH)).generated_groups
    assert group.carrier_dims == (1,) and group.matmul.b.offset == 16  # k: x's columns 16-31, inside each slab


def test_a_convolution_builds_its_plan_per_n_and_the_binding_asks_the_workspace_at_that_n(tmp_path):
    group, = analysed(_problem(tmp_path, "conv2d_relu", 4, RUNTIME_BATCH)).generated_groups
    assert (group.kind, group.free_dims, group.carrier_dims) == ("conv", 1, (1, 0, 0))
    for config in launch_candidates(group):
        kernel = render_kernel(group, config).content
        assert "constexpr int kInputDims[kDims] = {0, 8, 12, 12};" in kernel  # N: each call's
        assert "const int batch = checked_batch(leading);" in kernel and "plans[{device, allow_tf32, batch}]" in kernel
        assert "size_t kp_policy_g0_launch_workspace_bytes(int64_t leading, bool allow_tf32) {" in kernel
        if config.channels_last:
            assert "InputTranspose::run<false, false>(batch, " in kernel
    binding = render_binding(group).content
    assert 'check_batched(x, "x", torch::kFloat32, {8, 12, 12}, 1, device);' in binding
    assert 'check_tensor(conv_weight, "conv_weight", torch::kFloat32, {16, 8, 3, 3}, device);' in binding
    assert "kp_policy_g0_launch_workspace_bytes(x.size(0), allow_tf32)" in binding
    assert "std::vector<c10::SymInt>{batch, c10::SymInt(16), c10::SymInt(12), c10::SymInt(12)}" in binding
    # A transposed convolution (cuDNN's backward data) likewise; its bias kernel after it takes the batch too.
    conv, bias = analysed(_problem(tmp_path, "conv_transposed", 4, RUNTIME_BATCH)).generated_groups
    assert (conv.carrier_dims, bias.kind, bias.free_dims) == ((1, 0), "elementwise", 1)
    assert "cudnnConvolutionBackwardData(" in render_kernel(conv, launch_candidates(conv)[0]).content


def test_a_fixed_convolution_passes_its_generated_n(tmp_path):
    group, = analysed(_problem(tmp_path, "conv_of_one_image", 4, FIXED_BATCH)).generated_groups
    kernel = render_kernel(group, launch_candidates(group)[0]).content
    assert "constexpr int kInputDims[kDims] = {1, 8, 12, 12};" in kernel and "const int batch = kInputDims[0];" in kernel
    assert "checked_batch" not in kernel
    assert "kp_policy_g0_launch_workspace_bytes(allow_tf32)" in render_binding(group).content


@pytest.mark.parametrize("name", sorted(RUNTIME_SEQUENCE))
def test_runtime_sequence_kernels_and_bindings_are_the_same_code_at_any_batch_and_sequence(tmp_path, name):
    sizes = ((3, 5), (4, 6), (8, 7), (5, 11))
    at = {(b, t): analysed(_problem(tmp_path, name, b, RUNTIME_SEQUENCE, t)).generated_groups for b, t in sizes}
    assert len({len(groups) for groups in at.values()}) == 1
    for index, group in enumerate(at[(4, 6)]):
        assert 2 in group.carrier_dims, (group.name, group.kind, group.carrier_dims)
        for config in launch_candidates(group):
            assert len({_code(render_kernel(at[bt][index], config).content) for bt in at}) == 1, (group.name, config.label)
        assert len({_code(render_binding(at[bt][index]).content) for bt in at}) == 1


def test_a_reductions_own_length_is_not_taken_for_a_size_traced_to_a_number(tmp_path):
    """A mean over 64 features multiplies by 1/64. At 64 tokens, or a batch of 64, that constant equals a free dim's
    size, yet it counts reduced dims, never free ones. (TinyGPT's RMSNorm over (8, 1024, 1024) kept its sequence
    fixed for it, and the swapped model refused another sequence length.) A size that forward reads and divides by
    stays fixed: divided_by_the_tokens and divided_by_the_batch above."""
    for batch, sequence in ((4, 64), (64, 6)):
        (group,) = analysed(_problem(tmp_path, "rmsnorm_over_tokens", batch, RUNTIME_SEQUENCE, sequence)).generated_groups
        assert group.free_dims == 2, (batch, sequence, group.free_dims)


@pytest.mark.parametrize("name", sorted(FIXED_SEQUENCE))
def test_an_entangled_sequence_stays_fixed(tmp_path, name):
    groups = nonempty(analysed(_problem(tmp_path, name, 4, FIXED_SEQUENCE)).generated_groups, "generated groups")
    assert all(group.free_dims < 2 for group in groups), [(g.name, g.free_dims) for g in groups]
    for group in groups:
        assert "const c10::SymInt sequence" not in render_binding(group).content


def test_forward_views_a_runtime_sequence_result_by_its_own_dims(tmp_path):
    path = _problem(tmp_path, "token_sums", 4, RUNTIME_SEQUENCE)
    (group,) = analysed(path).generated_groups
    assert group.free_dims == 2
    model_new = next(f for f in render_all(load_problem(path), analysed(path)) if f.path == "model_new.py").content
    assert "return out_g0" in model_new


def test_the_runtime_batch_examples_are_those_whose_every_kernel_takes_it():
    every = {name for name in SUPPORTED_EXAMPLES
             if all(group.leading_free for group in analysed(EXAMPLES / f"{name}.py").generated_groups)}  # fmt: skip
    assert every == set(RUNTIME_BATCH_EXAMPLES)
    both = {name for name in SUPPORTED_EXAMPLES
            if all(2 in group.carrier_dims for group in analysed(EXAMPLES / f"{name}.py").generated_groups)}  # fmt: skip
    assert both == set(RUNTIME_SEQUENCE_EXAMPLES)


def test_stacked_per_row_values_keep_the_batch_fixed():
    # Cross-entropy plus z-loss: two values per row, stacked as [values, rows], read back at fixed offsets.
    groups = analysed(EXAMPLES / "cross_entropy_z_loss_bf16.py").generated_groups
    assert groups and not any(group.leading_free for group in groups)


def test_forward_views_a_runtime_batch_result_by_its_own_dim_0(tmp_path):
    path = _problem(tmp_path, "row_sums_unsqueezed", 4, RUNTIME_BATCH)
    model_new = next(f for f in render_all(load_problem(path), analysed(path)) if f.path == "model_new.py").content
    assert "return out_g0.view(out_g0.shape[0], 1, 5)" in model_new


@needs_nvcc
def test_runtime_batch_kernels_compile(tmp_path):
    # (The kernels of RUNTIME_SEQUENCE are these templates' runtime path too, with other constants: the bindings,
    # which differ, are compiled in the built workspace below.)
    sources = [render_kernel(group, config).content
               for name in sorted(RUNTIME_BATCH)
               for group in nonempty(analysed(_problem(tmp_path, name, 4, RUNTIME_BATCH)).generated_groups, name)
               for config in launch_candidates(group)[:2]]  # fmt: skip
    compile_each_cu(sources, tmp_path)


# ------------------------------------------------------------------ a built workspace, loaded on meta tensors


# Session-scoped: one build per test process, even when other modules' tests run between its tests there (a
# module-scoped fixture is built again after each such interruption).
@pytest.fixture(scope="session")
def runtime_batch_workspace(tmp_path_factory):
    """A compile-only build of a problem with an elementwise kernel that takes the batch at run time (its scale is
    per token), a row and a matmul kernel that take batch and tokens, and a LoRA chain through a flattened (batch x
    tokens, 4) intermediate (two matmuls whose tensors hold the rows in one dim or in two)."""
    folder = tmp_path_factory.mktemp("runtime_batch")
    path = write_problem(folder, "five_kernels", "def forward(self, x, r):\n    return torch.relu(x * self.scale + r), "
                         "torch.softmax(x, dim=-1), self.fc(x), r + self.up(self.down(x)) * 0.5",
                         "torch.randn(4, 6, 32), torch.randn(4, 6, 32)",
                         "self.scale = nn.Parameter(torch.rand(6, 1) + 0.5)\nself.fc = nn.Linear(32, 16)\n"
                         "self.down = nn.Linear(32, 4, bias=False)\nself.up = nn.Linear(4, 32, bias=False)")  # fmt: skip
    return built_workspace(path, folder)


def _meta_model(workspace):
    from kernelpilot.harness.candidate import load_candidate, make_candidate_model

    ws, result = workspace
    return ws, make_candidate_model(ws.problem(), load_candidate(ws, result), "meta")


@pytest.mark.cuda_build
def test_built_bindings_give_the_output_shape_at_another_batch(runtime_batch_workspace):
    ws, model = _meta_model(runtime_batch_workspace)
    for batch in (2, 9):
        inputs = [torch.empty(batch, 6, 32, device="meta") for _ in range(2)]
        with torch.no_grad():
            outputs = model(*inputs)
        assert [tuple(out.shape) for out in outputs] == [(batch, 6, 32)] * 2 + [(batch, 6, 16), (batch, 6, 32)]
    # The other dims stay fixed: a wrong feature size is refused, in one sentence.
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"x must have the dims \[32\] after its batch and sequence "
                                                          r"\(.*\), got \[4, 6, 31\]"):
        model(torch.empty(4, 6, 31, device="meta"), torch.empty(4, 6, 31, device="meta"))


@pytest.mark.cuda_build
def test_built_bindings_follow_the_sequence_where_it_is_free(runtime_batch_workspace):
    """The softmax, the Linear and the LoRA chain take (batch, tokens) at run time; the relu's scale is per token,
    so it refuses another sequence length, in one sentence."""
    ws, model = _meta_model(runtime_batch_workspace)
    ops = getattr(torch.ops, ws.namespace)
    groups = analysed(ws.model_path).generated_groups
    assert sorted(group.carrier_dims for group in groups) == [(1, 0, 1), (1, 0, 2), (2,), (2, 0), (2, 0, 0)]
    by_ops = {tuple(group.ops): getattr(ops, f"policy_{group.name}") for group in groups}
    x, r = torch.empty(3, 11, 32, device="meta"), torch.empty(3, 11, 32, device="meta")
    softmax = next(op for names, op in by_ops.items() if "aten._softmax" in names)
    assert tuple(softmax(x).shape) == (3, 11, 32)
    down, up = [next(g for g in groups if g.carrier_dims == dims) for dims in ((2, 0), (1, 0, 2))]
    rows = getattr(ops, f"policy_{down.name}")(x, torch.empty(4, 32, device="meta"))
    assert tuple(rows.shape) == (33, 4)  # batch x tokens rows
    assert tuple(getattr(ops, f"policy_{up.name}")(rows, torch.empty(32, 4, device="meta"), r).shape) == (3, 11, 32)
    with pytest.raises(RuntimeError, match=r"must hold as many rows in their free dims .*, got \[30, 4\] and \[3, 11, 32\]"):
        getattr(ops, f"policy_{up.name}")(rows[:30], torch.empty(32, 4, device="meta"), r)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"x must have the dims \[6, 32\] after its batch"):
        model(x, torch.empty(3, 11, 32, device="meta"))


@pytest.mark.cuda_build
def test_built_binding_refuses_tensors_that_disagree_on_the_batch(runtime_batch_workspace):
    ws, model = _meta_model(runtime_batch_workspace)
    (relu,) = [group.name for group in analysed(ws.model_path).generated_groups if "aten.relu" in group.ops]
    operator = getattr(getattr(torch.ops, ws.namespace), f"policy_{relu}")
    scale = torch.empty(6, 1, device="meta")
    with pytest.raises(RuntimeError, match=rf"policy_{relu}: r and x must agree on dim 0 \(the batch\), got 5 and 4"):
        operator(torch.empty(4, 6, 32, device="meta"), scale, torch.empty(5, 6, 32, device="meta"))


@pytest.mark.cuda_build
def test_built_model_traces_with_a_symbolic_batch(runtime_batch_workspace):
    ws, model = _meta_model(runtime_batch_workspace)
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch.no_grad():
        for batch in (3, 7):
            outputs = compiled(torch.empty(batch, 6, 32, device="meta"), torch.empty(batch, 6, 32, device="meta"))
            assert [tuple(out.shape) for out in outputs] == [(batch, 6, 32)] * 2 + [(batch, 6, 16), (batch, 6, 32)]


@pytest.fixture(scope="session")
def library_batch_workspace(tmp_path_factory):
    """A compile-only build of a cuDNN convolution and of attention scores (a strided batch of cuBLASLt matmuls
    over (batch, heads)), both taking the batch at run time."""
    folder = tmp_path_factory.mktemp("library_batch")
    path = write_problem(folder, "conv_and_scores", "def forward(self, x, q, k):\n    return torch.relu(self.conv(x)), "
                         "q @ k.transpose(-2, -1) * 0.3",
                         "torch.randn(4, 8, 12, 12), torch.randn(4, 2, 8, 16), torch.randn(4, 2, 8, 16)",
                         "self.conv = nn.Conv2d(8, 16, 3, padding=1)")  # fmt: skip
    return built_workspace(path, folder)


def _conv_and_scores_inputs(batch: int, channels: int = 8) -> list[torch.Tensor]:
    return [torch.empty(batch, channels, 12, 12, device="meta"), *(torch.empty(batch, 2, 8, 16, device="meta"),) * 2]


@pytest.mark.cuda_build
def test_built_conv_and_bmm_bindings_follow_the_batch_and_trace_with_a_symbolic_one(library_batch_workspace):
    ws, model = _meta_model(library_batch_workspace)
    assert sorted(group.kind for group in analysed(ws.model_path).generated_groups) == ["conv", "matmul"]
    for batch in (2, 9):
        with torch.no_grad():
            outputs = model(*_conv_and_scores_inputs(batch))
        assert [tuple(out.shape) for out in outputs] == [(batch, 16, 12, 12), (batch, 2, 8, 8)]
    # The other dims stay fixed: a wrong channel count is refused, in one sentence.
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"x must have the dims \[8, 12, 12\] after its batch"):
        model(*_conv_and_scores_inputs(4, channels=7))
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch.no_grad():
        for batch in (3, 7):
            outputs = compiled(*_conv_and_scores_inputs(batch))
            assert [tuple(out.shape) for out in outputs] == [(batch, 16, 12, 12), (batch, 2, 8, 8)]


def test_a_forward_argument_named_batch_does_not_shadow_the_bindings_batch(tmp_path):
    path = write_problem(tmp_path, "argument_named_batch", "def forward(self, batch):\n    return batch * 3",
                         "torch.randn(4, 8)")  # fmt: skip
    (group,) = analysed(path).generated_groups
    binding = render_binding(group).content
    assert 'check_batched(t0_batch, "t0_batch", torch::kFloat32, {8}, 1, device);' in binding
    assert "const c10::SymInt batch = t0_batch.sym_size(0);" in binding


def test_binding_messages_never_stream_a_symint():
    """Streaming a SymInt or a list of them into TORCH_CHECK's message segfaulted torch 2.11 (on an H200: a kernel
    called at a sequence length it does not take crashed its process where the check should have raised), so the
    binding writes sizes out itself (size_text, shape_text). Every TORCH_CHECK's message arguments, after its
    condition, name a sym_size only inside size_text."""
    import re

    from kernelpilot.resources import data_dir

    source = (data_dir("templates") / "policy" / "binding.cpp.j2").read_text()
    checks = re.findall(r"TORCH_CHECK\((.*?)\);", source, flags=re.S)
    assert len(checks) >= 8, "the binding's checks were not found"
    for check in checks:
        depth, split = 0, None
        for index, char in enumerate(check):
            depth += char in "([{"
            depth -= char in ")]}"
            if char == "," and depth == 0:
                split = index
                break
        assert split is not None, check
        message = re.sub(r"size_text\([^;]*?sym_size\(\d\)\)", "size_text(...)", check[split:])
        assert "sym_size" not in message, check
