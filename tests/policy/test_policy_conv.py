"""Convolutions in the built-in policy: aten.convolution as one cuDNN call, its epilogue fused or handed on.

The partition is checked with cpu_spec's CPU `evaluate` against Model on small inputs (every conv group
computed by torch.convolution in float64); the generated sources are compiled (and the workspace linked against
cuDNN) here, and verified through the judge on a GPU.
"""

from __future__ import annotations

import math
import re
import string
import subprocess

import pytest
import torch
from kp_testing import EXAMPLES, nonempty
from policy_testing import (
    analysed,
    assert_every_launch_candidate_verifies,
    assert_generated_kernels_verify,
    built_workspace,
    check_against_model,
    compile_cu,
    compile_each_cu,
    linked_and_fused_flags,
    _nvcc,
    needs_nvcc,
    only_group,
    write_problem,
)

from kernelpilot import build
from kernelpilot.errors import BuildError
from kernelpilot.harness import guards
from kernelpilot.policy.analysis import analyze
from kernelpilot.policy.convolution import ConvConfig, channels_last_applies, conv_context
from kernelpilot.policy.families import launch_candidates, render_all, render_kernel

CONV_INIT = """
self.conv = nn.Conv2d(8, 16, 3, padding=1)
self.shift = nn.Parameter(torch.randn(16, 1, 1) * 0.1)
"""
X = "torch.randn(2, 8, 12, 12)"

# name: (forward, inputs, __init__ lines, expected group kinds, the conv group's epilogue)
CONV_PROBLEMS = {
    "relu_then_shift": (
        "def forward(self, x):\n    return torch.relu(self.conv(x)) + self.shift", X, CONV_INIT,
        ["conv", "elementwise"], "bias",
    ),
    "relu_returned": ("def forward(self, x):\n    return torch.relu(self.conv(x))", X, CONV_INIT, ["conv"], "bias, ReLU"),
    "relu_viewed": (
        "def forward(self, x):\n    return torch.relu(self.conv(x)).flatten(1)", X, CONV_INIT, ["conv"], "bias, ReLU",
    ),
    "no_bias_relu": (
        "def forward(self, x):\n    return torch.relu(self.conv(x))", X,
        "self.conv = nn.Conv2d(8, 16, 3, padding=1, bias=False)", ["conv", "elementwise"], "",
    ),
    "stride_2_dilation_2": (
        "def forward(self, x):\n    return self.conv(x)", X,
        "self.conv = nn.Conv2d(8, 12, 3, stride=2, padding=2, dilation=2)", ["conv"], "bias",
    ),
    "groups": (
        "def forward(self, x):\n    return torch.relu(self.conv(x))", X,
        "self.conv = nn.Conv2d(8, 8, 3, padding=1, groups=4)", ["conv"], "bias, ReLU",
    ),
    "depthwise_then_softmax": (
        "def forward(self, x):\n    return torch.softmax(torch.relu(self.conv(x)), dim=-1)", X,
        "self.conv = nn.Conv2d(8, 8, 3, padding=1, groups=8)", ["conv", "row"], "bias",
    ),
    "conv1d": (
        "def forward(self, x):\n    return self.conv(x)", "torch.randn(2, 8, 20)",
        "self.conv = nn.Conv1d(8, 6, 5, padding=2)", ["conv"], "bias",
    ),
    "conv3d_silu": (
        "def forward(self, x):\n    return F.silu(self.conv(x))", "torch.randn(1, 4, 6, 6, 6)",
        "self.conv = nn.Conv3d(4, 8, 3, padding=1)", ["conv", "elementwise"], "bias",
    ),
    "transposed_input_copied": (
        "def forward(self, x):\n    return self.conv(x.transpose(2, 3))", "torch.randn(2, 8, 12, 10)", CONV_INIT,
        ["elementwise", "conv"], "bias",
    ),
    "computed_input": (
        "def forward(self, x):\n    return self.conv(x * 2 + 1)", X, CONV_INIT, ["elementwise", "conv"], "bias",
    ),
    "fp16": (
        "def forward(self, x):\n    return torch.relu(self.conv(x)) * 2", "torch.randn(2, 8, 10, 10, dtype=torch.float16)",
        "self.conv = nn.Conv2d(8, 16, 1).half()", ["conv", "elementwise"], "bias",
    ),
    "bf16": (
        "def forward(self, x):\n    return torch.relu(self.conv(x))", "torch.randn(2, 8, 9, 9, dtype=torch.bfloat16)",
        "self.conv = nn.Conv2d(8, 16, 3).to(torch.bfloat16)", ["conv"], "bias, ReLU",
    ),
}  # fmt: skip
LOW_PRECISION = {"fp16", "bf16"}


def conv_problem(folder, name: str):
    forward, inputs, init, *_ = CONV_PROBLEMS[name]
    return write_problem(folder, name, forward, inputs, init)


# Every convolution and epilogue in one problem, so the build and GPU tests make one workspace for all of them.
CONV_ZOO = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.plain = nn.Conv2d(8, 16, 3, padding=1)
        self.strided = nn.Conv2d(8, 12, 3, stride=2, padding=2, dilation=2, bias=False)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=4)
        self.line = nn.Conv1d(8, 6, 5, padding=2)
        self.volume = nn.Conv3d(4, 8, 3, padding=1)
        self.fp16 = nn.Conv2d(8, 16, 1).half()
        self.bf16 = nn.Conv2d(8, 16, 3).to(torch.bfloat16)
        self.shift = nn.Parameter(torch.randn(16, 1, 1) * 0.1)

    def forward(self, x, seq, vol, xh, xb):
        return (
            torch.relu(self.plain(x)) + self.shift,  # ReLU handed on to the elementwise kernel with the shift
            self.strided(x),  # stride 2, dilation 2, no bias: cudnnConvolutionForward
            torch.relu(self.grouped(x)),  # groups; ReLU fused (implicit precomputed GEMM)
            self.line(seq),  # 1-d, run as 2-d over a height of 1
            F.silu(self.volume(vol)),  # 3-d
            torch.relu(self.fp16(xh)) * 2,  # fp16
            torch.relu(self.bf16(xb.transpose(2, 3))),  # bf16, a transposed input copied first, ReLU fused
        )


def get_inputs():
    return [
        torch.randn(2, 8, 12, 12),
        torch.randn(2, 8, 20),
        torch.randn(1, 4, 6, 6, 6),
        torch.randn(2, 8, 10, 10, dtype=torch.float16),
        torch.randn(2, 8, 9, 9, dtype=torch.bfloat16),
    ]


def get_init_inputs():
    return []
"""


def conv_zoo_problem(folder):
    path = folder / "conv_zoo.py"
    path.write_text(CONV_ZOO)
    return path


# ------------------------------------------------------------------------------------------- analysis


def test_conv2d_relu_bias_is_a_cudnn_call_then_one_elementwise_kernel():
    analysis = analysed(EXAMPLES / "conv2d_relu_bias.py")
    assert analysis.supported, analysis.blockers()
    conv, epilogue = analysis.groups
    assert conv.kind == "conv" and conv.conv.epilogue() == "bias" and conv.conv.padding == (1, 1)
    assert [t.name for t in conv.tensors] == ["x", "conv.weight", "conv.bias"]
    # The ReLU joins the shift's kernel, which reads the convolution once: cuDNN may pick any algorithm.
    assert epilogue.kind == "elementwise" and epilogue.ops == ["aten.relu", "aten.add"]
    labels = [c.label for c in launch_candidates(conv)]
    assert labels[:4] == [f"cuDNN NCHW, heuristic algorithm {i} of 4" for i in (1, 2, 3, 4)]
    assert labels[4:8] == [f"cuDNN NHWC, heuristic algorithm {i} of 4 (input and weight transposed to NHWC, output back "
                           "to NCHW)" for i in (1, 2, 3, 4)]  # fmt: skip
    assert labels[8:] == [f"cuDNN NHWC, graph API engine configuration {i} of 4 (input and weight transposed to NHWC, "
                          "output back to NCHW)" for i in (1, 2, 3, 4)]  # fmt: skip
    assert conv.describe() == ("aten.convolution: one cuDNN convolution, 32x64x128x128 * 128x64x3x3 (padding 1) "
                               "with a fused bias epilogue (float32)")  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONV_PROBLEMS))
def test_conv_groups_compute_what_the_model_computes(tmp_path, name):
    *_, kinds, epilogue = CONV_PROBLEMS[name]
    analysis = check_against_model(conv_problem(tmp_path, name), atol=1e-2 if name in LOW_PRECISION else 1e-5)
    assert [g.kind for g in analysis.groups] == kinds
    assert [g.conv.epilogue() for g in analysis.groups if g.kind == "conv"] == [epilogue]


def test_conv_zoo_computes_what_the_model_computes(tmp_path):
    analysis = check_against_model(conv_zoo_problem(tmp_path), atol=1e-2)  # fp16 and bf16 outputs round
    convs = [g.conv for g in analysis.groups if g.kind == "conv"]
    assert len(convs) == 7 and [c.activation for c in convs].count("relu") == 2


def test_a_fused_relu_has_one_nchw_candidate_the_implicit_precomputed_gemm_and_four_nhwc(tmp_path):
    group = only_group(analysed(conv_problem(tmp_path, "relu_returned")))
    nhwc = [ConvConfig(i, channels_last=True, graph=graph) for graph in (False, True) for i in range(4)]
    assert launch_candidates(group) == [ConvConfig(0, fused_relu=True), *nhwc]
    source = render_kernel(group, launch_candidates(group)[0]).content
    assert "CUDNN_ACTIVATION_RELU" in source and "cudnnConvolutionBiasActivationForward(" in source
    assert "if (result.algo != CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM) return false;" in source


def test_a_bias_without_relu_is_an_identity_activation_any_algorithm_may_run(tmp_path):
    group = only_group(analysed(conv_problem(tmp_path, "stride_2_dilation_2")))
    source = render_kernel(group, ConvConfig(2)).content
    assert "CUDNN_ACTIVATION_IDENTITY" in source and "IMPLICIT_PRECOMP_GEMM) return false" not in source
    assert "constexpr int kAlgorithm = 2;" in source
    assert "constexpr int kStride[kDims - 2] = {2, 2};" in source and "kDilation[kDims - 2] = {2, 2};" in source


def test_a_convolution_without_bias_is_a_plain_forward_call(tmp_path):
    conv, _ = analysed(conv_problem(tmp_path, "no_bias_relu")).groups
    source = render_kernel(conv, launch_candidates(conv)[0]).content
    assert "cudnnConvolutionForward(" in source and "BiasActivation" not in source


def test_math_follows_torch_tf32_switch_for_float32_and_tensor_ops_for_16_bit(tmp_path):
    (fp32,) = analysed(conv_problem(tmp_path, "stride_2_dilation_2")).groups
    (bf16,) = analysed(conv_problem(tmp_path, "bf16")).groups
    fp32_files = {f.path: f.content for f in render_all(*_problem_and_analysis(conv_problem(tmp_path, "stride_2_dilation_2")))}
    assert "allowTF32CuDNN(at::Float32Op::CONV)" in fp32_files["kernels/policy_g0_binding.cpp"]
    fp32_source = render_kernel(fp32, ConvConfig(0)).content
    assert "return allow_tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;" in fp32_source
    assert "if (!allow_tf32 && tensor_ops) return false;" in fp32_source
    bf16_source = render_kernel(bf16, ConvConfig(0, fused_relu=True)).content
    assert "return CUDNN_TENSOR_OP_MATH;" in bf16_source and "CUDNN_DATA_BFLOAT16" in bf16_source


def test_a_1d_convolution_runs_as_2d_over_a_height_of_one(tmp_path):
    (group,) = analysed(conv_problem(tmp_path, "conv1d")).groups
    context = conv_context(group, ConvConfig(0))
    assert context["input_dims"] == [2, 8, 1, 20] and context["weight_dims"] == [6, 8, 1, 5]
    assert context["output_dims"] == [2, 6, 1, 20]
    assert (context["stride"], context["padding"], context["dilation"]) == ([1, 1], [0, 2], [1, 1])


def test_a_3d_convolution_keeps_five_dims(tmp_path):
    conv, _ = analysed(conv_problem(tmp_path, "conv3d_silu")).groups
    context = conv_context(conv, ConvConfig(0))
    assert context["input_dims"] == [1, 4, 6, 6, 6] and context["padding"] == [1, 1, 1]


@pytest.mark.parametrize("name", sorted(CONV_PROBLEMS))
def test_nhwc_candidates_follow_for_1d_and_2d_convolutions_not_3d(tmp_path, name):
    group = next(g for g in analysed(conv_problem(tmp_path, name)).groups if g.kind == "conv")
    nhwc = [config for config in launch_candidates(group) if config.channels_last]
    if name == "conv3d_silu":
        assert nhwc == []
        with pytest.raises(ValueError, match="NHWC candidates are generated for 1-d and 2-d convolutions only"):
            conv_context(group, ConvConfig(0, channels_last=True))
    else:
        assert nhwc == [ConvConfig(i, channels_last=True, graph=graph) for graph in (False, True) for i in range(4)]
        assert launch_candidates(group)[0].channels_last is False  # NCHW first: the layout measured so far


def test_an_nhwc_candidate_fuses_the_bias_and_relu_into_the_nchw_write_back(tmp_path):
    group = only_group(analysed(conv_problem(tmp_path, "relu_returned")))
    source = render_kernel(group, ConvConfig(1, channels_last=True)).content
    # The ReLU leaves the cuDNN call, so any ranked algorithm may run, not only implicit precomputed GEMM.
    assert "cudnnConvolutionForward(" in source and "BiasActivation" not in source
    assert "IMPLICIT_PRECOMP_GEMM) return false" not in source and "constexpr int kAlgorithm = 1;" in source
    assert "cudnnSetFilterNdDescriptor(plan.w, kDataType, CUDNN_TENSOR_NHWC, kDims, kWeightDims)" in source
    assert "using InputTranspose = Transpose<8, 144>;" in source  # N of C x H*W
    assert "using WeightTranspose = Transpose<8, 9>;" in source and "constexpr int kFilters = 16;" in source  # K of C x R*S
    assert "using OutputTranspose = Transpose<144, 16>;" in source  # N of H*W x K
    assert ("OutputTranspose::run<true, true>(batch, y_nhwc, static_cast<Element*>(out), static_cast<const Element*>(bias), "
            "stream);") in source  # fmt: skip
    # N is a runtime size here (leading.py): the copies are sized by each call's.
    assert "return scratch_bytes(batch) + plan_for_current_device(allow_tf32, batch).workspace_bytes;" in source
    assert "const int batch = checked_batch(leading);" in source


def test_a_graph_api_candidate_ranks_the_heuristics_engine_configs_over_the_same_nhwc_copies(tmp_path):
    group = only_group(analysed(conv_problem(tmp_path, "relu_returned")))
    legacy = render_kernel(group, ConvConfig(1, channels_last=True)).content
    source = render_kernel(group, ConvConfig(1, channels_last=True, graph=True)).content
    assert "the graph API of cudnn_graph.h" in source and "constexpr int kAlgorithm = 1;" in source
    for call in ("cudnnConvolutionForward(", "cudnnGetConvolutionForwardAlgorithm_v7", "cudnnSetFilterNdDescriptor"):
        assert call in legacy and call not in source
    assert "CUDNN_HEUR_MODE_A" in source and "cudnnBackendExecute(plan.handle, plan.execution, pack.get())" in source
    assert "convolve(plan, x_nhwc, w_nhwc, y_nhwc, copies + scratch);" in source
    # The same transposes and write-back as the legacy NHWC candidate.
    for line in ("using InputTranspose = Transpose<8, 144>;", "using OutputTranspose = Transpose<144, 16>;",
                 "OutputTranspose::run<true, true>(batch, y_nhwc, static_cast<Element*>(out), static_cast<const Element*>(bias), stream);"):  # fmt: skip
        assert line in legacy and line in source
    # As torch filters engines: none converting inputs down, none on tensor cores for float32 without TF32.
    assert "notes[i] == CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS" in source
    assert "kDataType == CUDNN_DATA_FLOAT && !allow_tf32 && notes[i] == CUDNN_NUMERICAL_NOTE_TENSOR_CORE" in source
    assert "behaviors[i] == CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION) return false;" in source


def test_a_graph_api_candidate_needs_the_nhwc_layout(tmp_path):
    group = only_group(analysed(conv_problem(tmp_path, "relu_returned")))
    with pytest.raises(ValueError, match="graph-API candidates are generated for NHWC"):
        conv_context(group, ConvConfig(0, graph=True))


@pytest.mark.parametrize(
    ("name", "transposes", "epilogue"),
    [
        ("conv1d", ((2, 8, 20), (6, 8, 5), (2, 20, 6)), "<true, false>"),  # a height of 1
        ("groups", ((2, 8, 144), (8, 2, 9), (2, 144, 8)), "<true, true>"),  # C / groups per filter
        ("stride_2_dilation_2", ((2, 8, 144), (12, 8, 9), (2, 36, 12)), "<true, false>"),
        ("no_bias_relu", ((2, 8, 144), (16, 8, 9), (2, 144, 16)), "<false, false>"),  # the ReLU is handed on
        ("bf16", ((2, 8, 81), (16, 8, 9), (2, 49, 16)), "<true, true>"),
    ],
)  # fmt: skip
def test_nhwc_transposes_have_the_shapes_of_the_convolution(tmp_path, name, transposes, epilogue):
    group = next(g for g in analysed(conv_problem(tmp_path, name)).groups if g.kind == "conv")
    source = render_kernel(group, ConvConfig(0, channels_last=True)).content
    for role, (_, rows, cols) in zip(("Input", "Weight", "Output"), transposes):
        assert f"using {role}Transpose = Transpose<{rows}, {cols}>;" in source
    # The filters are the weight's batch of matrices; the images' count is N, each call's (a runtime size here).
    assert f"constexpr int kFilters = {transposes[1][0]};" in source
    transposed = conv_context(group, ConvConfig(0, channels_last=True))["transposes"]
    assert [tuple(transposed[role].values()) for role in ("input", "weight", "output")] == list(transposes)
    assert f"OutputTranspose::run{epilogue}(batch, " in source
    if name == "bf16":
        assert "using Element = __nv_bfloat16;" in source and "CUDNN_DATA_BFLOAT16" in source


@needs_nvcc
@pytest.mark.parametrize("name", ["relu_returned", "conv1d", "groups", "stride_2_dilation_2", "fp16"])
def test_nhwc_transposes_move_every_element_where_a_permute_puts_it(tmp_path, name):
    """Walks every block of the three generated transposes on the host (their index helpers are host-callable):
    each source element is read once and written where torch's permute to (or from) channels-last puts it, and
    the write-back adds the bias of its output channel."""
    group = next(g for g in analysed(conv_problem(tmp_path, name)).groups if g.kind == "conv")
    walked = _walk_transposes(group, tmp_path)
    conv = group.conv
    image, filters, result = (_spatial_2d(conv.input.shape), _spatial_2d(conv.weight.shape), _spatial_2d(conv.shape))
    expected = {
        "input": _numbered(image).permute(0, 2, 3, 1),  # NCHW -> NHWC
        "weight": _numbered(filters).permute(0, 2, 3, 1),  # KCRS -> KRSC
        # The NHWC result (numbered in its own memory order) -> NCHW.
        "output": _numbered((result[0], *result[2:], result[1])).permute(0, 3, 1, 2),
    }
    for role, (source, destination, bias_index) in walked.items():
        numel = expected[role].numel()
        assert sorted(source) == list(range(numel)), f"{role}: every source element read exactly once"
        moved = torch.empty(numel, dtype=torch.long)
        moved[torch.tensor(destination)] = torch.tensor(source)
        assert torch.equal(moved, expected[role].flatten()), role
        if role == "output":  # the bias of each written element's output channel
            channels = (torch.tensor(destination) // math.prod(result[2:])) % result[1]
            assert torch.equal(torch.tensor(bias_index), channels)


def test_the_binding_allocates_the_workspace_the_algorithm_asks_for(tmp_path):
    files = {f.path: f.content for f in render_all(*_problem_and_analysis(EXAMPLES / "conv2d_relu_bias.py"))}
    binding = files["kernels/policy_g0_binding.cpp"]
    # N is a runtime size: the workspace is asked for at each call's, which the launcher takes too.
    assert "size_t kp_policy_g0_launch_workspace_bytes(int64_t leading, bool allow_tf32);" in binding
    assert "kp_policy_g0_launch_workspace_bytes(x.size(0), allow_tf32)" in binding
    assert re.search(r"workspace\.data_ptr\(\), kWorkspaceBytes,\s+x\.size\(0\),\s+allow_tf32,\s+c10::cuda::getCurrentCUDAStream",
                     binding)  # fmt: skip
    assert "kp_ops.policy_g0(x, self.conv.weight, self.conv.bias)" in files["model_new.py"]
    assert "kp_ops.policy_g1(out_g0, self.bias)" in files["model_new.py"]


@pytest.mark.parametrize(
    ("forward", "inputs", "init", "reason"),
    [
        (
            "def forward(self, x):\n    return self.conv(x)", "torch.randn(4096, 8, 256, 256)",
            "self.conv = nn.Conv2d(8, 4, 1)",
            "aten.convolution (a convolution whose input has 2^31 elements or more, beyond cuDNN's int dims)",
        ),
        (
            "def forward(self, x):\n    return self.conv(x)", "torch.randn(2, 8, 12, 12, dtype=torch.float64)",
            "self.conv = nn.Conv2d(8, 16, 3).double()",
            "aten.convolution (convolves float64 tensors; generated convolutions take float32, float16 or bfloat16)",
        ),
    ],
    ids=["int_dims", "float64"],
)  # fmt: skip
def test_unsupported_convolutions_are_named_in_one_sentence(tmp_path, forward, inputs, init, reason):
    analysis = analysed(write_problem(tmp_path, "unsupported", forward, inputs, init))
    assert not analysis.supported
    assert analysis.blockers() == f"Not supported by the built-in policy: {reason}."


# -------------------------------------------------------------------------------------- build and guards


def test_cudnn_comes_from_the_toolkit_first_then_from_the_nvidia_packages(monkeypatch, tmp_path):
    package = tmp_path / "nvidia" / "cudnn"
    (package / "include").mkdir(parents=True)
    (package / "include" / "cudnn.h").write_text("")
    (package / "lib").mkdir()
    for name in ("libcudnn.so.8", "libcudnn.so.9", "libcudnn_cnn.so.9"):
        (package / "lib" / name).write_text("")
    monkeypatch.setattr(build, "_nvidia_package_folders", lambda: [package])
    found = build.find_cudnn(tmp_path / "toolkit")
    assert found.include_dir == package / "include" and found.library.name == "libcudnn.so.9"
    (tmp_path / "toolkit" / "include").mkdir(parents=True)
    (tmp_path / "toolkit" / "include" / "cudnn.h").write_text("")
    (tmp_path / "toolkit" / "lib64").mkdir()
    (tmp_path / "toolkit" / "lib64" / "libcudnn.so").write_text("")
    assert build.find_cudnn(tmp_path / "toolkit").library == tmp_path / "toolkit" / "lib64" / "libcudnn.so"


def test_missing_cudnn_is_one_sentence_with_a_hint(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "_nvidia_package_folders", list)
    with pytest.raises(BuildError, match=r"includes cudnn\.h, but no cuDNN \(cudnn\.h with libcudnn\.so\)") as raised:
        build.find_cudnn(tmp_path)
    assert "nvidia-cudnn" in raised.value.hint


def test_a_fused_cudnn_call_counts_as_the_candidates_own_work():
    source = "cudnnConvolutionBiasActivationForward(handle, &one, x_desc, x, ...);"
    assert guards.find_no_custom_kernel(["sm90_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nchwkcrs_nchw"], source) is None
    assert guards.find_no_custom_kernel(["sm90_xmma_fprop_implicit_gemm"], "int main() {}") is not None
    # A transposed convolution is cuDNN's backward data; its legacy kernels carry no library prefix.
    source = "KP_CUDNN_CHECK(cudnnConvolutionBackwardData(plan.handle, &one, plan.w, w, plan.x, x, ...));"
    assert guards.find_no_custom_kernel(["convolveNd_dgrad_float_engine", "setTensor5d_kernel"], source) is None
    assert guards.find_no_custom_kernel(["convolveNd_dgrad_float_engine"], "int main() {}") is not None


@needs_nvcc
@pytest.mark.parametrize("name", ["conv2d_relu_bias"])
def test_conv_example_sources_compile(tmp_path, name):
    groups = nonempty(analysed(EXAMPLES / f"{name}.py").generated_groups, "generated groups")
    sources = [render_kernel(group, launch_candidates(group)[0]).content for group in groups]
    convs = [group for group in groups if group.kind == "conv"]
    nhwc = [render_kernel(group, ConvConfig(0, channels_last=True)).content for group in convs]
    reports = compile_each_cu(sources + nhwc, tmp_path)
    for group, source in zip(groups, sources):
        if group.kind == "conv":
            assert "#include <cudnn.h>" in source and "__global__" not in source  # cuDNN's kernels, none of ours
    assert convs
    for report in reports[len(sources):]:
        # The transposes: one kernel per shape and epilogue, none spilling.
        assert report.count("Compiling entry function") == 3 and "transpose_kernel" in report
        assert "0 bytes spill stores" in report and not re.search(r"[1-9]\d* bytes spill stores", report)


# A cuDNN candidate's rank: the comment naming it and the one constant that picks it from the ranked list.
_RANK = re.compile(r"(algorithm|engine configuration) \d+ of (\d+)|(constexpr int kAlgorithm = )\d+;")


def _rank_free(source: str) -> str:
    """`source` with the cuDNN rank it picks taken out: candidates that differ only in their rank compile alike."""
    return _RANK.sub(lambda m: f"{m[1]} K of {m[2]}" if m[1] else f"{m[3]}K;", source)


@needs_nvcc
def test_every_launch_candidate_of_the_conv_zoo_compiles(tmp_path):
    """Every candidate's code is compiled once: one per form, since candidates of a form differ only in the rank
    they pick at run time (checked here), and each compile of cuDNN's headers takes seconds."""
    compiled: dict[str, str] = {}  # form -> the first source of that form
    for group in nonempty(analysed(conv_zoo_problem(tmp_path)).generated_groups, "generated groups"):
        for config in nonempty(launch_candidates(group), "launch candidates")[: None if group.kind == "conv" else 1]:
            source = render_kernel(group, config).content
            form = _rank_free(source)
            if form != source:
                assert len(re.findall(r"constexpr int kAlgorithm = \d+;", source)) == 1, "one rank, in one constant"
            compiled.setdefault(form, source)
    compile_each_cu(list(compiled.values()), tmp_path)
    assert len(compiled) >= 8, "the zoo's forms: NCHW, NHWC and graph API kernels of several groups"


@pytest.mark.cuda_build
def test_a_conv_workspace_builds_and_links_cudnn(tmp_path):
    # One conv and its fused epilogue: every conv form of the zoo compiles in test_every_launch_candidate_of_the_
    # conv_zoo_compiles; a whole workspace of eleven groups took 95 s of a 2-core CI run.
    ws, result = built_workspace(EXAMPLES / "conv2d_relu_bias.py", tmp_path)
    # cuDNN's headers reach only the sources that include them: a fused kernel's command is unchanged.
    fused, linked = linked_and_fused_flags(ws, result.library, "cudnn")
    assert "cudnn" not in fused
    assert build.build_workspace(ws.root, arch="9.0").compiled == []  # nothing changed, nothing rebuilt
    # The graph-API candidates call cudnn_graph.h's functions: every one the library needs, the linked libcudnn
    # exports (so the dynamic linker resolves them where the GPU runs them).
    # (One group's kernel: every graph-API kernel calls the same functions, and each rebuild takes seconds.)
    analysis = analyze(ws.problem())
    group = next(g for g in analysis.generated_groups if g.kind == "conv" and channels_last_applies(g.conv))
    kernel = render_kernel(group, ConvConfig(0, channels_last=True, graph=True))
    (ws.root / kernel.path).write_text(kernel.content)
    rebuilt = build.build_workspace(ws.root, arch="9.0")
    assert rebuilt.ok and rebuilt.compiled, rebuilt.log[-3000:]
    needed = _dynamic_symbols(rebuilt.library, "--undefined-only")
    assert {"cudnnBackendCreateDescriptor", "cudnnBackendExecute", "cudnnBackendFinalize"} <= needed
    cudnn = re.search(r"libcudnn\.so\S* => (\S+)", linked).group(1)
    assert {name for name in needed if name.startswith("cudnn")} <= _dynamic_symbols(cudnn, "--defined-only")


def _dynamic_symbols(library: str, which: str) -> set[str]:
    listed = subprocess.run(["nm", "-D", which, library], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1].split("@")[0] for line in listed.splitlines() if line.strip()}


# --------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_conv2d_relu_bias_passes_verification(tmp_path, judge):  # noqa: F811 - the shared fixture
    assert_generated_kernels_verify(judge, EXAMPLES / "conv2d_relu_bias.py", tmp_path)


@pytest.mark.gpu
def test_every_launch_candidate_of_the_conv_zoo_passes_verification(tmp_path, judge):  # noqa: F811
    """NCHW and NHWC candidates alike: the zoo's 1-d, 2-d, strided, dilated, grouped, fp16 and bf16 convolutions."""
    assert_every_launch_candidate_verifies(judge, conv_zoo_problem(tmp_path), tmp_path)


@pytest.mark.gpu
def test_every_launch_candidate_of_conv2d_relu_bias_passes_verification(tmp_path, judge):  # noqa: F811
    """At the example's size, where cuDNN's NHWC tensor-core kernels run and the transposes span many tiles."""
    assert_every_launch_candidate_verifies(judge, EXAMPLES / "conv2d_relu_bias.py", tmp_path)


# -------------------------------------------------------------------------------------------------- helpers


def _spatial_2d(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A 1-d convolution's shape as the 2-d one it runs as (a height of 1)."""
    return (*shape[:2], 1, shape[2]) if len(shape) == 3 else shape


def _numbered(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(math.prod(shape)).reshape(shape)


# Prints, for every element each transpose of an NHWC candidate moves, its source and destination offsets and
# the bias index the write-back would add, walking tile_of's blocks as the kernel's threads do.
@needs_nvcc
@pytest.mark.parametrize("name", ["relu_returned", "conv1d", "groups", "stride_2_dilation_2", "bf16", "fp16"])
def test_the_graph_api_candidate_describes_the_nhwc_copies_and_cudnn_accepts_its_convolution(tmp_path, name):
    """Builds the graph candidate's tensors, convolution and forward operation on the host (cuDNN finalizes them
    without a device: it checks the attribute types and that the output's shape follows from the input, the weight
    and the convolution's settings) and reads the tensors' strides back. The graph, the heuristics and the run need
    a GPU."""
    group = next(g for g in analysed(conv_problem(tmp_path, name)).groups if g.kind == "conv")
    context = conv_context(group, ConvConfig(0, channels_last=True, graph=True))
    main = DESCRIBE_MAIN.substitute(batch=context["input_dims"][0])  # N, as the launcher passes it
    described = _run_on_host(group, ConvConfig(0, channels_last=True, graph=True), main, tmp_path)
    for role, dims in (("x", "input_dims"), ("w", "weight_dims"), ("y", "output_dims")):
        channels_last = torch.empty(context[dims], device="meta").contiguous(memory_format=torch.channels_last)
        # A dim of size 1 may have any stride (torch and cuDNN's descriptor give it different ones).
        expected = [stride if size > 1 else None for size, stride in zip(context[dims], channels_last.stride())]
        got = [stride if size > 1 else None for size, stride in zip(context[dims], described[role])]
        assert got == expected, role
    assert described["operation"] == ["finalized"]


DESCRIBE_MAIN = string.Template("""
#include <cstdio>

void print_strides(const char* role, const Descriptor& tensor) {
  int64_t strides[kDims], count = 0;
  KP_CUDNN_CHECK(cudnnBackendGetAttribute(tensor.get(), CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, kDims, &count, strides));
  std::printf("%s", role);
  for (int64_t d = 0; d < count; ++d) std::printf(" %lld", static_cast<long long>(strides[d]));
  std::printf("\\n");
}

int main() {
  int input_dims[kDims], output_dims[kDims];
  with_batch(kInputDims, $batch, input_dims);
  with_batch(kOutputDims, $batch, output_dims);
  Descriptor x = make_tensor(input_dims, kInputId);
  Descriptor w = make_tensor(kWeightDims, kWeightId);
  Descriptor y = make_tensor(output_dims, kOutputId);
  print_strides("x", x);
  print_strides("w", w);
  print_strides("y", y);
  Descriptor operation = make_operation(x, w, y, make_convolution());
  std::printf("operation finalized\\n");
}
""")


WALK_MAIN = string.Template("""
#include <cstdio>

template <int kRows, int kCols>
void walk(const char* role, int64_t blocks) {
  for (unsigned block = 0; block < blocks; ++block) {
    const Tile origin = tile_of<kRows, kCols>(block);
    for (int r = 0; r < kTile; ++r) {
      for (int c = 0; c < kTile; ++c) {
        const int row = origin.row + r, col = origin.col + c;
        if (row < kRows && col < kCols) {
          std::printf("%s %lld %lld %d\\n", role, static_cast<long long>(source_offset<kRows, kCols>(origin.matrix, row, col)),
                      static_cast<long long>(destination_offset<kRows, kCols>(origin.matrix, row, col)), col);
        }
      }
    }
  }
}

int main() {
  walk<$input>("input", InputTranspose::blocks($input_batch));
  walk<$weight>("weight", WeightTranspose::blocks($weight_batch));
  walk<$output>("output", OutputTranspose::blocks($output_batch));
}
""")


def _host_binary(source: str, folder) -> str:
    """Compile a candidate's source with a host main() appended and link it against cuDNN: the binary's path."""
    from kernelpilot.build import find_cudnn
    from kernelpilot.toolkit import resolve_cuda_home

    compile_cu(source, folder, host_object=True)
    cudnn = find_cudnn(resolve_cuda_home()).library
    command = [_nvcc(), "kernel.o", "-o", "host", f"-L{cudnn.parent}", f"-l:{cudnn.name}", f"-Xlinker=-rpath={cudnn.parent}"]
    linked = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=300)
    assert linked.returncode == 0, linked.stderr[-3000:]
    return str(folder / "host")


def _run_on_host(group, config: ConvConfig, main: str, folder) -> dict[str, list]:
    """Run the candidate with a host `main` appended (no GPU call may be made); its output lines as {first word:
    the rest, ints where they are}."""
    ran = subprocess.run([_host_binary(render_kernel(group, config).content + main, folder)], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert ran.returncode == 0, (ran.stdout[-2000:], ran.stderr[-2000:])
    lines = [line.split() for line in ran.stdout.splitlines() if line.strip()]
    return {words[0]: [int(w) if w.lstrip("-").isdigit() else w for w in words[1:]] for words in lines}


def _walk_transposes(group, folder) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """Run the NHWC candidate with WALK_MAIN on the host (linked against cuDNN, no GPU call made)."""
    transposes = conv_context(group, ConvConfig(0, channels_last=True))["transposes"]
    shapes = {role: f"{t['rows']}, {t['cols']}" for role, t in transposes.items()}
    shapes |= {f"{role}_batch": t["batch"] for role, t in transposes.items()}
    program = render_kernel(group, ConvConfig(0, channels_last=True)).content + WALK_MAIN.substitute(shapes)
    ran = subprocess.run([_host_binary(program, folder)], capture_output=True, text=True, check=True, timeout=300)
    walked: dict[str, tuple[list[int], list[int], list[int]]] = {role: ([], [], []) for role in transposes}
    for line in ran.stdout.splitlines():
        role, source, destination, bias_index = line.split()
        for column, value in zip(walked[role], (source, destination, bias_index)):
            column.append(int(value))
    return walked


def _problem_and_analysis(path):
    from kernelpilot.problem import load_problem

    problem = load_problem(path)
    return problem, analyze(problem)
