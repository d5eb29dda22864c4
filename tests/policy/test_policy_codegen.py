"""The built-in policy's generated sources: the index terms of its layouts, the launch candidates of its kernel
families (rows cached in registers, in shared memory or a cluster's, or streamed; blocks per SM; the L2 policy of
broadcast reads), and the kernels, bindings and model_new.py it renders. The CUDA is compiled in
test_policy_compile.py and verified on a GPU in test_policy_gpu.py."""

from __future__ import annotations

import math
import re

import pytest

from kernelpilot.policy.analysis import analyze
from kernelpilot.policy.codegen import LaunchConfig, index_terms
from kernelpilot.policy.families import launch_candidates, render_all, render_kernel
from kernelpilot.policy.ir import Analysis, Group
from kernelpilot.policy.matmul import MatmulConfig
from kernelpilot.problem import load_problem

from kp_testing import EXAMPLES, nonempty
from policy_testing import (
    FEW_LONG_ROWS,
    ONLINE_SOFTMAX_EXAMPLES,
    SUPPORTED_EXAMPLES,
    analysed,
    INTERLEAVED_ROWS,
    few_long_rows_problem,
    interleaved_rows_problem,
    forward_problem,
    offset_from_terms,
    small_problem,
    unsupported_problem,
    weighted_softmax_sum_problem,
    write_problem,
)


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


@pytest.mark.parametrize("name", sorted(FEW_LONG_ROWS))
def test_rows_too_few_for_every_sm_are_split_over_a_cluster_first(tmp_path, name):
    (group,) = analysed(few_long_rows_problem(tmp_path, name)).groups
    assert group.rows < 132
    split, *rest = launch_candidates(group)
    assert (split.split_blocks, split.shared_blocks, split.persistent) == (8, 0, False)
    assert not any(config.split_blocks for config in rest)
    source = render_kernel(group, split).content
    assert "__cluster_dims__(kClusterBlocks, 1, 1)" in source and "constexpr int kClusterBlocks = 8;" in source
    assert "too few rows to give every SM a block" in source and "cluster.map_shared_rank(" in source
    assert "kCacheBytes" not in source and "std::min<int64_t>(work, INT_MAX / kClusterBlocks) * kClusterBlocks" in source
    assert "each row streamed by a cluster of 8 blocks" in source


@pytest.mark.parametrize("name", sorted(INTERLEAVED_ROWS))
def test_rows_interleaved_in_memory_get_a_one_thread_team_second(tmp_path, name):
    # A warp of one-thread teams reads 32 adjacent rows at once: each load one contiguous run, not 32 scattered ones.
    group = analysed(interleaved_rows_problem(tmp_path, name)).groups[0]  # (a softmax's copy back in order follows)
    assert group.kind == "row"
    first, second = launch_candidates(group)[:2]
    assert first.threads > 1 and (second.threads, second.rows_per_block) == (1, 256)
    # Rows whose own elements are adjacent (a softmax over the last dim) keep their teams only.
    path = write_problem(tmp_path, "last_dim", "def forward(self, x):\n    return torch.softmax(x, -1)", "torch.randn(512, 1024)")
    (contiguous,) = analysed(path).groups
    assert all(config.threads > 1 for config in launch_candidates(contiguous))


def test_rows_enough_for_every_sm_or_too_short_to_share_out_are_not_split(tmp_path):
    many = forward_problem(tmp_path, "many_rows", "x", "torch.log_softmax(x, -1)", "torch.randn(512, 65536)")
    short = forward_problem(tmp_path, "short_rows", "x", "torch.log_softmax(x, -1)", "torch.randn(4, 8192)")
    for path in (many, short):
        (group,) = analysed(path).groups
        assert not any(config.split_blocks for config in launch_candidates(group))


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
    allocated = body.index("torch::Tensor out = at::empty_symint(")  # the batch is a runtime size here
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
    with pytest.raises(ValueError, match="aten.sort"):
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
