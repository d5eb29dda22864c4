"""scripts/bench_policy.py: how it judges the policy's workspaces (the rounding-faithful fallback and the launch
search, with a scripted judge) and the markdown table of its results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernelpilot.policy.analysis import analyze
from kernelpilot.policy.families import launch_candidates, render_all
from kernelpilot.problem import load_problem

from kp_testing import EXAMPLES, REPO_ROOT


class ScriptedJudge:
    """Judges a bench_policy workspace with chosen verdicts, one per evaluation (then correct); records the kernels
    it saw."""

    def __init__(self, *error_kinds: str | None):
        self.error_kinds = list(error_kinds)
        self.kernels: list[list[str]] = []

    def evaluate(self, workspace: str, trials: int = 5):
        from kernelpilot.results import EvalResult, VerifyResult

        self.kernels.append(sorted(path.name for path in (Path(workspace) / "kernels").glob("policy_g*.cu")))
        kind = self.error_kinds.pop(0) if self.error_kinds else None
        verify = VerifyResult(ok=kind is None, error_kind=kind, message=f"{kind} in trial 1" if kind else "")
        return EvalResult("problem", workspace, verify=verify, reward=1 if kind is None else -1, error_kind=kind,
                          message=verify.message)  # fmt: skip


def bench_policy_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_policy", REPO_ROOT / "scripts" / "bench_policy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("error_kind", "fallback"), [("mismatch", "faithful"), ("guard", None), ("crash", None)])
def test_bench_policy_judges_the_faithful_fallback_only_after_a_mismatch(tmp_path, error_kind, fallback):
    bench = bench_policy_script()
    path = EXAMPLES / "lora_residual_bf16.py"
    row = bench.prepare(path, tmp_path)
    judge = ScriptedJudge(error_kind)
    bench.judge_problem(judge, row, path, search=False)
    assert row.get("fallback") == fallback and row["correct"] == (fallback is not None)
    fused = ["policy_g0.cu", "policy_g1.cu"]
    assert judge.kernels == ([fused, fused + ["policy_g2.cu"]] if fallback else [fused])
    if fallback:
        assert row["first_message"] == "mismatch in trial 1"
        model_new = (Path(row["workspace"]) / "model_new.py").read_text()
        assert model_new == render_all(load_problem(path), analyze(load_problem(path), faithful=True))[-1].content


def test_bench_policy_searches_the_faithful_kernels_after_a_fallback(tmp_path):
    bench = bench_policy_script()
    path = EXAMPLES / "lora_residual_bf16.py"
    row = bench.prepare(path, tmp_path)
    judge = ScriptedJudge("mismatch")
    bench.judge_problem(judge, row, path, search=True)
    faithful = analyze(load_problem(path), faithful=True).generated_groups
    assert len(judge.kernels) == 2 + sum(len(launch_candidates(g)) - 1 for g in faithful)
    assert all(len(kernels) == 3 for kernels in judge.kernels[1:]) and set(row["configs"]) == {"g0", "g1", "g2"}


def test_bench_policy_search_records_why_a_try_was_rejected(tmp_path):
    bench = bench_policy_script()
    path = EXAMPLES / "lora_residual_bf16.py"
    row = bench.prepare(path, tmp_path)
    bench.judge_problem(ScriptedJudge(None, "mismatch", "crash"), row, path, search=True)
    assert [t["error_kind"] for t in row["tries"][1:3]] == ["mismatch", "crash"]
    assert [t["ms"] for t in row["tries"][1:3]] == [None, None] and row["correct"]


def bench_row(problem: str, **fields) -> dict:
    row = {"problem": problem, "supported": True, "correct": True, "eager_ms": 2.0, "compile_ms": 1.0,
           "ours_p10_ms": 0.4, "ours_p90_ms": 0.6, "bound": "memory", "configs": {"g0": "256 threads per row"}}
    return {**row, **fields}


def test_bench_policy_markdown_is_the_table_and_the_three_counts_of_the_goals():
    rows = [
        bench_row("b_win", ours_ms=0.5, vs_eager=4.0, vs_compile=2.0, sol=0.9),
        bench_row("a_parity", ours_ms=0.98, vs_eager=2.04, vs_compile=1.02, sol=0.7, bound="compute",
                  configs={"g0": "cuBLASLt heuristic algorithm 1 of 4", "g1": "128 threads per block"}, fallback="faithful"),
        bench_row("c_wrong", correct=False, message="trial 1 (seed 0): out: 3 elements outside tolerance\nmore"),
        {"problem": "d_unsupported", "supported": False, "note": "aten.sort is not supported"},
        bench_row("e_slow", ours_ms=1.25, vs_eager=1.6, vs_compile=0.8, sol=0.5),
    ]
    lines = bench_policy_script().markdown(rows).splitlines()
    assert lines[0].startswith("| problem | supported | correct |") and lines[0].count("|") == 11
    assert [line.split(" | ")[0] for line in lines[2:7]] == ["| a_parity", "| b_win", "| c_wrong", "| d_unsupported", "| e_slow"]
    assert lines[2].endswith("| 1.02x | 70% | g0: cuBLASLt heuristic algorithm 1 of 4; g1: 128 threads per block (faithful fallback) |")
    assert "| 0.500 (0.400–0.600) | 4.00x | 2.00x | 90% | 256 threads per row |" in lines[3]
    assert lines[4] == "| c_wrong | yes | **no** | - | - | - | - | - | - | trial 1 (seed 0): out: 3 elements outside tolerance |"
    assert lines[5] == "| d_unsupported | no | - | - | - | - | - | - | - | aten.sort is not supported |"
    assert lines[-3:] == ["- correct: 3 of 4 supported (5 problems)", "- >= 1.05x vs torch.compile: 1 of 4",
                          "- median % SOL of the memory-bound: 70% over 2"]


def test_bench_policy_markdown_names_a_missing_file_in_one_sentence(tmp_path):
    done = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "bench_policy.py"), "--markdown",
                           str(tmp_path / "nope.json")], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "no such file:" in done.stderr and "nope.json" in done.stderr
    assert "Traceback" not in done.stderr
