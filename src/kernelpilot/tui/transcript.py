"""The transcript panel: the model's messages, its tool calls with their outputs (long ones collapsed), and verdicts."""

from __future__ import annotations

import json
from typing import Any

from textual.containers import VerticalScroll
from textual.content import Content
from textual.widgets import Collapsible, Static

from kernelpilot.agent.session import describe_eval
from kernelpilot.results import EvalResult, from_dict

# Outputs longer than this start collapsed, so a build log or a file listing does not push the story off screen.
COLLAPSE_LINES = 8
TITLE_ARGUMENT_CHARS = 90


class Transcript(VerticalScroll):
    """Session records (as the transcript file holds them) shown turn by turn, newest at the bottom."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._turn = 0

    def on_mount(self) -> None:
        self.anchor()  # follow new entries until the user scrolls up to read

    def add_record(self, record: dict[str, Any]) -> None:
        """Show one session record: start, message, tool, eval, resume or end (steps only mark turns)."""
        turn = record.get("turn") or self._turn
        if record["type"] in ("message", "tool") and turn != self._turn:
            self._turn = turn
            self.add_line(f"─── turn {turn}", "turn")
        handler = getattr(self, f"_show_{record['type']}", None)
        if handler is not None:
            handler(record)

    def add_line(self, text: str, kind: str = "note") -> Static:
        """Append one plain line (its CSS class is `kind`)."""
        line = Static(text, markup=False, classes=kind)
        self.mount(line)
        return line

    def add_output(self, title: str, output: str, kind: str) -> Collapsible:
        """Append a titled block whose body starts collapsed when it is long."""
        collapsed = output.count("\n") >= COLLAPSE_LINES
        block = Collapsible(Static(output, markup=False), title=Content(title), collapsed=collapsed, classes=kind)
        self.mount(block)
        return block

    def _show_start(self, record: dict[str, Any]) -> None:
        self.add_line(f"session {record.get('session', '')} · model {record.get('model') or '?'}", "header")

    def _show_message(self, record: dict[str, Any]) -> None:
        message = record["message"]
        content = message.get("content") or ""
        if message["role"] == "assistant":
            if content.strip():
                self.add_line(content, "assistant")
        elif message["role"] in ("system", "user") and content:
            first_line = content.strip().splitlines()[0] if content.strip() else ""
            self.add_output(f"{message['role']}: {first_line}", content, message["role"])

    def _show_tool(self, record: dict[str, Any]) -> None:
        arguments = json.dumps(record.get("arguments") or {}, ensure_ascii=False)
        if len(arguments) > TITLE_ARGUMENT_CHARS:
            arguments = arguments[: TITLE_ARGUMENT_CHARS - 1] + "…"
        title = f"→ {record.get('name', '?')} {arguments} · {record.get('seconds', 0):.1f} s"
        self.add_output(title, record["message"]["content"], "tool")

    def _show_eval(self, record: dict[str, Any]) -> None:
        verdict = describe_eval(from_dict(EvalResult, record["eval"]))
        self.add_line(f"{'★ new best' if record.get('improved') else 'judged'}: {verdict}", "eval")

    def _show_resume(self, record: dict[str, Any]) -> None:
        self.add_line(f"resumed at turn {record.get('turn', 0)}", "header")

    def _show_end(self, record: dict[str, Any]) -> None:
        self.add_line(f"run ended: {record.get('status', '?')}", "header")
