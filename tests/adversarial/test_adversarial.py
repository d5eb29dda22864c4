"""The adversarial suite: cheating and broken candidates, each rejected by the judge for the right reason.

Each file in candidates/ is a model_new.py for one problem in problems/. They all call the kernels in
candidates/kernels/, which are built once through the judge and then loaded for every candidate; each candidate
is judged in its own workspace holding those sources, so the guards can tell its kernels from torch's. CASES says
what the judge must answer: the error kind, the exact set of failing guards, and the warnings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from kernelpilot.harness.judge import Judge, Timeouts, candidate_workspace
from kernelpilot.harness.confine import landlock_available

HERE = Path(__file__).parent
PROBLEMS = HERE / "problems"
CANDIDATES = HERE / "candidates"


@dataclass(frozen=True)
class Case:
    candidate: str  # candidates/<candidate>.py
    problem: str  # problems/<problem>.py
    error_kind: str | None  # None: the candidate is correct
    failing_guards: frozenset[str] = frozenset()
    warnings: frozenset[str] = frozenset()
    message: str = ""  # a piece of the verdict's message


def case(candidate, problem, error_kind, guards=(), warnings=(), message=""):
    return Case(candidate, problem, error_kind, frozenset(guards), frozenset(warnings), message)


HONEST = [
    case("honest_relu", "relu", None),
    case("honest_scale_shift", "scale_shift", None),
    case("honest_row_softmax", "row_softmax", None),
]

CHEATS = [
    case("torch_softmax", "row_softmax", "guard", {"torch-compute"}, message="aten::_softmax"),
    case("torch_in_thread", "relu", "guard", {"no-custom-kernel", "torch-compute"}),
    case("returns_input", "relu", "guard", {"output-aliases-input", "input-mutated"}),
    case("scribbles_input", "relu", "guard", {"input-mutated"}),
    case("global_cache", "relu", "guard", {"cached-output"}, message="previous call's memory"),
    case("view_of_cached", "relu", "guard", {"cached-output"}, message="self.cache"),
    case("reuses_output_buffer", "relu", "guard", {"cached-output"}, message="self.out"),
    case("side_stream", "relu", "guard", {"unsynced-stream"}),
    case("patches_synchronize", "relu", "guard", {"monkeypatch"}, message="torch.cuda.synchronize"),
    case("patches_elapsed_time", "relu", "guard", {"monkeypatch"}, message="torch.cuda.Event.elapsed_time"),
    case("hides_event", "relu", "guard", {"monkeypatch"}, message="torch.cuda.Event"),
    # Confined by Landlock, the sandbox cannot write model.py at all; unconfined, the rewrite is found afterwards.
    case("rewrites_model_py", "relu", "load", message="PermissionError")
    if landlock_available()
    else case("rewrites_model_py", "relu", "guard", {"protected-files"}, message="model.py"),
    case("wrong_second_seed", "scale_shift", "mismatch", message="trial 2"),
    case("partial_write", "relu", "mismatch", message="NaN at 1000 positions"),
    case("raises_in_forward", "relu", "runtime", message="must be contiguous"),
    case("huge_allocation", "relu", "oom"),
    case("out_of_bounds_write", "relu", "cuda-error", message="illegal memory access"),
    case("bf16_inside", "relu", None, warnings={"precision-drop"}, message="rounded to bf16"),
]

HANGS = [case("infinite_loop", "relu", "timeout")]


@pytest.fixture(scope="module")
def judge():
    with Judge("cuda", timeouts=Timeouts(build=600, verify=120, bench=300)) as judge:
        yield judge


@pytest.fixture(scope="module")
def shared_build(judge):
    """The suite's kernels, built once in a workspace that lives as long as the module's tests."""
    with candidate_workspace(PROBLEMS / "relu.py", CANDIDATES / "honest_relu.py") as ws_root:
        build = judge.build(ws_root)
        assert build.ok, build.error
        yield build


def judge_case(judge: Judge, build, case: Case):
    with candidate_workspace(PROBLEMS / f"{case.problem}.py", CANDIDATES / f"{case.candidate}.py") as ws_root:
        return judge.verify(ws_root, build, trials=5)


def assert_verdict(result, case: Case) -> None:
    failing = {finding.guard for finding in result.guards if finding.severity == "fail"}
    warnings = {finding.guard for finding in result.guards if finding.severity == "warn"}
    print(f"{case.candidate}: {result.error_kind or 'correct'} | guards {sorted(failing | warnings)} | {result.message}")
    verdict = f"{case.candidate}: {result.error_kind}: {result.message} | guards: {result.guards}"
    assert result.ok == (case.error_kind is None), verdict
    assert result.error_kind == case.error_kind, verdict
    assert failing == case.failing_guards, verdict
    assert warnings == case.warnings, verdict
    assert case.message in result.message + " ".join(f.message for f in result.guards), verdict


@pytest.mark.gpu
@pytest.mark.parametrize("case", HONEST + CHEATS, ids=lambda c: c.candidate)
def test_candidate_gets_the_expected_verdict(judge, shared_build, case):
    assert_verdict(judge_case(judge, shared_build, case), case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", HANGS, ids=lambda c: c.candidate)
def test_hanging_kernel_times_out_and_the_judge_carries_on(judge, shared_build, case):
    with Judge("cuda", timeouts=Timeouts(verify=30)) as impatient:
        assert_verdict(judge_case(impatient, shared_build, case), case)
        assert_verdict(judge_case(impatient, shared_build, HONEST[0]), HONEST[0])


@pytest.mark.gpu
@pytest.mark.parametrize("case", HONEST, ids=lambda c: c.candidate)
def test_honest_candidates_are_timed(judge, shared_build, case):
    with candidate_workspace(PROBLEMS / f"{case.problem}.py", CANDIDATES / f"{case.candidate}.py") as ws_root:
        bench = judge.bench(ws_root, shared_build, min_runs=20)
    assert bench.ok, bench.message
    assert bench.candidate is not None and bench.candidate.median_ms > 0


def test_every_candidate_file_has_a_case_and_the_suite_is_big_enough():
    assert len(CHEATS) + len(HANGS) >= 15 and len(HONEST) >= 3
    named = {path.stem for path in CANDIDATES.glob("*.py")}
    assert named == {c.candidate for c in HONEST + CHEATS + HANGS}
