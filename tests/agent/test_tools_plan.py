"""The plan and the end of a run: TodoWrite's typed plan (kept on the context for the loop and the TUI) and how the
model reads it, and Finish, whose typed result is what ends the run."""

from __future__ import annotations

import pytest
from tools_testing import call

from kernelpilot.agent import RecoverableError
from kernelpilot.agent.observations import finished_text, todos_text
from kernelpilot.agent.session import tool_result
from kernelpilot.agent.tool_results import RunFinished, TodoItem, TodoList


def test_todowrite_replaces_the_plan_with_a_typed_list_and_renders_it(ctx):
    ctx.todos = [TodoItem("old", "pending")]
    todos = [
        {"content": "read model.py", "status": "completed"},
        {"content": "write the kernel", "status": "in_progress"},
        {"content": "profile", "status": "pending"},
    ]
    output = call(ctx, "TodoWrite", todos=todos)
    plan = [TodoItem("read model.py", "completed"), TodoItem("write the kernel", "in_progress"), TodoItem("profile", "pending")]
    assert output.result == TodoList(plan) and ctx.todos == plan
    assert output.text == todos_text(output.result)
    assert output.text.splitlines() == [
        "Todo list (1/3 done):",
        "  [x] read model.py",
        "  [>] write the kernel",
        "  [ ] profile",
    ]
    assert output.data == {"todos": todos}
    assert tool_result({"type": "tool", "name": "TodoWrite", "result_type": "TodoList", "data": output.data}) == output.result


def test_an_empty_plan_says_it_was_cleared(ctx):
    output = call(ctx, "TodoWrite", todos=[])
    assert output.result == TodoList([]) and ctx.todos == []
    assert output.text == "Todo list cleared."


def test_todowrite_allows_one_item_in_progress(ctx):
    todos = [{"content": "a", "status": "in_progress"}, {"content": "b", "status": "in_progress"}]
    with pytest.raises(RecoverableError, match="2 items are in_progress"):
        call(ctx, "TodoWrite", todos=todos)
    assert ctx.todos == []


def test_finish_ends_the_run_with_the_summary(ctx):
    output = call(ctx, "Finish", summary="fused softmax, 1.3x vs compile")
    assert output.result == RunFinished("fused softmax, 1.3x vs compile") and output.finished
    assert output.text == finished_text(output.result) == "Run finished: fused softmax, 1.3x vs compile"
    assert output.data == {"summary": "fused softmax, 1.3x vs compile"}
    assert not call(ctx, "TodoWrite", todos=[]).finished, "only Finish ends the run"
