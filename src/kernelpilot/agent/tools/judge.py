"""The judge tools: Compile, Verify and Profile. Each returns the judge's typed result (rendered for the model by
`agent/observations.py`) and notes it in `ctx.judged`; only those results count, never the model's claims."""

from __future__ import annotations

from typing import Any

from kernelpilot.agent import RecoverableError, ToolContext, VerifyOutcome
from kernelpilot.agent.tools.schema import CheckedTool, object_schema
from kernelpilot.build_ahead import MAX_AHEAD, check_version
from kernelpilot.errors import WorkspaceError
from kernelpilot.results import BuildResult, EvalResult

MAX_TRIALS = 20


def require_judge(ctx: ToolContext, tool_name: str) -> Any:
    if ctx.judge is None:
        raise RecoverableError(f"{tool_name} needs the judge, and this run has none; only the file tools work here.")
    return ctx.judge


def judging_settings(ctx: ToolContext) -> dict[str, Any]:
    """The run's trials and tolerances (`ctx.settings`, set by the loop's caller)."""
    return {"trials": ctx.settings.trials, "atol": ctx.settings.atol, "rtol": ctx.settings.rtol}


def build_candidate(ctx: ToolContext, tool_name: str, ahead: list[dict[str, str]] | None = None) -> BuildResult:
    """Build the workspace (incremental: only changed sources recompile), and the `ahead` versions if it built;
    remember the result."""
    judge = require_judge(ctx, tool_name)
    try:
        build = judge.build(ctx.workspace.root, ahead=ahead) if ahead else judge.build(ctx.workspace.root)
    except WorkspaceError as err:  # what the workspace holds stops the build (a file name, a link): the model's to fix
        raise RecoverableError(f"{tool_name}: {err.message}" + (f" Hint: {err.hint}." if err.hint else "")) from None
    ctx.judged.note(build)
    return build


class CompileTool(CheckedTool):
    name = "Compile"
    description = (
        "Build kernels/ into the workspace's library of torch ops (incremental: only changed files recompile). "
        "Returns ok or failed, the files recompiled, compiler errors as file:line: message, and per-kernel "
        "registers, shared memory and spills from ptxas. Compile after editing kernels, before Verify. "
        f"With `ahead` (at most {MAX_AHEAD}), other versions of kernel files you will try next are compiled too, side "
        "by side and all at once; writing one of them later and building compiles nothing."
    )
    parameters = object_schema({
        "ahead": {
            "type": "array",
            "description": "versions to build ahead, each an object of path -> full content, e.g. "
                           '[{"kernels/add.cu": "..."}]; the workspace\'s files stay as they are',
            "items": {"type": "object", "additionalProperties": {"type": "string"}},
        }
    })  # fmt: skip

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> BuildResult:
        ahead = args.get("ahead") or []
        if len(ahead) > MAX_AHEAD:
            raise RecoverableError(f"Compile builds at most {MAX_AHEAD} versions ahead, not {len(ahead)}; ask for the "
                                   "ones the next turns will try.")  # fmt: skip
        for index, version in enumerate(ahead):
            if (problem := check_version(version)) is not None:
                raise RecoverableError(f"Compile: `ahead[{index}]` cannot be built: {problem}.")
        return build_candidate(ctx, self.name, ahead)


class VerifyTool(CheckedTool):
    name = "Verify"
    description = (
        "Build if needed, then check ModelNew against Model on fresh random inputs (`trials`, default: the run's "
        "setting, usually 5) and run the anti-cheat guards. Returns pass/fail per trial, max absolute and relative "
        "error, where the worst element is, and guard findings. A candidate counts only once it passes."
    )
    parameters = object_schema(
        {"trials": {"type": "integer", "minimum": 1, "maximum": MAX_TRIALS, "description": "how many"}}
    )

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> VerifyOutcome:
        build = build_candidate(ctx, self.name)
        if not build.ok:
            return VerifyOutcome(build)
        judging = judging_settings(ctx)
        judging["trials"] = args.get("trials", judging["trials"])  # the model may ask for more or fewer
        outcome = VerifyOutcome(build, ctx.judge.verify(ctx.workspace.root, build, **judging))
        ctx.judged.note(outcome)
        return outcome


class ProfileTool(CheckedTool):
    name = "Profile"
    description = (
        "The full judgement: build, verify, then time the candidate against PyTorch eager and torch.compile on the "
        "GPU. Returns the times (median and spread), speedups, % of speed-of-light, the reward (-1 broken or wrong, "
        "1 correct, 2 faster than eager, 3 faster than eager and torch.compile) and the candidate's top kernels. "
        "Run it before and after each optimisation. With `slower_than_ms` (your best time so far) a candidate whose "
        "calls take several times as long is stopped after 2 trials, neither verified further nor timed."
    )
    parameters = object_schema(
        {"slower_than_ms": {"type": "number", "exclusiveMinimum": 0, "description": "a time to beat, in ms"}}
    )

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> EvalResult:
        bound = {"slower_than_ms": args["slower_than_ms"]} if "slower_than_ms" in args else {}
        result = require_judge(ctx, self.name).evaluate(ctx.workspace.root, **judging_settings(ctx), **bound)
        ctx.judged.note(result)
        return result
