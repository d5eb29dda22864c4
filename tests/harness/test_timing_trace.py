"""The timed runs' kernel trace (harness/tracing.py, timing.py): which runs are traced, what their kernels decide,
and that their slowed times stay out of the figures. The CPU has no kernel trace, so the candidate's process is
the real one served in-process (the sandbox's request handling) and only its `traced_kernels` answer is the GPU's:
names as torch's profiler reports them there."""

from __future__ import annotations

import textwrap

import pytest

from kernelpilot.harness.bench import bench_candidate
from kernelpilot.harness.sandbox import LocalModel
from kernelpilot.harness.sandbox_client import InProcessClean, InProcessModel
from kernelpilot.problem import load_problem

pytestmark = pytest.mark.slow

PROBLEM = """
    import torch
    from torch import nn

    class Model(nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2.0

    def get_inputs():
        return [torch.randn(64, 256)]

    def get_init_inputs():
        return []
"""
TORCH_RELU = "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::launch_clamp_scalar>(int, float*)"
OWN_RELU = "void relu_kernel<float>(float const*, float*, long)"
TRACING_MS = 1000.0  # what a traced run adds to its reported time here: far more than any real run takes


class OnAGpu:
    """The candidate's process as the judge sees it on a GPU: its traced runs slower, their kernels reported
    (`per_run` for each traced run, or `reported` whatever runs were traced)."""

    def __init__(self, inner, per_run: list[str], reported: list[str] | None = None):
        self.inner, self.per_run, self.reported, self.requests, self.traced = inner, per_run, reported, [], 0

    def request(self, op: str, args: dict, *, timeout: float) -> dict:
        self.requests.append((op, dict(args)))
        if op == "traced_kernels":
            kernels = self.per_run * self.traced if self.reported is None else self.reported
            self.traced = 0
            return {"ok": True, "kernels": kernels, "traced": True}
        self.traced += op == "run" and bool(args.get("trace"))
        reply = self.inner.request(op, args, timeout=timeout)
        if op == "run" and args.get("trace") and reply.get("ok"):
            reply = dict(reply, ms=float(reply["ms"]) + TRACING_MS)
        return reply


@pytest.fixture
def problem(tmp_path):
    path = tmp_path / "relu2.py"
    path.write_text(textwrap.dedent(PROBLEM))
    return load_problem(path)


def bench_on_a_gpu(problem, tmp_path, per_run: list[str], reported: list[str] | None = None):
    import torch

    torch.manual_seed(0)
    served = InProcessModel(LocalModel(problem, problem.make_model("cpu"), torch.device("cpu")))
    candidate = OnAGpu(served, per_run, reported)
    result = bench_candidate(problem, candidate, InProcessClean(problem, "cpu"), device="cpu", seed=0,
                             cache_dir=tmp_path / "cache", min_runs=20)  # fmt: skip
    return result, candidate.requests


def test_a_sample_of_the_runs_is_traced_and_their_times_stay_out(problem, tmp_path):
    result, requests = bench_on_a_gpu(problem, tmp_path, [OWN_RELU])
    assert result.ok, result.message
    runs = [args for op, args in requests if op == "run"]
    traced = [args for args in runs if args.get("trace")]
    assert len(traced) == result.checked_calls >= 3, "as many runs are traced as are checked"
    assert len(runs) >= result.candidate.runs + len(traced), "traced runs are not among the timed figures"
    assert result.candidate.p90_ms < TRACING_MS, "a traced run's slowed time reached the figures"
    ops = [op for op, _ in requests]
    assert ops.count("traced_kernels") == 1 and ops.index("traced_kernels") > max(
        i for i, op in enumerate(ops) if op == "run"
    ), "the trace is read once, after the series"


def test_torch_kernels_in_traced_timed_runs_fail_as_torch_compute(problem, tmp_path):
    result, _ = bench_on_a_gpu(problem, tmp_path, [OWN_RELU], reported=[OWN_RELU, TORCH_RELU, OWN_RELU, TORCH_RELU, OWN_RELU])
    assert not result.ok and result.error_kind == "guard"
    assert [finding.guard for finding in result.guards] == ["torch-compute"]
    assert "a timed call ran torch's kernels (vectorized_elementwise_kernel x2)" in result.message


def test_a_fill_and_the_sandboxs_sleep_are_no_torch_compute(problem, tmp_path):
    fill = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, float*)"
    sleep = "at::cuda::(anonymous namespace)::spin_kernel(long)"
    result, _ = bench_on_a_gpu(problem, tmp_path, [sleep, fill, OWN_RELU])
    assert result.ok, result.message


def test_a_cpu_sandbox_traces_nothing_and_says_so(problem):
    import torch

    local = LocalModel(problem, problem.make_model("cpu"), torch.device("cpu"))
    served = InProcessModel(local)
    assert served.request("run", {"seed": 1, "trace": True}, timeout=30)["ok"] is True
    assert served.request("traced_kernels", {}, timeout=30) == {"ok": True, "kernels": [], "traced": False}


def test_traced_runs_that_show_no_kernel_fail(problem, tmp_path):
    # A process whose trace reports nothing (the candidate silenced it, or computed nothing): each traced timed run
    # must show at least one kernel.
    result, requests = bench_on_a_gpu(problem, tmp_path, [OWN_RELU], reported=[])
    traced = sum(1 for op, args in requests if op == "run" and args.get("trace"))
    assert not result.ok and result.error_kind == "guard", result.message
    assert [finding.guard for finding in result.guards] == ["no-custom-kernel"]
    assert f"{traced} traced timed runs launched 0 kernels" in result.message


def test_fewer_kernels_than_traced_runs_fail(problem, tmp_path):
    result, _ = bench_on_a_gpu(problem, tmp_path, [OWN_RELU], reported=[OWN_RELU])
    assert not result.ok and result.error_kind == "guard", result.message
    assert "launched 1 kernels" in result.message
