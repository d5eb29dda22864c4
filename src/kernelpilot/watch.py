"""`kernelpilot watch`: re-evaluate a workspace whenever its kernels, bindings or model_new.py are saved.

watchdog reports file events; a burst of them (one editor save is several events, a save-all many more) is
debounced into one evaluation, and evaluations run one at a time on one thread. Every step is published as a
WatchEvent to the subscribed listeners: the CLI's terminal view (`cli/render_watch.py`) or the TUI. A failing evaluation is an
event, never a crash.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from kernelpilot.errors import KernelpilotError
from kernelpilot.lockfile import KERNEL_SUFFIXES
from kernelpilot.results import EvalResult

DEBOUNCE_SECONDS = 0.5
# Events that mean a file's content may have changed; reads (opened, closed without writing) are ignored, or the
# evaluation's own reads of model_new.py would trigger the next evaluation.
_CONTENT_EVENTS = frozenset({"created", "modified", "moved", "deleted", "closed"})
_log = logging.getLogger(__name__)


@dataclass
class WatchEvent:
    """One step of watch mode, as the listeners see it."""

    kind: str  # "evaluating" | "result" | "error"
    changed: list[str] = field(default_factory=list)  # workspace-relative files saved since the last evaluation
    result: EvalResult | None = None  # for "result"
    previous: EvalResult | None = None  # for "result": the result to compare with (None for the first)
    message: str = ""  # for "error": why the evaluation could not run


WatchListener = Callable[[WatchEvent], None]
Evaluate = Callable[[Path], EvalResult]


class WorkspaceWatcher:
    """Watches one workspace and runs `evaluate(root)` after each debounced burst of saves to its sources."""

    def __init__(self, root: Path, evaluate: Evaluate, *, debounce_s: float = DEBOUNCE_SECONDS):
        self.root = Path(root).resolve()
        self.debounce_s = debounce_s
        self._evaluate = evaluate
        self._listeners: list[WatchListener] = []
        self._condition = threading.Condition()
        self._pending: set[str] | None = None  # None: no evaluation requested
        self._last_request = 0.0
        self._stopping = False
        self._baseline: EvalResult | None = None
        self._observer = Observer()
        self._thread = threading.Thread(target=self._run, name="kernelpilot-watch", daemon=True)

    def subscribe(self, listener: WatchListener) -> None:
        """Call `listener` with every WatchEvent from now on (on the evaluation thread)."""
        self._listeners.append(listener)

    def start(self) -> None:
        """Start watching model_new.py and kernels/ (not build/, which every build rewrites)."""
        handler = _SourceEventHandler(self)
        self._observer.schedule(handler, str(self.root), recursive=False)
        self._observer.schedule(handler, str(self.root / "kernels"), recursive=True)
        self._observer.start()
        self._thread.start()

    def request(self, changed: Iterable[str] = ()) -> None:
        """Ask for an evaluation once no further request has come for `debounce_s` seconds."""
        with self._condition:
            self._pending = (self._pending or set()) | set(changed)
            self._last_request = time.monotonic()
            self._condition.notify_all()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching; an evaluation under way finishes (or is abandoned after `timeout`) without being shown."""
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
        self._observer.stop()
        self._observer.join(timeout)
        self._thread.join(timeout)

    def is_source(self, path: str) -> bool:
        """Whether a save of `path` should trigger an evaluation: model_new.py, or a kernel source or header."""
        try:
            relative = Path(path).resolve().relative_to(self.root)
        except ValueError:
            return False
        if relative.as_posix() == "model_new.py":
            return True
        return len(relative.parts) > 1 and relative.parts[0] == "kernels" and relative.suffix in KERNEL_SUFFIXES

    # -- the evaluation thread

    def _run(self) -> None:
        while (changed := self._next_batch()) is not None:
            self._evaluate_and_publish(changed)

    def _next_batch(self) -> list[str] | None:
        """Wait for a request, then for `debounce_s` of quiet; the files saved meanwhile, or None when stopping."""
        with self._condition:
            while self._pending is None and not self._stopping:
                self._condition.wait()
            while not self._stopping:
                quiet_for = time.monotonic() - self._last_request
                if quiet_for >= self.debounce_s:
                    break
                self._condition.wait(self.debounce_s - quiet_for)
            if self._stopping:
                return None
            changed, self._pending = sorted(self._pending or ()), None
            return changed

    def _evaluate_and_publish(self, changed: list[str]) -> None:
        self._publish(WatchEvent("evaluating", changed))
        try:
            result = self._evaluate(self.root)
        except KernelpilotError as err:
            self._publish(WatchEvent("error", changed, message=err.message))
            return
        except Exception as err:  # noqa: BLE001 - watch mode outlives any one evaluation; the user sees why it failed
            self._publish(WatchEvent("error", changed, message=f"{type(err).__name__}: {err}"))
            return
        self._publish(WatchEvent("result", changed, result=result, previous=self._baseline))
        # A compile error is a moment in an edit, not a state to compare against: the fix is compared with the
        # last candidate that built.
        if result.build is None or result.build.ok:
            self._baseline = result

    def _publish(self, event: WatchEvent) -> None:
        if self._stopping:
            return
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - one broken listener must not stop the others or the watcher
                _log.exception("a watch listener failed on a %s event", event.kind)


class _SourceEventHandler(FileSystemEventHandler):
    """Turns watchdog's events on sources into evaluation requests."""

    def __init__(self, watcher: WorkspaceWatcher):
        self.watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.is_directory or event.event_type not in _CONTENT_EVENTS:
            return
        # An editor's atomic save writes a temporary file and renames it over the source: the destination counts.
        paths = [event.src_path, getattr(event, "dest_path", "")]
        sources = [_text(path) for path in paths if path and self.watcher.is_source(_text(path))]
        if sources:
            self.watcher.request(Path(path).resolve().relative_to(self.watcher.root).as_posix() for path in sources)


def _text(path: str | bytes) -> str:
    return path.decode() if isinstance(path, bytes) else path


# ------------------------------------------------------------------------------------------------ diff


@dataclass
class Change:
    """One metric before and after a save."""

    metric: str  # "correct", "reward", "candidate ms", "speedup vs eager", "speedup vs compile", "kernel NAME ms"
    before: float | None
    after: float | None
    unit: str  # "ms" | "x" | "yes/no" | ""
    lower_is_better: bool = False

    @property
    def relative(self) -> float | None:
        """after / before - 1, for times and speedups."""
        if self.unit not in ("ms", "x") or not self.before or self.after is None:
            return None
        return self.after / self.before - 1

    @property
    def improved(self) -> bool | None:
        """True when it got better, False when worse, None when unchanged or not comparable."""
        if self.before is None or self.after is None or self.before == self.after:
            return None
        return (self.after < self.before) == self.lower_is_better

    @property
    def label(self) -> str:
        """The change in words: "+12.0%" for times and speedups, "better" or "worse" otherwise, "" when unchanged."""
        if self.improved is None:
            return ""
        relative = self.relative
        return f"{relative:+.1%}" if relative is not None else ("better" if self.improved else "worse")


def diff_results(previous: EvalResult | None, current: EvalResult) -> list[Change]:
    """The metrics of `current` next to those of `previous`: correctness, reward, times, speedups, each kernel."""
    changes = [
        Change("correct", _correct(previous), _correct(current), "yes/no"),
        Change("reward", _reward(previous), _reward(current), ""),
        Change("candidate ms", _candidate_ms(previous), _candidate_ms(current), "ms", lower_is_better=True),
        Change(
            "speedup vs eager",
            _bench_value(previous, "speedup_vs_eager"),
            _bench_value(current, "speedup_vs_eager"),
            "x",
        ),
        Change(
            "speedup vs compile",
            _bench_value(previous, "speedup_vs_compile"),
            _bench_value(current, "speedup_vs_compile"),
            "x",
        ),
    ]
    before, after = _kernel_ms(previous), _kernel_ms(current)
    for name in sorted(set(before) | set(after), key=lambda kernel: -max(before.get(kernel, 0), after.get(kernel, 0))):
        changes.append(Change(f"kernel {name} ms", before.get(name), after.get(name), "ms", lower_is_better=True))
    return changes


def _correct(result: EvalResult | None) -> float | None:
    if result is None or result.verify is None:
        return None
    return 1.0 if result.verify.ok else 0.0


def _reward(result: EvalResult | None) -> float | None:
    return float(result.reward) if result is not None else None


def _candidate_ms(result: EvalResult | None) -> float | None:
    if result is None or result.bench is None or not result.bench.ok or result.bench.candidate is None:
        return None
    return result.bench.candidate.median_ms


def _bench_value(result: EvalResult | None, name: str) -> float | None:
    if result is None or result.bench is None or not result.bench.ok:
        return None
    return getattr(result.bench, name)


def _kernel_ms(result: EvalResult | None) -> dict[str, float]:
    if result is None or result.bench is None or not result.bench.ok:
        return {}
    return {kernel.name: kernel.total_ms for kernel in result.bench.kernels}


def watch_workspace(
    root: Path,
    listener: WatchListener,
    *,
    device: str | None = None,
    trials: int = 5,
    bench: bool = True,
    on_ready: Callable[[Path], None] | None = None,
) -> None:
    """`kernelpilot watch`: evaluate now and after every save until Ctrl-C, each step published to `listener`.

    `on_ready` gets the workspace's folder once the judge is up and the watcher runs; Ctrl-C returns normally.
    """
    from kernelpilot.harness.judge import Judge
    from kernelpilot.workspace import open_workspace

    ws = open_workspace(root)
    with Judge(device) as judge:
        watcher = WorkspaceWatcher(ws.root, lambda path: judge.evaluate(path, trials=trials, bench=bench))
        watcher.subscribe(listener)
        watcher.start()
        try:
            if on_ready is not None:
                on_ready(ws.root)
            watcher.request()
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return
        finally:
            # No long wait for an evaluation under way: closing the judge right after stops its worker.
            watcher.stop(timeout=1.0)


def format_value(value: float | None, unit: str) -> str:
    """A metric's value as the terminal view and the TUI show it: ms and speedups rounded, "–" when there is none."""
    if value is None:
        return "–"
    if unit == "yes/no":
        return "yes" if value else "no"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "ms":
        return f"{value:.4g}"
    return f"{value:g}"
