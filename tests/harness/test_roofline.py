"""The roofline: floor time, FLOPs and bytes of small known problems, the matmul rate per dtype, the caches."""

from __future__ import annotations

import contextlib
import textwrap

import pytest

from kernelpilot.harness import roofline
from kernelpilot.harness.roofline import (
    REAL_RUN_MAX_BYTES,
    count_cost,
    effective_rate,
    floor_time,
    matmul_rate,
    measure_ceilings,
    problem_cost,
    problem_roofline,
)
from kernelpilot.problem import load_problem

CEILINGS = {
    "gpu": "test GPU",
    "bandwidth_gbs": 2000.0,
    "matmul_tflops": {"bfloat16": 600.0, "float16": 620.0, "tf32": 300.0, "float32": 50.0},
}


def write_problem(tmp_path, body: str, name: str = "problem"):
    path = tmp_path / f"{name}.py"
    path.write_text("import torch\nimport torch.nn as nn\n\n" + textwrap.dedent(body))
    return load_problem(path)


MATMUL = """
    M, K, N = 64, 48, 32

    class Model(nn.Module):
        def forward(self, a, b):
            return a @ b

    def get_inputs():
        return [torch.randn(M, K), torch.randn(K, N)]

    def get_init_inputs():
        return []
"""

RELU = """
    class Model(nn.Module):
        def forward(self, x):
            return torch.relu(x)

    def get_inputs():
        return [torch.randn(128, 256)]

    def get_init_inputs():
        return []
"""


# ----------------------------------------------------------------------------------------- floor time


def test_floor_time_memory_bound():
    ms, bound = floor_time(flops=0, bytes=3e9, bandwidth_gbs=3000, tflops=500)
    assert bound == "memory"
    assert ms == pytest.approx(1.0)


def test_floor_time_compute_bound():
    ms, bound = floor_time(flops=1e12, bytes=3e6, bandwidth_gbs=3000, tflops=500)
    assert bound == "compute"
    assert ms == pytest.approx(2.0)


def test_floor_time_tie_is_memory_bound():
    assert floor_time(flops=1e9, bytes=2e6, bandwidth_gbs=2000, tflops=1000) == pytest.approx((1e-3, "memory"))


@pytest.mark.parametrize(("bandwidth", "tflops"), [(0, 100), (100, 0), (-1, 100)])
def test_floor_time_rejects_nonpositive_ceilings(bandwidth, tflops):
    with pytest.raises(ValueError, match="positive"):
        floor_time(flops=1, bytes=1, bandwidth_gbs=bandwidth, tflops=tflops)


# --------------------------------------------------------------------------------------- problem cost


def test_matmul_cost_is_2mnk_flops_and_operands_plus_result_bytes(tmp_path):
    cost = count_cost(write_problem(tmp_path, MATMUL), device="cpu")
    m, k, n = 64, 48, 32
    assert cost.flops == 2 * m * n * k
    assert cost.bytes == 4 * (m * k + k * n + m * n)
    assert (cost.dtype, cost.counted_on) == ("float32", "meta")


def test_elementwise_cost_is_input_plus_output_bytes_and_no_flops(tmp_path):
    cost = count_cost(write_problem(tmp_path, RELU), device="cpu")
    assert cost.flops == 0
    assert cost.bytes == 2 * 4 * 128 * 256


def test_parameters_used_twice_are_counted_once(tmp_path):
    problem = write_problem(
        tmp_path,
        """
        class Model(nn.Module):
            def __init__(self, width):
                super().__init__()
                self.fc = nn.Linear(width, width)

            def forward(self, x):
                return self.fc(self.fc(x))

        def get_inputs():
            return [torch.randn(16, 64)]

        def get_init_inputs():
            return [64]
        """,
    )
    cost = count_cost(problem, device="cpu")
    activations = 2 * 16 * 64
    parameters = 64 * 64 + 64
    assert cost.bytes == 4 * (activations + parameters)
    assert cost.flops == 2 * (2 * 16 * 64 * 64)


def test_bf16_inputs_give_the_bf16_dtype(tmp_path):
    problem = write_problem(tmp_path, RELU.replace("torch.randn(128, 256)", "torch.randn(128, 256, dtype=torch.bfloat16)"))
    cost = count_cost(problem, device="cpu")
    assert cost.dtype == "bfloat16"
    assert cost.bytes == 2 * 2 * 128 * 256


DATA_DEPENDENT = """
    class Model(nn.Module):
        def forward(self, x):
            return x[x > 0]

    def get_inputs():
        return [torch.randn(SHAPE)]

    def get_init_inputs():
        return []
"""


def test_a_problem_with_no_meta_kernel_is_counted_on_the_real_device(tmp_path):
    problem = write_problem(tmp_path, "SHAPE = (64, 32)\n" + textwrap.dedent(DATA_DEPENDENT))
    cost = count_cost(problem, device="cpu")
    assert cost.counted_on == "cpu"
    assert cost.bytes > 4 * 64 * 32  # the input plus however many elements were positive


def test_a_large_problem_with_no_meta_kernel_is_not_run_for_real(tmp_path):
    elements = REAL_RUN_MAX_BYTES // 4 + 1
    problem = write_problem(tmp_path, f"SHAPE = ({elements},)\n" + textwrap.dedent(DATA_DEPENDENT))
    with pytest.raises(RuntimeError, match="too large to count on cpu"):
        count_cost(problem, device="cpu")


# --------------------------------------------------------------------------------------- matmul rate


@pytest.mark.parametrize(
    ("dtype", "tf32", "expected"),
    [("bfloat16", False, 600.0), ("float16", False, 620.0), ("float32", False, 50.0), ("float32", True, 300.0),
     ("float64", True, 50.0), ("", False, 50.0)],
)
def test_matmul_rate_matches_the_dtype(dtype, tf32, expected):
    assert matmul_rate(CEILINGS, dtype, tf32=tf32) == expected


@contextlib.contextmanager
def tf32_allowed(*, matmul: bool, cudnn: bool):
    """Set torch's two tf32 switches for a block (computed attributes: monkeypatch cannot restore them)."""
    import torch

    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@pytest.mark.parametrize(("allowed", "expected"), [(True, 300.0), (False, 50.0)])
def test_matmul_rate_follows_torch_tf32_setting(allowed, expected):
    with tf32_allowed(matmul=allowed, cudnn=False):
        assert matmul_rate(CEILINGS, "float32") == expected


CONV_THEN_LINEAR = """
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(self.conv(x).permute(0, 2, 3, 1))

    def get_inputs():
        return [torch.randn(2, 3, 16, 16)]

    def get_init_inputs():
        return []
"""


def test_convolution_flops_are_counted_apart(tmp_path):
    cost = count_cost(write_problem(tmp_path, CONV_THEN_LINEAR), device="cpu")
    out_pixels = 2 * 14 * 14
    assert cost.conv_flops == 2 * out_pixels * 8 * (3 * 3 * 3)
    assert cost.flops - cost.conv_flops == 2 * out_pixels * 8 * 8


def test_fp32_convolutions_run_at_cudnn_precision_and_matmuls_at_cublas_precision(tmp_path):
    cost = count_cost(write_problem(tmp_path, CONV_THEN_LINEAR), device="cpu")
    with tf32_allowed(matmul=False, cudnn=True):  # torch's defaults
        rate = effective_rate(CEILINGS, cost)
    expected_seconds = cost.conv_flops / 300.0 + (cost.flops - cost.conv_flops) / 50.0
    assert rate == pytest.approx(cost.flops / expected_seconds)
    with tf32_allowed(matmul=True, cudnn=True):
        assert effective_rate(CEILINGS, cost) == pytest.approx(300.0)


# ------------------------------------------------------------------------------------------ roofline


def test_problem_roofline_with_explicit_ceilings(tmp_path):
    problem = write_problem(tmp_path, MATMUL)
    with tf32_allowed(matmul=False, cudnn=True):
        result = problem_roofline(problem, device="cpu", cache_dir=tmp_path / "cache", ceilings=CEILINGS)
    expected_ms, expected_bound = floor_time(result.flops, result.bytes, 2000.0, 50.0)
    assert (result.floor_ms, result.bound) == (pytest.approx(expected_ms), expected_bound)
    assert (result.bandwidth_gbs, result.matmul_tflops) == (2000.0, 50.0)


def test_problem_roofline_off_the_gpu_needs_ceilings(tmp_path):
    with pytest.raises(ValueError, match="ceilings"):
        problem_roofline(write_problem(tmp_path, RELU), device="cpu", cache_dir=tmp_path / "cache")


def test_measure_ceilings_refuses_a_cpu():
    with pytest.raises(ValueError, match="CUDA"):
        measure_ceilings("cpu")


def test_problem_cost_is_cached_per_problem(tmp_path, monkeypatch):
    problem = write_problem(tmp_path, MATMUL)
    first = problem_cost(problem, device="cpu", cache_dir=tmp_path / "cache")

    def must_not_recount(*args, **kwargs):
        raise AssertionError("the cost was counted again despite the cache")

    monkeypatch.setattr(roofline, "count_cost", must_not_recount)
    assert problem_cost(problem, device="cpu", cache_dir=tmp_path / "cache") == first
    changed = write_problem(tmp_path, MATMUL.replace("64, 48, 32", "64, 48, 16"), name="other")
    with pytest.raises(AssertionError, match="counted again"):
        problem_cost(changed, device="cpu", cache_dir=tmp_path / "cache")


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_measured_ceilings_are_plausible_for_a_datacenter_gpu(tmp_path):
    ceilings = roofline.gpu_ceilings("cuda", cache_dir=tmp_path)
    rates = ceilings["matmul_tflops"]
    assert 1000 < ceilings["bandwidth_gbs"] < 6000
    assert rates["bfloat16"] > rates["tf32"] > rates["float32"] > 5
    assert roofline.gpu_ceilings("cuda", cache_dir=tmp_path) == ceilings  # the second call reads the cache


@pytest.mark.gpu
def test_an_example_problem_has_a_roofline_on_the_gpu(tmp_path):
    from kp_testing import EXAMPLES

    problem = load_problem(EXAMPLES / "matmul_gelu.py")
    result = problem_roofline(problem, device="cuda", cache_dir=tmp_path)
    assert result.flops == 2 * 4096**3
    assert result.bound == "compute"
    assert result.floor_ms > 0
