"""The baseline cache against a real sandboxed cheat on the CPU: candidates/signs_forged_baselines.py reads the judge's
signing key (reads are never confined) and signs a 25 ms torch.compile time into the judge's cache. Confined by
Landlock, it cannot write there and the cache serves the next bench as before; unconfined, the judge keeps its
measurements in its own memory and neither reads nor writes the cache folder.

The judge's side (`worker.WorkerState`, `op_bench`) runs in this process, so the test can choose how its sandboxes
start; the candidate and the reference run in real sandbox processes. Unconfined sandboxes are made the way the judge
would make them on a kernel without Landlock: the judge's side gives them no folders to confine their writes to (the
sandbox environment without `confine.WRITABLE_ENV`), so `confine.harden` returns "none" in the child. Nothing the
candidate can set chooses this: its process's environment is fixed before it starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelpilot.harness import process
from kernelpilot.harness.confine import WRITABLE_ENV, landlock_available
from kernelpilot.harness.sandbox_client import CleanSandboxes
from kernelpilot.harness.shared import SHARED_DIR_ENV
from kernelpilot.harness.worker import WorkerState, op_bench
from kernelpilot.results import BenchResult, from_dict
from kp_testing import scale_problem

CHEAT = Path(__file__).parent / "candidates" / "signs_forged_baselines.py"
FORGED_MS = 25.0  # the torch.compile time the cheat signs (its FORGED_MS)
UNTRUSTED = "sandboxes are not confined on this system (no Landlock)"  # in the bench's message, unconfined


@pytest.fixture
def cheat_workspace(tmp_path) -> Path:
    """The cheat as model_new.py of a tiny problem; the judge's cache folder will be its sibling tmp_path/cache."""
    root = tmp_path / "ws"
    root.mkdir()
    (root / "model.py").write_text(scale_problem(rows=4, features=8))
    (root / "model_new.py").write_text(CHEAT.read_text())
    return root


@pytest.fixture
def judge_side(monkeypatch):
    """A judge's trusted side in this process, closed after the test. torch.compile on the CPU takes half a minute
    (inductor and g++), so its baseline is timed in the eager sandbox: the cache does not care what was timed."""
    monkeypatch.setenv(SHARED_DIR_ENV, "")  # WorkerState points it at its own folder; restored after the test
    monkeypatch.setattr(CleanSandboxes, "compiled", CleanSandboxes.eager)
    states: list[WorkerState] = []

    def make() -> WorkerState:
        states.append(WorkerState("cpu"))
        return states[-1]

    yield make
    for state in states:
        state.close()


def unconfined_sandboxes(monkeypatch) -> None:
    """Sandboxes started from now on run as on a kernel without Landlock (`confine.harden` returns "none")."""
    made = process.sandbox_environment
    monkeypatch.setattr(process, "sandbox_environment",
                        lambda env, private_dir: {k: v for k, v in made(env, private_dir).items() if k != WRITABLE_ENV})  # fmt: skip


def bench(state: WorkerState, root: Path, cache_dir: Path) -> BenchResult:
    result = from_dict(BenchResult, op_bench(state, {"workspace": str(root), "cache_dir": str(cache_dir), "min_runs": 5}))
    assert result.ok, result.message
    return result


CONFINEMENTS = [
    pytest.param("landlock", marks=pytest.mark.skipif("not landlock_available()", reason="this kernel has no Landlock")),
    pytest.param("none", marks=pytest.mark.xfail(strict=True, reason="the cheat's signed entry is trusted")),
]


@pytest.mark.parametrize("confinement", CONFINEMENTS)
def test_a_candidate_that_reads_the_signing_key_cannot_forge_the_baselines(
    cheat_workspace, tmp_path, judge_side, monkeypatch, confinement
):
    if confinement == "none":
        unconfined_sandboxes(monkeypatch)
    cache_dir = tmp_path / "cache"
    state = judge_side()
    first = bench(state, cheat_workspace, cache_dir)  # the cheat forges while it is timed
    second = bench(state, cheat_workspace, cache_dir)  # ...and at import here
    for result in (first, second):
        print(f"eager {result.eager.median_ms} ms, compile {result.compiled.median_ms} ms: {result.message}")
        assert result.compiled.median_ms < FORGED_MS / 10, "the torch.compile baseline is the forged one"
    assert (second.eager, second.compiled) == (first.eager, first.compiled), "the second bench measured them again"
    stored = sorted(path.relative_to(cache_dir).as_posix() for path in cache_dir.rglob("*.json"))
    if confinement == "landlock":  # as before: signed on disk, and read from there by the second bench
        assert len(stored) == 1 and stored[0].startswith("baselines/"), stored
        assert UNTRUSTED not in first.message + second.message
    else:  # in the judge's memory only; measured anew once, and says why
        assert stored == []
        assert UNTRUSTED in first.message and UNTRUSTED not in second.message
