"""The agent's tool registry and argument schemas: the fixed set of tools in OpenAI function-calling format, unknown
tools named, and bad arguments refused with a sentence naming the problem. Each tool's own behaviour, typed result
and rendering are tested beside its concern: test_tools_shell.py, test_tools_files.py, test_tools_plan.py and
test_tools_judge.py."""

from __future__ import annotations

import pytest
from tools_testing import TOOLS

from kernelpilot.agent import RecoverableError, Tool, ToolCall
from kernelpilot.agent.loop import run_tool
from kernelpilot.agent.tool_results import ToolError
from kernelpilot.agent.tools import default_tools, find_tool, tool_schemas


# ------------------------------------------------------------------------------------- schemas, registry

SPEC = {  # tool -> (properties, required), as the agent's interface fixes them
    "Bash": ({"command", "timeout_s"}, {"command"}),
    "Glob": ({"pattern"}, {"pattern"}),
    "Read": ({"path", "offset", "limit"}, {"path"}),
    "Write": ({"path", "content"}, {"path", "content"}),
    "MultiEdit": ({"path", "edits"}, {"path", "edits"}),
    "TodoWrite": ({"todos"}, {"todos"}),
    "Compile": ({"ahead"}, set()),
    "Verify": ({"trials"}, set()),
    "Profile": ({"slower_than_ms"}, set()),
    "Ncu": ({"kernel"}, set()),
    "Finish": ({"summary"}, {"summary"}),
}


def test_default_tools_are_the_fixed_set_in_openai_function_format():
    tools = default_tools()
    assert all(isinstance(tool, Tool) for tool in tools)
    schemas = tool_schemas(tools)
    assert [schema["function"]["name"] for schema in schemas] == list(SPEC)
    for schema in schemas:
        assert schema["type"] == "function"
        function = schema["function"]
        properties, required = SPEC[function["name"]]
        assert set(function["parameters"]["properties"]) == properties
        assert set(function["parameters"]["required"]) == required
        assert function["parameters"]["additionalProperties"] is False
        assert len(function["description"]) > 80, "descriptions tell the model when to use the tool"


def test_multiedit_and_todowrite_item_schemas():
    edit_item = TOOLS["MultiEdit"].parameters["properties"]["edits"]["items"]
    assert set(edit_item["properties"]) == {"old_string", "new_string", "replace_all"}
    assert set(edit_item["required"]) == {"old_string", "new_string"}
    todo_item = TOOLS["TodoWrite"].parameters["properties"]["todos"]["items"]
    assert todo_item["properties"]["status"]["enum"] == ["pending", "in_progress", "completed"]


def test_find_tool_names_the_valid_tools_for_an_unknown_one():
    assert find_tool(default_tools(), "Read").name == "Read"
    with pytest.raises(RecoverableError, match="no tool named 'Edit'; the tools are: Bash, Glob, Read, Write, MultiEdit"):
        find_tool(default_tools(), "Edit")


@pytest.mark.parametrize(
    ("tool_name", "args", "message"),
    [
        ("Bash", {}, "Bash: the argument `command` is required"),
        ("Bash", {"command": "ls", "cmd": "ls"}, "Bash: unknown argument `cmd`; it takes: command, timeout_s"),
        ("Bash", {"command": ["ls"]}, "`command` must be a string, not array"),
        ("Bash", {"command": "ls", "timeout_s": "10"}, "`timeout_s` must be an integer, not string"),
        ("Bash", {"command": "ls", "timeout_s": True}, "`timeout_s` must be an integer, not boolean"),
        ("Bash", {"command": "ls", "timeout_s": 601}, "`timeout_s` must be at most 600, not 601"),
        ("Bash", {"command": ""}, "`command` must not be empty"),
        ("Read", {"path": "model.py", "offset": 0}, "`offset` must be at least 1, not 0"),
        ("MultiEdit", {"path": "model_new.py", "edits": []}, "`edits` needs at least 1 item"),
        ("MultiEdit", {"path": "model_new.py", "edits": [{"new_string": "x"}]}, "`edits[0].old_string` is required"),
        ("MultiEdit", {"path": "model_new.py", "edits": [{"old_string": "a", "new_string": "b", "replace_all": "yes"}]},
         "`edits[0].replace_all` must be a boolean"),
        ("TodoWrite", {"todos": [{"content": "x", "status": "done"}]},
         '`todos[0].status` must be one of "pending", "in_progress", "completed", not "done"'),
        ("Verify", {"trials": 100}, "`trials` must be at most 20"),
        ("Profile", {"slower_than_ms": 0}, "`slower_than_ms` must be more than 0, not 0"),
        ("Profile", {"slower_than_ms": "3 ms"}, "`slower_than_ms` must be a number, not string"),
        ("Compile", {"clean": True}, "Compile: unknown argument `clean`; it takes: ahead"),
        ("Compile", {"ahead": {"kernels/a.cu": "x"}}, "Compile: `ahead` must be an array, not object"),
        ("Finish", {}, "Finish: the argument `summary` is required"),
    ],
)  # fmt: skip
def test_bad_arguments_are_recoverable_errors_naming_the_problem(ctx, tool_name, args, message):
    with pytest.raises(RecoverableError) as caught:
        TOOLS[tool_name].run(args, ctx)
    assert message in str(caught.value)


def test_arguments_must_be_an_object(ctx):
    with pytest.raises(RecoverableError, match="Glob takes a JSON object of arguments, not array"):
        TOOLS["Glob"].run(["*.py"], ctx)


def test_a_call_the_model_can_fix_comes_back_as_a_typed_error_rendered_for_it(ctx):
    unknown = run_tool(ToolCall("c1", "Edit", {"path": "model_new.py"}), default_tools(), ctx)
    assert isinstance(unknown.result, ToolError) and unknown.result.message.startswith("There is no tool named 'Edit'")
    assert unknown.text == f"Error: {unknown.result.message}"
    assert unknown.data == {"message": unknown.result.message} and not unknown.finished
    refused = run_tool(ToolCall("c2", "Read", {"path": "../problem.py"}), default_tools(), ctx)
    assert isinstance(refused.result, ToolError) and "is outside the workspace" in refused.text
    assert ctx.judged.by_call == {}, "only the judge's results are kept by call"
