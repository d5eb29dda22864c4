"""Steering a run from another thread: pause, resume and stop between turns, and a session that reports records.

The agent loop runs on a worker thread and the UI on its own. `RunControl.between_turns` is the loop's `on_turn`
callback: while the run is paused it blocks on a threading.Event, so the loop really waits, and when a stop was
asked for it ends the run with RunEnded. `ReportingSession` writes every record exactly as Session does (so the
transcript stays resumable) and then hands the same record to a listener.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kernelpilot.agent import RunEnded
from kernelpilot.agent.session import RunState, Session
from kernelpilot.results import to_dict

Record = dict[str, Any]


class RunControl:
    """A pause/resume/stop switch the UI flips and the loop obeys at the end of each turn."""

    def __init__(self, on_change: Callable[[], None] | None = None):
        self._may_continue = threading.Event()
        self._may_continue.set()
        self._waiting = threading.Event()  # set while the loop is blocked between turns
        self._stop_status: str | None = None
        self._on_change = on_change or (lambda: None)

    @property
    def phase(self) -> str:
        """running | pausing (asked, turn not over) | paused (loop blocked) | stopping."""
        if self._stop_status is not None:
            return "stopping"
        if not self._may_continue.is_set():
            return "paused" if self._waiting.is_set() else "pausing"
        return "running"

    @property
    def stop_status(self) -> str | None:
        """The status a requested stop ends the run with, or None when no stop was asked for."""
        return self._stop_status

    @property
    def loop_waiting(self) -> bool:
        """Whether the loop is blocked between turns right now."""
        return self._waiting.is_set()

    def pause(self) -> None:
        """Hold the loop after the current turn, until resume or stop."""
        self._may_continue.clear()

    def resume(self) -> None:
        self._may_continue.set()

    def stop(self, status: str = "stopped") -> None:
        """End the run after the current turn (at once when paused); the first status asked for wins."""
        if self._stop_status is None:
            self._stop_status = status
        self._may_continue.set()

    def between_turns(self, state: RunState, last_action: str) -> None:
        """The loop's on_turn callback: wait while paused, then raise RunEnded if a stop was asked for."""
        if not self._may_continue.is_set():
            self._waiting.set()
            self._on_change()
            self._may_continue.wait()
            self._waiting.clear()
            self._on_change()
        if self._stop_status is not None:
            raise RunEnded(self._stop_status, "stopped from the terminal UI")


class ReportingSession(Session):
    """The same transcript as `session`, whose every record is also handed to `listener` once it is on disk."""

    def __init__(self, session: Session, listener: Callable[[Record], None]):
        super().__init__(session.path, session.messages, session.state)
        self._listener = listener

    def append(self, record_type: str, **fields: Any) -> None:
        super().append(record_type, **fields)
        # The listener sees the record as the file holds it (plain JSON-able values), live or replayed alike.
        self._listener({"type": record_type, **to_dict(fields)})
