"""The plan panel: the agent's todo list as its last TodoWrite left it."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from kernelpilot.agent.tool_results import TodoItem

MARKS = {"pending": ("○", "dim"), "in_progress": ("▶", "bold yellow"), "completed": ("✔", "green")}


class TodoPanel(Static):
    """One line per todo item: a mark for its status, then the step."""

    todos: reactive[list[TodoItem]] = reactive(list, always_update=True)

    def watch_todos(self, todos: list[TodoItem]) -> None:
        self.update(render_todos(todos))


def render_todos(todos: list[TodoItem]) -> Text:
    """The list as styled text; an empty plan says so."""
    if not todos:
        return Text("no plan yet", style="dim")
    text = Text()
    for item in todos:
        mark, style = MARKS.get(item.status, MARKS["pending"])
        text.append(f"{mark} ", style=style)
        text.append(f"{item.content}\n", style="dim" if item.status == "completed" else "")
    text.rstrip()
    return text
