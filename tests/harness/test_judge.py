"""The Judge API and `kernelpilot eval`: refusal without a GPU, the tamper check, argument errors, the report,
and whole evaluations through a real worker (a CPU extension where torch's CUDA build can compile one; the
workspace's CUDA example on a GPU)."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kernelpilot.cli import app
from kernelpilot.errors import KernelpilotError, NoGPUError
from kernelpilot.cli.render_eval import render_eval
from kernelpilot.harness.judge import Judge, candidate_workspace
from kernelpilot.results import (
    NOT_APPLICABLE,
    BenchResult,
    BuildResult,
    EvalResult,
    GuardFinding,
    Roofline,
    Timing,
    TrialResult,
    VariantCheck,
    VerifyResult,
    from_dict,
)
from kernelpilot.workspace import EXAMPLE_KERNELS, init_workspace, tampered_files
from kp_testing import (
    run_cache_dir,
    scale_mul_binding,
    scale_mul_candidate,
    scale_problem,
    scale_shift_problem,
    write_problem,
)


def gpu_visible() -> bool:
    import torch

    return torch.cuda.is_available()


SCALE_PROBLEM = scale_problem(rows=32, features=64)


@pytest.fixture
def workspace(tmp_path) -> Path:
    ws, _ = init_workspace(write_problem(tmp_path / "problem", SCALE_PROBLEM), tmp_path / "ws")
    return ws.root


# ---------------------------------------------------------------------------------------------- no GPU


@pytest.mark.skipif("gpu_visible()", reason="a GPU is visible here")
def test_judge_without_a_gpu_refuses_with_one_sentence():
    with pytest.raises(NoGPUError, match="no CUDA GPU is visible, and verifying and timing kernels needs one") as caught:
        Judge()
    assert caught.value.hint


@pytest.mark.skipif("gpu_visible()", reason="a GPU is visible here")
def test_eval_cli_without_a_gpu_prints_one_error_line_and_exits_non_zero(workspace):
    run = subprocess.run(
        [sys.executable, "-m", "kernelpilot", "eval", str(workspace)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert lines[0] == "error: no CUDA GPU is visible, and verifying and timing kernels needs one."
    assert len(lines) <= 2 and lines[-1].startswith("hint:")
    assert "Traceback" not in run.stdout + run.stderr


def test_an_unknown_device_is_a_user_error():
    with pytest.raises(KernelpilotError, match="Unknown device 'tpu'"):
        Judge("tpu")


# ------------------------------------------------------------------------------------- before any work


def test_tampered_protected_files_fail_the_evaluation_before_anything_runs(workspace):
    model = workspace / "model.py"
    model.chmod(stat.S_IRUSR | stat.S_IWUSR)
    model.write_text(model.read_text() + "\n# the reference, edited\n")
    (workspace / "kernels" / "kp_cuda.h").unlink()

    with Judge("cpu") as judge:
        result = judge.evaluate(workspace)
        assert not judge.worker.running, "no step may run for a tampered workspace"

    assert (result.error_kind, result.reward) == ("tampered", -1)
    assert "model.py" in result.message and "kernels/kp_cuda.h" in result.message
    assert result.build is None and result.verify is None
    assert not (workspace / "build").exists()


def test_eval_of_a_problem_file_needs_a_candidate(tmp_path):
    problem = write_problem(tmp_path, SCALE_PROBLEM)
    outcome = CliRunner().invoke(app, ["eval", str(problem)])
    assert outcome.exit_code != 0
    assert "is a problem file, so the candidate to judge is missing" in outcome.output
    assert "Traceback" not in outcome.output


def test_eval_with_a_candidate_needs_a_problem_file(workspace):
    outcome = CliRunner().invoke(app, ["eval", str(workspace), "--candidate", str(workspace / "model_new.py")])
    assert outcome.exit_code != 0
    assert "--candidate needs a problem file" in outcome.output


def test_candidate_workspace_holds_the_candidate_and_its_kernels_but_never_replaces_protected_files(tmp_path):
    problem = write_problem(tmp_path / "problem", SCALE_PROBLEM)
    mine = tmp_path / "mine"
    (mine / "kernels").mkdir(parents=True)
    (mine / "model_new.py").write_text("# my candidate\n")
    (mine / "kernels" / "my_op.cu").write_text("// my kernel\n")
    (mine / "kernels" / "kp_registry.h").write_text("// an old registry\n")

    with candidate_workspace(problem, mine / "model_new.py") as root:
        from kernelpilot.workspace import open_workspace

        ws = open_workspace(root)
        assert ws.model_new_path.read_text() == "# my candidate\n"
        assert (ws.kernels_dir / "my_op.cu").read_text() == "// my kernel\n"
        assert tampered_files(ws) == []
        assert not any((root / example).exists() for example in EXAMPLE_KERNELS)
    assert not root.exists()


# ------------------------------------------------------------------------------------------- the report


def test_render_eval_shows_verdict_errors_times_speedups_sol_reward_and_guards():
    timing = Timing(median_ms=2.0, p10_ms=1.9, p90_ms=2.2, mean_ms=2.05, runs=50)
    result = EvalResult(
        problem_id="abc123",
        workspace="/tmp/kp-softmax",
        build=BuildResult(ok=True, workspace="/tmp/kp-softmax", extension_name="kp_kernels", arch="9.0", compiled=["kernels/a.cu"]),
        verify=VerifyResult(
            ok=True,
            trials=[TrialResult(seed=s, ok=True, max_abs_error=1e-6, max_rel_error=2e-5) for s in range(5)],
            guards=[GuardFinding(guard="precision-drop", severity="warn", message="matches a bf16 rounding")],
        ),
        bench=BenchResult(
            ok=True,
            gpu="NVIDIA H100 80GB HBM3",
            candidate=Timing(median_ms=1.0, p10_ms=0.98, p90_ms=1.03, mean_ms=1.0, runs=100),
            eager=timing,
            compiled=Timing(median_ms=1.5, p10_ms=1.45, p90_ms=1.6, mean_ms=1.5, runs=50),
            speedup_vs_eager=2.0,
            speedup_vs_compile=1.5,
            roofline=Roofline(flops=0, bytes=2e9, floor_ms=0.6, bound="memory", bandwidth_gbs=3300, matmul_tflops=60),
            sol_candidate=0.6,
        ),
        reward=3,
    )
    console = Console(record=True, width=160)
    render_eval(console, result)
    text = console.export_text()
    for expected in ("5/5 trials", "1e-06 / 2e-05", "guard precision-drop", "matches a bf16 rounding", "NVIDIA H100",
                     "2.00x", "1.50x", "60.0% SOL", "memory-bound", "reward", "1 recompiled"):  # fmt: skip
        assert expected in text, expected


def test_render_eval_prints_one_line_per_shape_variant():
    verify = VerifyResult(ok=True, trials=[TrialResult(seed=0, ok=True)], input_shapes=[[8, 6], [6], None], variants=[
        VariantCheck("half", "verified", inputs=[[4, 6], [6], None], message="2 trials passed"),
        VariantCheck("double", "failed", inputs=[[16, 6], [6], None], message="RuntimeError: 8 rows only"),
        VariantCheck("triple", NOT_APPLICABLE, message="the leading size is 1, which cannot be halved"),
    ])  # fmt: skip
    console = Console(record=True, width=200)
    render_eval(console, EvalResult(problem_id="p", workspace="/w", verify=verify, reward=1))
    lines = console.export_text().splitlines()
    for label, value in (("shapes ", "verified at (8, 6), (6,), value"),
                         ("shapes half ", "verified at (4, 6), (6,), value"),
                         ("shapes double ", "failed at (16, 6), (6,), value (recorded, not a verdict): RuntimeError: 8 rows only"),
                         ("shapes triple ", "not applicable: the leading size is 1, which cannot be halved")):  # fmt: skip
        assert any(f" {label}" in line and f" {value} " in line for line in lines), (label, value)


def test_render_eval_of_a_verifier_failure_prints_its_traceback():
    message = "kernelpilot's verifier failed, not the candidate: KeyError: 'out'. This is a bug in kernelpilot; ..."
    traceback = "Traceback (most recent call last):\n  File \"guards.py\", line 9, in find_output_aliasing\nKeyError: 'out'"
    verify = VerifyResult(ok=False, error_kind="harness", message=message, traceback=traceback)
    console = Console(record=True, width=160)
    result = EvalResult(problem_id="p", workspace="/w", verify=verify, error_kind="harness", message=message)
    render_eval(console, result)
    text = console.export_text()
    assert "harness: kernelpilot's verifier failed, not the candidate" in text
    assert "The verifier's traceback:\n" + traceback in text


# ------------------------------------------------------------------------ whole evaluations in a worker

@pytest.mark.cuda_build
def test_cpu_extension_is_built_verified_timed_and_rebuilt_in_one_worker(workspace, tmp_path):
    for example in EXAMPLE_KERNELS:
        (workspace / example).unlink()
    binding = workspace / "kernels" / "scale_mul_binding.cpp"
    binding.write_text(scale_mul_binding(offset=0.0))
    (workspace / "model_new.py").write_text(scale_mul_candidate(features=64))

    with Judge("cpu", arch="9.0", cache_dir=run_cache_dir(tmp_path)) as judge:
        honest = judge.evaluate(workspace, trials=3)
        pid = judge.worker.pid
        binding.write_text(scale_mul_binding(offset=1.0))
        wrong = judge.evaluate(workspace, trials=3, bench=False)
        assert judge.worker.pid == pid, "a rebuilt extension loads in the same worker"

    assert honest.build.ok and honest.verify.ok, honest.message
    assert honest.bench.ok and honest.bench.candidate.runs > 0, honest.bench.message
    assert honest.reward >= 1
    assert wrong.build.compiled == ["kernels/scale_mul_binding.cpp"]
    assert wrong.build.library != honest.build.library
    assert (wrong.error_kind, wrong.reward) == ("mismatch", -1)
    assert wrong.verify.max_abs_error == pytest.approx(1.0)


GPU_CANDIDATE = """
import torch
from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        {body}
"""


@pytest.fixture(scope="module")
def gpu_workspace(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gpu")
    problem = write_problem(folder / "problem", scale_shift_problem(rows=4096, columns=4096))
    ws, _ = init_workspace(problem, folder / "ws")
    return ws.root


def use_forward(root: Path, body: str) -> None:
    (root / "model_new.py").write_text(GPU_CANDIDATE.format(body=body))


@pytest.mark.gpu
def test_gpu_the_example_kernel_passes_and_is_timed_through_the_cli(gpu_workspace):
    use_forward(gpu_workspace, "return kp_ops.scale_shift(x, 2.0, 1.0)")
    outcome = CliRunner().invoke(app, ["eval", str(gpu_workspace), "--json"])
    result = from_dict(EvalResult, json.loads(outcome.stdout))
    assert outcome.exit_code == 0, result.message
    assert result.verify.ok and result.bench.ok
    assert result.bench.candidate.median_ms > 0 and result.bench.speedup_vs_eager is not None
    assert result.reward >= 1


@pytest.mark.gpu
def test_gpu_a_sticky_cuda_error_ends_the_candidates_sandbox_and_the_next_evaluation_passes(gpu_workspace):
    # An out-of-range index on the GPU trips a device-side assert, which poisons the sandbox's CUDA context only.
    use_forward(gpu_workspace, "return x[torch.full((4,), 1 << 40, device=x.device)]")
    with Judge() as judge:
        pid = judge.worker.start()["pid"]
        broken = judge.evaluate(gpu_workspace, bench=False)
        assert judge.worker.pid == pid, "the judge's own process is untouched by the candidate's CUDA error"
        use_forward(gpu_workspace, "return kp_ops.scale_shift(x, 2.0, 1.0)")
        recovered = judge.evaluate(gpu_workspace, bench=False)

    assert (broken.error_kind, broken.reward) == ("cuda-error", -1), broken.message
    assert recovered.verify.ok, recovered.message


@pytest.mark.gpu
def test_gpu_out_of_memory_is_reported_and_the_worker_stays(gpu_workspace):
    use_forward(gpu_workspace, "return torch.empty(1 << 46, dtype=torch.uint8, device=x.device)")
    with Judge() as judge:
        pid = judge.worker.start()["pid"]
        result = judge.evaluate(gpu_workspace, bench=False)
        assert judge.worker.pid == pid

    assert (result.error_kind, result.reward) == ("oom", -1), result.message


@pytest.mark.gpu
def test_gpu_an_edited_kernel_is_rebuilt_and_loaded_in_the_same_worker(gpu_workspace):
    use_forward(gpu_workspace, "return kp_ops.scale_shift(x, 2.0, 1.0)")
    kernel = gpu_workspace / "kernels" / "example_scale_shift.cu"
    original = kernel.read_text()
    with Judge() as judge:
        first = judge.evaluate(gpu_workspace, bench=False)
        pid = judge.worker.pid
        kernel.write_text(original.replace("#include", "#define KP_TEST_EDIT 1\n#include", 1) + "\n")
        second = judge.evaluate(gpu_workspace, bench=False)
        assert judge.worker.pid == pid
    kernel.write_text(original)

    assert first.verify.ok and second.verify.ok, second.message
    assert second.build.compiled == ["kernels/example_scale_shift.cu"]
    assert second.build.library != first.build.library


@pytest.mark.gpu
def test_gpu_a_prepared_judge_benches_with_the_clean_sandboxes_it_warmed(gpu_workspace, tmp_path):
    """`Judge.prepare` (what optimize sends first) warms eager and torch.compile while the candidate builds: the
    first bench then spends its baselines phase timing, not compiling, and its figures are those of a plain bench."""
    use_forward(gpu_workspace, "return kp_ops.scale_shift(x, 2.0, 1.0)")
    with Judge("cuda", cache_dir=tmp_path / "cache") as judge:
        judge.prepare(gpu_workspace)
        result = judge.evaluate(gpu_workspace)
    assert result.bench is not None and result.bench.ok, result.bench
    assert result.bench.compiled is not None and result.bench.speedup_vs_compile is not None
