"""What the tool tests share (tests/agent/test_tools*.py): a scaffolded workspace as a ToolContext, and a tool called
by name the way the loop calls it."""

from __future__ import annotations

from pathlib import Path

from kernelpilot.agent import ToolContext, ToolOutput
from kernelpilot.agent.tools import default_tools
from kernelpilot.workspace import init_workspace
from kp_testing import scale_problem, write_problem

PROBLEM = scale_problem(rows=8, features=16)
TOOLS = {tool.name: tool for tool in default_tools()}


def make_workspace(folder: Path, source: str = PROBLEM) -> ToolContext:
    ws, _ = init_workspace(write_problem(folder, source), folder / "ws")
    return ToolContext(workspace=ws, judge=None)


def call(ctx: ToolContext, tool_name: str, **args) -> ToolOutput:
    return TOOLS[tool_name].run(args, ctx)
