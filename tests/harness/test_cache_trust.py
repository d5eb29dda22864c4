"""The baseline cache against a real sandboxed cheat on the CPU: tests/adversarial/candidates/cpu/
signs_forged_baselines.py (the adversarial folder's cheats judged without a GPU) reads the judge's signing key
(reads are never confined) and signs a 25 ms torch.compile time into the judge's cache. Confined by
Landlock, it cannot write there and the cache serves the next bench as before; unconfined, the judge keeps its
measurements in its own memory and neither reads nor writes the cache folder.

The judge's side (`worker.WorkerState`, `op_bench`) runs in this process, so the test can choose how its sandboxes
start; the candidate and the reference run in real sandbox processes. Unconfined sandboxes are made the way the judge
would make them on a kernel without Landlock (`confinement_testing.unconfine_sandboxes`): the judge's side gives them
no folders to confine their writes to, so `confine.harden` returns "none" in the child. Nothing the candidate can set
chooses this: its process's environment is fixed before it starts.

Below, the judge's side alone: which sandboxes' word ends the trust in the folder, and a judge that does not trust it
ignoring a signed entry there (what a cheat wrote before, or under a judge of another system sharing the folder).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from confinement_testing import unconfine_sandboxes
from kernelpilot.harness.confine import landlock_available
from kernelpilot.harness.sandbox_client import CleanSandboxes, SandboxPool
from kernelpilot.harness.shared import SHARED_DIR_ENV
from kernelpilot.harness.worker import WorkerState, op_bench
from kernelpilot.results import BenchResult, from_dict
from kp_testing import scale_problem

CHEAT = Path(__file__).parents[1] / "adversarial" / "candidates" / "cpu" / "signs_forged_baselines.py"
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


def agree_within_load(monkeypatch) -> None:
    """A cached eager time is used when a fresh calibration agrees with it. This problem's call takes about 0.01 ms,
    which a busy machine can time several times slower from one bench to the next: on the CPU the two agree unless
    10x off (bench.CPU_BASELINE_BAND), said here so that a change of the band does not make this test flaky. (The
    cheat keeps the cached eager time, so the agreement is no defence against it; a forged eager is refuted in
    test_bench.py.)"""
    from kernelpilot.harness import bench as bench_module

    monkeypatch.setattr(bench_module, "CPU_BASELINE_BAND", 10.0)


@pytest.fixture
def judge_side(monkeypatch):
    """A judge's trusted side in this process, closed after the test. torch.compile on the CPU takes half a minute
    (inductor and g++), so its baseline is timed in the eager sandbox: the cache does not care what was timed."""
    monkeypatch.setenv(SHARED_DIR_ENV, "")  # WorkerState points it at its own folder; restored after the test
    monkeypatch.setattr(CleanSandboxes, "compiled", CleanSandboxes.eager)
    agree_within_load(monkeypatch)
    states: list[WorkerState] = []

    def make() -> WorkerState:
        states.append(WorkerState("cpu"))
        return states[-1]

    yield make
    for state in states:
        state.close()


def bench(state: WorkerState, root: Path, cache_dir: Path) -> BenchResult:
    args = {"workspace": str(root), "cache_dir": str(cache_dir), "min_runs": 5}
    result = from_dict(BenchResult, op_bench(state, args))
    assert result.ok, result.message
    return result


CONFINEMENTS = [
    pytest.param("landlock", marks=pytest.mark.skipif(not landlock_available(), reason="this kernel has no Landlock")),
    "none",
]


@pytest.mark.parametrize("confinement", CONFINEMENTS)
def test_a_candidate_that_reads_the_signing_key_cannot_forge_the_baselines(
    cheat_workspace, tmp_path, judge_side, monkeypatch, confinement
):
    if confinement == "none":
        unconfine_sandboxes(monkeypatch.setattr)
    cache_dir = tmp_path / "cache"
    state = judge_side()
    first = bench(state, cheat_workspace, cache_dir)  # the cheat forges while it is timed
    second = bench(state, cheat_workspace, cache_dir)  # ...and at import here
    for result in (first, second):
        print(f"eager {result.eager.median_ms} ms, compile {result.compiled.median_ms} ms: {result.message}")
        assert result.compiled.median_ms < FORGED_MS / 10, "the torch.compile baseline is the forged one"
    assert (second.eager, second.compiled) == (first.eager, first.compiled), "the second bench measured them again"
    stored = sorted(path.relative_to(cache_dir).as_posix() for path in cache_dir.rglob("*.json"))
    assert state.pool.confined == (confinement == "landlock"), "the sandboxes' own word, before any candidate ran"
    if confinement == "landlock":  # as before: signed on disk, and read from there by the second bench
        assert len(stored) == 1 and stored[0].startswith("baselines/"), stored
        assert UNTRUSTED not in first.message + second.message
    else:  # in the judge's memory only (the folder was never made: no key, no entry); measured anew once, and says why
        assert not cache_dir.exists(), stored
        assert UNTRUSTED in first.message and UNTRUSTED not in second.message


# ------------------------------------------------------------------------------------ the judge's side alone


class HelloOnly:
    """A sandbox that only says hello: `hellos` are what the next ones say, in order."""

    hellos: list[dict] = []

    def __init__(self, device: str, *, log_dir: Path):
        self.pid = None

    def start(self) -> dict:
        return HelloOnly.hellos.pop(0) if HelloOnly.hellos else {"ok": True, "confinement": "landlock"}

    def launch(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("kernel_has_landlock", [True, False])
def test_the_cache_folder_is_trusted_only_while_every_sandbox_was_confined(tmp_path, monkeypatch, kernel_has_landlock):
    from kernelpilot.harness import confine, sandbox_client
    from kernelpilot.harness.cache import MemoryCache

    monkeypatch.setattr(confine, "landlock_available", lambda: kernel_has_landlock)
    monkeypatch.setattr(sandbox_client, "Sandbox", HelloOnly)
    monkeypatch.setenv(SHARED_DIR_ENV, "")
    folder = tmp_path / "cache"
    state = WorkerState("cpu")
    try:
        HelloOnly.hellos = [{"ok": True, "confinement": "landlock"}, {"ok": False, "message": "did not start"},
                            {"ok": True, "confinement": "none"}, {"ok": True, "confinement": "landlock"}]  # fmt: skip
        trusted = []
        for _ in range(4):
            state.pool.take()
            trusted.append(state.cache_for(folder) == folder)
        # A sandbox that never started ran no candidate; one unconfined sandbox ends the trust for good.
        assert trusted == ([True, True, False, False] if kernel_has_landlock else [False] * 4)
        assert isinstance(state.cache_for(folder), MemoryCache) and state.cache_for(None) is state.cache_for(folder)
    finally:
        state.close()


def test_a_judge_that_does_not_trust_the_folder_ignores_a_signed_entry_there_and_writes_nothing(tmp_path, monkeypatch):
    """What a cheat signed into the folder (before, or under a judge of another system sharing it) is what a judge
    trusting the folder reports; a judge keeping its measurements in memory measures them and leaves the folder as
    it was."""
    from kernelpilot.harness import bench
    from kernelpilot.harness.cache import MemoryCache
    from kernelpilot.harness.sandbox_client import InProcessClean, InProcessModel
    from kernelpilot.problem import load_problem
    from kernelpilot.results import Timing

    monkeypatch.setattr(InProcessClean, "compiled", InProcessClean.eager)  # (as judge_side: no inductor here)
    agree_within_load(monkeypatch)
    path = tmp_path / "problem.py"
    path.write_text(scale_problem(rows=4, features=8))
    problem = load_problem(path)
    folder = tmp_path / "cache"

    def bench_in(cache: Path | MemoryCache) -> BenchResult:
        candidate = InProcessModel.from_class(problem, type(problem.make_model("cpu")), device="cpu", seed=0)
        result = bench.bench_candidate(problem, candidate, InProcessClean(problem, "cpu"), device="cpu", seed=0,
                                       cache_dir=cache, min_runs=5)  # fmt: skip
        assert result.ok, result.message
        return result

    honest = bench_in(folder)
    key = bench.baseline_key(problem, device="cpu", dtype="float32")
    slow = Timing(median_ms=FORGED_MS, p10_ms=FORGED_MS, p90_ms=FORGED_MS, mean_ms=FORGED_MS, runs=20)
    bench.store_baselines(key, bench.Baselines(eager=honest.eager, compiled=slow), folder)  # as the cheat signs it
    assert bench_in(folder).compiled == slow, "a judge trusting the folder reports the signed entry"
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    untrusting = bench_in(MemoryCache(note=UNTRUSTED))
    assert untrusting.compiled.median_ms < FORGED_MS / 10 and UNTRUSTED in untrusting.message
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


@pytest.fixture
def launched(monkeypatch) -> list:
    """Every sandbox a pool launches, in order: sandboxes that only say hello (no process)."""
    from kernelpilot.harness import sandbox_client

    launched: list = []

    class Recording(HelloOnly):
        def launch(self) -> None:
            launched.append(self)

    monkeypatch.setattr(sandbox_client, "Sandbox", Recording)
    return launched


def test_a_spare_started_ahead_is_the_first_sandbox_handed_out(tmp_path, launched):
    """On a GPU the worker starts the first sandbox while it builds (`op_build`): the verification after the build
    takes that one, and a second prelaunch while it is starting starts nothing more."""
    pool = SandboxPool("cpu", tmp_path, spares=1)
    pool.prelaunch()
    pool.prelaunch()
    assert len(launched) == 1
    assert pool.take() is launched[0] and len(launched) == 2  # the next spare starts as this one is taken
    pool.close()


def test_a_cpu_judge_starts_no_spare_that_would_run_beside_the_timed_candidate(tmp_path, launched):
    pool = SandboxPool("cpu", tmp_path)
    pool.prelaunch()
    assert launched == []
    assert pool.take() is launched[0] and len(launched) == 1, "started when needed, and no spare after it"
    assert SandboxPool("cuda", tmp_path).spares == 2


def test_a_gpu_judge_keeps_two_spares_and_hands_out_the_oldest(tmp_path, launched):
    """A search's turns come every 2-3 s: one spare, started as the last was taken, was still importing torch."""
    pool = SandboxPool("cuda", tmp_path)
    pool.prelaunch()
    pool.prelaunch()
    assert len(launched) == 2
    assert pool.take() is launched[0] and len(launched) == 3
    assert pool.reserve() is launched[1] and len(launched) == 4
    pool.close()
