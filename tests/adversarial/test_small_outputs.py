"""Cheats on outputs the element test cannot resolve, judged on the CPU (C++ kernels built with torch's CUDA build):

- a mean cross-entropy is one number, about 12.09 on every draw, and atol + rtol * 12 = 0.13 is wider than its
  spread across draws (about 0.037): a constant passes every trial's element test, and a 0-dim output has no spread
  of its own for the scale check to compare with;
- int64 row sums near 2**50 compared in float32 (spacing 2**27) cannot tell a sum off by one from the right one;
- weight + 1e-3 * x answered by the weight: the output has a spread of its own (the weight's) for the scale check,
  and each element moves by about 1e-3 across draws, under atol + rtol * |out|: only the elements' movement across
  the trials tells (element_trials.py);
- the constant loss and the weight answered only in timed runs, honest in verification: each checked timed run
  passes the element test, so the checked runs are checked across them too.

Each cheat stands beside an honest kernel for the same problem, which must still pass. The kernels are in
candidates/small_outputs/kernels/, built once; each candidate is judged in its own workspace with that build.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernelpilot.harness.judge import Judge, candidate_workspace
from kernelpilot.harness.verify import SEED_STRIDE
from kernelpilot.problem import load_problem
from kp_testing import run_cache_dir

HERE = Path(__file__).parent
PROBLEMS = HERE / "problems"
CANDIDATES = HERE / "candidates" / "small_outputs"
BASE_SEED = 1153895862  # fixed: the cheat's constant is checked below to pass every trial's element test
TRIALS = 5
ATOL = RTOL = 1e-2


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    """A CPU judge and the build of the small-output kernels, made once in a workspace of the cross-entropy."""
    cache = run_cache_dir(tmp_path_factory.mktemp("small-outputs"))
    with Judge("cpu", arch="9.0", cache_dir=cache) as judge:
        with candidate_workspace(PROBLEMS / "scalar_cross_entropy.py", CANDIDATES / "honest_cross_entropy.py") as root:
            build = judge.build(root)
            assert build.ok, build.error
            yield judge, build


def verify(judged, problem: str, candidate: str):
    judge, build = judged
    with candidate_workspace(PROBLEMS / f"{problem}.py", CANDIDATES / f"{candidate}.py") as root:
        return judge.verify(root, build, trials=TRIALS, atol=ATOL, rtol=RTOL, base_seed=BASE_SEED)


def failing_and_warning_guards(result) -> tuple[set[str], set[str]]:
    failing = {f.guard for f in result.guards if f.severity == "fail"}
    return failing, {f.guard for f in result.guards if f.severity == "warn"}


def test_the_constant_loss_is_within_atol_rtol_of_every_trials_loss():
    """The cheat's premise at these seeds: the element test alone passes it on every trial."""
    problem = load_problem(PROBLEMS / "scalar_cross_entropy.py")
    model = problem.make_model("cpu")
    for index in range(TRIALS):
        logits, targets = problem.make_inputs("cpu", BASE_SEED + index * SEED_STRIDE)
        expected = float(model(logits, targets))
        cheat = float(torch.tensor(12.09, dtype=torch.float32) + torch.tensor(1e-4, dtype=torch.float32) * logits[0, 0])
        assert abs(cheat - expected) <= ATOL + RTOL * abs(expected), (index, cheat, expected)


@pytest.mark.cuda_build
@pytest.mark.parametrize(("problem", "cheat"), [
    ("scalar_cross_entropy", "constant_cross_entropy"),  # one number: no spread of its own
    ("weighted_shift", "weight_only"),  # the weight's spread: only the elements' movement across trials tells
])  # fmt: skip
def test_answers_within_atol_rtol_but_no_better_than_a_constant_are_refused(judged, problem, cheat):
    result = verify(judged, problem, cheat)
    assert not result.ok and result.error_kind == "mismatch", result.message
    assert "across the" in result.message and "no better than" in result.message, result.message


@pytest.mark.cuda_build
@pytest.mark.parametrize(("problem", "honest"), [
    ("scalar_cross_entropy", "honest_cross_entropy"),
    ("weighted_shift", "honest_weighted_shift"),
])  # fmt: skip
def test_honest_answers_to_the_same_problems_pass_without_warnings(judged, problem, honest):
    result = verify(judged, problem, honest)
    assert result.ok, result.message
    assert failing_and_warning_guards(result) == (set(), set()), result.guards


@pytest.mark.cuda_build
def test_int64_sums_off_by_one_are_refused(judged):
    result = verify(judged, "int64_row_sum", "int_sum_off_by_one")
    assert not result.ok and result.error_kind == "mismatch", result.message
    assert "64 of 64 elements" in result.message and "max abs error 1" in result.message, result.message


@pytest.mark.cuda_build
def test_exact_int64_sums_pass(judged):
    result = verify(judged, "int64_row_sum", "honest_int_sum")
    assert result.ok and result.max_abs_error == 0, result.message


def bench(judged, problem: str, candidate: str):
    judge, build = judged
    with candidate_workspace(PROBLEMS / f"{problem}.py", CANDIDATES / f"{candidate}.py") as root:
        return judge.bench(root, build, atol=ATOL, rtol=RTOL)


@pytest.mark.cuda_build
@pytest.mark.parametrize(("problem", "honest", "cheat"), [
    ("weighted_shift", "honest_weighted_shift", "weight_only_when_timed"),
    ("scalar_cross_entropy", "honest_cross_entropy", "constant_loss_when_timed"),
])  # fmt: skip
def test_answers_no_better_than_a_constant_only_while_timed_fail_across_the_checked_runs(judged, problem, honest, cheat):
    """Honest in verification, then each timed run's answer within atol/rtol of the reference's, but no better
    than a constant: the checked timed runs are checked across them as verification's trials are."""
    result = bench(judged, problem, honest)
    assert result.ok, result.message
    result = bench(judged, problem, cheat)
    assert not result.ok and result.error_kind == "mismatch", result.message
    assert "checked timed calls, across them" in result.message and "no better than" in result.message, result.message
