"""`kernelpilot optimize`, `suite`, `sessions` and `replay` through the real CLI, a loopback OpenAI server, litellm
and a CPU judge: a verified candidate written beside the problem, the best kept over a worse last edit, the server
down (one sentence), resume after the model failed, and the suite's metrics and restart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import git
import pytest
import torch
from openai_server import ScriptedOpenAIServer
from typer.testing import CliRunner

from kernelpilot.cli import app
from kernelpilot.lockfile import LOCK_NAME, read_lock
from kernelpilot.suite import ProblemOutcome, geometric_mean, summarize
from kernelpilot.workspace import EXAMPLE_KERNELS
from kp_testing import DOUBLE_PROBLEM, REPO_ROOT, UNSUPPORTED_PROBLEM, run_cache_dir, write_problem

# A CPU stand-in for a CUDA kernel: the extension builds with g++ here and the judge runs it on the CPU.
CPU_BINDING = """
#include <torch/types.h>

#include "kp_registry.h"

namespace {

torch::Tensor twice(const torch::Tensor& x) {
  TORCH_CHECK(x.is_contiguous(), "twice: contiguous tensors only");
  torch::Tensor y = torch::empty_like(x);
  if (x.is_meta()) return y;
  const float* xs = x.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) ys[i] = xs[i] * 2.0f;
  return y;
}

}  // namespace

KP_OP("twice(Tensor x) -> Tensor", twice);
"""

KERNEL_CANDIDATE = """
from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return kp_ops.twice(x)
"""

BROKEN_CANDIDATE = "raise RuntimeError('a worse last edit')\n"


def write_double_problem(folder: Path, name: str = "double.py") -> Path:
    return write_problem(folder, DOUBLE_PROBLEM, name)


def invoke(*args: str):
    return CliRunner().invoke(app, [str(arg) for arg in args])


def model_flags(server: ScriptedOpenAIServer) -> list[str]:
    return ["--model", "openai/test-model", "--api-base", server.base_url, "--api-key", "test"]


@pytest.mark.cuda_build
def test_optimize_writes_the_best_verified_candidate_beside_the_problem(tmp_path, monkeypatch, double_problem_cpu_cache):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setenv("KERNELPILOT_CACHE_DIR", str(double_problem_cpu_cache))
    monkeypatch.setenv("COLUMNS", "200")
    problem = write_double_problem(tmp_path / "problems")
    with ScriptedOpenAIServer() as server:
        server.reply_tool_calls([("Bash", {"command": "rm " + " ".join(EXAMPLE_KERNELS)})])
        server.reply_tool_calls([("Write", {"path": "kernels/twice_binding.cpp", "content": CPU_BINDING}),
                                 ("Write", {"path": "model_new.py", "content": KERNEL_CANDIDATE})])
        server.reply_tool_calls([("Profile", {})])
        server.reply_tool_calls([("Write", {"path": "model_new.py", "content": BROKEN_CANDIDATE})])
        server.reply_tool_calls([("Finish", {"summary": "twice, fused"})])
        outcome = invoke("optimize", problem, *model_flags(server), "--workspace", tmp_path / "ws", "--device", "cpu", "--json")

    assert outcome.exit_code == 0, outcome.output
    report = json.loads(outcome.stdout)
    assert (report["status"], report["turns"]) == ("finished", 5)
    assert report["best"]["verify"]["ok"] and report["best"]["reward"] >= 1
    beside = problem.parent
    assert (beside / "model_new.py").read_text() == KERNEL_CANDIDATE, "the best, not the worse last edit"
    assert (beside / "kernels" / "twice_binding.cpp").read_text() == CPU_BINDING
    assert not (beside / "kernels" / "kp_module.cpp").exists(), "protected infrastructure stays in the workspace"
    assert (tmp_path / "ws" / "model_new.py").read_text() == KERNEL_CANDIDATE
    assert sorted(report["written"]) == sorted([str(beside / "model_new.py"), str(beside / "kernels" / "twice_binding.cpp")])

    # Rich sizes the table to the terminal: 80 columns in an xdist worker, which cut "finished" short.
    from kernelpilot.cli.base import console

    monkeypatch.setattr(console, "_width", 200)
    listing = invoke("sessions", tmp_path / "ws")
    assert report["session_id"] in listing.stdout and "finished" in listing.stdout
    [transcript] = (tmp_path / "ws" / ".kernelpilot" / "sessions").glob("*.jsonl")
    replay = invoke("replay", transcript)
    assert replay.exit_code == 0 and "turn 5" in replay.stdout and "new best" in replay.stdout


def make_repo(path: Path, monkeypatch) -> git.Repo:
    """A repository with an identity, seeing neither the user's global nor the system git configuration."""
    (path.parent / "gitconfig").write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(path.parent / "gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    repo = git.Repo.init(path, initial_branch="main")
    with repo.config_writer() as config:
        config.set_value("user", "name", "Ada Lovelace")
        config.set_value("user", "email", "ada@example.com")
    return repo


@pytest.mark.cuda_build
def test_optimize_commit_commits_the_workspace_and_a_late_refusal_keeps_the_output(
    tmp_path, monkeypatch, double_problem_cpu_cache
):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setenv("KERNELPILOT_CACHE_DIR", str(double_problem_cpu_cache))
    repo = make_repo(tmp_path / "project", monkeypatch)
    problem = write_double_problem(tmp_path / "project" / "problems")
    common = ["--workspace", tmp_path / "project" / "kp-double", "--device", "cpu", "--json", "--commit"]
    with ScriptedOpenAIServer() as server:
        server.reply_tool_calls([("Bash", {"command": "rm " + " ".join(EXAMPLE_KERNELS)})])
        server.reply_tool_calls([("Write", {"path": "kernels/twice_binding.cpp", "content": CPU_BINDING}),
                                 ("Write", {"path": "model_new.py", "content": KERNEL_CANDIDATE})])
        server.reply_tool_calls([("Profile", {})])
        server.reply_tool_calls([("Finish", {"summary": "twice"})])
        committed = invoke("optimize", problem, *model_flags(server), *common)

        # The user leaves the branch while a resumed run goes on: git refuses at the end, after the full report.
        # (The user's own action, in the repository above the workspace, which the agent's Bash cannot write.)
        server.reply_tool_calls([("Finish", {"summary": "twice, again"})],
                                before=lambda: repo.git.checkout("--detach", "-q"))
        refused = invoke("optimize", problem, *model_flags(server), *common, "--resume")

    assert committed.exit_code == 0, committed.output
    report = json.loads(committed.stdout)
    head = repo.commit("main")
    assert report["commit"]["sha"] == head.hexsha and report["commit_refused"] is None
    files = set(head.stats.files)
    for name in ("kernelpilot.lock.json", "model_new.py", "kernels/twice_binding.cpp", ".kernelpilot/manifest.json"):
        assert f"kp-double/{name}" in files, name
    assert not any(name.startswith("problems/") for name in files), "the copy beside the problem is the user's"
    assert "kp-double/.kernelpilot/sessions" not in str(files)
    # Verified again at the shape variants before the commit, as `kernelpilot accept` does; timed by the run.
    lock = read_lock(tmp_path / "project" / "kp-double" / LOCK_NAME)
    assert [(s.variant, s.inputs) for s in lock.shapes.verified] == [
        ("problem", [[16, 32]]), ("half", [[8, 32]]), ("double", [[32, 32]])]  # fmt: skip
    assert lock.shapes.failed == []
    assert [s.variant for s in lock.shapes.not_applicable] == ["half-sequence", "double-sequence"]  # a 2-d input
    assert lock.timings.candidate.median_ms == report["best"]["bench"]["candidate"]["median_ms"]
    assert len(lock.verification.seeds) == len(report["best"]["verify"]["trials"])

    assert refused.exit_code == 2
    report = json.loads(refused.stdout)
    assert report["best"]["verify"]["ok"] and report["commit"] is None
    assert report["commit_refused"].startswith("HEAD is detached")
    error_lines = [line for line in refused.output.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "Traceback" not in refused.output
    assert "kernelpilot accept" in refused.output
    assert repo.commit("main") == head, "nothing more was committed"


def test_optimize_commit_outside_a_repository_refuses_before_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # whatever holds tmp_path is not searched
    problem = write_double_problem(tmp_path)
    with ScriptedOpenAIServer() as server:
        outcome = invoke("optimize", problem, *model_flags(server), "--workspace", tmp_path / "ws", "--device", "cpu",
                         "--commit")  # fmt: skip
    assert outcome.exit_code == 2 and "Traceback" not in outcome.output
    assert "is not inside a git repository" in outcome.output and "without --commit" in outcome.output
    assert server.requests == [], "the model was never asked"


def test_server_down_is_one_sentence_and_a_nonzero_exit(tmp_path):
    problem = write_double_problem(tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "kernelpilot", "optimize", str(problem), "--model", "openai/test-model",
         "--api-base", "http://127.0.0.1:9/v1", "--api-key", "test", "--device", "cpu", "--workspace", str(tmp_path / "ws")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert run.returncode != 0
    assert "Traceback" not in run.stdout + run.stderr
    error_lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "127.0.0.1:9" in error_lines[0], run.stderr
    [transcript] = (tmp_path / "ws" / ".kernelpilot" / "sessions").glob("*.jsonl")
    assert json.loads(transcript.read_text().splitlines()[-1])["status"] == "error"


def test_resume_continues_a_session_the_model_broke_off(tmp_path):
    problem = write_double_problem(tmp_path)
    common = ["--workspace", tmp_path / "ws", "--device", "cpu", "--json"]
    with ScriptedOpenAIServer() as server:
        server.reply_tool_calls([("Glob", {"pattern": "kernels/*"})])  # then the script runs out: a 400
        first = invoke("optimize", problem, *model_flags(server), *common)
        assert first.exit_code != 0 and "no scripted reply left" in first.output

        server.reply_tool_calls([("Finish", {"summary": "nothing verified"})])
        second = invoke("optimize", problem, *model_flags(server), *common, "--resume")
    report = json.loads(second.stdout)
    assert second.exit_code == 1  # finished, but nothing verified
    assert (report["status"], report["turns"], report["best"], report["written"]) == ("finished", 3, None, [])
    assert report["failure"] == {"kind": "no-candidate", "message": "nothing verified"}, "the judge never checked one"
    resumed_request = server.requests[-1]["messages"]
    assert any(m["role"] == "tool" and "example_scale_shift.cu" in m["content"] for m in resumed_request)
    assert not (problem.parent / "model_new.py").exists(), "nothing verified: nothing written beside the problem"


def test_bad_settings_are_one_line(tmp_path):
    outcome = invoke("optimize", write_double_problem(tmp_path), "--max-turns", "500")
    assert outcome.exit_code == 2
    assert "max_turns must be between 1 and 200" in outcome.output and "Traceback" not in outcome.output
    missing = invoke("replay", tmp_path / "nope.jsonl")
    assert missing.exit_code == 2 and "Cannot read the session" in missing.output


def test_suite_reports_metrics_and_skips_finished_problems_on_rerun(tmp_path):
    folder = tmp_path / "level1"
    write_double_problem(folder, "1_double.py")
    write_problem(folder, "def get_inputs():\n    return []\n", "2_not_a_problem.py")  # no Model: reported
    out = tmp_path / "out"
    with ScriptedOpenAIServer() as server:
        server.reply_tool_calls([("Finish", {"summary": "gave up"})])
        first = invoke("suite", tmp_path, *model_flags(server), "--device", "cpu", "--out", out, "--json")
        assert first.exit_code == 0, first.output
        report = json.loads(first.stdout)
        assert [(o["problem"], o["status"]) for o in report["outcomes"]] == [
            ("level1/1_double.py", "finished"), ("level1/2_not_a_problem.py", "invalid")]
        assert report["pass_rate"] == 0.0 and report["mean_reward"] == -1.0
        assert (report["outcomes"][0]["failure"], report["outcomes"][0]["message"]) == ("no-candidate", "gave up")
        assert report["outcomes"][1]["failure"] == "problem" and "Model" in report["outcomes"][1]["message"]
        assert all(o["seconds"] >= 0 for o in report["outcomes"]) and report["fast_p_vs_both"] == {"1": 0.0, "1.05": 0.0}

        requests = len(server.requests)
        again = invoke("suite", tmp_path, *model_flags(server), "--device", "cpu", "--out", out)
    assert again.exit_code == 0 and len(server.requests) == requests, "finished problems are not run again"
    assert "pass rate" in again.stdout and "seconds per problem (median / max)" in again.stdout


def user_environment(tmp_path: Path) -> dict[str, str]:
    """The environment of a user who set none of kernelpilot's variables, except where the test run keeps its own
    folders: the run's precompiled torch header (else each such test builds one, about 20 s, in the home folder)
    and a cache folder of the run's (not the home folder's)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("KERNELPILOT_")}
    env["KERNELPILOT_CACHE_DIR"] = str(run_cache_dir(tmp_path))
    if os.environ.get("KERNELPILOT_PCH_DIR"):
        env["KERNELPILOT_PCH_DIR"] = os.environ["KERNELPILOT_PCH_DIR"]
    return env


def suite_with_the_built_in_policy(folder: Path, out: Path) -> subprocess.CompletedProcess:
    """`kernelpilot suite FOLDER` with no model (the built-in policy) on the CPU judge, as a user runs it."""
    env = user_environment(out)
    env.update(CUDA_VISIBLE_DEVICES="", COLUMNS="200", TORCH_CUDA_ARCH_LIST="9.0", PYTHONPATH=str(REPO_ROOT / "src"))
    return subprocess.run([sys.executable, "-m", "kernelpilot", "suite", str(folder), "--device", "cpu", "--dir", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=folder.parent, env=env)  # fmt: skip


def result_files(out: Path) -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in (out / "results").glob("*.json")}


def test_suite_results_and_report_say_why_an_unsupported_and_an_unloadable_problem_failed(tmp_path):
    folder = tmp_path / "problems"
    write_problem(folder, UNSUPPORTED_PROBLEM, "1_sort.py")
    broken_source = "import torch\n\nraise RuntimeError('the weights file is missing')\n\n\ndef get_inputs():\n    return []\n"
    write_problem(folder, broken_source, "2_broken.py")
    run = suite_with_the_built_in_policy(folder, tmp_path / "out")

    assert run.returncode == 0 and "Traceback" not in run.stdout + run.stderr, run.stderr
    results = result_files(tmp_path / "out")
    unsupported, broken = results["1_sort"], results["2_broken"]
    assert (unsupported["status"], unsupported["correct"], unsupported["failure"]) == ("finished", False, "no-candidate")
    assert unsupported["message"].startswith("No kernels written for 1_sort: Not supported by the built-in policy: "
                                             "aten.sort")  # fmt: skip
    assert (broken["status"], broken["failure"]) == ("invalid", "problem")
    assert "raised RuntimeError: the weights file is missing" in broken["message"]
    # The text report gives each failure whole, on a line of its own.
    lines = run.stdout.splitlines()
    assert f"  1_sort.py: no-candidate: {unsupported['message']}" in lines
    assert f"  2_broken.py: problem: {broken['message']}" in lines


@pytest.mark.cuda_build
def test_suite_results_give_the_failing_checks_kind_and_first_line(tmp_path):
    # The built-in policy's kernels build (nvcc, no GPU needed) but take CUDA tensors, so the CPU judge's trial fails.
    folder = tmp_path / "problems"
    write_double_problem(folder, "1_double.py")
    run = suite_with_the_built_in_policy(folder, tmp_path / "out")

    assert run.returncode == 0, run.stderr
    result = result_files(tmp_path / "out")["1_double"]
    assert (result["correct"], result["failure"]) == (False, "runtime")
    assert result["message"].startswith("ModelNew.forward (seed ") and "raised RuntimeError" in result["message"]
    assert f"  1_double.py: runtime: {result['message']}" in run.stdout.splitlines()


def test_suite_metrics_follow_kernelbench():
    outcomes = [
        ProblemOutcome("a", "finished", True, 3, speedup_vs_eager=2.0, speedup_vs_compile=1.5, cost_usd=0.1),
        ProblemOutcome("b", "finished", True, 2, speedup_vs_eager=1.04, speedup_vs_compile=0.5, cost_usd=0.2),
        ProblemOutcome("c", "max-turns", True, 1, speedup_vs_eager=None, speedup_vs_compile=None, cost_usd=0.3),
        ProblemOutcome("d", "finished", False, -1, cost_usd=0.4),
    ]
    report = summarize(outcomes)
    assert report.pass_rate == 0.75
    assert report.fast_p_vs_eager == {"1": 0.5, "1.05": 0.25}
    assert report.fast_p_vs_compile == {"1": 0.25, "1.05": 0.25}
    assert report.fast_p_vs_both == {"1": 0.25, "1.05": 0.25}  # b is faster than eager only
    assert report.geomean_speedup_vs_eager == pytest.approx((2.0 * 1.04) ** 0.5)
    assert report.mean_reward == pytest.approx(5 / 4)
    assert report.cost_usd == pytest.approx(1.0)
    assert summarize(outcomes + [ProblemOutcome("e", "finished", False, -1)]).cost_usd is None
    assert geometric_mean([None]) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path; on a GPU the built-in policy runs for real")
def test_no_gpu_is_one_sentence_with_no_policy_banner_and_no_workspace(tmp_path):
    env = user_environment(tmp_path)
    problem = write_double_problem(tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "kernelpilot", "optimize", str(problem), "--workspace", str(tmp_path / "ws")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "No model configured" not in run.stderr  # the banner shows only once the run proceeds
    assert not (tmp_path / "ws").exists()
    error_lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert error_lines == ["error: no CUDA GPU is visible, and verifying and timing kernels needs one."], run.stderr


def test_tui_command_reaches_the_run_with_optimize_defaults(tmp_path):
    # `kernelpilot tui` calls optimize() directly, so optimize's defaults must be plain values (an OptionInfo
    # default for --commit once made every `kernelpilot tui` refuse with the --commit sentence).
    run = subprocess.run([sys.executable, "-m", "kernelpilot", "tui", str(tmp_path / "missing.py")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "--commit" not in run.stdout + run.stderr
    assert "missing.py does not exist" in run.stdout + run.stderr


@pytest.mark.gpu
def test_optimize_with_no_model_writes_a_verified_kernel_faster_than_torch_compile(tmp_path):
    """The issue's "done when": `kernelpilot optimize examples/<x>.py` with no model and no key, on a GPU."""
    from kp_testing import EXAMPLES

    env = user_environment(tmp_path)
    output = tmp_path / "out" / "model_new.py"
    done = subprocess.run(
        [sys.executable, "-m", "kernelpilot", "optimize", str(EXAMPLES / "softmax_long_rows.py"),
         "--workspace", str(tmp_path / "ws"), "--output", str(output), "--json"],
        capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["model"] == "builtin" and summary["best"]["verify"]["ok"]
    assert summary["best"]["reward"] == 3, summary["best"]["bench"]
    assert output.is_file() and "kp_ops.policy_g0(x)" in output.read_text()
    assert not list((tmp_path / "ws" / "kernels").glob("example_*")), "the policy removed the scaffold's example"


def _finished_run(candidate_ms: float, compile_ms: float | None, bench_message: str = ""):
    from kernelpilot.agent.loop import RunSummary
    from kernelpilot.optimize import OptimizeResult
    from kernelpilot.results import BenchResult, EvalResult, Timing

    def timing(ms: float) -> Timing:
        return Timing(median_ms=ms, p10_ms=ms, p90_ms=ms, mean_ms=ms, runs=20)

    bench = BenchResult(ok=True, gpu="NVIDIA H100", candidate=timing(candidate_ms), eager=timing(1.0),
                        compiled=timing(compile_ms) if compile_ms else None, speedup_vs_eager=1.0 / candidate_ms,
                        speedup_vs_compile=compile_ms / candidate_ms if compile_ms else None,
                        message=bench_message, sol_candidate=0.8)  # fmt: skip
    best = EvalResult("problem", "/w", bench=bench, reward=2)
    summary = RunSummary(status="finished", session_id="s", turns=9, prompt_tokens=0, completion_tokens=0,
                         cost_usd=0.0, best=best)  # fmt: skip
    return OptimizeResult(problem=Path("model.py"), workspace=Path("ws"), model="builtin", summary=summary,
                          written=[Path("model_new.py")])  # fmt: skip


def test_a_run_whose_best_is_slower_than_torch_compile_says_so_plainly_at_the_end():
    from io import StringIO

    from rich.console import Console

    from kernelpilot.cli.render_agent import render_result

    slower = _finished_run(candidate_ms=0.50, compile_ms=0.40)
    out = StringIO()
    render_result(Console(file=out, width=200), slower)
    sentence = "torch.compile is faster here: 0.4 ms vs 0.5 ms for the best candidate (0.80x)."
    assert out.getvalue().rstrip().splitlines()[-1] == sentence
    assert slower.to_json()["compile_is_faster"] == sentence
    # Within 3% of torch.compile, or faster, nothing is said.
    assert _finished_run(candidate_ms=0.41, compile_ms=0.40).compile_is_faster is None
    assert _finished_run(candidate_ms=0.30, compile_ms=0.40).compile_is_faster is None


def test_suite_results_and_report_say_when_torch_compile_is_faster_or_has_no_time():
    from io import StringIO

    from rich.console import Console

    from kernelpilot.cli.render_agent import render_report
    from kernelpilot.suite import outcome_of

    slower = outcome_of("level1/a.py", _finished_run(candidate_ms=0.50, compile_ms=0.40))
    assert slower.correct and slower.message.startswith("torch.compile is faster here: 0.4 ms vs 0.5 ms")
    failed_compile = "torch.compile failed on this problem (Model.forward raised InductorError: ...)"
    untimed = outcome_of("level2/b.py", _finished_run(candidate_ms=0.5, compile_ms=None, bench_message=failed_compile))
    assert untimed.correct and untimed.speedup_vs_compile is None and untimed.message == failed_compile
    faster = outcome_of("level2/c.py", _finished_run(candidate_ms=0.30, compile_ms=0.40))
    assert faster.message == "" and faster.sol == 0.8
    out = StringIO()
    render_report(Console(file=out, width=200), summarize([slower, untimed, faster]))
    text = out.getvalue()
    assert "notes" in text and "why not correct" not in text
    assert f"level1/a.py: {slower.message}" in text and f"level2/b.py: {failed_compile}" in text
    assert "level2/c.py:" not in text
    assert "median % of speed-of-light" in text and "80% (of 3)" in text
