"""Fixtures and markers of the agent tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from tools_testing import make_workspace

from kernelpilot.agent import ToolContext
from kp_testing import run_cache_dir

# Seconds each (CLI subprocesses, litellm retries and time-outs, a command killed at its time-out).
SLOW = {
    "test_bash_kills_a_command_and_its_children_at_the_timeout",
    "test_known_facts_read_the_caches_with_the_benches_own_key",
    "test_no_model_says_the_built_in_policy_is_used_and_no_gpu_is_one_sentence",
    "test_optimize_commit_outside_a_repository_refuses_before_the_run",
    "test_resume_continues_a_session_the_model_broke_off",
    "test_server_down_is_one_sentence_and_a_nonzero_exit",
    "test_suite_results_and_report_say_why_an_unsupported_and_an_unloadable_problem_failed",
    "test_tui_command_reaches_the_run_with_optimize_defaults",
}


def pytest_itemcollected(item):
    # Called for the items of this folder only (a collection hook through the item's own path).
    if item.originalname in SLOW:
        item.add_marker(pytest.mark.slow)


@pytest.fixture
def ctx(tmp_path) -> ToolContext:
    """A fresh workspace for the tool tests, with no judge."""
    return make_workspace(tmp_path)


@pytest.fixture(scope="session")
def double_problem_cpu_cache(tmp_path_factory) -> Path:
    """The run's judge cache folder, for the tests that time DOUBLE_PROBLEM on a CPU judge: session-scoped, so
    xdist runs them on one worker, one after the other, and only the first measures the problem's torch.compile
    baseline (about 30 s of CPU); run side by side, each measured it, as neither found it cached yet."""
    return run_cache_dir(tmp_path_factory.mktemp("double_problem"))
