"""The built-in policy's replies over a conversation: its tool calls (plan, write, compile, verify, profile, the
launch search, finish) decided from the judge's typed results, the rounding-faithful fallback after a mismatch,
resuming from a conversation, the agent loop driving it, and how the model name resolves to it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kernelpilot.agent import VerifyOutcome
from kernelpilot.agent.loop import assistant_message
from kernelpilot.agent.observations import render
from kernelpilot.agent.tools import default_tools, tool_schemas
from kernelpilot.policy import BuiltinPolicy
from kernelpilot.policy.analysis import analyze
from kernelpilot.policy.families import launch_candidates, render_all, render_kernel
from kernelpilot.policy.policy import candidate_ms, kernel_shares
from kernelpilot.policy.search import LaunchSearch
from kernelpilot.problem import load_problem
from kernelpilot.results import (
    HARNESS_ERROR, BenchResult, BuildResult, Diagnostic, EvalResult, KernelTime, Timing, TrialResult, VerifyResult,
)  # fmt: skip

from kp_testing import EXAMPLES
from policy_testing import analysed, only_group, unsupported_problem


# ------------------------------------------------------------------------------------ the policy's replies

SCHEMAS = tool_schemas(default_tools())


def timing(ms: float) -> Timing:
    return Timing(median_ms=ms, p10_ms=ms, p90_ms=ms, mean_ms=ms, runs=20)


def built(ok: bool = True) -> BuildResult:
    if ok:
        return BuildResult(ok=True, workspace="/w", extension_name="kp_kernels", arch="9.0", seconds=1.2,
                           compiled=["kernels/policy_g0.cu"])  # fmt: skip
    error = Diagnostic("error", "expected ';'", file="kernels/policy_g0.cu", line=10)
    return BuildResult(ok=False, workspace="/w", extension_name="kp_kernels", arch="9.0", diagnostics=[error],
                       error="the compiler reported 1 error")  # fmt: skip


def verified(error_kind: str | None = None, message: str = "") -> VerifyResult:
    trials = [TrialResult(seed=seed, ok=error_kind is None) for seed in range(5)]
    return VerifyResult(ok=error_kind is None, trials=trials, error_kind=error_kind, message=message)


def profiled(ms: float, sol: float | None = None, vs_compile: float = 1.10, kernels: dict[str, float] | None = None) -> EvalResult:
    bench = BenchResult(ok=True, gpu="NVIDIA H100", candidate=timing(ms), eager=timing(9.0),
                        speedup_vs_eager=9 / ms, speedup_vs_compile=vs_compile, sol_candidate=sol,
                        kernels=[KernelTime(name, total, 1) for name, total in (kernels or {}).items()])  # fmt: skip
    return EvalResult("problem", "/w", build=built(), verify=verified(), bench=bench, reward=3)


class ScriptedTools:
    """Answers tool calls with the judge's typed results, chosen outcomes; the text is what the real tools render."""

    def __init__(self, build_ok: bool = True, verify_ok: bool = True, times_ms: tuple[float, ...] = (3.0,),
                 verify_failures: tuple[VerifyResult, ...] = (), sols: tuple[float | None, ...] = ()):  # fmt: skip
        self.build_ok, self.verify_ok, self.times = build_ok, verify_ok, list(times_ms)
        self.sols = list(sols)  # each Profile's fraction of speed-of-light, one each (then None: no roofline)
        self.verify_failures = list(verify_failures)  # what the first verifying calls answer, one each
        self.calls: list = []
        self.results: dict = {}  # call id -> typed result, as the loop keeps them in ctx.judged.by_call

    def __call__(self, call) -> str:
        self.calls.append(call)
        result = self._result(call.name)
        if result is None:
            return "ok"
        self.results[call.id] = result
        return render(result)

    def _result(self, name: str):
        if name == "Compile":
            return built(self.build_ok)
        if name == "Verify":
            if self.verify_failures:
                return VerifyOutcome(built(), self.verify_failures.pop(0))
            return VerifyOutcome(built(), verified(None if self.verify_ok else "mismatch"))
        if name == "Profile":  # the judge verifies before it times: a failed verification is timed not at all
            if self.verify_failures or not self.verify_ok:
                failure = self.verify_failures.pop(0) if self.verify_failures else verified("mismatch")
                return EvalResult("problem", "/w", build=built(), verify=failure, reward=-1)
            return profiled(self.times.pop(0) if len(self.times) > 1 else self.times[0],
                            self.sols.pop(0) if self.sols else None)
        return None


def policy_for(workspace: Path, tools: ScriptedTools) -> BuiltinPolicy:
    return BuiltinPolicy(workspace / "model.py", tools.results)


def converse(policy: BuiltinPolicy, tools: Callable[[Any], str], turns: int = 30) -> list[dict]:
    """Drive the policy as the loop does; return the conversation."""
    messages = [{"role": "system", "content": "..."}, {"role": "user", "content": "Optimise it."}]
    for _ in range(turns):
        reply = policy.query(messages, SCHEMAS)
        messages.append(assistant_message(reply))
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": tools(call)})
        if reply.tool_calls[-1].name == "Finish":
            return messages
    raise AssertionError("the policy did not finish")


def actions(messages: list[dict]) -> list[list[str]]:
    return [[c["function"]["name"] for c in m["tool_calls"]] for m in messages if m["role"] == "assistant"]


def written(messages: list[dict], path: str) -> list[str]:
    import json

    return [
        json.loads(c["function"]["arguments"])["content"]
        for m in messages if m["role"] == "assistant" for c in m["tool_calls"]
        if c["function"]["name"] == "Write" and json.loads(c["function"]["arguments"])["path"] == path
    ]  # fmt: skip


@pytest.fixture
def layernorm_workspace(tmp_path) -> Path:
    (tmp_path / "model.py").write_text((EXAMPLES / "layernorm.py").read_text())
    return tmp_path


def test_policy_plans_writes_compiles_verifies_profiles_searches_and_finishes(layernorm_workspace):
    problem = load_problem(layernorm_workspace / "model.py")
    (group,) = analyze(problem).groups
    candidates = launch_candidates(group)
    # The second candidate is the fastest.
    tools = ScriptedTools(times_ms=(3.0, 2.0) + (2.5,) * (len(candidates) - 2))
    messages = converse(policy_for(layernorm_workspace, tools), tools)
    # The first try builds the other configurations ahead, all at once, so the later tries compile nothing.
    tries = [["Write", "Compile", "Profile"]] + [["Write", "Profile"]] * (len(candidates) - 2)
    assert actions(messages) == [
        ["TodoWrite"], ["Write", "Write", "Write"], ["Compile"], ["Profile"], *tries, ["Write", "Verify"], ["Finish"],
    ]  # fmt: skip
    (ahead,) = [c.arguments["ahead"] for c in tools.calls if c.name == "Compile" and c.arguments]
    assert ahead == [{"kernels/policy_g0.cu": render_kernel(group, c).content} for c in candidates[2:]]
    # Each try carries the time to beat (the best so far): a configuration far slower is stopped early, untimed.
    bounds = [c.arguments for c in tools.calls if c.name == "Profile"]
    assert bounds == [{}, {"slower_than_ms": 3.0}] + [{"slower_than_ms": 2.0}] * (len(candidates) - 2)
    kernels = written(messages, "kernels/policy_g0.cu")
    assert kernels[-1] == render_kernel(group, candidates[1]).content  # the fastest is written back
    summary = tools.calls[-1].arguments["summary"]
    assert "Verified correct" in summary and "2 ms" in summary and candidates[1].label in summary


def test_policy_stops_the_search_near_speed_of_light_and_says_so(layernorm_workspace):
    problem = load_problem(layernorm_workspace / "model.py")
    (group,) = analyze(problem).groups
    left = len(launch_candidates(group)) - 3
    assert left > 0, "the example needs more candidates than this test times"
    # The first configuration runs at 80% of speed-of-light, the second at 93%: the search stops there.
    tools = ScriptedTools(times_ms=(3.0, 2.6, 2.5), sols=(0.8, 0.93, 0.95))
    messages = converse(policy_for(layernorm_workspace, tools), tools)
    # The fastest is the configuration just profiled (verified, then timed): nothing to write back and verify again.
    assert actions(messages) == [
        ["TodoWrite"], ["Write", "Write", "Write"], ["Compile"], ["Profile"], ["Write", "Compile", "Profile"],
        ["Finish"],
    ]  # fmt: skip
    assert written(messages, "kernels/policy_g0.cu")[-1] == render_kernel(group, launch_candidates(group)[1]).content
    summary = tools.calls[-1].arguments["summary"]
    assert "Verified correct" in summary and "Candidate median 2.6 ms" in summary
    assert "Timed 2 launch configuration(s)" in summary
    assert f"Stopped the search at 93% of speed-of-light: the {left + 1} configuration(s) left could win little." in summary


def test_policy_resumes_from_the_conversation_and_the_judges_results(layernorm_workspace):
    tools = ScriptedTools()
    messages = converse(policy_for(layernorm_workspace, tools), tools, turns=30)
    # A fresh policy handed the conversation up to the Compile result continues with Profile.
    cut = next(i for i, m in enumerate(messages) if m["role"] == "tool" and m["tool_call_id"].endswith(".compile.0"))
    reply = policy_for(layernorm_workspace, tools).query(messages[: cut + 1], SCHEMAS)
    assert [c.name for c in reply.tool_calls] == ["Profile"]


def test_policy_verifies_with_verify_where_there_is_no_profile_and_a_session_that_did_goes_on_to_profile(layernorm_workspace):
    no_profile = [schema for schema in SCHEMAS if schema["function"]["name"] != "Profile"]
    tools = ScriptedTools()
    policy, messages = policy_for(layernorm_workspace, tools), [{"role": "user", "content": "Optimise it."}]
    while not messages[-1].get("content", "").startswith("Verify PASSED"):
        reply = policy.query(messages, no_profile)
        messages.append(assistant_message(reply))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": tools(c)} for c in reply.tool_calls]
    assert actions(messages) == [["TodoWrite"], ["Write", "Write", "Write"], ["Compile"], ["Verify"]]
    # A session started before the first Profile verified by itself (or with Profile added) goes on to time it.
    reply = policy_for(layernorm_workspace, tools).query(messages, SCHEMAS)
    assert [c.name for c in reply.tool_calls] == ["Profile"]
    assert policy.query(messages, no_profile).tool_calls[-1].name == "Finish"


def test_policy_ends_honestly_when_the_build_fails(layernorm_workspace):
    tools = ScriptedTools(build_ok=False)
    messages = converse(policy_for(layernorm_workspace, tools), tools)
    assert actions(messages)[-2:] == [["Compile"], ["Finish"]]
    summary = tools.calls[-1].arguments["summary"]
    assert "did not compile: build: kernels/policy_g0.cu:10: expected ';'" in summary, "the suite's failure line"
    assert "no verified candidate" in summary


def test_policy_ends_honestly_when_verification_fails(layernorm_workspace):
    tools = ScriptedTools(verify_ok=False)
    messages = converse(policy_for(layernorm_workspace, tools), tools)
    assert actions(messages)[-2:] == [["Profile"], ["Finish"]]
    assert "failed verification" in tools.calls[-1].arguments["summary"]


# As the H100 answered the LoRA example's fused first answer (BENCHMARKS.md, 2026-11-23 and 2026-11-26).
LORA_MISMATCH = VerifyResult(
    ok=False, error_kind="mismatch", message="trial 1 (seed 1): 1 of 33554432 outside tolerance",
    trials=[TrialResult(seed=0, ok=True), TrialResult(seed=1, ok=False, max_abs_error=0.0156, max_rel_error=0.0435,
                                                      worst_index=[3, 1021, 77])],
)  # fmt: skip
FAITHFUL_SENTENCE = "The fused epilogue rounded differently from eager; the product is now written in bf16 first."


@pytest.fixture
def lora_workspace(tmp_path) -> Path:
    (tmp_path / "model.py").write_text((EXAMPLES / "lora_residual_bf16.py").read_text())
    return tmp_path


def test_policy_falls_back_to_the_faithful_kernels_after_a_mismatch_and_says_why(lora_workspace):
    problem = load_problem(lora_workspace / "model.py")
    fused, faithful = analyze(problem), analyze(problem, faithful=True)
    tools = ScriptedTools(verify_failures=(LORA_MISMATCH,))
    messages = converse(policy_for(lora_workspace, tools), tools)
    tries = []  # the faithful plan's search: a group's first try builds its other configurations ahead
    for group in faithful.generated_groups:
        count = len(launch_candidates(group)) - 1
        tries += [["Write"] * 3 + ["Compile"] * (k == 0 < count - 1) + ["Profile"] for k in range(count)]
    files = len(render_all(problem, fused)), len(render_all(problem, faithful))
    assert files[1] == files[0] + 2  # one more kernel and its binding
    assert actions(messages) == [
        ["TodoWrite"], ["Write"] * files[0], ["Compile"], ["Profile"], ["Write"] * files[1], ["Compile"],
        ["Profile"], *tries, ["Write"] * 3 + ["Verify"], ["Finish"],
    ]  # fmt: skip
    fallback = next(m for m in messages if m["role"] == "assistant" and "faithful" in m["tool_calls"][0]["id"])
    assert FAITHFUL_SENTENCE in fallback["content"]
    assert [f.content for f in render_all(problem, fused)][-1] == written(messages, "model_new.py")[0]
    assert [f.content for f in render_all(problem, faithful)][-1] == written(messages, "model_new.py")[1]
    (update,) = written(messages, "kernels/policy_g2.cu")[:1]  # the scale and add, first written by the fallback
    assert update == render_kernel(faithful.groups[2], launch_candidates(faithful.groups[2])[0]).content
    summary = tools.calls[-1].arguments["summary"]
    assert "Verified correct." in summary and FAITHFUL_SENTENCE in summary and "3 kernel(s)" in summary


def test_policy_resumes_a_fallback_on_the_faithful_kernels(lora_workspace):
    tools = ScriptedTools(verify_failures=(LORA_MISMATCH,))
    messages = converse(policy_for(lora_workspace, tools), tools)
    # A fresh policy handed the conversation up to the faithful kernels' first Profile result times the faithful
    # plan's third group (the first Profile result is the fused answer's mismatch).
    cut = [i for i, m in enumerate(messages) if m["role"] == "tool" and m["content"].startswith("Profile:")][1]
    tool_calls = policy_for(lora_workspace, tools).query(messages[: cut + 1], SCHEMAS).tool_calls
    assert [c.name for c in tool_calls] == ["Write"] * 3 + ["Compile", "Profile"]
    assert [c.arguments["path"] for c in tool_calls[:3]] == [f"kernels/policy_g{i}.cu" for i in range(3)]


def test_policy_ends_honestly_when_the_faithful_kernels_fail_verification_too(lora_workspace):
    tools = ScriptedTools(verify_failures=(LORA_MISMATCH, LORA_MISMATCH))
    messages = converse(policy_for(lora_workspace, tools), tools)
    files = len(render_all(load_problem(lora_workspace / "model.py"), analysed(lora_workspace / "model.py", faithful=True)))
    assert actions(messages)[-5:] == [["Profile"], ["Write"] * files, ["Compile"], ["Profile"], ["Finish"]]
    summary = tools.calls[-1].arguments["summary"]
    assert "failed verification" in summary and "unfused form" in summary and "no verified candidate" in summary


@pytest.mark.parametrize(
    "failure",
    [verified("guard", "torch-compute: forward computes with torch"), verified("crash", "illegal memory access"),
     verified(HARNESS_ERROR, "kernelpilot's verifier failed: KeyError: 'out'")],
    ids=["guard", "crash", "harness"],
)
def test_policy_falls_back_only_after_a_mismatch(lora_workspace, failure):
    tools = ScriptedTools(verify_failures=(failure,))
    messages = converse(policy_for(lora_workspace, tools), tools)
    assert actions(messages)[-2:] == [["Profile"], ["Finish"]]
    assert f"failed verification: {failure.error_kind}: {failure.message}" in tools.calls[-1].arguments["summary"]


def test_policy_names_unsupported_ops_and_writes_nothing(tmp_path):
    unsupported_problem(tmp_path)
    tools = ScriptedTools()
    messages = converse(policy_for(tmp_path, tools), tools)
    assert actions(messages) == [["TodoWrite"], ["Finish"]]
    todos = tools.calls[0].arguments["todos"]
    assert any("aten.sort" in todo["content"] for todo in todos)
    summary = tools.calls[-1].arguments["summary"]
    assert summary.startswith("No kernels written") and "aten.sort" in summary


class TypedJudge:
    """A judge that answers with chosen typed results (the real one needs a GPU): builds succeed, verifications
    pass, and each evaluation takes the next of `times_ms`."""

    device = "cpu"

    def __init__(self, *times_ms: float, vs_compile: float = 1.10):
        self.times = list(times_ms)
        self.vs_compile = vs_compile

    def build(self, root, ahead=()):
        return built()

    def verify(self, root, build, trials=5, atol=1e-2, rtol=1e-2):
        return verified()

    def evaluate(self, root, trials=5, atol=1e-2, rtol=1e-2, slower_than_ms=None):
        return profiled(self.times.pop(0) if len(self.times) > 1 else self.times[0], vs_compile=self.vs_compile)


def test_the_loop_hands_the_policy_the_judges_typed_results_and_a_resume_rebuilds_them(tmp_path):
    from kernelpilot.agent import JudgeRecord, ToolContext
    from kernelpilot.agent.loop import run_agent
    from kernelpilot.agent.session import Session
    from kernelpilot.config import Settings
    from kernelpilot.workspace import init_workspace

    ws, _ = init_workspace(EXAMPLES / "layernorm.py", tmp_path / "ws")
    count = len(launch_candidates(only_group(analysed(EXAMPLES / "layernorm.py"))))
    judged = JudgeRecord()
    ctx = ToolContext(workspace=ws, judge=TypedJudge(3.0, 2.0, *[2.5] * count), judged=judged)
    session = Session.create(ws.root, problem=str(ws.model_path), model="builtin")
    task = [{"role": "user", "content": "Optimise it."}]
    summary = run_agent(task, BuiltinPolicy(ws.model_path, judged.by_call), default_tools(), ctx, Settings(), session)
    assert summary.status == "finished" and summary.best is not None
    finish = Session.resume(ws.root).messages[-2]["tool_calls"][0]["function"]["arguments"]
    assert "Verified correct" in finish and "2 ms" in finish  # the second configuration was the fastest
    # A resumed session rebuilds every judge call's typed result from the transcript.
    rebuilt = Session.resume(ws.root).state.judged_calls
    assert rebuilt.keys() == judged.by_call.keys() and len(rebuilt) == 3 + count  # 2 Compiles, Profiles, Verify
    assert all(type(rebuilt[key]) is type(result) for key, result in judged.by_call.items())
    assert [candidate_ms(r) for r in rebuilt.values()] == [candidate_ms(r) for r in judged.by_call.values()]


def test_policy_works_on_the_problem_it_is_given_whatever_the_task_says():
    policy = BuiltinPolicy(EXAMPLES / "silu_scale_shift.py")
    reply = policy.query([{"role": "user", "content": f"Optimise it.\n\nWorkspace: {EXAMPLES / 'layernorm'}"}], SCHEMAS)
    assert [c.name for c in reply.tool_calls] == ["TodoWrite"]
    assert "silu_scale_shift" in reply.content


def test_the_built_in_policy_is_resolved_only_with_its_problem():
    from kernelpilot.agent.model import ModelError
    from kernelpilot.models import resolve_model

    results = {}
    policy = resolve_model(None, None, None, problem_path=EXAMPLES / "layernorm.py", judge_results=results)
    assert isinstance(policy, BuiltinPolicy) and policy.judge_results is results
    with pytest.raises(ModelError, match="needs the problem"):
        resolve_model(None, None, None)


def test_launch_search_tries_one_group_at_a_time_with_the_others_at_their_best():
    search = LaunchSearch({"g0": 3, "g1": 2}, first_ms=3.0)
    assert search.tries == [("g0", 1), ("g0", 2), ("g1", 1)]
    assert search.choice(*search.next_try()) == {"g0": 1, "g1": 0}
    assert search.record(2.0)  # faster: kept
    assert not search.record(None)  # broken or wrong: no time, nothing changes
    assert search.choice(*search.next_try()) == {"g0": 1, "g1": 1}
    assert not search.record(2.5)
    assert search.next_try() is None and (search.best, search.best_ms) == ({"g0": 1, "g1": 0}, 2.0)
    untimed = LaunchSearch({"g0": 2}, first_ms=None)  # the first configuration got no time: any time is kept
    assert untimed.record(9.0) and untimed.best == {"g0": 1}


def test_launch_search_ends_when_the_best_is_near_speed_of_light():
    assert LaunchSearch({"g0": 3}, first_ms=1.0, first_sol=0.95).next_try() is None
    assert LaunchSearch({"g0": 3}, first_ms=None, first_sol=0.95).next_try() == ("g0", 1)  # untimed: no claim
    search = LaunchSearch({"g0": 4}, first_ms=3.0, first_sol=0.5)
    assert not search.record(3.5, 0.95)  # slower: its fraction is not the best's
    assert search.next_try() == ("g0", 2)
    assert search.record(2.0, 0.91) and search.near_sol and search.next_try() is None
    no_roofline = LaunchSearch({"g0": 2}, first_ms=3.0, first_sol=None)
    assert no_roofline.next_try() == ("g0", 1)


def test_launch_search_skips_groups_whose_kernels_take_a_sliver_of_the_time():
    search = LaunchSearch({"g0": 3, "g1": 4, "g2": 2}, first_ms=3.0, shares={"g1": 0.02, "g2": 0.40})
    assert search.tries == [("g0", 1), ("g0", 2), ("g2", 1)] and search.skipped == {"g1": 3}
    # Not timed, nothing is known of the shares: every group is searched.
    assert len(LaunchSearch({"g0": 3, "g1": 4}, first_ms=None, shares={"g1": 0.0}).tries) == 5


def test_kernel_shares_come_from_the_profile_for_generated_kernels_only(tmp_path):
    (tmp_path / "model.py").write_text(LONG_SEARCH_PROBLEM)
    groups = analysed(tmp_path / "model.py").generated_groups
    assert [g.kind for g in groups] == ["conv", "row", "row"]
    result = profiled(4.0, kernels={"sm80_xmma_fprop_implicit_gemm_f32f32_cudnn": 3.0,
                                    "void (anonymous namespace)::policy_g1_kernel<1>(float const*, float*, long)": 0.9,
                                    "void (anonymous namespace)::policy_g2_kernel<1>(float const*, float*, long)": 0.05})
    # The denominator is the candidate's median or its kernels' sum, the larger; the cuDNN call's group has no share.
    assert kernel_shares(result, groups) == pytest.approx({"g1": 0.9 / 4.0, "g2": 0.05 / 4.0})
    assert kernel_shares(profiled(4.0), groups) == {}  # no kernel list: nothing is known


def test_policy_does_not_search_a_group_whose_kernels_take_a_sliver_of_the_time(tmp_path):
    (tmp_path / "model.py").write_text(LONG_SEARCH_PROBLEM)
    groups = analysed(tmp_path / "model.py").generated_groups
    counts = {g.name: len(launch_candidates(g)) for g in groups}
    kernels = {"sm80_xmma_fprop_cudnn": 3.0, "void policy_g1_kernel<1>(float const*)": 0.9,
               "void policy_g2_kernel<1>(float const*)": 0.05}

    class WithKernels(ScriptedTools):
        def _result(self, name):
            result = super()._result(name)
            if name == "Profile":
                result.bench.kernels = [KernelTime(k, ms, 1) for k, ms in kernels.items()]
            return result

    tools = WithKernels(times_ms=(4.0,))
    messages = converse(policy_for(tmp_path, tools), tools, turns=40)
    tried = [m["content"] for m in messages if m["role"] == "assistant" and m["content"].startswith("Time ")]
    assert len(tried) == counts["g0"] - 1 + counts["g1"] - 1 and not any(t.startswith("Time g2") for t in tried)
    summary = tools.calls[-1].arguments["summary"]
    assert f"Did not search g2 ({counts['g2'] - 1} configuration(s)): their kernels took under 3% of the time." in summary


def test_candidate_time_counts_only_when_verified():
    assert candidate_ms(profiled(1.25)) == 1.25
    wrong = EvalResult("problem", "/w", build=built(), verify=verified("mismatch"), reward=-1, error_kind="mismatch")
    assert candidate_ms(wrong) is None
    assert candidate_ms(VerifyOutcome(built(), verified())) is None  # a Verify times nothing


def test_policy_decisions_do_not_depend_on_the_wording_of_the_tools_text(layernorm_workspace):
    # The text the model would read is replaced: the policy reads only the typed results, so its run is unchanged.
    tools, reworded = ScriptedTools(times_ms=(3.0, 2.0, 2.5)), ScriptedTools(times_ms=(3.0, 2.0, 2.5))
    expected = converse(policy_for(layernorm_workspace, tools), tools)
    messages = converse(policy_for(layernorm_workspace, reworded), lambda call: reworded(call) and "(reworded)")
    assert [m for m in messages if m["role"] == "assistant"] == [m for m in expected if m["role"] == "assistant"]


LONG_SEARCH_PROBLEM = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(16, 32, 3, padding=1)

    def forward(self, x):
        y = torch.softmax(torch.relu(self.conv(x)), dim=1)
        return y.mean(dim=(2, 3)) + y.amax(dim=(2, 3))


def get_inputs():
    return [torch.randn(8, 16, 64, 64)]


def get_init_inputs():
    return []
'''


def test_a_search_longer_than_a_model_context_window_runs_each_try_once(tmp_path):
    # Three groups (a cuDNN convolution with 12 algorithms, two row kernels), each try writing all three kernels
    # (~40 KB): the conversation passes the loop's default context window long before the search ends (torch.compile
    # stays faster: no target is met). The policy replays its search from the conversation, so a trimmed one made it
    # start the search again, round after round, until max turns (KernelBench L2 8 on an H200: 40 turns, 227 s).
    from kernelpilot.agent import JudgeRecord, ToolContext
    from kernelpilot.agent.loop import run_agent
    from kernelpilot.agent.session import Session
    from kernelpilot.config import Settings
    from kernelpilot.workspace import init_workspace

    (tmp_path / "problem.py").write_text(LONG_SEARCH_PROBLEM)
    ws, _ = init_workspace(tmp_path / "problem.py", tmp_path / "ws")
    tries = sum(len(launch_candidates(g)) - 1 for g in analysed(tmp_path / "problem.py").generated_groups)
    judged = JudgeRecord()
    ctx = ToolContext(workspace=ws, judge=TypedJudge(3.0, vs_compile=0.9), judged=judged)
    session = Session.create(ws.root, problem=str(ws.model_path), model="builtin")
    task = [{"role": "user", "content": "Optimise it."}]
    summary = run_agent(task, BuiltinPolicy(ws.model_path, judged.by_call), default_tools(), ctx, Settings(), session)
    assert summary.status == "finished", summary.status
    messages = Session.resume(ws.root).messages
    assert sum(len(json.dumps(m)) for m in messages) > 4 * 128_000  # well past the window it must outlast
    profiles = [c for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or []
                if c["function"]["name"] == "Profile"]
    assert len(profiles) == 1 + tries


def test_the_policy_removes_the_scaffolds_example_kernel_when_it_writes_its_own(tmp_path):
    """Left in, `init`'s example would be compiled into every build and register its op beside the policy's."""
    from kernelpilot.agent import ToolContext
    from kernelpilot.models import resolve_model
    from kernelpilot.workspace import EXAMPLE_KERNELS, init_workspace

    ws, _ = init_workspace(EXAMPLES / "layernorm.py", tmp_path / "ws")
    assert all((ws.root / name).is_file() for name in EXAMPLE_KERNELS)
    # As `optimize` makes it: the user's problem file, and the workspace the run writes in.
    policy = resolve_model(None, None, None, problem_path=EXAMPLES / "layernorm.py", workspace=ws.root)
    messages = [{"role": "user", "content": "Optimise it."}]
    messages.append(assistant_message(policy.query(messages, SCHEMAS)))  # the plan
    messages.append({"role": "tool", "tool_call_id": messages[-1]["tool_calls"][0]["id"], "content": "ok"})
    write = policy.query(messages, SCHEMAS)
    assert [c.name for c in write.tool_calls][-1] == "Bash" and "example kernel" in write.content
    tools = {tool.name: tool for tool in default_tools()}
    ctx = ToolContext(workspace=ws, judge=None)
    for call in write.tool_calls:
        tools[call.name].run(call.arguments, ctx)
    assert not any((ws.root / name).exists() for name in EXAMPLE_KERNELS)
    assert (ws.root / "kernels" / "policy_g0.cu").is_file()
    # Without Bash (or once they are gone) the write step is Writes only.
    no_bash = tool_schemas([tool for tool in default_tools() if tool.name != "Bash"])
    assert {c.name for c in BuiltinPolicy(ws.model_path).query(messages, no_bash).tool_calls} == {"Write"}
