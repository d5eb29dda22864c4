"""The judge's tools and what the model reads of them: Compile, Verify and Profile through a real CPU judge (one
shared build) returning the judge's typed results, their rendering (build and eval text), Ncu's typed report and
its CSV parsing, and on a GPU the whole chain with the example kernel."""

from __future__ import annotations

import re
import shutil
import sys

import pytest
from tools_testing import call, make_workspace

from kernelpilot.agent import RecoverableError, VerifyOutcome
from kernelpilot.agent.failure import judged_failure
from kernelpilot.agent.observations import build_text, eval_text, ncu_text, verify_outcome_text
from kernelpilot.agent.session import tool_result
from kernelpilot.agent.tool_results import NcuReport
from kernelpilot.agent.tools.ncu import NCU_DRIVER, NCU_TIMEOUT_S, driver_environment, parse_ncu_csv
from kernelpilot.agent.tools.shell import run_process
from kernelpilot.config import Settings
from kernelpilot.results import (
    BenchResult,
    BuildResult,
    Diagnostic,
    EvalResult,
    KernelResources,
    KernelTime,
    Roofline,
    Timing,
    TrialResult,
    VerifyResult,
)
from kernelpilot.workspace import EXAMPLE_KERNELS
from kp_testing import EXAMPLE_KERNEL_CANDIDATE, scale_shift_problem


# ---------------------------------------------------------------------------------------- harness tools


@pytest.mark.parametrize("tool_name", ["Compile", "Verify", "Profile"])
def test_harness_tools_need_a_judge(ctx, tool_name):
    with pytest.raises(RecoverableError, match=f"{tool_name} needs the judge"):
        call(ctx, tool_name)


def test_ncu_without_ncu_or_a_gpu_answers_in_one_sentence(ctx):
    output = call(ctx, "Ncu")
    assert isinstance(output.result, NcuReport) and not output.result.available
    assert output.text == output.result.reason and not output.data["available"]
    assert output.text.count(". ") == 0 and output.text.endswith("kernel breakdown.")


NCU_CSV = '''==PROF== Connected to process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python","h","softmax_kernel","1","7","(256, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","dram__throughput.avg.pct_of_peak_sustained_elapsed","%","91.52"
"0","4242","python","h","softmax_kernel","1","7","(256, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","1,234,567"
"0","4242","python","h","softmax_kernel","1","7","(256, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","launch__registers_per_thread","register/thread","32"
"0","4242","python","h","softmax_kernel","1","7","(256, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","sm__throughput.avg.pct_of_peak_sustained_elapsed","%","20.1"
"1","4242","python","h","tiny_kernel","1","7","(32, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__throughput.avg.pct_of_peak_sustained_elapsed","%","0.5"
"1","4242","python","h","tiny_kernel","1","7","(32, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","sm__throughput.avg.pct_of_peak_sustained_elapsed","%","1.5"
"1","4242","python","h","tiny_kernel","1","7","(32, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","sm__warps_active.avg.pct_of_peak_sustained_active","%","3.1"
==PROF== Disconnected from process 4242
'''


def test_ncu_csv_becomes_one_summary_line_per_launch():
    launches = parse_ncu_csv(NCU_CSV)
    assert [launch.kernel for launch in launches] == ["softmax_kernel", "tiny_kernel"]
    assert launches[0].duration_us == pytest.approx(1234.567)
    assert launches[0].registers == 32 and launches[1].occupancy_pct == pytest.approx(3.1)
    assert launches[1].duration_us is None, "a metric ncu did not report stays unknown"
    text = ncu_text(NcuReport(exit_code=0, timeout_s=NCU_TIMEOUT_S, launches=launches))
    lines = text.splitlines()
    assert lines[0] == "ncu: 2 kernel launch(es) in one forward call:"
    assert lines[1] == "  softmax_kernel: 1235 us, DRAM 91.5%, SM 20.1%, 32 regs -> memory-bound (DRAM busy): move fewer bytes"
    assert "occupancy 3.1%" in lines[2] and "latency-bound" in lines[2]


def test_ncu_with_no_profiled_launch_shows_why():
    failed = NcuReport(exit_code=1, output_tail="==ERROR== ERR_NVGPUCTRPERM - no permission")
    assert ncu_text(failed) == "ncu profiled no kernel (exit code 1).\n==ERROR== ERR_NVGPUCTRPERM - no permission"
    unmatched = NcuReport(kernel="gemm", exit_code=0)
    assert ncu_text(unmatched) == "ncu profiled no kernel (no kernel matched 'gemm')."
    stopped = NcuReport(timed_out=True, timeout_s=NCU_TIMEOUT_S)
    assert ncu_text(stopped) == f"ncu did not finish within {NCU_TIMEOUT_S} s and was stopped; profile fewer kernels with `kernel`."
    broken = BuildResult(ok=False, workspace="/w", extension_name="kp_kernels", arch="9.0", error="1 error")
    assert ncu_text(NcuReport(build=broken)).splitlines()[:2] == ["Ncu skipped: the build failed.", "Build FAILED: 1 error"]


def test_build_text_lists_errors_at_most_twenty_and_kernel_resources():
    errors = [Diagnostic("error", f"problem {n}", "kernels/a.cu", n, 3) for n in range(1, 26)]
    failed = BuildResult(ok=False, workspace="/w", extension_name="kp_kernels", arch="9.0", compiled=["kernels/a.cu"],
                         diagnostics=[Diagnostic("error", "build stopped", tool="ninja"), *errors], error="25 errors")  # fmt: skip
    lines = build_text(failed).splitlines()
    assert lines[:4] == ["Build FAILED: 25 errors", "Recompiled: kernels/a.cu.", "Errors (25):", "  kernels/a.cu:1:3: problem 1"]
    assert lines[-1] == "  (5 more errors not shown; fix these first)" and "build stopped" not in lines
    kernel = KernelResources(kernel="void k<4>(float*)", arch="sm_90", registers=40, shared_bytes=4096, spill_stores=8)
    built = BuildResult(ok=True, workspace="/w", extension_name="kp_kernels", arch="9.0", resources=[kernel], seconds=1.5)
    assert build_text(built).splitlines() == [
        "Build ok for sm_90 in 1.5 s; recompiled: nothing (up to date).",
        "Kernels (ptxas): registers, shared memory, stack, spill stores/loads",
        "  void k<4>(float*): 40 regs, 4096 B smem, 0 B stack, spills 8/0 (SPILLING)",
    ]


def test_eval_text_shows_times_speedups_speed_of_light_and_top_kernels():
    def timing(ms: float) -> Timing:
        return Timing(median_ms=ms, p10_ms=ms * 0.98, p90_ms=ms * 1.02, mean_ms=ms, runs=50)

    bench = BenchResult(
        ok=True, gpu="NVIDIA H100 80GB HBM3", candidate=timing(1.0), eager=timing(2.0), compiled=timing(1.5),
        speedup_vs_eager=2.0, speedup_vs_compile=1.5, sol_candidate=0.6,
        roofline=Roofline(flops=0, bytes=2e9, floor_ms=0.6, bound="memory", bandwidth_gbs=3300, matmul_tflops=60),
        kernels=[KernelTime("small_kernel", 0.1, 1), KernelTime("big_kernel", 0.9, 2)],
    )  # fmt: skip
    verify = VerifyResult(ok=True, trials=[TrialResult(seed=0, ok=True, max_abs_error=1e-6, max_rel_error=1e-5)])
    text = eval_text(EvalResult(problem_id="p", workspace="/w", verify=verify, bench=bench, reward=3))
    lines = text.splitlines()
    assert lines[0].startswith("Profile: reward 3 ")
    assert lines[1].startswith("Verify PASSED: 1/1 trials")
    assert "  candidate     1 ms; 0.98-1.02 ms; 4.0% (50 runs); 60.0% of speed-of-light" in lines
    assert "Speedup: 2.00x vs eager, 1.50x vs torch.compile." in lines
    assert "Speed-of-light floor: 0.6 ms (memory-bound: 2 GB, 0 GFLOP)." in lines
    top = lines.index("Top kernels of the candidate (total ms, calls, share):")
    assert lines[top + 1] == "  0.9 ms  x2  90%  big_kernel" and lines[top + 2] == "  0.1 ms  x1  10%  small_kernel"


def test_a_verifier_failure_is_told_as_the_verifiers_not_the_kernels():
    verify = VerifyResult(ok=False, error_kind="harness", message="kernelpilot's verifier failed, not the candidate: "
                          "KeyError: 'out'", traceback="Traceback (most recent call last): ...")  # fmt: skip
    lines = eval_text(EvalResult(problem_id="p", workspace="/w", verify=verify, error_kind="harness",
                                 message=verify.message)).splitlines()  # fmt: skip
    assert lines[1] == (
        "Verify did not judge the candidate: kernelpilot's verifier failed, not your kernel (0 trials passed before it did)."
    )
    assert lines[2] == verify.message
    assert "FAILED" not in "\n".join(lines) and "Traceback" not in "\n".join(lines)


def test_a_profile_stopped_against_the_time_to_beat_is_told_as_no_verdict():
    message = "stopped after 2 trials: a call took 190 ms, more than 3x the 10.7 ms to beat (+20 ms); not timed"
    verify = VerifyResult(ok=False, error_kind="slower", message=message,
                          trials=[TrialResult(seed=1, ok=True), TrialResult(seed=2, ok=True)])  # fmt: skip
    text = eval_text(EvalResult(problem_id="p", workspace="/w", verify=verify, reward=-1, error_kind="slower",
                                message=message))  # fmt: skip
    assert text.splitlines() == ["Profile stopped early: slower than the time to beat, so neither verified further nor "
                                 "timed.", message]  # fmt: skip
    assert "wrong" not in text and "FAILED" not in text


def test_eval_text_of_a_tampered_workspace_says_why():
    text = eval_text(EvalResult(problem_id="p", workspace="/w", error_kind="tampered", message="model.py was changed."))
    assert text.splitlines()[1] == "tampered: model.py was changed."


# One build on the CPU for the three harness tools: only the protected kp_module.cpp is compiled (with g++), and the
# candidate computes with torch in forward, which the torch-compute guard must reject.
TORCH_CANDIDATE = """
import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, features: int = 16):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(features))

    def forward(self, x):
        return x * self.scale
"""

EXTRA_CPP = "int kp_extra() {{ return {}; }}\n"

# The run's settings, which Verify and Profile must judge with (the judge's defaults are 5 trials, 1e-2 and 1e-2).
# Only the tolerances show here: the guard stops the torch candidate after its first trial.
RUN_SETTINGS = Settings(trials=3, atol=3e-3, rtol=2e-3)


@pytest.fixture(scope="session")  # session: one build, even when other modules' tests run between its tests
def judged_on_cpu(tmp_path_factory):
    from kernelpilot.harness.judge import Judge

    ctx = make_workspace(tmp_path_factory.mktemp("judged"))
    root = ctx.workspace.root
    for example in EXAMPLE_KERNELS:
        (root / example).unlink()
    ctx.workspace.model_new_path.write_text(TORCH_CANDIDATE)
    ctx.settings = RUN_SETTINGS
    with Judge("cpu", arch="9.0", cache_dir=tmp_path_factory.mktemp("cache")) as judge:
        ctx.judge = judge
        outputs = {name: call(ctx, name) for name in ("Compile", "Verify", "Profile")}
        good_build = ctx.judged.build
        # A file of the candidate's and another version of it, built ahead; then that version written and built.
        extra = root / "kernels" / "extra.cpp"
        extra.write_text(EXTRA_CPP.format(1))
        outputs["ahead Compile"] = call(ctx, "Compile", ahead=[{"kernels/extra.cpp": EXTRA_CPP.format(2)}])
        extra.write_text(EXTRA_CPP.format(2))
        outputs["Compile of a version built ahead"] = call(ctx, "Compile")
        extra.unlink()
        (root / "kernels" / "broken.cpp").write_text("int broken() {\n  return undefined_name;\n}\n")
        outputs["broken Compile"] = call(ctx, "Compile")
        outputs["broken Verify"] = call(ctx, "Verify", trials=2)
    return ctx, outputs, good_build


@pytest.mark.cuda_build
@pytest.mark.parametrize(
    "name, result_type, render, first_words, shown",
    [("Compile", BuildResult, build_text, "Build ok for sm_90 in ", "recompiled: kernels/kp_module.cpp."),
     ("Verify", VerifyOutcome, verify_outcome_text, "Verify FAILED (guard)", "guard torch-compute [fail]"),
     ("Profile", EvalResult, eval_text, "Profile: reward -1 ", "guard torch-compute [fail]")],
    ids=["Compile", "Verify", "Profile"],
)  # fmt: skip
def test_a_judge_tool_answers_its_typed_result_as_the_model_reads_it(judged_on_cpu, name, result_type, render,
                                                                     first_words, shown):  # fmt: skip
    output = judged_on_cpu[1][name]
    assert isinstance(output.result, result_type) and output.text == render(output.result)
    assert output.text.startswith(first_words) and shown in output.text


@pytest.mark.cuda_build
def test_compile_builds_versions_ahead_in_the_judge_and_a_later_build_of_one_compiles_nothing(judged_on_cpu):
    _, outputs, _ = judged_on_cpu
    ahead = outputs["ahead Compile"]
    assert ahead.result.ahead.built == 1 and ahead.result.ahead.compiled == ["kernels/extra.cpp"]
    assert "\nBuilt ahead: 1 version(s) in " in ahead.text and ahead.text.splitlines()[0].endswith("kernels/extra.cpp.")
    later = outputs["Compile of a version built ahead"]
    assert later.result.reused and "recompiled: nothing (these sources were built before" in later.text


@pytest.mark.parametrize(
    "ahead, refusal",
    [([{"kernels/kp_module.cpp": "x"}], "Compile: `ahead[0]` cannot be built: kernels/kp_module.cpp cannot change"),
     ([{"kernels/a.cu": "x"}, {"model_new.py": "x"}], "`ahead[1]` cannot be built: 'model_new.py' is not a file under"),
     ([{"kernels/a.cu": "x"}] * 17, "Compile builds at most 16 versions ahead, not 17"),
     ([{"kernels/a.cu": 1}], "`ahead[0]` cannot be built: the content of 'kernels/a.cu' is not text")],
)  # fmt: skip
def test_compile_refuses_versions_it_cannot_build_ahead_in_one_sentence(ctx, ahead, refusal):
    with pytest.raises(RecoverableError, match=re.escape(refusal)):
        call(ctx, "Compile", ahead=ahead)


@pytest.mark.cuda_build
def test_compile_errors_come_back_as_file_line_messages(judged_on_cpu):
    ctx, outputs, _ = judged_on_cpu
    text = outputs["broken Compile"].text
    assert text.startswith("Build FAILED: ")
    assert "Recompiled: kernels/broken.cpp." in text
    assert "kernels/broken.cpp:2:" in text and "undefined_name" in text
    assert not ctx.judged.build.ok, "the latest build is the one remembered"
    assert outputs["broken Verify"].text.startswith("Verify skipped: the build failed.\nBuild FAILED")


@pytest.mark.cuda_build
def test_the_judges_real_failures_give_their_kind_and_first_line(judged_on_cpu):
    _, outputs, _ = judged_on_cpu
    broken = judged_failure(outputs["broken Compile"].result)
    assert broken.kind == "build" and broken.message.startswith("kernels/broken.cpp:2:") and "undefined_name" in broken.message
    assert judged_failure(outputs["broken Verify"].result) == broken
    guarded = judged_failure(outputs["Verify"].result)
    assert guarded.kind == "guard" and guarded.message.startswith("guard torch-compute failed: ")
    assert judged_failure(outputs["Profile"].result).kind == "guard"


@pytest.mark.cuda_build
def test_compile_and_verify_keep_their_results_as_transcript_data(judged_on_cpu):
    _, outputs, _ = judged_on_cpu
    assert outputs["Compile"].data["ok"] and outputs["Compile"].data["library"]
    verified = outputs["Verify"]
    assert verified.data["verify"]["ok"] is False and verified.data["build"]["ok"] is True
    record = {"type": "tool", "name": "Verify", "result_type": "VerifyOutcome", "data": verified.data}
    assert tool_result(record) == verified.result, "the transcript gives back the typed result"


@pytest.mark.cuda_build
def test_profile_records_the_evaluation_for_the_loop(judged_on_cpu):
    ctx, outputs, _ = judged_on_cpu
    profiled = outputs["Profile"]
    assert ctx.judged.evals == [profiled.result] and profiled.data["reward"] == -1


@pytest.mark.cuda_build
def test_verify_and_profile_judge_with_the_runs_trials_and_tolerances(judged_on_cpu):
    ctx, outputs, _ = judged_on_cpu
    for judged in (outputs["Verify"].data["verify"], outputs["Profile"].data["verify"]):
        assert (judged["atol"], judged["rtol"]) == (3e-3, 2e-3)
    assert "within |actual - expected| <= 0.003 + 0.002 * |expected|" in outputs["Verify"].text


@pytest.mark.cuda_build
def test_the_ncu_driver_loads_and_runs_the_candidate_the_way_the_harness_does(judged_on_cpu):
    import json

    from kernelpilot.results import to_dict

    ctx, _, good_build = judged_on_cpu
    build_json = ctx.workspace.root / ".kernelpilot" / "tmp" / "build.json"
    build_json.parent.mkdir(parents=True, exist_ok=True)
    build_json.write_text(json.dumps(to_dict(good_build)))
    argv = [sys.executable, "-c", NCU_DRIVER, str(ctx.workspace.root), str(build_json), "cpu"]
    run = run_process(argv, cwd=ctx.workspace.root, env=driver_environment(build_json.parent / "sandbox"), timeout=120)
    assert run.returncode == 0, run.output


def test_the_ncu_driver_runs_the_candidate_confined_like_a_sandbox(tmp_path, monkeypatch):
    """Candidate code under ncu is as confined as in the judge's sandboxes: none of the user's credentials in its
    environment, and (where Landlock exists) no writes outside its private folder."""
    from kernelpilot.harness.confine import landlock_available

    ctx = make_workspace(tmp_path / "ws", scale_shift_problem(rows=4, columns=4))
    outside = tmp_path / "outside.txt"
    ctx.workspace.model_new_path.write_text(
        "import os\nfrom pathlib import Path\n"
        "print('SEEN', sorted(os.environ))\n"
        f"try:\n    Path({str(outside)!r}).write_text('escaped')\nexcept OSError as err:\n    print('BLOCKED', err)\n"
        "from torch import nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x * 2.0 + 1.0\n"
    )
    for source in ctx.workspace.kernel_sources():  # no kernels, so no build: the driver loads model_new.py alone
        source.unlink()
    build_json = tmp_path / "build.json"
    build_json.write_text("null")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-of-the-user")
    argv = [sys.executable, "-c", NCU_DRIVER, str(ctx.workspace.root), str(build_json), "cpu"]
    run = run_process(argv, cwd=ctx.workspace.root, env=driver_environment(tmp_path / "sandbox"), timeout=120)
    assert run.returncode == 0, run.output
    seen = next(line for line in run.output.splitlines() if line.startswith("SEEN"))
    assert "OPENAI_API_KEY" not in seen and "HOME" in seen
    if landlock_available():
        assert "confinement: landlock" in run.output and "BLOCKED" in run.output
        assert not outside.exists()


# -------------------------------------------------------------------------------------------------- GPU

@pytest.fixture(scope="module")
def gpu_ctx(tmp_path_factory):
    from kernelpilot.harness.judge import Judge

    ctx = make_workspace(tmp_path_factory.mktemp("gpu"), scale_shift_problem(rows=4096, columns=4096))
    ctx.workspace.model_new_path.write_text(EXAMPLE_KERNEL_CANDIDATE)
    with Judge(cache_dir=tmp_path_factory.mktemp("cache")) as judge:
        ctx.judge = judge
        yield ctx


@pytest.mark.gpu
def test_gpu_compile_verify_profile_the_example_kernel(gpu_ctx):
    compiled = call(gpu_ctx, "Compile")
    assert compiled.data["ok"], compiled.text
    assert "scale_shift_kernel" in compiled.text and " regs, " in compiled.text
    verified = call(gpu_ctx, "Verify", trials=3)
    assert verified.text.startswith("Verify PASSED: 3/3 trials"), verified.text
    profiled = call(gpu_ctx, "Profile")
    assert profiled.data["reward"] >= 1, profiled.text
    assert "Speedup: " in profiled.text and "% of speed-of-light" in profiled.text
    assert "Top kernels of the candidate" in profiled.text and "scale_shift" in profiled.text
    assert gpu_ctx.judged.evals[-1].reward == profiled.data["reward"]


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("ncu") is None, reason="ncu (Nsight Compute) is not on PATH")
def test_gpu_ncu_profiles_the_candidates_kernel(gpu_ctx):
    output = call(gpu_ctx, "Ncu", kernel="scale_shift")
    assert output.data["available"], output.text
    assert output.text.startswith("ncu: 1 kernel launch(es) in one forward call:"), output.text
    assert "scale_shift_kernel" in output.text and "DRAM " in output.text and " us, " in output.text
