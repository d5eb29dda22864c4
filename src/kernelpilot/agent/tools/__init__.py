"""The agent's tools: one small class per action the model can take on its workspace and the judge.

Each tool has a name, a description written for the model, a JSON schema of its arguments (checked before it runs,
`schema.py`) and `run(args, ctx) -> ToolOutput`: its typed result (`agent/tool_results.py`; the judge's own results
for the judge tools), the text the model reads of it (rendered in `agent/observations.py`) and its plain data for
the transcript. Anything the model can fix (a bad argument, a missing file, a refused command) is a
RecoverableError, which the loop answers with a ToolError as the model's next observation. One module per concern:
`schema.py` (arguments), `files.py` (Glob, Read, Write, MultiEdit and the path guard), `shell.py` (Bash and
processes), `plan.py` (TodoWrite, Finish), `judge.py` (Compile, Verify, Profile), `ncu.py` (Ncu); this module is
the registry.
"""

from __future__ import annotations

from typing import Any

from kernelpilot.agent import RecoverableError, Tool
from kernelpilot.agent.tools.files import GlobTool, MultiEditTool, ReadTool, WriteTool
from kernelpilot.agent.tools.judge import CompileTool, ProfileTool, VerifyTool
from kernelpilot.agent.tools.ncu import NcuTool
from kernelpilot.agent.tools.plan import FinishTool, TodoWriteTool
from kernelpilot.agent.tools.shell import BashTool


def default_tools() -> list[Tool]:
    """Every tool the agent gets, in the order the model sees them."""
    return [BashTool(), GlobTool(), ReadTool(), WriteTool(), MultiEditTool(), TodoWriteTool(), CompileTool(),
            VerifyTool(), ProfileTool(), NcuTool(), FinishTool()]  # fmt: skip


def tool_schemas(tools: list[Tool]) -> list[dict[str, Any]]:
    """The tools in OpenAI function-calling format."""
    return [
        {
            "type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
        }
        for tool in tools
    ]


def find_tool(tools: list[Tool], name: str) -> Tool:
    """The tool called `name`; RecoverableError listing the valid names when there is none."""
    for tool in tools:
        if tool.name == name:
            return tool
    raise RecoverableError(f"There is no tool named {name!r}; the tools are: {', '.join(tool.name for tool in tools)}.")
