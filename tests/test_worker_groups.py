"""The promise of conftest.py's docstring that the test command relies on: with `-n auto --dist loadgroup`, tests
sharing a group run on one worker. (pytest 9.2 with pytest-xdist 3.8 broke it silently: every worker built every
session-scoped build, and CI ran minutes longer.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("xdist")

pytestmark = pytest.mark.slow

TESTS = '''
import os
import pytest

@pytest.mark.xdist_group("shared")
@pytest.mark.parametrize("n", range(6))
def test_grouped(n, tmp_path_factory):
    with open(os.environ["GROUP_LOG"], "a") as log:
        log.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.mark.parametrize("n", range(6))
def test_free(n):
    pass
'''


def test_a_group_runs_on_one_worker(tmp_path):
    (tmp_path / "test_grouping.py").write_text(TESTS)
    log = tmp_path / "workers.log"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "."],
        cwd=tmp_path, env={**_env(), "GROUP_LOG": str(log)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    workers = log.read_text().split()
    assert len(workers) == 6 and len(set(workers)) == 1, f"the group ran on workers {sorted(set(workers))}"


def _env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST_", "GROUP_LOG"))}
