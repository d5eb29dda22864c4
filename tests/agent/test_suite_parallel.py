"""`run_suite` scheduling: problems run concurrently, each worker on its own device; an interruption stops new
problems and leaves no result JSON, so a rerun does exactly the unfinished ones. The per-problem runner here is a
plain function standing in for the agent, whose own runs are tested in test_cli_optimize.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kernelpilot.config import Settings
from kernelpilot.errors import NoGPUError
from kernelpilot.suite import RESULTS_DIR, ProblemOutcome, find_problems, run_suite


def write_problems(folder: Path, *names: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text("# a problem file; the stand-in runner never reads it\ndef get_inputs():\n    return []\n")


def finished(problem: Path, folder: Path, reward: int = 1) -> ProblemOutcome:
    return ProblemOutcome(problem=str(problem.relative_to(folder)), status="finished", correct=reward >= 1, reward=reward)


def test_problems_run_at_once_one_per_worker_on_its_device(tmp_path):
    folder, out = tmp_path / "problems", tmp_path / "out"
    write_problems(folder, "1_a.py", "2_b.py")
    both_running = threading.Barrier(2, timeout=10)  # breaks (and fails the run) if the problems run one by one
    devices: dict[str, str | None] = {}

    def run_problem(problem, folder_, settings, out_dir, name, on_turn):
        devices[name] = settings.device
        both_running.wait()
        return finished(problem, folder_)

    report = run_suite(folder, Settings(device="cpu"), out, jobs=2, run_problem=run_problem)

    assert [outcome.problem for outcome in report.outcomes] == ["1_a.py", "2_b.py"]
    assert sorted((out / RESULTS_DIR).glob("*.json")) == [out / RESULTS_DIR / "1_a.json", out / RESULTS_DIR / "2_b.json"]
    assert devices == {"1_a": "cpu", "2_b": "cpu"}
    assert report.pass_rate == 1.0


def test_an_interruption_stops_new_problems_and_a_rerun_does_only_the_unfinished(tmp_path):
    folder, out = tmp_path / "problems", tmp_path / "out"
    write_problems(folder, "1_a.py", "2_b.py", "3_c.py")
    started: list[str] = []

    def interrupted_at_b(problem, folder_, settings, out_dir, name, on_turn):
        started.append(name)
        if name == "2_b":
            return ProblemOutcome(problem=name, status="interrupted", correct=False, reward=-1)
        return finished(problem, folder_)

    first = run_suite(folder, Settings(device="cpu"), out, run_problem=interrupted_at_b)
    assert started == ["1_a", "2_b"]
    assert [outcome.problem for outcome in first.outcomes] == ["1_a.py"]

    started.clear()

    def finishes(problem, folder_, settings, out_dir, name, on_turn):
        started.append(name)
        return finished(problem, folder_)

    again = run_suite(folder, Settings(device="cpu"), out, jobs=2, run_problem=finishes)
    assert sorted(started) == ["2_b", "3_c"]
    assert [outcome.problem for outcome in again.outcomes] == ["1_a.py", "2_b.py", "3_c.py"]


def test_ctrl_c_with_parallel_workers_leaves_no_result_for_the_problems_it_cut_short(tmp_path):
    """Found on a GPU: Ctrl-C (or `timeout -s INT`) reached the main thread, whose unwinding killed the judge
    workers; another worker's problem then failed with "the worker died during build" and was written as a
    finished result, so a rerun skipped it. A problem that ends after the interruption gets no result."""
    import signal

    # Ctrl-C as a terminal delivers it, whatever the test runner set (an xdist worker ignores SIGINT).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    folder, out = tmp_path / "problems", tmp_path / "out"
    write_problems(folder, "1_a.py", "2_b.py", "3_c.py")
    both_running = threading.Barrier(2, timeout=60)
    main_unwound = threading.Event()
    ended: list[str] = []

    def run_problem(problem, folder_, settings, out_dir, name, on_turn):
        both_running.wait()
        if name == "1_a":
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # Ctrl-C, to the main thread
        assert main_unwound.wait(timeout=60)  # generous: a loaded CI machine starves threads for seconds
        ended.append(name)
        # What a run whose judge worker was killed returns: a failure, not "interrupted".
        return ProblemOutcome(problem=name, status="finished", correct=False, reward=-1, failure="build",
                              message="the worker died during build (killed by SIGKILL); it will restart.")

    try:
        with pytest.raises(KeyboardInterrupt):
            try:
                run_suite(folder, Settings(device="cpu"), out, jobs=2, run_problem=run_problem)
            finally:
                main_unwound.set()
    finally:
        signal.signal(signal.SIGINT, previous)
    # Not Thread.join: on Python 3.11 a join that Ctrl-C interrupts marks the thread it waited for as stopped while
    # it still runs (bpo-45274's fix), and a later join returns at once. A thread leaves enumerate() when it exits.
    deadline = time.monotonic() + 30
    while any(t.name.startswith("lane-") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(ended) == ["1_a", "2_b"]
    assert not list((out / RESULTS_DIR).glob("*.json"))


def test_a_failing_problem_runner_error_reaches_the_caller(tmp_path):
    folder = tmp_path / "problems"
    write_problems(folder, "1_a.py", "2_b.py")

    def no_gpu(problem, folder_, settings, out_dir, name, on_turn):
        raise NoGPUError("no CUDA GPU is visible.", hint="Run it on a GPU machine.")

    with pytest.raises(NoGPUError):
        run_suite(folder, Settings(device="cpu"), tmp_path / "out", jobs=2, run_problem=no_gpu)
    assert not (tmp_path / "out" / RESULTS_DIR).exists()


def test_the_suite_takes_problem_files_and_skips_scripts_beside_them(tmp_path):
    """A folder like examples/: problems, and a subfolder with a user's model and a script that are not problems."""
    write_problems(tmp_path, "1_a.py")
    write_problems(tmp_path / "level2", "2_b.py")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny_gpt.py").write_text("class TinyGPT:\n    pass\n")
    (tmp_path / "models" / "run_it.py").write_text("print('a script')\n")
    write_problems(tmp_path / "kp-1_a", "model.py")  # a workspace's copy of a problem: not a problem of the folder
    assert find_problems(tmp_path) == [tmp_path / "1_a.py", tmp_path / "level2" / "2_b.py"]
    with pytest.raises(Exception, match="holds no problem files"):
        find_problems(tmp_path / "models")
