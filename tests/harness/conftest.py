"""Markers and shared fixtures of the harness tests."""

from __future__ import annotations

import pytest

# Seconds each (CLI subprocesses, fresh worker processes, a hang waited out, timing loops).
SLOW = {
    "test_a_judge_that_does_not_trust_the_folder_ignores_a_signed_entry_there_and_writes_nothing",
    "test_a_judge_that_must_be_confined_refuses_a_system_without_landlock_and_an_unconfined_sandbox",
    "test_a_candidate_that_reads_the_signing_key_cannot_forge_the_baselines",
    "test_a_hanging_candidate_is_killed_in_its_sandbox_and_the_worker_stays",
    "test_a_daemon_the_candidate_forks_does_not_outlive_the_step",
    "test_a_candidate_cannot_write_outside_its_sandbox",
    "test_a_candidate_idle_while_timed_fails_on_a_checked_timed_call",
    "test_a_candidate_memoising_by_input_gains_nothing_because_every_run_has_fresh_inputs",
    "test_cached_baselines_a_fresh_eager_run_refutes_are_measured_again",
    "test_a_segfault_is_a_crash",
    "test_an_abort_is_a_crash_with_the_signal_and_the_log_tail_and_the_worker_recovers",
    "test_bench_candidate_on_cpu_then_from_the_cache",
    "test_candidate_load_errors_are_one_sentence",
    "test_candidate_model_gets_the_reference_weights",
    "test_candidate_sees_its_own_model_and_leaves_nothing_behind",
    "test_close_stops_the_worker",
    "test_eval_cli_without_a_gpu_prints_one_error_line_and_exits_non_zero",
    "test_eval_says_whether_the_judges_sandboxes_were_confined_and_warns_once_when_not",
    "test_judge_without_a_gpu_refuses_with_one_sentence",
}


def pytest_itemcollected(item):
    # Called for the items of this folder only (a collection hook through the item's own path).
    if item.originalname in SLOW:
        item.add_marker(pytest.mark.slow)


@pytest.fixture
def relu_problem(tmp_path):
    """verify_testing.py's ReLU problem, written to tmp_path and loaded."""
    from verify_testing import RELU_PROBLEM, write_problem

    return write_problem(tmp_path, RELU_PROBLEM)
