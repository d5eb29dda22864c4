"""The plan panel: the agent's todo list as its last TodoWrite left it."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

MARKS = {"pending": ("○", "dim"), "in_progress": ("▶", "bold yellow"), "completed": ("✔", "green")}


class TodoPanel(Static):
    """One line per todo item: a mark for its status, then the step."""

    todos: reactive[list[dict[str, Any]]] = reactive(list, always_update=True)

    def watch_todos(self, todos: list[dict[str, Any]]) -> None:
        self.update(render_todos(todos))


def render_todos(todos: list[dict[str, Any]]) -> Text:
    """The list as styled text; an empty plan says so."""
    if not todos:
        return Text("no plan yet", style="dim")
    text = Text()
    for item in todos:
        mark, style = MARKS.get(item.get("status", "pending"), MARKS["pending"])
        text.append(f"{mark} ", style=style)
        text.append(f"{item.get('content', '')}\n", style="dim" if item.get("status") == "completed" else "")
    text.rstrip()
    return text
