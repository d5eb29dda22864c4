"""verify_candidate's anti-cheat guards on CPU tensors: torch compute in forward (inside the workspace's own ops
too), outputs aliasing or cached, inputs written, monkeypatched timing and sync, changed protected files, precision
drops; and the guards on plain values (unsynced outputs and side streams, the workspace's own kernels and torch's,
memory overlap, patches made before the snapshot).

A CPU stand-in for a custom kernel (verify_testing.py): ModelNew allocates its output with torch (allowed) and
computes it by reading and writing the tensors' memory through ctypes, outside torch's dispatcher, as a CUDA kernel
would.
"""

from __future__ import annotations

import ctypes
import math
import struct
import textwrap
import time

import pytest
import torch
from torch import nn

from kernelpilot.harness import guards
from kernelpilot.harness.sandbox_client import InProcessModel
from kernelpilot.harness.verify import verify_candidate

from verify_testing import RELU_PROBLEM, HonestRelu, guard_names, memory, raw_relu, verify, write_problem


# ------------------------------------------------------------------------------------------ guards


def test_torch_ops_in_forward_fail_torch_compute(relu_problem):
    class TorchRelu(nn.Module):
        def forward(self, x):
            return torch.relu(x)

    result = verify(relu_problem, TorchRelu)

    assert not result.ok and result.error_kind == "guard"
    assert guard_names(result) == ["torch-compute"]
    assert "aten::relu x1" in result.guards[0].message
    assert result.trials[0].max_abs_error == 0.0  # the numbers are still reported


def test_allocation_views_and_metadata_are_not_torch_compute():
    x = torch.randn(4, 8)
    with guards.AtenOpRecorder() as recorder:
        out = torch.empty_like(x).zero_()
        out.view(32).unsqueeze(0).t()
        x.reshape(2, 16).transpose(0, 1)
        torch.zeros(3), torch.full((2,), 1.0), x[1:3].select(0, 0)
    assert guards.find_torch_compute(recorder.counts) is None

    with guards.AtenOpRecorder() as recorder:
        x.t().contiguous()  # a real copy
        x.sum().item()
    finding = guards.find_torch_compute(recorder.counts)
    assert finding is not None and "aten::clone" in finding.message and "aten::_local_scalar_dense" in finding.message


@pytest.fixture(scope="module")
def workspace_op():
    """A custom op standing in for a workspace's kernel, in a namespace of its own: its CPU kernel calls torch
    compute (aten::relu) and allocates (aten::empty_like)."""
    library = torch.library.Library("kp_recorder_test", "DEF")
    library.define("relu(Tensor x) -> Tensor")

    def relu(x):
        y = torch.empty_like(x)
        y.copy_(torch.relu(x))
        return y

    library.impl("relu", relu, "CPU")
    yield torch.ops.kp_recorder_test.relu
    library._destroy()


def test_the_recorder_sees_into_the_workspaces_own_ops(workspace_op):
    x = torch.randn(8)
    with torch.no_grad(), guards.AtenOpRecorder(own_namespaces={"kp_recorder_test"}) as recorder:
        y = workspace_op(x)
    torch.testing.assert_close(y, torch.relu(x))
    assert recorder.own_calls == {"kp_recorder_test::relu": 1}
    assert {"aten::empty_like", "aten::relu", "aten::copy_"} <= set(recorder.counts)
    assert "kp_recorder_test::relu" not in recorder.counts
    finding = guards.find_torch_compute(recorder.counts)
    assert finding is not None and "aten::relu x1" in finding.message  # the op's own torch compute, found inside it


def test_an_op_of_another_namespace_is_torch_compute(workspace_op):
    x = torch.randn(8)
    with torch.no_grad(), guards.AtenOpRecorder(own_namespaces={"kp_some_workspace"}) as recorder:
        workspace_op(x)
    assert recorder.counts == {"kp_recorder_test::relu": 1} and not recorder.own_calls
    assert "kp_recorder_test::relu x1" in guards.find_torch_compute(recorder.counts).message


def test_output_aliasing_an_input_fails(relu_problem):
    class ReturnsInput(nn.Module):
        def forward(self, x):
            raw_relu(x, x)
            return x

    result = verify(relu_problem, ReturnsInput)

    assert "output-aliases-input" in guard_names(result)
    assert "input-mutated" in guard_names(result)
    assert result.error_kind == "guard"


def test_view_of_input_is_fine_when_the_reference_returns_one_too(tmp_path):
    problem = write_problem(tmp_path, RELU_PROBLEM.replace("torch.relu(x)", "x.view(-1)"))

    class Flatten(nn.Module):
        def forward(self, x):
            return x.view(-1)

    result = verify(problem, Flatten)
    assert result.ok, result.message


def test_writing_into_an_input_fails(relu_problem):
    class ScribblesOnInput(nn.Module):
        def forward(self, x):
            out = raw_relu(x, torch.empty_like(x))
            memory(x)[0] = 123.0
            return out

    result = verify(relu_problem, ScribblesOnInput)

    assert guard_names(result) == ["input-mutated"]
    assert "inputs[0]" in result.guards[0].message


def test_an_output_held_by_the_module_fails_cached_output(relu_problem):
    class KeepsBuffer(nn.Module):
        def forward(self, x):
            if not hasattr(self, "buffer"):
                self.buffer = torch.empty_like(x)
            return raw_relu(x, self.buffer)

    result = verify(relu_problem, KeepsBuffer)

    assert guard_names(result) == ["cached-output"]
    assert "self.buffer" in result.guards[0].message


def test_returning_the_same_storage_again_fails_cached_output(relu_problem):
    cache = []

    class ComputesOnce(nn.Module):
        def forward(self, x):
            if not cache:
                cache.append(raw_relu(x, torch.empty_like(x)))
            return cache[0]

    result = verify(relu_problem, ComputesOnce)

    assert "cached-output" in guard_names(result)
    assert "previous call's memory" in next(f.message for f in result.guards if f.guard == "cached-output")
    assert result.trials[0].ok and not result.trials[1].ok


def test_copying_out_precomputed_values_fails_cached_output(relu_problem):
    cache = []

    class CopiesCache(nn.Module):
        def forward(self, x):
            if not cache:
                cache.append(list(raw_relu(x, torch.empty_like(x)).tolist()))
            out = torch.empty_like(x)
            memory(out)[:] = [v for row in cache[0] for v in row]
            return out

    result = verify(relu_problem, CopiesCache)

    finding = next(f for f in result.guards if f.guard == "cached-output")
    assert "exactly the previous call's values" in finding.message


def test_monkeypatched_synchronize_is_reported_and_restored(relu_problem):
    original = torch.cuda.synchronize

    class PatchesSync(HonestRelu):
        def forward(self, x):
            torch.cuda.synchronize = lambda *args, **kwargs: None
            return super().forward(x)

    result = verify(relu_problem, PatchesSync)

    assert guard_names(result) == ["monkeypatch"]
    assert "torch.cuda.synchronize" in result.guards[0].message and "after forward" in result.guards[0].message
    assert torch.cuda.synchronize is original


def test_monkeypatch_at_import_time_is_seen_before_the_first_trial(relu_problem):
    original = time.perf_counter
    time.perf_counter = lambda: 0.0  # as a model_new.py could do at its top level
    try:

        class ImportedWhilePatched(HonestRelu):
            pass

        result = verify(relu_problem, ImportedWhilePatched)
    finally:
        time.perf_counter = original

    assert guard_names(result) == ["monkeypatch"]
    assert "time.perf_counter" in result.guards[0].message and "imported" in result.guards[0].message


def test_monkeypatched_event_elapsed_time_is_reported(relu_problem):
    original = torch.cuda.Event.elapsed_time

    class PatchesEvent(HonestRelu):
        def forward(self, x):
            torch.cuda.Event.elapsed_time = lambda self, end: 0.001
            return super().forward(x)

    result = verify(relu_problem, PatchesEvent)

    assert "torch.cuda.Event.elapsed_time" in result.guards[0].message
    assert torch.cuda.Event.elapsed_time is original


def test_an_owner_replaced_by_an_object_that_raises_is_still_a_monkeypatch_finding(relu_problem, monkeypatch):
    original = torch.cuda.Event
    monkeypatch.setattr(torch.cuda, "Event", original)  # put back after the test even if the guard does not

    class Hostile:
        def __getattr__(self, name):
            raise ValueError(f"no {name} here")

    class ReplacesEvent(HonestRelu):
        def forward(self, x):
            torch.cuda.Event = Hostile()  # looking up torch.cuda.Event.record now raises ValueError
            return super().forward(x)

    result = verify(relu_problem, ReplacesEvent)

    assert result.error_kind == "guard" and guard_names(result) == ["monkeypatch"]
    assert "torch.cuda.Event" in result.guards[0].message
    assert torch.cuda.Event is original


def test_changed_protected_file_fails(tmp_path):
    from kernelpilot.workspace import init_workspace

    problem_path = tmp_path / "relu.py"
    problem_path.write_text(textwrap.dedent(RELU_PROBLEM))
    ws, _ = init_workspace(problem_path, tmp_path / "ws")
    ws.model_path.write_text(ws.model_path.read_text() + "\n# the reference now does less\n")

    result = verify(ws.problem(), HonestRelu, workspace=ws.root)

    assert guard_names(result) == ["protected-files"]
    assert "model.py" in result.guards[0].message


def test_bf16_rounded_output_of_an_fp32_problem_is_a_precision_warning(relu_problem):
    def to_bf16(value: float) -> float:
        bits = struct.unpack("<I", struct.pack("<f", value))[0]
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round to nearest even
        return struct.unpack("<f", struct.pack("<I", bits))[0]

    class Bf16Relu(nn.Module):
        def forward(self, x):
            out = torch.empty_like(x)
            memory(out)[:] = [to_bf16(v) if v > 0 else 0.0 for v in memory(x)]
            return out

    result = verify(relu_problem, Bf16Relu)

    assert result.ok, result.message  # within tolerance: a warning, not a failure
    assert guard_names(result) == ["precision-drop"] and result.guards[0].severity == "warn"
    assert "rounded to bf16" in result.guards[0].message and "warnings: precision-drop" in result.message


def test_precision_check_pairs_each_fp32_output_with_its_own_fp64_reference(tmp_path):
    # A bf16 output between fp32 ones has no precision check; the outputs after it must still be matched with
    # their own fp64 values, not their neighbour's (here (2, 3) against (3, 5) would not even broadcast).
    problem = write_problem(
        tmp_path,
        """
        import torch
        from torch import nn

        class Model(nn.Module):
            def forward(self, x, h, y):
                return torch.relu(x), torch.relu(h), torch.relu(y)

        def get_inputs():
            return [torch.randn(4, 8), torch.randn(3, 5, dtype=torch.bfloat16), torch.randn(2, 3)]

        def get_init_inputs():
            return []
        """,
    )

    class HonestMixedRelu(nn.Module):
        def forward(self, x, h, y):
            out_h, bf16_array = torch.empty_like(h), ctypes.c_uint16 * h.numel()
            # A set sign bit is a negative bf16.
            bf16_array.from_address(out_h.data_ptr())[:] = [
                0 if bits & 0x8000 else bits for bits in bf16_array.from_address(h.data_ptr())
            ]
            return raw_relu(x, torch.empty_like(x)), out_h, raw_relu(y, torch.empty_like(y))

    result = verify(problem, HonestMixedRelu)

    assert result.ok, result.message
    assert result.guards == []


def test_precision_guard_is_quiet_for_fp32_accurate_results():
    exact = torch.randn(1000, dtype=torch.float64)
    reference = exact.float()
    one_ulp_off = torch.nextafter(reference, torch.full_like(reference, math.inf))
    assert guards.find_precision_drop(one_ulp_off, reference, exact) is None


# ------------------------------------------------------------------------------- guards on plain values


def test_unsynced_output_is_seen_when_values_change_after_return():
    early = [("out", torch.tensor([math.nan, 1.0]))]
    late = [("out", torch.tensor([2.0, 1.0]))]
    finding = guards.find_unsynced_output(early, late)

    assert finding is not None and finding.guard == "unsynced-stream"
    assert guards.find_unsynced_output(late, [("out", late[0][1].clone())]) is None


def test_side_stream_kernels_without_a_sync_fail():
    launches = [guards.KernelLaunch("void relu_kernel(float const*, float*, long)", stream=13)]
    unsynced = guards.ProfiledForward(kernels=launches, current_stream=7, synchronized=False)
    joined = guards.ProfiledForward(kernels=launches, current_stream=7, synchronized=True)

    finding = guards.find_unsynced_side_stream(unsynced)
    assert finding is not None and "relu_kernel" in finding.message
    assert guards.find_unsynced_side_stream(joined) is None


def test_custom_kernel_is_recognised_by_its_name_in_the_workspace_sources():
    source = "__global__ void relu_kernel(const float* x, float* y, int64_t n) {}"
    ours = "void (anonymous namespace)::relu_kernel<float>(float const*, float*, long)"
    torchs = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int)"

    assert guards.find_no_custom_kernel([torchs, ours], source) is None
    assert guards.find_no_custom_kernel([torchs], source).guard == "no-custom-kernel"
    assert guards.find_no_custom_kernel(["sm90_xmma_gemm_f32f32_tf32f32_nn"], None) is not None
    assert guards.find_no_custom_kernel(["my_fused_kernel"], None) is None


def test_library_kernels_count_as_the_workspaces_own_when_its_sources_call_the_library():
    gemm = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_relu_TNT"
    calls_cublaslt = "KP_CUBLAS_CHECK(cublasLtMatmul(plan.handle, plan.operation, &alpha, a, plan.a));"
    torchs = "void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float> >(int)"

    assert guards.find_no_custom_kernel([gemm], calls_cublaslt) is None
    assert guards.find_no_custom_kernel([gemm], "__global__ void relu_kernel() {}") is not None
    assert guards.find_no_custom_kernel([torchs], calls_cublaslt) is not None


def test_torch_kernels_other_than_fills_are_torch_compute_but_cublas_is_allowed():
    fill = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int)"
    softmax = "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*, float const*, int)"
    cublas_gemm = "sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_kernel"

    assert guards.find_torch_kernels([fill, cublas_gemm]) is None
    finding = guards.find_torch_kernels([fill, softmax, softmax])
    assert finding is not None and "cunn_SoftMaxForward x2" in finding.message


def test_memory_overlap_sees_views_and_slices_but_not_copies():
    x = torch.randn(8)
    assert guards.shares_memory(x[2:4], x) and guards.shares_memory(x.view(2, 4), x)
    assert not guards.shares_memory(x.clone(), x)
    assert not guards.shares_memory(torch.empty(0), x)


def test_a_patch_made_when_the_candidate_was_loaded_is_reported(relu_problem):
    original = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *args: None
    try:

        class ImportedWhilePatched(HonestRelu):
            pass

        model = InProcessModel.from_class(relu_problem, ImportedWhilePatched, device="cpu", seed=0)
    finally:
        torch.cuda.synchronize = original
    result = verify_candidate(relu_problem, model, device="cpu", base_seed=0)

    assert guard_names(result) == ["monkeypatch"]
    assert torch.cuda.synchronize is original


def test_a_replacement_made_before_the_snapshot_is_still_seen():
    original = time.perf_counter
    fake = lambda: 0.0  # noqa: E731
    time.perf_counter = fake
    try:
        finding = guards.find_monkeypatches({("time", "perf_counter"): fake}, when="now")
    finally:
        time.perf_counter = original
    assert finding is not None and "time.perf_counter" in finding.message
