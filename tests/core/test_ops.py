"""A workspace's kernels as torch custom operators (kernelpilot.ops): namespaces, several libraries in one process,
the meta kernel torch.compile and opcheck use, the no-backward error, and what a .cu-only rebuild recompiles.

The cuda_build tests compile real workspaces without a GPU and load them into this process: a library links against
torch's CUDA libraries, which load without a device, and everything but a CUDA kernel (the registration, the meta
kernel, the Autograd kernel, a C++ stand-in op on CPU tensors) runs on the CPU. The gpu tests run the kernels.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from kernelpilot.build import build_workspace, load_extension
from kernelpilot.errors import WorkspaceError
from kernelpilot.harness.candidate import CandidateError, load_candidate, make_candidate_model
from kernelpilot.ops import OpsError, loaded_namespaces, workspace_ops
from kernelpilot.workspace import EXAMPLE_KERNELS, Workspace, init_workspace, new_namespace, open_workspace
from kp_testing import (
    EXAMPLE_KERNEL_CANDIDATE,
    scale_mul_binding,
    scale_mul_candidate,
    scale_problem,
    scale_shift_problem,
    write_problem,
)

ARCH = "9.0"
EXAMPLE_CU = "kernels/example_scale_shift.cu"

# An op whose schema declares an argument its function does not take.
MISMATCHED_BINDING = """
#include <torch/types.h>

#include "kp_registry.h"

namespace {

torch::Tensor add_one(const torch::Tensor& x) { return torch::empty_like(x); }

}  // namespace

KP_OP("add_one(Tensor x, float amount) -> Tensor", add_one);
"""


def _scale_shift_workspace(folder: Path) -> Workspace:
    """A workspace of y = 2x + 1 on a (64, 48) input, answered by the example kernel every new workspace holds."""
    ws, _ = init_workspace(write_problem(folder, scale_shift_problem(rows=64, columns=48)), folder / "ws")
    ws.model_new_path.write_text(EXAMPLE_KERNEL_CANDIDATE)
    return ws


def _built(ws: Workspace):
    result = build_workspace(ws.root, arch=ARCH)
    assert result.ok, result.log[-3000:]
    return result


# ------------------------------------------------------------------------------------------- namespaces


def test_a_namespace_is_an_identifier_made_of_the_problem_name_and_random_hex():
    assert re.fullmatch(r"kp_my_problem_2_[0-9a-f]{6}", new_namespace("My-Problem (2)"))
    assert re.fullmatch(r"kp_ws_[0-9a-f]{6}", new_namespace("---"))
    assert new_namespace("relu") != new_namespace("relu")


def test_two_workspaces_of_one_problem_get_namespaces_of_their_own_and_keep_them(tmp_path):
    problem = write_problem(tmp_path, scale_shift_problem(rows=4, columns=4), name="scale_shift.py")
    first, _ = init_workspace(problem, tmp_path / "first")
    second, _ = init_workspace(problem, tmp_path / "second")

    assert re.fullmatch(r"kp_scale_shift_[0-9a-f]{6}", first.namespace)
    assert first.namespace != second.namespace
    init_workspace(problem, tmp_path / "first")  # init again: the manifest is rewritten, the namespace kept
    assert open_workspace(tmp_path / "first").namespace == first.namespace


def test_a_folder_without_a_manifest_gets_a_namespace_from_its_path(tmp_path):
    namespace = Workspace(tmp_path / "Some Kernels").namespace

    assert re.fullmatch(r"kp_some_kernels_[0-9a-f]{6}", namespace)
    assert Workspace(tmp_path / "Some Kernels").namespace == namespace
    assert Workspace(tmp_path / "elsewhere" / "Some Kernels").namespace != namespace


def test_a_manifest_whose_namespace_is_no_identifier_is_refused(tmp_path):
    ws, _ = init_workspace(write_problem(tmp_path, scale_shift_problem(rows=4, columns=4)), tmp_path / "ws")
    manifest = json.loads(ws.manifest_path.read_text())
    ws.manifest_path.write_text(json.dumps({**manifest, "namespace": "kp-scale shift"}))

    with pytest.raises(WorkspaceError, match="is not a version-2 kernelpilot manifest"):
        open_workspace(ws.root)


def test_model_new_of_a_workspace_never_built_is_one_error_with_a_hint(tmp_path):
    ws = _scale_shift_workspace(tmp_path)

    with pytest.raises(OpsError) as raised:
        workspace_ops(ws.model_new_path)
    assert str(raised.value) == (
        f"No build of the workspace {ws.root} is loaded or built, so model_new.py has no kernels to call."
    )
    assert raised.value.hint == f"build it first: kernelpilot build {ws.root}"


# ------------------------------------------------------------------------- the example kernel's ops (cuda_build)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The scale-shift workspace and its first build (compile-only: the CUDA kernel never runs here)."""
    ws = _scale_shift_workspace(tmp_path_factory.mktemp("example"))
    return ws, _built(ws)


@pytest.mark.cuda_build
def test_a_built_workspace_registers_its_ops_under_its_namespace_with_a_meta_kernel(example):
    ws, result = example
    kp_ops = load_extension(result)

    assert kp_ops is getattr(torch.ops, ws.namespace) and ws.namespace in loaded_namespaces()
    schema = f"{ws.namespace}::scale_shift(Tensor x, float a, float b) -> Tensor"
    assert str(kp_ops.scale_shift.default._schema) == schema
    y = kp_ops.scale_shift(torch.empty(64, 48, device="meta"), 2.0, 1.0)
    assert (y.device.type, tuple(y.shape), y.dtype) == ("meta", (64, 48), torch.float32)
    with pytest.raises(RuntimeError, match="scale_shift: x must be a CUDA tensor, got one on cpu"):
        kp_ops.scale_shift(torch.randn(4), 2.0, 1.0)  # the binding's own check, not a missing-kernel error


@pytest.mark.parametrize(
    "device", [pytest.param("meta", marks=pytest.mark.cuda_build), pytest.param("cuda", marks=pytest.mark.gpu)]
)
def test_opcheck_passes_on_the_example_op(example, device):
    """On meta tensors (the meta kernel, no GPU needed) and, on a GPU, on CUDA tensors (the kernel itself)."""
    kp_ops = load_extension(example[1])

    report = torch.library.opcheck(kp_ops.scale_shift.default, (torch.randn(64, 48, device=device), 2.0, 1.0))

    assert set(report.values()) == {"SUCCESS"} and len(report) == 4, report


def _model_new_and_input(example, device: str):
    """The example's ModelNew on `device`, and its problem's input there."""
    ws, result = example
    problem = ws.problem()
    model = make_candidate_model(problem, load_candidate(ws, result), device)
    (x,) = problem.make_inputs(device)
    return model, x


@pytest.mark.cuda_build
def test_torch_compile_traces_model_new_through_its_ops_with_no_graph_break(example):
    model, x = _model_new_and_input(example, "meta")

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break is an error
    with torch.no_grad():
        y = compiled(x)

    assert (y.device.type, tuple(y.shape), y.dtype) == ("meta", (64, 48), torch.float32)


@pytest.mark.cuda_build
def test_an_op_called_where_grad_is_required_raises_one_clear_error(example):
    ws, result = example
    kp_ops = load_extension(result)
    x = torch.empty(64, 48, device="meta", requires_grad=True)

    with pytest.raises(RuntimeError) as raised:
        kp_ops.scale_shift(x, 2.0, 1.0)
    assert str(raised.value).splitlines()[0] == (
        f"kp op {ws.namespace}::scale_shift has no backward yet; call it under torch.no_grad() or on tensors that do "
        "not require grad"
    )
    with torch.no_grad():
        assert not kp_ops.scale_shift(x, 2.0, 1.0).requires_grad
    assert not kp_ops.scale_shift(x.detach(), 2.0, 1.0).requires_grad


@pytest.mark.cuda_build
def test_two_workspaces_load_in_one_process_under_their_own_namespaces(example, tmp_path):
    ws, result = example
    other = _scale_shift_workspace(tmp_path)
    # The other workspace's own build would compile the same sources: a copy of the library is a second library.
    library = other.build_dir / "versions" / "0123456789abcdef" / "kp_kernels.so"
    library.parent.mkdir(parents=True)
    shutil.copyfile(result.library, library)
    builds = [result, dataclasses.replace(result, workspace=str(other.root), library=str(library))]

    for workspace, build in zip((ws, other), builds):
        model_cls = load_candidate(workspace, build)
        assert sys.modules[model_cls.__module__].kp_ops is getattr(torch.ops, workspace.namespace)
        model = make_candidate_model(workspace.problem(), model_cls, "meta")
        with torch.no_grad():
            assert tuple(model(torch.empty(64, 48, device="meta")).shape) == (64, 48)
    assert ws.namespace != other.namespace and {ws.namespace, other.namespace} <= loaded_namespaces()


@pytest.mark.cuda_build
def test_a_cu_only_rebuild_recompiles_no_registration_and_loads_beside_the_first_build(example):
    ws, first = example
    first_ops = load_extension(first)
    cu = ws.root / EXAMPLE_CU
    original = cu.read_text()
    cu.write_text(original.replace("constexpr int kBlocksPerSm = 4;", "constexpr int kBlocksPerSm = 5;"))
    try:
        second = _built(ws)
    finally:
        cu.write_text(original)

    # ninja's own log: one compile (the .cu), one link; kp_module.cpp and the binding are not rebuilt.
    steps = re.findall(r"^\[kp \d+/\d+\] (.+)$", second.log, re.MULTILINE)
    assert steps == [f"compile {EXAMPLE_CU}", "link kp_kernels.so"] and second.compiled == [EXAMPLE_CU]
    second_ops = load_extension(second)
    assert second_ops is getattr(torch.ops, f"{ws.namespace}_2")  # the first build's namespace is taken
    assert workspace_ops(ws.model_new_path) is second_ops  # the last build loaded is what model_new.py reaches
    assert load_extension(first) is first_ops and workspace_ops(ws.model_new_path) is first_ops
    assert first_ops.scale_shift.default is not second_ops.scale_shift.default


# ------------------------------------------------------------------- a C++ op on CPU tensors (cuda_build)


@pytest.fixture(scope="module")
def cpu_op(tmp_path_factory):
    """A workspace whose op (scale_mul) is plain C++ on CPU tensors, so this machine runs it; built once."""
    folder = tmp_path_factory.mktemp("cpu_op")
    ws, _ = init_workspace(write_problem(folder, scale_problem(rows=8, features=16)), folder / "ws")
    for example in EXAMPLE_KERNELS:
        (ws.root / example).unlink()
    (ws.kernels_dir / "scale_mul_binding.cpp").write_text(scale_mul_binding())
    ws.model_new_path.write_text(scale_mul_candidate(features=16))
    return ws, _built(ws)


@pytest.mark.cuda_build
def test_opcheck_passes_on_an_op_that_runs_and_compiled_model_new_matches_eager(cpu_op):
    ws, result = cpu_op
    kp_ops = load_extension(result)
    x, scale = torch.randn(8, 16), torch.randn(16)

    report = torch.library.opcheck(kp_ops.scale_mul.default, (x, scale))
    assert set(report.values()) == {"SUCCESS"}, report

    problem = ws.problem()
    model = make_candidate_model(problem, load_candidate(ws, result), "cpu")
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(eager, x * model.scale.detach())  # the weights it adopted from Model


@pytest.mark.cuda_build
def test_a_schema_that_does_not_fit_its_function_fails_the_load_in_one_sentence(cpu_op):
    ws, _ = cpu_op
    mismatched = ws.kernels_dir / "mismatched_binding.cpp"
    mismatched.write_text(MISMATCHED_BINDING)
    try:
        result = _built(ws)
    finally:
        mismatched.unlink()

    with pytest.raises(CandidateError) as raised:
        load_candidate(ws, result)
    message = raised.value.message
    prefix = "the built extension could not be loaded: The ops of kp_kernels.so could not be registered as torch.ops."
    assert re.match(rf"{re.escape(prefix + ws.namespace)}(_\d+)?: ", message), message
    assert "add_one" in message and "\n" not in message
    assert "KP_OP's schema" in raised.value.hint


@pytest.mark.cuda_build
def test_a_library_built_without_kp_module_is_refused_with_a_hint(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "module.cpp").write_text('extern "C" int kp_version() { return 1; }\n')
    result = _built(Workspace(tmp_path))

    with pytest.raises(OpsError, match="has no kp_register_ops: it was not built with this kernelpilot's") as raised:
        load_extension(result)
    assert "KP_OP" in raised.value.hint


# ------------------------------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
def test_gpu_compiled_model_new_matches_eager(example):
    model, x = _model_new_and_input(example, "cuda")

    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)(x)  # inductor, the default backend

    torch.testing.assert_close(eager, x * 2.0 + 1.0)
    torch.testing.assert_close(compiled, eager)


@pytest.mark.gpu
def test_gpu_two_workspaces_loaded_in_one_process_both_run(example, tmp_path):
    ws, result = example
    other = _scale_shift_workspace(tmp_path)
    cu = other.root / EXAMPLE_CU
    cu.write_text(cu.read_text().replace("vector_count, a, b);", "vector_count, a, b + 1.0f);"))  # y = 2x + 2 here
    models = [
        make_candidate_model(workspace.problem(), load_candidate(workspace, build), "cuda")
        for workspace, build in ((ws, result), (other, _built(other)))
    ]
    x = torch.randn(64, 48, device="cuda")

    with torch.no_grad():
        first, second = (model(x) for model in models)

    torch.testing.assert_close(first, x * 2.0 + 1.0)
    torch.testing.assert_close(second, x * 2.0 + 2.0)
