"""What a built extension links against (harness/symbols.py): its undefined symbols, torch compute among them, and
the GEMM/convolution libraries it really calls.

The pure tests judge symbol lists (demangled as c++filt writes them, and mangled); the cuda_build tests compile
bindings with the workspace build (one shared folder: kp_module.cpp is compiled once, each case swaps the files
it adds) and read the symbols of the library that build produced.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from kp_testing import EXAMPLES, REPO_ROOT

from kernelpilot.harness.symbols import (
    ALLOWED_ATEN_OPS,
    SymbolReadError,
    calls_library,
    find_no_own_kernel,
    find_torch_compute_symbols,
    is_allowed_aten_op,
    library_kernels_called,
    qualified_name,
    undefined_symbols,
)

# ------------------------------------------------------------------------------------------- symbol lists

# What the workspace template's binding and kp_module.cpp reference in torch, as nm -D -C lists them (with the
# mangled form beside): every one must pass.
HONEST = {
    "at::_ops::empty_like::call(at::Tensor const&, std::optional<c10::ScalarType>, std::optional<c10::Layout>, "
    "std::optional<c10::Device>, std::optional<bool>, std::optional<c10::MemoryFormat>)":
        "_ZN2at4_ops10empty_like4callERKNS_6TensorESt8optionalIN3c1010ScalarTypeEES5_INS6_6LayoutEES5_INS6_6DeviceEES5_IbES5_INS6_12MemoryFormatEE",
    "at::_ops::empty_memory_format::call(c10::ArrayRef<c10::SymInt>, std::optional<c10::ScalarType>, "
    "std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>, std::optional<c10::MemoryFormat>)":
        "_ZN2at4_ops19empty_memory_format4callEN3c108ArrayRefINS2_6SymIntEEESt8optionalINS2_10ScalarTypeEES6_INS2_6LayoutEES6_INS2_6DeviceEES6_IbES6_INS2_12MemoryFormatEE",
    "float* at::TensorBase::data_ptr<float>() const": "_ZNK2at10TensorBase8data_ptrIfEEPT_v",
    "at::globalContext()": "_ZN2at13globalContextEv",
    "at::Context::allowTF32CuDNN(std::optional<at::Float32Op>) const": "_ZNK2at7Context14allowTF32CuDNNESt8optionalINS_9Float32OpEE",
    "c10::detail::torchCheckFail(char const*, char const*, unsigned int, char const*)": "_ZN3c106detail14torchCheckFailEPKcS2_jS2_",
    "c10::impl::ExcludeDispatchKeyGuard::ExcludeDispatchKeyGuard(c10::DispatchKeySet)":
        "_ZN3c104impl23ExcludeDispatchKeyGuardC1ENS_14DispatchKeySetE",
    "c10::cuda::getCurrentCUDAStream(signed char)": "_ZN3c104cuda20getCurrentCUDAStreamEa",
    "c10::operator<<(std::ostream&, c10::Device const&)": "_ZN3c10lsERSoRKNS_6DeviceE",
    "vtable for torch::autograd::AutogradMeta": "_ZTVN5torch8autograd12AutogradMetaE",
    # kp_module.cpp's Autograd kernel: is grad on, then on to the device kernel through the dispatcher.
    "c10::GradMode::is_enabled()": "_ZN3c108GradMode10is_enabledEv",
    "c10::Dispatcher::realSingleton()": "_ZN3c1010Dispatcher13realSingletonEv",
    "c10::impl::OperatorEntry::reportError(c10::DispatchKey) const":
        "_ZNK3c104impl13OperatorEntry11reportErrorENS_11DispatchKeyE",
    "caffe2::TypeMeta::typeMetaDatas()": "_ZN6caffe28TypeMeta13typeMetaDatasEv",
    "PyObject_GetAttrString": "PyObject_GetAttrString",
    "cudaLaunchKernel": "cudaLaunchKernel",
    "cublasLtMatmul": "cublasLtMatmul",
    "cudnnConvolutionBiasActivationForward": "cudnnConvolutionBiasActivationForward",
    "std::runtime_error::what() const": "_ZNKSt13runtime_error4whatEv",
}  # fmt: skip

RELU = ("at::_ops::relu::call(at::Tensor const&)", "_ZN2at4_ops4relu4callERKNS_6TensorE")
MM = ("at::_ops::mm::call(at::Tensor const&, at::Tensor const&)", "_ZN2at4_ops2mm4callERKNS_6TensorES4_")


@pytest.mark.parametrize("readable, mangled", list(HONEST.items()) + [RELU, MM])
def test_mangled_and_demangled_names_have_the_same_scope_path(readable, mangled):
    assert qualified_name(readable) == qualified_name(mangled)


def test_scope_paths_drop_return_types_templates_parameters_and_versions():
    assert qualified_name(RELU[0]) == ("at", "_ops", "relu", "call")
    assert qualified_name("float* at::TensorBase::data_ptr<float>() const") == ("at", "TensorBase", "data_ptr")
    assert qualified_name("memcpy@GLIBC_2.14") == ("memcpy",)
    assert qualified_name("std::ostream::operator<<(int)@GLIBCXX_3.4") == ("std", "ostream", "operator")


@pytest.mark.parametrize("form", [0, 1], ids=["demangled", "mangled"])
def test_what_honest_bindings_reference_passes(form):
    symbols = [pair[form] for pair in HONEST.items()]
    assert find_torch_compute_symbols(symbols) is None


@pytest.mark.parametrize("form", [0, 1], ids=["demangled", "mangled"])
def test_aten_compute_fails_and_is_named(form):
    finding = find_torch_compute_symbols([pair[form] for pair in HONEST.items()] + [RELU[form], MM[form]])
    assert finding is not None and finding.guard == "torch-symbols" and finding.severity == "fail"
    assert "mm" in finding.message and "relu" in finding.message and "kernels/*.cu" in finding.message
    assert "empty_like" not in finding.message  # only the offending ones are named


@pytest.mark.parametrize(
    "symbol, named",
    [
        ("at::native::add_out(at::Tensor const&, at::Tensor const&, c10::Scalar const&, at::Tensor&)", "at::native::add_out"),
        ("at::cuda::relu(at::Tensor const&)", "at::cuda::relu"),  # the CUDA kernel, no dispatcher at all
        ("at::cuda::blas::gemm<float>(char, char, long, long, long, float, float const*, long, float const*, long, float, float*, long)",
         "at::cuda::blas::gemm"),
        ("torch::jit::Module::forward(std::vector<c10::IValue, std::allocator<c10::IValue> >)", "torch::jit::Module::forward"),
        ("c10::Dispatcher::findSchemaOrThrow(char const*, char const*)", "findSchemaOrThrow"),
        ("at::_ops::clone::call(at::Tensor const&, std::optional<c10::MemoryFormat>)", "clone"),
        ("at::_ops::to_dtype::call(at::Tensor const&, c10::ScalarType, bool, bool, std::optional<c10::MemoryFormat>)", "to_dtype"),
        ("at::_ops::select_scatter::call(at::Tensor const&, at::Tensor const&, long, c10::SymInt)", "select_scatter"),
        ("dlsym@GLIBC_2.34", "dlsym"),
        ("at::Tensor::relu_() const", "at::Tensor::relu_"),  # compute methods of at::Tensor compiled into torch
        ("at::Tensor::index(c10::ArrayRef<at::indexing::TensorIndex>) const", "at::Tensor::index"),
        ("_ZNK2at10TensorBase2toEN3c1013TensorOptionsEbbSt8optionalINS1_12MemoryFormatEE", "at::TensorBase::to"),
    ],
)  # fmt: skip
def test_other_ways_to_reach_torch_compute_fail(symbol, named):
    finding = find_torch_compute_symbols([symbol])
    assert finding is not None and named in finding.message


def test_allocation_views_and_free_layout_ops_pass():
    allowed = ["empty_strided", "zeros", "fill__Scalar", "view", "as_strided", "permute", "select_int", "slice_Tensor",
               "transpose_int", "contiguous", "reshape", "unsqueeze", "expand", "narrow"]  # fmt: skip
    assert find_torch_compute_symbols([f"at::_ops::{op}::call()" for op in allowed]) is None
    metadata = ["at::checkDim(char const*, at::TensorGeometryArg const&, long)", "at::TensorBase::toString() const",
                "at::TensorBase::__dispatch_contiguous(c10::MemoryFormat) const", "at::Tensor::narrow(long, long, long) const",
                "at::cuda::getCurrentCUDABlasLtHandle()", "torch::Library::_def(c10::FunctionSchema&&, ...)"]  # fmt: skip
    assert find_torch_compute_symbols(metadata) is None


# What a TORCH_LIBRARY registration of a custom op (m.def with a schema string, m.impl) references, and so
# kp_module.cpp's registration of the KP_OP ops.
CUSTOM_OP_REGISTRATION = [
    "torch::CppFunction::CppFunction(c10::KernelFunction, std::optional<c10::impl::CppSignature>, "
    "std::unique_ptr<c10::FunctionSchema, std::default_delete<c10::FunctionSchema> >)",
    "torch::CppFunction::~CppFunction()",
    "torch::Library::_def(c10::FunctionSchema&&, c10::OperatorName*, std::vector<torch::headeronly::Tag, "
    "std::allocator<torch::headeronly::Tag> > const&, torch::_RegisterOrVerify) &",
    "torch::jit::parseSchema(std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> > const&, bool)",
    "torch::Library::Library(torch::Library::Kind, std::__cxx11::basic_string<char, std::char_traits<char>, "
    "std::allocator<char> >, std::optional<c10::DispatchKey>, char const*, unsigned int)",
    "torch::Library::_impl(char const*, torch::CppFunction&&, torch::_RegisterOrVerify) &",
]


def test_registering_a_custom_op_passes():
    assert find_torch_compute_symbols(CUSTOM_OP_REGISTRATION) is None


def test_an_operator_looked_up_by_name_fails_and_only_the_lookup_is_named():
    # What `c10::Dispatcher::singleton().findSchemaOrThrow("aten::relu", "").typed<...>().call(x)` references.
    finding = find_torch_compute_symbols([
        "at::RecordFunction::RecordFunction(at::StepCallbacks&&)", "at::getStepCallbacksUnlessEmpty(at::RecordScope)",
        "c10::Dispatcher::realSingleton()", "c10::Dispatcher::findSchemaOrThrow(char const*, char const*)",
        "c10::impl::OperatorEntry::assertSignatureIsCorrect(c10::impl::CppSignature const&, bool) const",
    ])  # fmt: skip
    assert finding is not None and "findSchemaOrThrow" in finding.message and "RecordFunction" not in finding.message


def test_at_most_eight_ops_are_named():
    ops = ["abs", "add_Tensor", "addmm", "bmm", "conv2d", "exp", "matmul", "mean", "mul_Tensor", "softmax_int"]
    finding = find_torch_compute_symbols([f"at::_ops::{op}::call()" for op in ops])
    assert finding is not None and "and 2 more" in finding.message
    assert "mul_Tensor" not in finding.message and "softmax_int" not in finding.message


def test_overloads_are_told_from_operators_of_their_own():
    # Every operator torch registers, as `at::_ops` names it: allowed exactly when its operator is in the table.
    torch = pytest.importorskip("torch")
    wrong = []
    for name in torch._C._dispatch_get_all_op_names():
        namespace, _, qualified = name.partition("::")
        if namespace != "aten":
            continue
        op, _, overload = qualified.partition(".")
        struct_name = f"{op}_{overload}" if overload else op
        if is_allowed_aten_op(struct_name) != (op in ALLOWED_ATEN_OPS):
            wrong.append(name)
    assert wrong == []


def test_calls_library_counts_entry_points_not_handles():
    assert calls_library(HONEST) == {"cuBLASLt", "cuDNN"}
    assert calls_library(["cublasLtCreate", "cublasLtMatmulDescCreate", "cudnnCreate"]) == set()
    assert calls_library(["cublasGemmEx@libcublas.so.13", "cublasSgemm_v2"]) == {"cuBLAS"}
    assert calls_library(["cudnnBackendExecute"]) == {"cuDNN"}


KERNELS_SEEN = ["nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "void at::native::vectorized_elementwise_kernel<4>()"]


def test_library_kernels_count_only_when_the_extension_calls_the_library():
    source = "// cublasLtMatmul( is only named here\n__global__ void scale_kernel(float* y) {}\n"
    assert library_kernels_called(KERNELS_SEEN, set()) == []
    assert library_kernels_called(KERNELS_SEEN, {"cuBLASLt"}) == KERNELS_SEEN[:1]
    finding = find_no_own_kernel(KERNELS_SEEN, source, set())
    assert finding is not None and finding.guard == "no-custom-kernel" and "nvjet" in finding.message
    assert find_no_own_kernel(KERNELS_SEEN, source, {"cuBLASLt"}) is None
    assert find_no_own_kernel(["void kp::scale_kernel<float>(float*)"], source, set()) is None


# What an H200 profiled for the built-in policy's bias-free transposed convolutions (KernelBench L1 68, 73, 75):
# cudnnConvolutionBackwardData launches cuDNN's legacy data-gradient kernels, whose names carry no library prefix.
TRANSPOSED_CONV_KERNELS = [["convolveNd_dgrad_float_engine", "setTensor5d_kernel"], ["dgrad_engine", "scaleTensor_kernel"]]


@pytest.mark.parametrize("kernels", TRANSPOSED_CONV_KERNELS, ids=["3d", "2d"])
def test_a_transposed_convolution_through_cudnn_is_the_workspaces_own_work(kernels):
    symbols = ["cudnnCreate", "cudnnGetConvolutionBackwardDataAlgorithm_v7", "cudnnConvolutionBackwardData"]
    assert calls_library(symbols) == {"cuDNN"}
    assert library_kernels_called(kernels, {"cuDNN"}) == kernels
    assert find_no_own_kernel(kernels, "", {"cuDNN"}) is None
    # Without the call in the extension they are someone else's (torch's own conv_transpose launches them too).
    assert find_no_own_kernel(kernels, "", set()) is not None
    assert calls_library(["cudnnGetConvolutionBackwardDataWorkspaceSize"]) == set()


@pytest.mark.parametrize("content", [b"not a library", b"\x7fELF\x02\x01\x01" + bytes(20)], ids=["text", "truncated"])
def test_a_file_that_is_no_readable_elf_is_refused(tmp_path, content):
    path = tmp_path / "kp_kernels.so"
    path.write_bytes(content)
    with pytest.raises(SymbolReadError):
        undefined_symbols(path)


# -------------------------------------------------------------------------------------- built bindings

ADVERSARIAL_KERNELS = REPO_ROOT / "tests" / "adversarial" / "candidates" / "kernels"
INFRASTRUCTURE = ("kp_registry.h", "kp_module.cpp", "kp_cuda.h")

BINDING_HEAD = """
#include <torch/types.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAGuard.h>

#include "kp_registry.h"

namespace {
"""

EXCLUDED_RELU = BINDING_HEAD + """
// Out of sight of a Python dispatch mode: torch computes, the recorder sees nothing.
torch::Tensor relu(const torch::Tensor& x) {
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::Python);
  return at::relu(x);
}
}  // namespace
KP_OP("relu(Tensor x) -> Tensor", relu);
"""

MATMULS = BINDING_HEAD + """
torch::Tensor product(const torch::Tensor& a, const torch::Tensor& b) { return torch::matmul(a, b); }
torch::Tensor mm(const torch::Tensor& a, const torch::Tensor& b) { return at::mm(a, b); }
}  // namespace
KP_OP("product(Tensor a, Tensor b) -> Tensor", product);
KP_OP("mm(Tensor a, Tensor b) -> Tensor", mm);
"""

LAUNCHER = """
#include <cublasLt.h>

#include <cstdint>

__global__ void copy_kernel(const float* x, float* y, int64_t n) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i];
}

int kp_product_launch(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const float* a, const float* b, float* c,
                      cublasLtMatrixLayout_t layout, cudaStream_t stream) {
  const float one = 1.0f, zero = 0.0f;
%s
  return 0;
}
"""
COMMENTED_CALL = LAUNCHER % """  // Would call cublasLtMatmul(handle, desc, &one, a, layout, b, layout, &zero, c, layout, c, layout, ...);
  copy_kernel<<<1, 32, 0, stream>>>(a, c, 32);"""
REAL_CALL = LAUNCHER % """  return cublasLtMatmul(handle, desc, &one, a, layout, b, layout, &zero, c, layout, c, layout, nullptr, nullptr, 0,
                        stream);"""


class BindingBuilds:
    """One folder with kernels/, built by the workspace build once per case: kp_module.cpp compiles once, and each
    case only adds its own files (removing the previous case's), so ninja recompiles just those."""

    def __init__(self, root: Path):
        self.root, self.symbols, self.libraries = root, {}, {}
        (root / "kernels").mkdir(parents=True)
        for name in INFRASTRUCTURE:
            shutil.copy(REPO_ROOT / "templates" / "kernels" / name, root / "kernels" / name)
        self.case_files: list[Path] = []

    def undefined(self, case: str, files: dict[str, str]) -> list[str]:
        if case not in self.symbols:
            self.libraries[case] = self._build(files)
            self.symbols[case] = undefined_symbols(self.libraries[case])
        return self.symbols[case]

    def _build(self, files: dict[str, str]) -> Path:
        from kernelpilot.build import build_workspace

        for path in self.case_files:
            path.unlink()
        self.case_files = [self.root / "kernels" / name for name in files]
        for path, text in zip(self.case_files, files.values()):
            path.write_text(text)
        result = build_workspace(self.root, arch="9.0")
        assert result.ok, result.log[-3000:]
        return Path(result.library)


@pytest.fixture(scope="session")
def builds(tmp_path_factory) -> BindingBuilds:
    return BindingBuilds(tmp_path_factory.mktemp("symbols_ws"))


def adversarial(*names: str) -> dict[str, str]:
    return {name: (ADVERSARIAL_KERNELS / name).read_text() for name in names}


@pytest.mark.cuda_build
def test_honest_relu_binding_passes_and_calls_no_library(builds):
    symbols = builds.undefined("honest", adversarial("relu.cu", "relu_binding.cpp"))
    assert any(qualified_name(s)[:3] == ("at", "_ops", "empty_like") for s in symbols)  # it did read torch's symbols
    assert any(qualified_name(s)[:3] == ("torch", "Library", "_def") for s in symbols)  # and kp_module.cpp's
    assert find_torch_compute_symbols(symbols) is None
    assert calls_library(symbols) == set()


@pytest.mark.cuda_build
def test_relu_called_with_the_python_key_excluded_fails(builds):
    finding = find_torch_compute_symbols(builds.undefined("excluded relu", {"excluded_binding.cpp": EXCLUDED_RELU}))
    assert finding is not None and "relu" in finding.message


@pytest.mark.cuda_build
def test_torch_matmul_and_at_mm_fail(builds):
    finding = find_torch_compute_symbols(builds.undefined("matmuls", {"products_binding.cpp": MATMULS}))
    assert finding is not None and "matmul" in finding.message and "mm" in finding.message


@pytest.mark.cuda_build
def test_a_comment_naming_cublaslt_is_no_call_and_a_real_call_is(builds):
    # The build links libcublasLt for sources that include its header; only the real call is an undefined symbol.
    commented = builds.undefined("commented call", {"product.cu": COMMENTED_CALL})
    real = builds.undefined("real call", {"product.cu": REAL_CALL})
    assert calls_library(commented) == set()
    assert calls_library(real) == {"cuBLASLt"}


@pytest.mark.cuda_build
@pytest.mark.parametrize("example, libraries", [("layernorm", set()), ("linear_bias_relu", {"cuBLASLt"})])
def test_policy_generated_bindings_pass(builds, example, libraries):
    from kernelpilot.policy.analysis import analyze
    from kernelpilot.policy.families import render_all
    from kernelpilot.problem import load_problem

    problem = load_problem(EXAMPLES / f"{example}.py")
    files = {
        Path(file.path).name: file.content
        for file in render_all(problem, analyze(problem))
        if Path(file.path).parent.name == "kernels"
    }
    symbols = builds.undefined(example, files)
    assert find_torch_compute_symbols(symbols) is None
    assert calls_library(symbols) == libraries


@pytest.mark.cuda_build
@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm to compare with")
def test_the_elf_reader_lists_what_nm_lists(builds):
    symbols = builds.undefined("honest", adversarial("relu.cu", "relu_binding.cpp"))
    listed = subprocess.run(["nm", "-D", "--undefined-only", str(builds.libraries["honest"])],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    mangled = {line.split()[-1].split("@")[0] for line in listed.splitlines() if line.strip()}
    assert len(mangled) == len(symbols) and {qualified_name(name) for name in mangled} == {
        qualified_name(name) for name in symbols
    }
