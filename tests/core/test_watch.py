"""Watch mode: which saves count, debouncing, one evaluation at a time, failures as events, the diff of two
results, the terminal view, a real CPU judge driven by file saves (compile error included), and Ctrl-C."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from kernelpilot.errors import KernelpilotError
from kernelpilot.results import BenchResult, EvalResult, KernelTime, Timing, VerifyResult
from kernelpilot.cli.render_watch import TerminalView
from kernelpilot.watch import WatchEvent, WorkspaceWatcher, diff_results
from kernelpilot.workspace import EXAMPLE_KERNELS, Workspace, init_workspace
from kp_testing import run_cache_dir, scale_mul_binding, scale_mul_candidate, scale_problem, write_problem

# Long enough for the quiet period to be unmistakable, short enough for quick tests.
DEBOUNCE_S = 0.4
EVENT_TIMEOUT_S = 10
BUILD_TIMEOUT_S = 300  # a cold build of the workspace's extension takes about 25 s on 2 cores


@pytest.fixture
def workspace(tmp_path) -> Workspace:
    ws, _ = init_workspace(write_problem(tmp_path, scale_problem(rows=32, features=64)), tmp_path / "kp-scale")
    return ws


class Recorder:
    """An evaluate callable for tests of the watcher itself: records each call and answers with a plain result."""

    def __init__(self, ws: Workspace):
        self.ws = ws
        self.calls: list[float] = []
        self.fail_with: Exception | None = None
        self.hold = threading.Event()
        self.hold.set()

    def __call__(self, root: Path) -> EvalResult:
        self.calls.append(time.monotonic())
        self.hold.wait(EVENT_TIMEOUT_S)
        if self.fail_with is not None:
            raise self.fail_with
        return EvalResult(problem_id=self.ws.problem_id, workspace=str(root), reward=len(self.calls))


@pytest.fixture
def watched(workspace):
    """A started watcher over `workspace` with a Recorder; yields (watcher, recorder, queue of its events)."""
    recorder = Recorder(workspace)
    watcher = WorkspaceWatcher(workspace.root, recorder, debounce_s=DEBOUNCE_S)
    events: queue.Queue[WatchEvent] = queue.Queue()
    watcher.subscribe(events.put)
    watcher.start()
    yield watcher, recorder, events
    watcher.stop()


def next_event(events: queue.Queue, kind: str, timeout: float = EVENT_TIMEOUT_S) -> WatchEvent:
    event = events.get(timeout=timeout)
    assert event.kind == kind, event
    return event


def assert_quiet(events: queue.Queue, seconds: float) -> None:
    try:
        extra = events.get(timeout=seconds)
    except queue.Empty:
        return
    pytest.fail(f"unexpected event {extra}")


def save(path: Path, text: str) -> None:
    path.write_text(text)


# ------------------------------------------------------------------------------------------ what counts


def test_only_model_new_and_kernel_sources_count_as_sources(workspace):
    watcher = WorkspaceWatcher(workspace.root, Recorder(workspace))
    root = workspace.root
    for name in ("model_new.py", "kernels/a.cu", "kernels/a.cuh", "kernels/a_binding.cpp", "kernels/sub/b.h"):
        assert watcher.is_source(str(root / name)), name
    for name in ("model.py", "notes.txt", "kernels/a.cu~", "kernels/.a.cu.swp", "kernels/4913", "build/a.cpp",
                 "build/versions/x/kp_kernels.so", "sub/model_new.py"):  # fmt: skip
        assert not watcher.is_source(str(root / name)), name
    assert not watcher.is_source(str(root.parent / "model_new.py"))


# ------------------------------------------------------------------------------------------- debounce


def test_a_burst_of_saves_is_one_evaluation_after_the_quiet_period(watched, workspace):
    watcher, recorder, events = watched
    kernel = workspace.kernels_dir / "example_scale_shift.cu"
    started = time.monotonic()
    for edit in range(5):
        save(kernel, f"// edit {edit}\n")
        time.sleep(0.05)
    last_save = time.monotonic()  # (before the save: the test's thread may be held up after it, the watcher's not)
    save(workspace.model_new_path, "# edited\n")
    save(workspace.root / "notes.txt", "not a source\n")

    evaluating = next_event(events, "evaluating")
    result = next_event(events, "result")

    assert evaluating.changed == ["kernels/example_scale_shift.cu", "model_new.py"]
    assert len(recorder.calls) == 1
    assert recorder.calls[0] - last_save >= DEBOUNCE_S, "it waited for the saves to stop"
    assert recorder.calls[0] - started >= DEBOUNCE_S
    assert result.result.reward == 1 and result.previous is None
    assert_quiet(events, DEBOUNCE_S * 3)

    save(kernel, "// one more edit\n")
    next_event(events, "evaluating")
    second = next_event(events, "result")
    assert len(recorder.calls) == 2
    assert second.previous is result.result, "each result is compared with the one before"


def test_an_editors_atomic_save_counts_by_the_file_it_replaces(watched, workspace):
    _, recorder, events = watched
    temporary = workspace.kernels_dir / "example_scale_shift.cu.tmp123"
    save(temporary, "// saved atomically\n")
    os.replace(temporary, workspace.kernels_dir / "example_scale_shift.cu")

    assert next_event(events, "evaluating").changed == ["kernels/example_scale_shift.cu"]
    next_event(events, "result")
    assert len(recorder.calls) == 1


def test_saves_during_an_evaluation_make_exactly_one_more(watched, workspace):
    watcher, recorder, events = watched
    recorder.hold.clear()
    watcher.request()
    next_event(events, "evaluating")
    for edit in range(3):
        save(workspace.model_new_path, f"# edit {edit} while evaluating\n")
        time.sleep(0.05)
    time.sleep(DEBOUNCE_S * 2)
    assert len(recorder.calls) == 1, "evaluations never overlap"
    recorder.hold.set()

    next_event(events, "result")
    assert next_event(events, "evaluating").changed == ["model_new.py"]
    next_event(events, "result")
    assert len(recorder.calls) == 2
    assert_quiet(events, DEBOUNCE_S * 3)


# ------------------------------------------------------------------------------------ nothing crashes


def test_a_failing_evaluation_is_an_event_and_watching_goes_on(watched, workspace):
    watcher, recorder, events = watched
    recorder.fail_with = KernelpilotError("Protected workspace files were changed or deleted: model.py.")
    watcher.request()
    next_event(events, "evaluating")
    assert next_event(events, "error").message == "Protected workspace files were changed or deleted: model.py."

    recorder.fail_with = RuntimeError("the worker pipe closed")
    save(workspace.model_new_path, "# again\n")
    next_event(events, "evaluating")
    assert next_event(events, "error").message == "RuntimeError: the worker pipe closed"

    recorder.fail_with = None
    save(workspace.model_new_path, "# and again\n")
    next_event(events, "evaluating")
    assert next_event(events, "result").result is not None


def test_a_broken_listener_does_not_stop_the_others(watched):
    watcher, _, events = watched
    seen: list[str] = []

    def broken(event: WatchEvent) -> None:
        raise ValueError("a listener bug")

    watcher.subscribe(broken)
    watcher.subscribe(lambda event: seen.append(event.kind))
    watcher.request()
    next_event(events, "evaluating")
    next_event(events, "result")
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while seen != ["evaluating", "result"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == ["evaluating", "result"]


# ----------------------------------------------------------------------------------------- the diff


def timed_result(candidate_ms: float, kernels: dict[str, float], correct: bool = True) -> EvalResult:
    timing = lambda ms: Timing(median_ms=ms, p10_ms=ms, p90_ms=ms, mean_ms=ms, runs=50)  # noqa: E731
    return EvalResult(
        problem_id="p",
        workspace="ws",
        verify=VerifyResult(ok=correct),
        bench=BenchResult(
            ok=True,
            gpu="NVIDIA H100 80GB HBM3",
            candidate=timing(candidate_ms),
            eager=timing(1.0),
            compiled=timing(0.8),
            speedup_vs_eager=1.0 / candidate_ms,
            speedup_vs_compile=0.8 / candidate_ms,
            kernels=[KernelTime(name=name, total_ms=ms, calls=1) for name, ms in kernels.items()],
        ),
        reward=3 if candidate_ms < 0.8 else 2,
    )


def test_diff_compares_times_speedups_correctness_and_each_kernel():
    before = timed_result(0.5, {"softmax_kernel": 0.4, "copy_kernel": 0.1})
    after = timed_result(1.0, {"softmax_kernel": 0.7, "reduce_kernel": 0.3})

    changes = {change.metric: change for change in diff_results(before, after)}

    candidate = changes["candidate ms"]
    assert (candidate.before, candidate.after, candidate.relative, candidate.improved) == (0.5, 1.0, 1.0, False)
    assert changes["speedup vs compile"].improved is False
    assert changes["speedup vs compile"].relative == pytest.approx(-0.5)
    assert changes["reward"].before == 3 and changes["reward"].after == 2
    assert changes["correct"].improved is None, "correct both times"
    assert (changes["kernel reduce_kernel ms"].before, changes["kernel reduce_kernel ms"].after) == (None, 0.3)
    assert (changes["kernel copy_kernel ms"].before, changes["kernel copy_kernel ms"].after) == (0.1, None)
    assert changes["kernel softmax_kernel ms"].improved is False
    kernel_rows = [metric for metric in changes if metric.startswith("kernel ")]
    assert kernel_rows[0] == "kernel softmax_kernel ms", "the biggest kernel first"

    faster = {change.metric: change for change in diff_results(after, before)}
    assert faster["candidate ms"].improved is True and faster["speedup vs eager"].improved is True

    labels = [changes[metric].label for metric in ("candidate ms", "speedup vs compile", "reward", "correct")]
    assert labels == ["+100.0%", "-50.0%", "worse", ""], "the words the terminal view and the TUI both show"


def test_the_terminal_view_prints_the_result_and_its_diff():
    console = Console(record=True, width=120)
    view = TerminalView(console)
    before = timed_result(0.5, {"softmax_kernel": 0.4})
    after = timed_result(0.25, {"softmax_kernel": 0.2})

    view(WatchEvent("evaluating", ["kernels/softmax.cu"]))
    view(WatchEvent("result", ["kernels/softmax.cu"], result=after, previous=before))
    view(WatchEvent("error", [], message="the worker pipe closed"))

    text = console.export_text()
    for expected in ("kernels/softmax.cu: building, verifying, timing", "correct · reward 3", "candidate ms", "0.5",
                     "0.25", "-50.0%", "+100.0%", "4.00x", "kernel softmax_kernel ms",
                     "could not evaluate: the worker pipe closed"):  # fmt: skip
        assert expected in text, expected


# ---------------------------------------------------------------------------------- a real CPU judge


@pytest.mark.cuda_build
def test_saves_drive_a_real_cpu_judge_through_a_compile_error_and_its_fix(workspace, tmp_path, monkeypatch):
    from kernelpilot.harness.judge import Judge

    monkeypatch.setenv("KERNELPILOT_CACHE_DIR", str(run_cache_dir(tmp_path)))
    for example in EXAMPLE_KERNELS:
        (workspace.root / example).unlink()
    binding = workspace.kernels_dir / "scale_mul_binding.cpp"
    honest_binding = scale_mul_binding()
    save(binding, honest_binding)
    save(workspace.model_new_path, scale_mul_candidate(features=64))
    console = Console(record=True, width=160)
    events: queue.Queue[WatchEvent] = queue.Queue()

    with Judge("cpu", arch="9.0") as judge:
        watcher = WorkspaceWatcher(workspace.root, lambda root: judge.evaluate(root, trials=2, bench=False))
        watcher.subscribe(TerminalView(console))
        watcher.subscribe(events.put)
        watcher.start()
        try:
            watcher.request()
            next_event(events, "evaluating")
            first = next_event(events, "result", BUILD_TIMEOUT_S).result
            save(binding, honest_binding.replace("ys[i] = xs[i]", "ys[i] = undeclared_name[i]"))
            assert next_event(events, "evaluating").changed == ["kernels/scale_mul_binding.cpp"]
            broken = next_event(events, "result", BUILD_TIMEOUT_S).result
            save(binding, honest_binding)
            next_event(events, "evaluating")
            fixed = next_event(events, "result", BUILD_TIMEOUT_S)
            assert_quiet(events, 3.0)  # the builds' own writes under build/ trigger nothing
        finally:
            watcher.stop()

    assert first.verify.ok, first.message
    assert not broken.build.ok and broken.error_kind == "build"
    assert any(d.severity == "error" and "undeclared_name" in d.message for d in broken.build.diagnostics)
    assert fixed.result.verify.ok, fixed.result.message
    assert fixed.previous is first, "the fix is compared with the last candidate that built"
    text = console.export_text()
    assert "build failed" in text and "scale_mul_binding.cpp:" in text and "undeclared_name" in text
    assert text.count("correct · reward") == 2


# ------------------------------------------------------------------------------------------- the CLI


def _sigint_as_at_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_watch_cli_stops_cleanly_on_ctrl_c(workspace):
    process = subprocess.Popen(
        [sys.executable, "-m", "kernelpilot", "watch", str(workspace.root), "--device", "cpu", "--no-bench"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TORCH_CUDA_ARCH_LIST": "9.0"},
        # Ctrl-C as at a terminal, however pytest was started: a shell's background job inherits SIGINT ignored, and
        # Python then leaves it ignored in every process it starts.
        preexec_fn=_sigint_as_at_a_terminal,
    )  # fmt: skip
    try:
        first_line = process.stdout.readline()
        assert first_line.startswith("watching "), first_line + process.stderr.read()
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert "stopped watching" in stdout
    assert "Traceback" not in stdout + stderr
