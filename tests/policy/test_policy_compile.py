"""The built-in policy's CUDA, compiled: generated kernels with nvcc (compile-only, sm_90; `cuda_build`, skipped
without nvcc), ptxas reporting no spills where it matters, and whole workspaces built compile-only by the project's
build (`cuda_build`)."""

from __future__ import annotations

import re

import pytest
import torch

from kernelpilot.policy.families import launch_candidates, render_kernel

from kp_testing import EXAMPLES, nonempty
from policy_testing import (
    FUSED_EXAMPLES,
    MATMUL_EXAMPLES,
    ONLINE_SOFTMAX_EXAMPLES,
    analysed,
    assert_every_launch_candidate_compiles,
    built_workspace,
    compile_cu,
    few_long_rows_problem,
    interleaved_rows_problem,
    forward_problem,
    linked_and_fused_flags,
    matmul_zoo_problem,
    needs_nvcc,
    small_problem,
    zoo_problem,
)


# -------------------------------------------------------------------- nvcc compiles of generated sources


@needs_nvcc
@pytest.mark.parametrize("name", FUSED_EXAMPLES)
def test_example_kernels_compile_without_spills(tmp_path, name):
    for group in nonempty(analysed(EXAMPLES / f"{name}.py").generated_groups, "generated groups"):
        report = compile_cu(render_kernel(group, launch_candidates(group)[0]).content, tmp_path)
        spills = re.findall(r"(\d+) bytes spill", report)
        assert spills and set(spills) == {"0"}


@needs_nvcc
def test_a_row_split_over_a_cluster_compiles_without_spills(tmp_path):
    (group,) = analysed(few_long_rows_problem(tmp_path, "layer_norm_3d")).groups
    split = launch_candidates(group)[0]
    assert split.split_blocks == 8
    assert_compiles_without_spills(group, split, tmp_path)


@needs_nvcc
def test_the_one_thread_team_of_interleaved_rows_compiles_without_spills(tmp_path):
    (group,) = analysed(interleaved_rows_problem(tmp_path, "argmin_middle_dim")).groups
    one = launch_candidates(group)[1]
    assert one.threads == 1
    assert_compiles_without_spills(group, one, tmp_path)


def assert_compiles_without_spills(group, config, tmp_path) -> None:
    assert set(re.findall(r"(\d+) bytes spill", compile_cu(render_kernel(group, config).content, tmp_path))) == {"0"}


@needs_nvcc
def test_every_launch_candidate_of_the_zoo_compiles(tmp_path):
    for group in nonempty(analysed(zoo_problem(tmp_path)).generated_groups, "generated groups"):
        for config in nonempty(launch_candidates(group), "launch candidates")[: 4 if group.kind == "row" else 1]:
            compile_cu(render_kernel(group, config).content, tmp_path)


@needs_nvcc
@pytest.mark.parametrize("name", MATMUL_EXAMPLES)
def test_matmul_example_sources_compile(tmp_path, name):
    for group in nonempty(analysed(EXAMPLES / f"{name}.py").generated_groups, "generated groups"):
        source = render_kernel(group, launch_candidates(group)[0]).content
        report = compile_cu(source, tmp_path)
        if group.kind == "matmul":
            assert "cublasLtMatmul(" in source and "__global__" not in source  # cuBLASLt's kernels, none of ours
        else:
            assert set(re.findall(r"(\d+) bytes spill", report)) == {"0"}


@needs_nvcc
def test_every_matmul_zoo_source_compiles(tmp_path):
    for group in nonempty(analysed(matmul_zoo_problem(tmp_path)).generated_groups, "generated groups"):
        compile_cu(render_kernel(group, launch_candidates(group)[0]).content, tmp_path)


@needs_nvcc
@pytest.mark.parametrize("name", ["lora_residual_bf16", "out_proj_residual_bf16"])
def test_every_launch_candidate_of_the_faithful_residual_examples_compiles(tmp_path, name):
    assert_every_launch_candidate_compiles(EXAMPLES / f"{name}.py", tmp_path, faithful=True)


@needs_nvcc
@pytest.mark.parametrize("dtype", ["bool", "float16", "float32"])
def test_masks_of_every_width_load_through_the_l2_policy_and_compile(tmp_path, dtype):
    # fp32 rows: 16-byte vectors of scores, so a mask vector is 4 (bool), 8 (fp16) or 16 bytes, and 1, 2 or 4 in
    # the unaligned kernel (VEC = 1): every width of the policy load.
    path = forward_problem(tmp_path, f"mask_{dtype}", "s, m", "torch.softmax(s, dim=-1) * m",
                           f"torch.randn(4, 8, 64, 256), (torch.rand(64, 256) > 0.1).to(torch.{dtype})")  # fmt: skip
    (group,) = analysed(path).groups
    source = render_kernel(group, launch_candidates(group)[0]).content
    assert "load_elements<VEC, false>(row1 + column_offset1(col), v1, l2_evict_last);" in source
    assert set(re.findall(r"(\d+) bytes spill", compile_cu(source, tmp_path))) == {"0"}


@needs_nvcc
@pytest.mark.parametrize("name", ONLINE_SOFTMAX_EXAMPLES)
def test_every_online_softmax_candidate_compiles_without_spills(tmp_path, name):
    # Includes the candidates that ask for registers for two blocks per SM (__launch_bounds__'s second argument).
    assert_every_launch_candidate_compiles(EXAMPLES / f"{name}.py", tmp_path, without_spills=True)


# ------------------------------------------------------------------ compile-only workspace builds


@pytest.mark.cuda_build
def test_generated_workspace_builds_and_its_ops_trace_under_its_namespace(tmp_path):
    from kernelpilot.harness.candidate import load_candidate, make_candidate_model

    ws, result = built_workspace(small_problem(tmp_path, "gelu_residual_layernorm"), tmp_path)
    assert any("policy_g0_kernel" in kernel.kernel and kernel.spill_stores == 0 for kernel in result.resources)
    # Loaded here without a GPU: the generated op's meta kernel gives the output torch.compile traces with.
    problem = ws.problem()
    model = make_candidate_model(problem, load_candidate(ws, result), "meta")
    assert hasattr(getattr(torch.ops, ws.namespace), "policy_g0")
    inputs = problem.make_inputs("meta")
    with torch.no_grad():
        out = torch.compile(model, fullgraph=True, backend="aot_eager")(*inputs)
        expected = problem.make_model("meta")(*inputs)
    assert (out.device.type, out.shape, out.dtype) == ("meta", expected.shape, expected.dtype)


@pytest.mark.cuda_build
def test_a_matmul_workspace_builds_and_links_cublaslt(tmp_path):
    from kernelpilot.build import build_workspace

    # A matmul and a fused row kernel (every matmul form of the zoo compiles in test_matmul_example_sources_compile
    # and the matmul zoo's own tests; a whole workspace of seven groups took 65 s of a 2-core CI run).
    ws, result = built_workspace(EXAMPLES / "small_mlp_block.py", tmp_path)
    # cuBLASLt's headers reach only the sources that include them: a fused kernel's command is unchanged.
    fused, _ = linked_and_fused_flags(ws, result.library, "cublasLt")
    assert "cublasLt" not in fused and "libcublasLt" not in fused
    assert build_workspace(ws.root, arch="9.0").compiled == []  # nothing changed, nothing rebuilt
