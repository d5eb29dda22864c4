"""The milestone reward: every branch, and the threshold's boundary taken exactly."""

from __future__ import annotations

import pytest

from kernelpilot.harness.reward import milestone_reward, reward_of
from kernelpilot.results import BenchResult, BuildResult, EvalResult, VerifyResult


@pytest.mark.parametrize(
    ("built", "correct", "vs_eager", "vs_compile", "expected"),
    [
        (False, True, 2.0, 2.0, -1),  # not built: nothing else matters
        (True, False, 2.0, 2.0, -1),  # wrong: speedups do not matter
        (False, False, None, None, -1),
        (True, True, None, None, 1),  # correct, not timed
        (True, True, 1.0, 1.0, 1),
        (True, True, 1.05, 2.0, 1),  # exactly at the threshold is not faster
        (True, True, 1.0500001, 1.0, 2),
        (True, True, 1.2, None, 2),  # compile failed on the problem: at most 2
        (True, True, 1.2, 1.05, 2),
        (True, True, 1.2, 1.0500001, 3),
        (True, True, 0.9, 1.5, 1),  # beating compile alone is not a milestone
    ],
)
def test_milestone_reward_table(built, correct, vs_eager, vs_compile, expected):
    reward = milestone_reward(built=built, correct=correct, speedup_vs_eager=vs_eager, speedup_vs_compile=vs_compile)
    assert reward == expected


@pytest.mark.parametrize(("vs_eager", "vs_compile", "expected"), [(1.1, 1.1, 1), (1.3, 1.1, 2), (1.3, 1.25, 3)])
def test_threshold_is_configurable(vs_eager, vs_compile, expected):
    reward = milestone_reward(
        built=True, correct=True, speedup_vs_eager=vs_eager, speedup_vs_compile=vs_compile, threshold=1.2
    )
    assert reward == expected


def _result(*, build_ok: bool | None = True, verify_ok: bool | None = True, bench: BenchResult | None = None) -> EvalResult:
    build = None if build_ok is None else BuildResult(ok=build_ok, workspace="ws", extension_name="kp_kernels", arch="sm_90")
    verify = None if verify_ok is None else VerifyResult(ok=verify_ok)
    return EvalResult(problem_id="abc", workspace="ws", build=build, verify=verify, bench=bench)


FAST = BenchResult(ok=True, speedup_vs_eager=1.5, speedup_vs_compile=1.1)


def test_reward_of_a_fast_correct_candidate():
    assert reward_of(_result(bench=FAST)) == 3
    assert reward_of(_result(bench=FAST), threshold=1.2) == 2


def test_reward_of_a_candidate_without_a_build_step_counts_as_built():
    assert reward_of(_result(build_ok=None, bench=FAST)) == 3


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (_result(build_ok=False, verify_ok=None), -1),
        (_result(verify_ok=False, bench=FAST), -1),
        (_result(verify_ok=None), -1),
        (_result(bench=None), 1),
        (_result(bench=BenchResult(ok=False, speedup_vs_eager=3.0, speedup_vs_compile=3.0)), 1),
    ],
    ids=["build-failed", "wrong", "not-verified", "not-timed", "bench-failed"],
)
def test_reward_of_failures_and_missing_stages(result, expected):
    assert reward_of(result) == expected
