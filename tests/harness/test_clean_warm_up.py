"""The reference's clean sandboxes warmed ahead of the first bench (`CleanSandboxes.warm` running
`bench.warm_clean_models` in a thread of the judge's worker while the candidate builds), with real sandbox processes
on the CPU. torch.compile on the CPU takes half a minute (inductor and g++), so here the compiled form is served by
the eager process, as in test_cache_trust.py; which form the warm-up asks for is what is recorded."""

from __future__ import annotations

import threading

import pytest

from kernelpilot.harness.bench import Baselines, baseline_key, store_baselines, warm_clean_models
from kernelpilot.harness.cache import MemoryCache
from kernelpilot.harness.sandbox_client import CleanSandboxes, SandboxPool
from kernelpilot.harness.shared import SHARED_DIR_ENV
from kernelpilot.problem import load_problem
from kernelpilot.results import Timing
from kp_testing import scale_problem


@pytest.fixture
def clean(tmp_path, monkeypatch):
    """Clean sandboxes of a tiny problem, recording every process they take or reserve (by which thread) and every
    call for the compiled form."""
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setenv(SHARED_DIR_ENV, str(shared))
    path = tmp_path / "model.py"
    path.write_text(scale_problem(rows=4, features=8))
    pool = SandboxPool("cpu", tmp_path, spares=1)  # as on a GPU: the spare is what can die with a thread
    taken, compiled = [], []
    for name in ("take", "reserve"):
        def recorded(method=getattr(pool, name), name=name):
            taken.append((name, threading.current_thread().name, method()))
            return taken[-1][2]

        setattr(pool, name, recorded)

    def compiled_served_by_eager(self):
        compiled.append(threading.current_thread().name)
        return self.eager()

    monkeypatch.setattr(CleanSandboxes, "compiled", compiled_served_by_eager)
    models = CleanSandboxes(pool, path)
    models.record = (load_problem(path), taken, compiled)  # type: ignore[attr-defined]
    yield models
    models.close()
    pool.close()


@pytest.mark.parametrize("cached", [False, True], ids=["no-baselines-cached", "baselines-cached"])
def test_the_warm_up_starts_the_clean_processes_and_the_bench_finds_them(clean, cached):
    problem, taken, compiled = clean.record
    cache = MemoryCache()
    if cached:  # what an earlier bench of the problem stored
        key = baseline_key(problem, device="cpu", dtype="float32")
        store_baselines(key, Baselines(eager=Timing(median_ms=1.0, p10_ms=1.0, p90_ms=1.0, mean_ms=1.0, runs=20)), cache)

    clean.warm(lambda models: warm_clean_models(problem, models, device="cpu", cache_dir=cache))
    eager = clean.eager()  # waits for the warm-up, then takes nothing more

    assert clean.warm_note == ""
    # Both forms' processes were launched by this thread, which outlives them (see the last test); the warm-up
    # loaded the eager one, and the bench took nothing more.
    assert [(how, thread) for how, thread, _ in taken] == [("reserve", "MainThread")] * 2 and taken[0][2] is eager
    assert eager.hello.get("ok") and eager.pid is not None
    # torch.compile is warmed (given its first, compiling call) only where the bench will measure it.
    assert compiled == ([] if cached else ["kernelpilot-warm-clean"])


def test_closing_during_the_warm_up_leaves_no_clean_process_running(clean):
    problem, taken, _ = clean.record
    started, release = threading.Event(), threading.Event()

    def slow_warm_up(models) -> None:
        started.set()
        release.wait()
        warm_clean_models(problem, models, device="cpu", cache_dir=MemoryCache())

    clean.warm(slow_warm_up)
    started.wait()
    closer = threading.Thread(target=clean.close)
    closer.start()
    release.set()
    closer.join()

    assert all(sandbox.pid is None for _, _, sandbox in taken), "close() returned with a clean process still running"
    with pytest.raises(RuntimeError, match="closed"):
        clean.eager()


def test_a_warm_up_that_fails_leaves_the_bench_to_start_the_processes(clean):
    _, taken, _ = clean.record

    def broken(models) -> None:
        raise ValueError("the reference raised")

    clean.warm(broken)
    eager = clean.eager()
    assert "ValueError: the reference raised" in clean.warm_note
    assert eager is taken[0][2] and eager.hello.get("ok")  # the bench loads the process reserved for the warm-up


def test_the_processes_the_warm_up_readied_outlive_its_thread(clean):
    """A sandbox arms PR_SET_PDEATHSIG, which fires when the *thread* that started it ends: the warm-up thread must
    start no process (on an H200 every warmed process, and the spare its take() launched, died with the thread,
    and a candidate loaded into that spare was killed mid-call)."""
    problem, _, _ = clean.record
    clean.warm(lambda models: warm_clean_models(problem, models, device="cpu", cache_dir=MemoryCache()))
    clean.wait_for_warm_up()
    eager = clean.eager()
    reply = eager.request("bind", {"slots": [], "inputs": None}, timeout=60.0)
    assert reply.get("ok"), reply
    spare = clean.pool.take()  # the spare the pool holds now: started by whom?
    assert spare.start().get("ok") and spare.pid is not None


def test_a_step_on_the_device_waits_for_the_warm_up_and_a_build_does_not(tmp_path, monkeypatch):
    """The worker runs a build beside a warm-up, but nothing that uses the device or the shared arena: on an H200 a
    verification that overlapped a warm-up's timing call aborted the worker (two threads in the arena)."""
    from kernelpilot.harness import worker

    monkeypatch.setenv(SHARED_DIR_ENV, "")  # WorkerState points it at its own folder; restored after the test
    state = worker.WorkerState("cpu")
    path = tmp_path / "model.py"
    path.write_text(scale_problem(rows=4, features=8))
    clean = state.clean_models(path, load_problem(path))
    release = threading.Event()
    clean.warm(lambda models: release.wait(), modes=())
    seen = lambda state, args: {"warm-up running": clean._warming.is_alive()}  # noqa: E731
    monkeypatch.setitem(worker.OPS, "build", seen)
    monkeypatch.setitem(worker.OPS, "verify", seen)
    try:
        assert worker.handle(state, {"op": "build"})["result"] == {"warm-up running": True}
        threading.Timer(0.2, release.set).start()  # (whenever it ends, the verification comes after it)
        assert worker.handle(state, {"op": "verify"})["result"] == {"warm-up running": False}
        assert state.warm_wait_s > 0
    finally:
        release.set()
        state.close()
