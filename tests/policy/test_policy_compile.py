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
    compile_each_cu,
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
def test_sources_compiled_together_fail_as_each_would_alone_and_report_their_own_kernels(tmp_path):
    # compile_each_cu compiles sources with the same leading preprocessor lines as one file: no source may see
    # another's macro or function there, and each report holds its own kernels only.
    head = "#include <cstdint>\n\n"
    scale = head + "__device__ float twice(float v);\n#define SCALE 2.0f\n" \
                   "__device__ float twice(float v) { return v * SCALE; }\n" \
                   "__global__ void scale_kernel(float* x) { x[threadIdx.x] = twice(x[threadIdx.x]); }\n"
    shift = head + "__global__ void shift_kernel(float* x) { x[threadIdx.x] += 1.0f; }\n"
    reports = compile_each_cu([scale, shift, scale], tmp_path)
    assert [r.count("Compiling entry function") for r in reports] == [1, 1, 1]
    assert "scale_kernel" in reports[0] and "shift_kernel" not in reports[0] and "scale_kernel" not in reports[1]
    assert "kp_source_" in reports[0], "compiled in one file (a source's kernels in its namespace), not one by one"
    assert reports[2] == reports[0] and set(re.findall(r"(\d+) bytes spill", reports[1])) == {"0"}
    # A header included below some code, outside any braces (as the cluster kernels include cooperative groups).
    synced = head + "namespace {\n__device__ int one() { return 1; }\n}  // namespace\n\n" \
                    "#include <cooperative_groups.h>\n\nnamespace cg = cooperative_groups;\n" \
                    "__global__ void KERNEL(int* x) { cg::this_thread_block().sync(); x[0] = one(); }\n"
    reports = compile_each_cu([synced.replace("KERNEL", "first"), synced.replace("KERNEL", "second")], tmp_path)
    assert ["first" in r and "second" not in r for r in reports] == [True, False] and "kp_source_" in reports[1]
    uses_the_macro = head + "__global__ void k(float* x) { x[0] = SCALE; }\n"
    uses_the_function = head + "__global__ void k(float* x) { x[0] = twice(x[0]); }\n"
    warns = head + "__global__ void k(float* x) { int unused = 1; x[0] = 0; }\n"
    for alone_fails, match in ((uses_the_macro, "SCALE"), (uses_the_function, "twice"), (warns, "warning")):
        with pytest.raises(AssertionError, match=match):
            compile_each_cu([scale, alone_fails], tmp_path)


@needs_nvcc
@pytest.mark.parametrize("name", FUSED_EXAMPLES)
def test_example_kernels_compile_without_spills(tmp_path, name):
    groups = nonempty(analysed(EXAMPLES / f"{name}.py").generated_groups, "generated groups")
    for group, report in zip(groups, compile_each_cu([first_source(group) for group in groups], tmp_path)):
        spills = re.findall(r"(\d+) bytes spill", report)
        assert spills and set(spills) == {"0"}, (group.name, report)


def first_source(group) -> str:
    return render_kernel(group, launch_candidates(group)[0]).content


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
    groups = nonempty(analysed(zoo_problem(tmp_path)).generated_groups, "generated groups")
    compile_each_cu([render_kernel(group, config).content for group in groups
                     for config in nonempty(launch_candidates(group), "candidates")[: 4 if group.kind == "row" else 1]],
                    tmp_path)  # fmt: skip


@needs_nvcc
@pytest.mark.parametrize("name", MATMUL_EXAMPLES)
def test_matmul_example_sources_compile(tmp_path, name):
    groups = nonempty(analysed(EXAMPLES / f"{name}.py").generated_groups, "generated groups")
    sources = [first_source(group) for group in groups]
    for group, source, report in zip(groups, sources, compile_each_cu(sources, tmp_path)):
        if group.kind == "matmul":
            assert "cublasLtMatmul(" in source and "__global__" not in source  # cuBLASLt's kernels, none of ours
        else:
            assert set(re.findall(r"(\d+) bytes spill", report)) == {"0"}


@needs_nvcc
def test_every_matmul_zoo_source_compiles(tmp_path):
    groups = nonempty(analysed(matmul_zoo_problem(tmp_path)).generated_groups, "generated groups")
    compile_each_cu([first_source(group) for group in groups], tmp_path)


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
