"""Fixtures and markers of the core tests."""

from __future__ import annotations

import importlib
import re
import sys

import pytest

from build_testing import ARCH, scale_workspace
from capture_testing import write_user_package


@pytest.fixture
def isolated_git(tmp_path, monkeypatch):
    """Git sees neither the user's global nor the system configuration (signing, hooks, default branch)."""
    (tmp_path / "gitconfig").write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """The `layers` module of a user's package in tmp_path/project/src, importable in this process only (a child
    process does not have it on its path); the package's name is unique to the test, so no import is reused."""
    package = "userpkg_" + re.sub(r"\W", "_", tmp_path.name)
    monkeypatch.syspath_prepend(str(write_user_package(tmp_path / "project", package)))
    yield importlib.import_module(f"{package}.layers")
    for name in [name for name in sys.modules if name == package or name.startswith(f"{package}.")]:
        del sys.modules[name]


# Seconds each (CLI subprocesses, pre-commit runs, watch debouncing waited out).
SLOW = {
    "test_a_class_defined_in_the_script_being_run_is_refused",
    "test_check_without_a_gpu_says_so_and_passes_unless_a_gpu_is_required",
    "test_cli_init_reports_a_bad_problem_in_one_line",
    "test_pre_commit_runs_the_hook_from_this_repository_and_it_skips_without_a_gpu",
    "test_python_m_kernelpilot_init_exits_cleanly_on_a_missing_file",
    "test_the_problem_loads_and_passes_the_init_check_in_a_process_without_the_users_package",
    "test_the_installed_hook_with_require_gpu_blocks_the_commit_without_a_gpu",
    "test_watch_cli_stops_cleanly_on_ctrl_c",
}


def pytest_itemcollected(item):
    # Called for the items of this folder only (a collection hook through the item's own path).
    if item.originalname in SLOW:
        item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """One workspace (build_testing's scale kernel), cold-built once for the build tests and the builds ahead; each
    test leaves it built and its sources as they were."""
    from kernelpilot.build import build_workspace

    root = scale_workspace(tmp_path_factory.mktemp("scale_ws"))
    return root, build_workspace(root, arch=ARCH)
