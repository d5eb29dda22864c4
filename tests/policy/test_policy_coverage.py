"""scripts/policy_coverage.py: each problem of a KernelBench-like folder analysed in a forked child with a time
limit, and the per-level counts, blockers and times it reports."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from kp_testing import REPO_ROOT
from policy_testing import write_problem

SCRIPT = REPO_ROOT / "scripts" / "policy_coverage.py"
pytestmark = pytest.mark.slow  # children, a time limit run out, a subprocess


def coverage_module():
    spec = importlib.util.spec_from_file_location("policy_coverage", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def benchmark(tmp_path):
    """A level of three problems: one the policy generates, one it names a blocker of, one that hangs in forward."""
    level = tmp_path / "level1"
    level.mkdir()
    write_problem(level, "1_relu", "def forward(self, x):\n    return torch.relu(x) * 2", "torch.randn(8, 16)")
    write_problem(level, "2_sort", "def forward(self, x):\n    return x.sort(1).values", "torch.randn(8, 16)")
    write_problem(level, "10_hangs", "def forward(self, x):\n    import time\n    time.sleep(60)\n    return x",
                  "torch.randn(8, 16)")  # fmt: skip
    return tmp_path


def test_each_problem_is_supported_named_or_out_of_time(benchmark):
    coverage = coverage_module()
    paths = coverage.problems(benchmark, 1, [])
    assert [path.stem for path in paths] == ["1_relu", "2_sort", "10_hangs"]  # KernelBench's numeric order
    # As the script does: torch's tracing machinery imported here, not in each forked child within its time limit
    # (without it each child took 2 s of the 5 on a busy 2-core machine; with it 0.2 s).
    coverage.warm_up()
    rows = [coverage.run_one(path, timeout_s=5.0, check_bytes=2**20) for path in paths]
    relu, sort, hangs = rows
    assert relu["supported"] and relu["groups"] == 1 and relu["check"].startswith("ok")
    assert not sort["supported"] and sort["reasons"] == ["aten.sort (no template for this op)"]
    assert not hangs["supported"] and hangs["reasons"] == ["analysis exceeded 5 s"] and hangs["seconds"] >= 5
    info = coverage.summary(1, rows, top=10)
    assert (info["problems"], info["supported"], info["slowest"]) == (3, 1, "10_hangs")
    assert info["blockers"] == [("aten.sort (no template for this op)", 1), ("analysis exceeded N s", 1)]
    assert info["checks"] == {"ok": 1}


def test_the_script_writes_every_row_and_summary_as_json(benchmark, tmp_path):
    out = tmp_path / "coverage.json"
    done = subprocess.run([sys.executable, str(SCRIPT), str(benchmark), "--levels", "1", "--only", "relu", "sort",
                           "--quiet", "--json", str(out)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "level 1: 1/2 supported" in done.stdout
    (level,) = json.loads(out.read_text())["levels"]
    assert [row["problem"] for row in level["rows"]] == ["1_relu", "2_sort"]


def test_a_missing_level_folder_is_one_sentence(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--levels", "1"], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode != 0 and "is not a folder: pass KernelBench's root" in done.stderr
