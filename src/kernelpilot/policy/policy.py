"""BuiltinPolicy: a `Model` that answers with tool calls from the analysis and generated kernels, no LLM needed.

Over successive replies it plans (TodoWrite), writes the generated files, compiles them, verifies and times them
in one Profile (which verifies before it times; Verify where there is no Profile tool), then times each remaining
launch configuration (Write of the re-rendered .cu, Profile), writes the fastest back, verifies it and finishes
with an honest summary. When the first answer's outputs mismatch and the
rounding-faithful analysis (`analyze(faithful=True)`: a half-precision product written in its dtype before a
scale or an add, as eager rounds it) differs, it writes that form once and goes on from its Compile. A forward it
cannot generate entirely ends after the plan with a Finish naming what is unsupported: it never falls back to
torch ops in ModelNew.forward.

The policy is given its problem and the judge tools' typed results by call id (BuildResult, VerifyOutcome,
EvalResult; the loop fills that mapping, and rebuilds it from the transcript on a resume). It never reads the text
the model would read. Beyond a cache of the analysis it keeps no state between calls: where it is in the run is
read back from the conversation (its tool call ids name the step), so a resumed run goes on where it stopped.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelpilot.agent import JudgeResult, ModelReply, ToolCall, VerifyOutcome
from kernelpilot.agent.failure import judged_failure
from kernelpilot.agent.observations import speedup_text
from kernelpilot.build_ahead import MAX_AHEAD
from kernelpilot.policy.search import MIN_SHARE, LaunchSearch
from kernelpilot.results import BuildResult, EvalResult

if TYPE_CHECKING:
    from kernelpilot.policy.ir import Analysis, Group
    from kernelpilot.policy.codegen import GeneratedFile
    from kernelpilot.policy.families import KernelConfig
    from kernelpilot.problem import Problem

CALL_PREFIX = "kp"
# The stage that writes the faithful analysis' files; every reply after it works on that analysis.
FAITHFUL_STAGE = "faithful"
_SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}


@dataclass
class _Step:
    """One earlier reply of this policy: its number, its stage, and each call's name and typed result."""

    number: int
    stage: str
    results: dict[str, JudgeResult | None] = field(default_factory=dict)  # tool name -> result (None: none yet)


@dataclass
class _Plan:
    """What the policy decided for one problem: the analysis and each generated group's launch candidates."""

    problem: Problem
    analysis: Analysis
    candidates: dict[str, list[KernelConfig]]
    faithful: bool = False  # from analyze(faithful=True): the fallback after a mismatch

    @property
    def groups(self) -> list[Group]:
        return self.analysis.generated_groups

    def search(self, first: JudgeResult | None) -> LaunchSearch:
        """A launch search over this plan's candidates, from the first configuration's Profile result (None: not
        profiled yet)."""
        counts = {g.name: len(self.candidates[g.name]) for g in self.groups}
        return LaunchSearch(counts, candidate_ms(first), candidate_sol(first), kernel_shares(first, self.groups))


class BuiltinPolicy:
    """The offline policy: fused CUDA kernels generated from templates, driven through the agent's tools."""

    name = "builtin"
    # The loop fits a conversation to a model's context window by dropping old turns. This policy sends the
    # conversation nowhere, and it replays its launch search from every earlier Profile result in it: a trimmed
    # conversation would start the search again. So its window holds any conversation.
    context_window = sys.maxsize

    def __init__(self, problem_path: str | Path, judge_results: Mapping[str, JudgeResult] | None = None,
                 workspace: str | Path | None = None):  # fmt: skip
        """`workspace`: the folder the run writes in (default: the problem's, as for a workspace's model.py)."""
        self.problem_path = Path(problem_path)
        self.workspace = Path(workspace) if workspace is not None else self.problem_path.parent
        self.judge_results = judge_results if judge_results is not None else {}  # call id -> the judge's result
        self._plans: dict[bool, _Plan] = {}  # faithful -> the plan

    def query(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> ModelReply:
        steps = _steps(messages, self.judge_results)
        faithful = any(step.stage == FAITHFUL_STAGE for step in steps)
        run = _Run(self._plan(faithful), steps, _tool_names(tools), fallback=lambda: self._plan(True),
                   workspace=self.workspace)  # fmt: skip
        return run.next_reply(1 + max((s.number for s in steps), default=0))

    def _plan(self, faithful: bool = False) -> _Plan:
        from kernelpilot.policy.analysis import analyze
        from kernelpilot.policy.families import launch_candidates
        from kernelpilot.problem import load_problem

        if faithful not in self._plans:
            problem = load_problem(self.problem_path)
            analysis = analyze(problem, faithful=faithful)
            candidates = {g.name: launch_candidates(g) for g in analysis.generated_groups}
            self._plans[faithful] = _Plan(problem, analysis, candidates, faithful)
        return self._plans[faithful]


def _tool_names(tools: list[dict[str, Any]]) -> set[str]:
    return {schema.get("function", {}).get("name") for schema in tools}


def _steps(messages: list[dict[str, Any]], judge_results: Mapping[str, JudgeResult]) -> list[_Step]:
    """This policy's earlier replies, from the ids of their tool calls, with the judge's result of each call."""
    steps: dict[int, _Step] = {}
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or []:
            parts = str(call.get("id", "")).split(".")
            if len(parts) != 4 or parts[0] != CALL_PREFIX or not parts[1].isdigit():
                continue
            step = steps.setdefault(int(parts[1]), _Step(int(parts[1]), parts[2]))
            step.results[call.get("function", {}).get("name", "")] = judge_results.get(call["id"])
    return sorted(steps.values(), key=lambda step: step.number)


# --------------------------------------------------------------------------------------------- results


def build_ok(result: JudgeResult | None) -> bool:
    return isinstance(result, BuildResult) and result.ok


def verify_ok(result: JudgeResult | None) -> bool:
    """True when the judge verified the candidate: a Verify that passed, or a Profile whose verification did."""
    verify = result.verify if isinstance(result, (VerifyOutcome, EvalResult)) else None
    return verify is not None and verify.ok


def verify_mismatch(result: JudgeResult | None) -> bool:
    """True when the outputs were compared and some were wrong: not a crash, a guard finding or a timeout."""
    verify = result.verify if isinstance(result, (VerifyOutcome, EvalResult)) else None
    return verify is not None and not verify.ok and (verify.error_kind or "mismatch") == "mismatch"


def candidate_ms(result: JudgeResult | None) -> float | None:
    """The candidate's median time in a Profile result, or None when it was not timed (broken or wrong)."""
    if not isinstance(result, EvalResult) or not verify_ok(result):
        return None
    bench = result.bench
    return bench.candidate.median_ms if bench is not None and bench.ok and bench.candidate is not None else None


def candidate_sol(result: JudgeResult | None) -> float | None:
    """The timed candidate's fraction of speed-of-light in a Profile result, or None (not timed, no roofline)."""
    if candidate_ms(result) is None:
        return None
    return result.bench.sol_candidate  # type: ignore[union-attr]  # candidate_ms checked it is a timed EvalResult


# Groups that launch only kernels generated from templates, named policy_<group>_...: their time can be read off a
# Profile's kernel list. A matmul or conv group's library kernels carry the library's names.
_NAMED_KERNEL_KINDS = ("elementwise", "row", "column", "scan")
_KERNEL_GROUP = re.compile(r"\bpolicy_([A-Za-z0-9]+)_")


def kernel_shares(result: JudgeResult | None, groups: list[Group]) -> dict[str, float]:
    """The fraction of a Profile's candidate time spent in each group's kernels, for the groups whose kernels are
    all generated (named after the group); empty when the result has no kernel list."""
    bench = result.bench if isinstance(result, EvalResult) and result.bench is not None and result.bench.ok else None
    if bench is None or bench.candidate is None or not bench.kernels:
        return {}
    spent: dict[str, float] = {}
    for kernel in bench.kernels:
        if (match := _KERNEL_GROUP.search(kernel.name)) is not None:
            spent[match.group(1)] = spent.get(match.group(1), 0.0) + kernel.total_ms
    total = max(bench.candidate.median_ms, sum(kernel.total_ms for kernel in bench.kernels))
    return {g.name: spent.get(g.name, 0.0) / total for g in groups if g.kind in _NAMED_KERNEL_KINDS} if total > 0 else {}


def problem_line(result: JudgeResult | None) -> str:
    """What went wrong in a failed judge result, in one line for the summary: the failure's kind and line as the
    suite reports them (agent/failure.py)."""
    if result is None:
        return "no result was returned"
    failure = judged_failure(result)
    return f"{failure.kind}: {failure.message}" if failure is not None else "the judge found nothing wrong"


# ------------------------------------------------------------------------------------------------- run


class _Run:
    """The next reply, given the plan and what earlier replies got back."""

    def __init__(self, plan: _Plan, steps: list[_Step], tools: set[str], fallback: Callable[[], _Plan] | None = None,
                 workspace: Path | None = None):  # fmt: skip
        self.plan = plan
        self.workspace = workspace
        self.steps = steps
        self.tools = tools
        self.fallback = fallback  # the faithful plan, analysed only when a mismatch asks for it
        self.by_stage = {step.stage: step for step in steps}
        self.number = 0

    def next_reply(self, number: int) -> ModelReply:
        self.number = number
        last = self.steps[-1] if self.steps else None
        if last is None:
            return self._todo()
        if last.stage == "plan":
            return self._write() if self.plan.analysis.supported else self._finish(self._unsupported_summary())
        if last.stage in ("write", FAITHFUL_STAGE):
            return self._reply("compile", "Compile the generated kernels.", [("Compile", {})])
        if last.stage == "compile":
            if not build_ok(last.results.get("Compile")):
                return self._finish(self._failure("did not compile", last.results.get("Compile")))
            if "Profile" in self.tools:  # Profile verifies before it times: one verification of the first answer
                return self._reply("profile", "Verify and time the first launch configuration.", [("Profile", {})])
            return self._reply("verify", "Check the kernels against the reference.", [("Verify", {})])
        if last.stage in ("verify", "profile"):
            verified = last.results.get("Verify" if last.stage == "verify" else "Profile")
            if not verify_ok(verified):
                faithful = self._faithful_fallback(verified)
                if faithful is not None:
                    return self._write_faithful(faithful)
                return self._finish(self._failure("failed verification", verified))
            if last.stage == "verify":  # no Profile tool (or a session from before Profile verified first)
                if "Profile" not in self.tools:
                    return self._finish(self._success_summary(verified=True))
                return self._reply("profile", "Time the first launch configuration.", [("Profile", {})])
        if last.stage.startswith("final"):
            return self._after_final(last)
        if last.stage == "finish":
            return self._finish("The run is already finished; see the summary above.")
        return self._next_try_or_final()

    # ------------------------------------------------------------------------------------- replies

    def _reply(self, stage: str, content: str, calls: list[tuple[str, dict[str, Any]]]) -> ModelReply:
        tool_calls = [
            ToolCall(f"{CALL_PREFIX}.{self.number}.{stage}.{k}", name, arguments, json.dumps(arguments))
            for k, (name, arguments) in enumerate(calls)
        ]
        return ModelReply(content=content, tool_calls=tool_calls)

    def _todo(self) -> ModelReply:
        analysis = self.plan.analysis
        todos = [{"content": f"Analyse the forward: {len(analysis.groups)} group(s)", "status": "completed"}]
        for group in analysis.groups:
            action = "Generate" if group.generated else "Cannot generate"
            todos.append({"content": f"{action} {group.name}: {group.describe()}", "status": "pending"})
        if analysis.supported:
            todos += [
                {"content": "Write the kernels, bindings and model_new.py; compile; verify", "status": "pending"},
                {"content": f"Time up to {1 + len(self.plan.search(None).tries)} launch configuration(s); keep the fastest", "status": "pending"},
            ]
        else:
            todos.append({"content": analysis.blockers(), "status": "pending"})
        intro = f"Built-in policy plan for {analysis.problem_name}."
        return self._reply("plan", intro, [("TodoWrite", {"todos": todos})])

    def _write(self) -> ModelReply:
        from kernelpilot.policy.families import render_all

        files = render_all(self.plan.problem, self.plan.analysis)
        calls = [("Write", _write_args(f)) for f in files]
        content = "Write the generated files."
        examples = self._starter_examples()
        if examples and "Bash" in self.tools:
            # Compiled in, the scaffold's example would register its op beside ours and cost a compile per build.
            calls.append(("Bash", {"command": "rm -f " + " ".join(examples)}))
            content += " Remove the scaffold's example kernel, which the answer does not use."
        return self._reply("write", content, calls)

    def _starter_examples(self) -> list[str]:
        """The example kernel files `init` scaffolded that are still in the workspace."""
        from kernelpilot.workspace import EXAMPLE_KERNELS

        if self.workspace is None:
            return []
        return [name for name in EXAMPLE_KERNELS if (self.workspace / name).is_file()]

    def _faithful_fallback(self, verified: JudgeResult | None) -> _Plan | None:
        """The plan to write after a mismatch of the first answer, or None: only once, only for a mismatch (a
        crash or a guard finding is no rounding), and only when rounding as eager does changes the kernels."""
        if self.plan.faithful or self.fallback is None or not verify_mismatch(verified):
            return None
        faithful = self.fallback()
        return faithful if faithful.analysis != self.plan.analysis else None

    def _write_faithful(self, faithful: _Plan) -> ModelReply:
        from kernelpilot.policy.families import render_all

        # The faithful analysis only splits groups off, so its files overwrite every kernel of the first answer.
        files = render_all(faithful.problem, faithful.analysis)
        content = f"{_faithful_reason(faithful.analysis)} Write the unfused form and verify it."
        return self._reply(FAITHFUL_STAGE, content, [("Write", _write_args(f)) for f in files])

    def _finish(self, summary: str) -> ModelReply:
        return self._reply("finish", summary, [("Finish", {"summary": summary})])

    # ---------------------------------------------------------------------------------- the search

    def _search(self) -> tuple[LaunchSearch, str]:
        """The launch search replayed from the Profile results so far, and the stage of its fastest time."""
        profile = self.by_stage.get("profile")
        first = profile.results.get("Profile") if profile else None
        search = self.plan.search(first)
        best_stage = "profile"
        while (next_try := search.next_try()) is not None and (step := self.by_stage.get(_try_stage(*next_try))):
            result = step.results.get("Profile")
            if search.record(candidate_ms(result), candidate_sol(result)):
                best_stage = step.stage
        return search, best_stage

    def _timings(self) -> tuple[dict[str, int], float | None, str]:
        """The fastest configuration per group so far, its time (None when nothing was timed) and its stage."""
        search, best_stage = self._search()
        return search.best, search.best_ms, best_stage

    def _next_try_or_final(self) -> ModelReply:
        search, _ = self._search()
        next_try = search.next_try()
        if "Profile" in self.tools and next_try is not None:
            group_name, index = next_try
            config = self.plan.candidates[group_name][index]
            # Profile builds, verifies and times: a configuration that breaks the kernel gets no time, and one whose
            # calls are far slower than the best so far is stopped after two trials, untimed.
            bound = {"slower_than_ms": search.best_ms} if search.best_ms is not None else {}
            calls = [("Write", _write_args(f)) for f in self._kernels(search.choice(*next_try))]
            content = f"Time {group_name} with {config.label}."
            ahead = self._ahead(search, group_name, index)
            if ahead:  # the group's first try: build its other configurations now, side by side
                calls.append(("Compile", {"ahead": ahead}))
                content += f" Build the group's other {len(ahead)} configuration(s) ahead, all at once."
            return self._reply(_try_stage(*next_try), content, calls + [("Profile", bound)])
        if self.steps and self._timings()[2] == self.steps[-1].stage:
            # The fastest configuration is the one just profiled (verified, then timed): the workspace holds it.
            return self._finish(self._success_summary(verified=True))
        return self._final(0)

    def _ahead(self, search: LaunchSearch, group_name: str, index: int) -> list[dict[str, str]]:
        """At a group's first try (with Compile to ask): the group's file at each of its later tries, with the other
        groups at their best so far, as they will be; empty otherwise."""
        later = [i for name, i in search.tries[search.recorded + 1:] if name == group_name][:MAX_AHEAD]
        first = next(i for name, i in search.tries if name == group_name)
        if index != first or not later or "Compile" not in self.tools:
            return []
        group = next(g for g in self.plan.groups if g.name == group_name)
        return [{f.path: f.content for f in self._kernels({group_name: i}, [group])} for i in later]

    def _final_choices(self) -> list[dict[str, int]]:
        """What to write back, in order of preference: the fastest configurations, then the first ones."""
        best, _, _ = self._timings()
        first = {group.name: 0 for group in self.plan.groups}
        return [best] if best == first else [best, first]

    def _final(self, index: int) -> ModelReply:
        choice = self._final_choices()[index]
        calls = [("Write", _write_args(f)) for f in self._kernels(choice)] + [("Verify", {})]
        return self._reply(f"final{index}", "Write the fastest configuration back and verify it.", calls)

    def _after_final(self, step: _Step) -> ModelReply:
        index = int(step.stage.removeprefix("final"))
        if verify_ok(step.results.get("Verify")):
            return self._finish(self._success_summary(verified=True, final_index=index))
        if index + 1 < len(self._final_choices()):
            return self._final(index + 1)
        return self._finish(self._failure("failed verification when written back", step.results.get("Verify")))

    def _kernels(self, choice: dict[str, int], groups: list[Group] | None = None) -> list[GeneratedFile]:
        from kernelpilot.policy.families import render_kernel

        groups = self.plan.groups if groups is None else groups
        return [render_kernel(g, self.plan.candidates[g.name][choice[g.name]]) for g in groups]

    # ------------------------------------------------------------------------------------- summaries

    def _unsupported_summary(self) -> str:
        analysis = self.plan.analysis
        fusible = [g for g in analysis.groups if g.generated]
        parts = [f"No kernels written for {analysis.problem_name}: {analysis.blockers()}"]
        if fusible:
            shown = "; ".join(g.describe() for g in fusible)
            parts.append(f"The rest could be fused ({shown}), but ModelNew.forward may not compute the unsupported "
                         "part with torch, so nothing was generated.")  # fmt: skip
        return " ".join(parts)

    def _failure(self, what: str, result: JudgeResult | None) -> str:
        fallback = " (the unfused form written after the fused epilogue failed verification)" * self.plan.faithful
        return (f"The generated kernels for {self.plan.analysis.problem_name}{fallback} {what}: "
                f"{problem_line(result)} model_new.py holds them as written; no verified candidate came out "
                "of this run.")  # fmt: skip

    def _success_summary(self, verified: bool, final_index: int = 0) -> str:
        analysis = self.plan.analysis
        groups = "; ".join(group.describe() for group in self.plan.groups)
        parts = [f"Generated {len(self.plan.groups)} kernel(s) for {analysis.problem_name} ({groups})."]
        parts.append("Verified correct." if verified else "Not verified.")
        if self.plan.faithful:
            parts.append(_faithful_reason(analysis))
        best, best_ms, best_stage = self._timings()
        timed = [s for s in self.steps if s.stage == "profile" or s.stage.startswith("try")]
        if best_ms is not None:
            choice = self._final_choices()[final_index]
            configs = ", ".join(f"{name}: {self.plan.candidates[name][i].label}" for name, i in choice.items())
            parts.append(f"Timed {len(timed)} launch configuration(s); kept {configs}.")
            search, _ = self._search()
            if search.skipped:
                names = ", ".join(search.skipped)
                parts.append(f"Did not search {names} ({sum(search.skipped.values())} configuration(s)): their kernels "
                             f"took under {MIN_SHARE:.0%} of the time.")
            if search.near_sol and search.recorded < len(search.tries):
                parts.append(f"Stopped the search at {search.best_sol:.0%} of speed-of-light: the "
                             f"{len(search.tries) - search.recorded} configuration(s) left could win little.")
            if choice == best:
                parts.append(f"Candidate median {best_ms:.4g} ms{self._speedups(best_stage)}.")
            else:
                parts.append("The fastest configuration failed verification when written back, so the first one was kept.")
        return " ".join(parts)

    def _speedups(self, stage: str) -> str:
        """' (1.20x vs eager, 0.95x vs torch.compile)' from the Profile result of the kept configuration."""
        step = self.by_stage.get(stage)
        result = step.results.get("Profile") if step else None
        bench = result.bench if isinstance(result, EvalResult) else None
        return f" ({speedup_text(bench)})" if bench is not None and bench.ok else ""


def _faithful_reason(analysis: Analysis) -> str:
    """Why the faithful form was written, in one sentence naming the products' dtype."""
    dtypes = {group.output.dtype for group in analysis.groups if group.kind == "matmul"} & set(_SHORT_DTYPES)
    shown = " and ".join(_SHORT_DTYPES[dtype] for dtype in sorted(dtypes)) or "its dtype"
    return f"The fused epilogue rounded differently from eager; the product is now written in {shown} first."


def _try_stage(group_name: str, index: int) -> str:
    return f"try-{group_name}-{index}"


def _write_args(file: GeneratedFile) -> dict[str, str]:
    return {"path": file.path, "content": file.content}
