"""The ReAct loop: ask the model, run the tools it calls, feed back what they return, until a stop condition.

Only the judge's results (the EvalResults the tools note in `ctx.judged.evals`) decide what counts; the model's
claims never do. The best verified candidate is copied aside as soon as it appears, and every turn is
checkpointed in the session's transcript in a `finally:`, so Ctrl-C or a crash loses nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kernelpilot.agent import (
    JUDGE_RESULT_CLASSES,
    Model,
    ModelReply,
    RecoverableError,
    RunEnded,
    RunFinished,
    Tool,
    ToolCall,
    ToolContext,
    ToolOutput,
    Usage,
)
from kernelpilot.agent.observations import observe
from kernelpilot.agent.session import RunState, Session, is_improvement, save_best, target_met
from kernelpilot.agent.tool_results import ToolError
from kernelpilot.config import Settings
from kernelpilot.results import EvalResult

TOOL_OUTPUT_CHARS = 12_000
DEFAULT_CONTEXT_TOKENS = 128_000
NO_TOOL_CALL = "Your reply called no tool. Act through the tools: call one (Finish with a summary when you are done)."


@dataclass
class RunSummary:
    """How a run ended and the best verified result it found."""

    status: str  # finished | max-turns | wall-time | token-budget | cost-budget | target-met | interrupted | error | ...
    session_id: str
    turns: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float | None  # None when some reply's price was unknown
    best: EvalResult | None
    finish_summary: str | None = None  # the model's own words on Finish: a claim, never a verdict


def run_agent(
    task_messages: list[dict[str, Any]],
    model: Model,
    tools: list[Tool],
    ctx: ToolContext,
    settings: Settings,
    session: Session,
    on_turn: Callable[[RunState, str], None] | None = None,
) -> RunSummary:
    """Run the loop from `task_messages` (a new task, or a resumed session's conversation) until it stops."""
    from kernelpilot.agent.tools import tool_schemas

    messages, state, schemas = list(task_messages), session.state, tool_schemas(tools)
    ctx.todos, ctx.judged.evals = state.todos, list(state.evals)
    ctx.judged.by_call.update(state.judged_calls)  # a resumed run's earlier results, for a model that reads them
    clock_start, status = time.monotonic() - state.elapsed_s, "error"
    try:
        while (stop := stop_reason(state, settings)) is None:
            state.turn += 1
            try:
                last_action = _turn(messages, model, tools, schemas, ctx, session, state)
            finally:
                state.elapsed_s, state.todos = time.monotonic() - clock_start, ctx.todos
                session.append("step", turn=state.turn, elapsed_s=state.elapsed_s, todos=ctx.todos, tokens=state.tokens)
            if on_turn is not None:
                on_turn(state, last_action)
            if last_action == "Finish":
                stop = "finished"
                break
        status = stop
    except KeyboardInterrupt:
        status = "interrupted"
    except RunEnded as ended:
        status = ended.status
    finally:
        summary = _summary(status, session, state)
        session.append_vouched("end", status=status, summary=summary)
    return summary


def _turn(messages, model, tools, schemas, ctx, session, state) -> str:
    """One model reply and its tool calls; returns the last action's name ("Finish" ends the run)."""
    problem = NO_TOOL_CALL
    try:
        reply = model.query(_fit(messages, model), schemas)
    except RecoverableError as err:  # e.g. a malformed tool call: the model sees what was wrong and tries again
        reply, problem = ModelReply(getattr(err, "content", ""), [], getattr(err, "usage", None) or Usage()), str(err)
    state.add_usage(reply.usage)
    assistant = assistant_message(reply)
    messages.append(assistant)
    session.append("message", turn=state.turn, message=assistant, usage=reply.usage)
    if not reply.tool_calls:
        observation = {"role": "user", "content": problem}
        messages.append(observation)
        session.append("message", turn=state.turn, message=observation)
        return "no tool call"
    finished = False
    for call in reply.tool_calls:
        started = time.monotonic()
        output = run_tool(call, tools, ctx)
        result = {"role": "tool", "tool_call_id": call.id, "content": _truncate(output.text)}
        messages.append(result)
        session.append("tool", turn=state.turn, message=result, name=call.name, arguments=call.arguments,
                       data=output.data, result_type=type(output.result).__name__,
                       seconds=round(time.monotonic() - started, 3), finished=output.finished)  # fmt: skip
        record_evals(ctx, session, state)
        if isinstance(output.result, RunFinished):
            finished, state.finish_summary = True, output.result.summary
    return "Finish" if finished else reply.tool_calls[-1].name


def run_tool(call: ToolCall, tools: list[Tool], ctx: ToolContext) -> ToolOutput:
    """Run one call; a problem the model can fix comes back as its observation (a ToolError). A judge tool's
    typed result is kept in `ctx.judged.by_call` under the call's id."""
    from kernelpilot.agent.tools import find_tool

    try:
        output = find_tool(tools, call.name).run(call.arguments, ctx)
    except RecoverableError as err:
        return observe(ToolError(str(err)))
    if isinstance(output.result, JUDGE_RESULT_CLASSES):
        ctx.judged.by_call[call.id] = output.result
    return output


def record_evals(ctx: ToolContext, session: Session, state: RunState) -> None:
    """Log the judge's new results; keep a copy of the candidate's files when one is the new best."""
    for result in ctx.judged.evals[len(state.evals):]:
        improved = is_improvement(result, state.best)
        digest = session.append_vouched("eval", turn=state.turn, eval=result, improved=improved)
        if improved:
            save_best(ctx.workspace, session.path, digest)
            state.best, state.best_turn = result, state.turn
        state.evals.append(result)


def stop_reason(state: RunState, settings: Settings) -> str | None:
    """Why the run must stop before another turn, or None."""
    if state.turn >= settings.max_turns:
        return "max-turns"
    if settings.wall_time_s is not None and state.elapsed_s >= settings.wall_time_s:
        return "wall-time"
    if settings.max_tokens is not None and state.tokens >= settings.max_tokens:
        return "token-budget"
    if settings.max_cost_usd is not None and state.cost_usd >= settings.max_cost_usd:
        return "cost-budget"
    if target_met(state.best, settings.target_speedup) and state.turn - state.best_turn >= settings.patience:
        return "target-met"
    return None


def assistant_message(reply: ModelReply) -> dict[str, Any]:
    """The reply as an OpenAI chat message (tool calls with their arguments as JSON text)."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or ""}
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.raw_arguments or json.dumps(call.arguments)}}
            for call in reply.tool_calls
        ]
    return message


def _fit(messages: list[dict[str, Any]], model: Model) -> list[dict[str, Any]]:
    from kernelpilot.agent.context import count_tokens, fit_context

    window = getattr(model, "context_window", None) or DEFAULT_CONTEXT_TOKENS
    # A model that counts its own tokens (litellm's tokenizer) fits more exactly than the estimate.
    return fit_context(messages, max_tokens=window, count_tokens=getattr(model, "count_tokens", count_tokens))


def _truncate(text: str) -> str:
    from kernelpilot.agent.context import truncate_output

    return truncate_output(text, TOOL_OUTPUT_CHARS)


def _summary(status: str, session: Session, state: RunState) -> RunSummary:
    return RunSummary(
        status=status,
        session_id=session.id,
        turns=state.turn,
        prompt_tokens=state.prompt_tokens,
        completion_tokens=state.completion_tokens,
        cost_usd=state.cost_usd if state.cost_known else None,
        best=state.best,
        finish_summary=state.finish_summary,
    )
