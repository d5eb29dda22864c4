"""The agent: three small protocols (Model, Tool, and the loop that joins them) and the types they exchange.

A model answers chat messages with text and tool calls; tools act on the workspace and the judge; the loop
(`agent/loop.py`) feeds observations back until a budget or the target ends the run. Swapping litellm for the
built-in policy or a scripted test model changes one object, not the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kernelpilot.agent.tool_results import (  # re-exported: the types the loop, the policy and the TUI exchange
    JUDGE_RESULT_CLASSES,
    JudgeResult,
    RunFinished,
    TodoItem,
    ToolResult,
    VerifyOutcome,
)
from kernelpilot.config import Settings
from kernelpilot.results import BuildResult, EvalResult, VerifyResult

if TYPE_CHECKING:
    from kernelpilot.harness.judge import Judge
    from kernelpilot.workspace import Workspace


@dataclass
class ToolCall:
    """One call the model asked for. `arguments` is the parsed JSON object (raw text kept for errors)."""

    id: str
    name: str
    arguments: dict[str, Any]
    raw_arguments: str = ""


@dataclass
class Usage:
    """Tokens and cost of one model reply (cost is None when the provider's price is unknown)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None


@dataclass
class ModelReply:
    """A model's answer: free text (its reasoning/plan) and the tool calls it wants run."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)


@runtime_checkable
class Model(Protocol):
    """Anything that answers chat messages given tool schemas: litellm, the built-in policy, a test script."""

    name: str

    def query(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> ModelReply: ...


@dataclass
class JudgeRecord:
    """What the judge said in this run, typed: the latest build and verification, every Profile's EvalResult in
    order, and each judge tool call's result by its call id (the built-in policy reads its own calls' results here).
    Only these count; the model's own claims (Finish's summary) never do."""

    build: BuildResult | None = None
    verify: VerifyResult | None = None
    evals: list[EvalResult] = field(default_factory=list)
    by_call: dict[str, JudgeResult] = field(default_factory=dict)

    def note(self, result: JudgeResult) -> None:
        """Remember `result` as the latest of its kind (a Profile's EvalResult also joins `evals`)."""
        if isinstance(result, BuildResult):
            self.build = result
        elif isinstance(result, VerifyOutcome):
            self.build, self.verify = result.build, result.verify or self.verify
        else:
            self.evals.append(result)
            self.build = result.build or self.build
            self.verify = result.verify or self.verify


@dataclass
class ToolContext:
    """What a tool may touch: the workspace, the judge (GPU worker), the run's settings (trials and tolerances the
    judge tools use) and what the judge said so far."""

    workspace: Workspace
    judge: Judge | None
    settings: Settings = field(default_factory=Settings)
    todos: list[TodoItem] = field(default_factory=list)
    judged: JudgeRecord = field(default_factory=JudgeRecord)


@dataclass
class ToolOutput:
    """What a tool returns: its typed result, the text the model reads of it and the plain data the transcript keeps
    (both made from the result by `agent/observations.observe`)."""

    result: ToolResult
    text: str
    data: dict[str, Any]

    @property
    def finished(self) -> bool:
        """True when the call ends the run (Finish)."""
        return isinstance(self.result, RunFinished)


@runtime_checkable
class Tool(Protocol):
    """One action the model can take; `parameters` is its JSON schema (OpenAI function-calling format)."""

    name: str
    description: str
    parameters: dict[str, Any]

    def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput: ...


class RecoverableError(Exception):
    """A problem the model can fix (bad arguments, unknown tool, no tool call): its message becomes the next observation."""


class RunEnded(Exception):
    """A terminal condition (finished, budget spent, target met): ends the run with `status`."""

    def __init__(self, status: str, message: str = ""):
        super().__init__(message or status)
        self.status = status
