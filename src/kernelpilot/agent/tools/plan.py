"""The plan and the end of a run: TodoWrite (the model's todo list, shown to the user) and Finish."""

from __future__ import annotations

from typing import Any

from kernelpilot.agent import RecoverableError, ToolContext
from kernelpilot.agent.tool_results import RunFinished, TodoItem, TodoList
from kernelpilot.agent.tools.schema import CheckedTool, object_schema


class TodoWriteTool(CheckedTool):
    name = "TodoWrite"
    description = (
        "Replace your plan: the whole todo list, each item with `content` and `status` (pending, in_progress, "
        "completed; at most one in_progress). The user sees it. Update it as you start and finish steps. Returns "
        "the list as shown."
    )
    parameters = object_schema(
        {
            "todos": {
                "type": "array",
                "items": object_schema(
                    {
                        "content": {"type": "string", "minLength": 1, "description": "the step"},
                        "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
                    },
                    ["content", "status"],
                ),
            }
        },
        ["todos"],
    )

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> TodoList:
        todos = [TodoItem(item["content"], item["status"]) for item in args["todos"]]
        in_progress = [item.content for item in todos if item.status == "in_progress"]
        if len(in_progress) > 1:
            raise RecoverableError(
                f"TodoWrite: {len(in_progress)} items are in_progress ({'; '.join(in_progress)}); mark at most one."
            )
        ctx.todos = todos
        return TodoList(todos)


class FinishTool(CheckedTool):
    name = "Finish"
    description = (
        "End the run with a short summary of what you did and what the last Verify/Profile showed. Only results "
        "the judge verified count, so Verify and Profile your final kernel before finishing."
    )
    parameters = object_schema(
        {"summary": {"type": "string", "minLength": 1, "description": "what was achieved"}}, ["summary"]
    )

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> RunFinished:
        return RunFinished(args["summary"])
