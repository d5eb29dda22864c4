"""The latest-edit panel: the unified diff of the agent's last Write or MultiEdit, syntax-highlighted."""

from __future__ import annotations

from rich.syntax import Syntax
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.reactive import reactive
from textual.widgets import Static


class DiffView(VerticalScroll):
    """Shows one file's diff; `show_edit` replaces it with the next edit's."""

    path: reactive[str] = reactive("")
    diff: reactive[str] = reactive("", always_update=True)  # the same diff on another file must still show

    def compose(self) -> ComposeResult:
        yield Static("no edit yet", classes="empty")

    def show_edit(self, path: str, diff: str) -> None:
        """Show the diff of an edit to `path` (an edit that changed nothing has an empty diff)."""
        self.path, self.diff = path, diff

    def watch_diff(self, diff: str) -> None:
        if not self.path:
            return
        self.border_title = f"latest edit · {self.path}" if self.path else "latest edit"
        body = Syntax(diff, "diff", theme="ansi_dark", word_wrap=False) if diff else Text(f"{self.path}: no change")
        self.query_one(Static).update(body)
        self.scroll_home(animate=False)
