"""The ReAct loop: a scripted trajectory through litellm and a loopback OpenAI server judged by a real CPU worker,
recoverable errors as observations, budgets, Ctrl-C and resume, the prompts, and (on an H100) a real
online-softmax kernel that ends the run verified and faster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernelpilot.agent import ModelReply, ToolCall, ToolContext, Usage
from kernelpilot.agent.loop import NO_TOOL_CALL, RunSummary, run_agent, stop_reason
from kernelpilot.agent.model import LiteLLMModel, ScriptedModel
from kernelpilot.agent.prompts import TaskFacts, baseline_cache_key, known_facts, render_prompt, task_messages
from kernelpilot.agent.session import INTERRUPTED_CALL, RunState, Session, read_records, tool_result
from kernelpilot.agent.tool_results import RunFinished, TodoItem, ToolError
from kernelpilot.agent.tools import default_tools
from kernelpilot.config import Settings
from kernelpilot.results import BenchResult, EvalResult, Timing, VerifyResult
from kernelpilot.workspace import EXAMPLE_KERNELS, Workspace, init_workspace
from kp_testing import DOUBLE_PROBLEM, run_cache_dir, write_problem
from openai_server import ScriptedOpenAIServer

REPO_ROOT = Path(__file__).resolve().parents[2]

# Correct, but computed by torch in forward: the torch-compute guard must fail it whatever the numbers say.
TORCH_CANDIDATE = """
from torch import nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x * 2.0
"""


def make_workspace(folder: Path) -> Workspace:
    ws, _ = init_workspace(write_problem(folder, DOUBLE_PROBLEM, "double.py"), folder / "ws")
    return ws


@pytest.fixture
def workspace(tmp_path) -> Workspace:
    return make_workspace(tmp_path)


def call(name: str, call_id: str = "", **arguments) -> ToolCall:
    return ToolCall(id=call_id or f"call_{name}", name=name, arguments=arguments, raw_arguments=json.dumps(arguments))


def reply(*calls: ToolCall, content: str = "", usage: Usage | None = None) -> ModelReply:
    return ModelReply(content=content, tool_calls=list(calls), usage=usage or Usage(10, 5, 0.001))


def start(ws: Workspace, settings: Settings | None = None) -> tuple[list[dict], Session]:
    settings = settings or Settings()
    messages = task_messages(ws.problem(), ws, settings, TaskFacts())
    session = Session.create(ws.root, problem=str(ws.model_path), model="test")
    for message in messages:
        session.append("message", turn=0, message=message)
    return messages, session


def run(ws: Workspace, model, settings: Settings | None = None, judge=None) -> tuple[RunSummary, Session]:
    settings = settings or Settings()
    messages, session = start(ws, settings)
    summary = run_agent(messages, model, default_tools(), ToolContext(workspace=ws, judge=judge), settings, session)
    return summary, session


def records_of(session: Session, record_type: str) -> list[dict]:
    return [record for record in read_records(session.path) if record["type"] == record_type]


# ------------------------------------------------------------------ a whole trajectory through litellm


@pytest.mark.cuda_build
def test_trajectory_through_litellm_writes_compiles_verifies_and_records_the_guard_verdict(tmp_path, monkeypatch):
    from kernelpilot.harness.judge import Judge

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    ws = make_workspace(tmp_path)
    script = [
        ("TodoWrite", {"todos": [{"content": "write ModelNew", "status": "in_progress"}]}),
        ("Bash", {"command": "rm " + " ".join(EXAMPLE_KERNELS)}),
        ("Write", {"path": "model_new.py", "content": TORCH_CANDIDATE}),
        ("Compile", {}),
        ("Verify", {"trials": 2}),
        ("Profile", {}),
        ("Finish", {"summary": "ModelNew is correct and fast."}),
    ]
    with ScriptedOpenAIServer() as server, Judge("cpu", arch="9.0", cache_dir=run_cache_dir(tmp_path)) as judge:
        for name, arguments in script:
            server.reply_tool_calls([(name, arguments)], content=f"Next: {name}.")
        model = LiteLLMModel("openai/test-model", api_base=server.base_url, api_key="test", context_window=100_000)
        summary, session = run(ws, model, judge=judge)

    assert (summary.status, summary.turns) == ("finished", len(script))
    assert (summary.prompt_tokens, summary.completion_tokens) == (10 * len(script), 5 * len(script))
    assert summary.best is None, "the model's claim of success counts for nothing"
    assert not (ws.root / ".kernelpilot" / "best").exists()
    assert ws.model_new_path.read_text() == TORCH_CANDIDATE
    [evaluation] = records_of(session, "eval")
    assert evaluation["improved"] is False
    assert evaluation["eval"]["error_kind"] == "guard" and evaluation["eval"]["reward"] == -1
    verify = next(r for r in records_of(session, "tool") if r["name"] == "Verify")
    assert "torch-compute" in {finding["guard"] for finding in verify["data"]["verify"]["guards"]}
    assert len(records_of(session, "step")) == len(script)
    assert records_of(session, "end")[-1]["status"] == "finished"
    # The model saw the tool results: the last request carries the Profile verdict as a tool message.
    last_request = server.requests[-1]["messages"]
    assert last_request[0]["role"] == "system" and "SKILL.md" in last_request[0]["content"]
    assert any(m["role"] == "tool" and "torch-compute" in (m["content"] or "") for m in last_request)


# ---------------------------------------------------------------------- recoverable errors, budgets


def test_bad_arguments_unknown_tool_and_no_tool_call_become_observations(workspace):
    model = ScriptedModel([
        reply(call("Read", "bad", path=7)),
        reply(call("Teleport", "unknown")),
        reply(content="I think I am done."),
        reply(call("Finish", summary="nothing verified")),
    ])
    summary, session = run(workspace, model)
    assert summary.status == "finished" and summary.turns == 4
    observations = model.received[-1]
    bad = next(m for m in observations if m.get("tool_call_id") == "bad")
    unknown = next(m for m in observations if m.get("tool_call_id") == "unknown")
    assert bad["content"].startswith("Error:") and "path" in bad["content"]
    assert "no tool named 'Teleport'" in unknown["content"] and "Finish" in unknown["content"]
    assert observations[-1] == {"role": "user", "content": NO_TOOL_CALL}
    # The transcript keeps each call's typed result: the refusals as errors, Finish's summary as the model's words.
    results = [tool_result(record) for record in records_of(session, "tool")]
    assert [type(result) for result in results] == [ToolError, ToolError, RunFinished]
    assert results[1].message in unknown["content"]
    assert summary.finish_summary == "nothing verified" and summary.best is None


def test_a_malformed_reply_is_shown_to_the_model_and_its_tokens_counted(workspace, tmp_path):
    with ScriptedOpenAIServer() as server:
        server.reply_tool_calls([("Glob", "{not json")], prompt_tokens=7, completion_tokens=3)
        server.reply_tool_calls([("Finish", {"summary": "done"})])
        model = LiteLLMModel("openai/test-model", api_base=server.base_url, api_key="test", context_window=100_000)
        summary, _ = run(workspace, model)
    assert summary.status == "finished" and summary.prompt_tokens == 17
    observation = server.requests[1]["messages"][-1]
    assert observation["role"] == "user" and "not valid JSON" in observation["content"]


def test_429_then_success_is_retried_inside_one_turn(workspace):
    with ScriptedOpenAIServer() as server:
        server.fail(429, retry_after="0")
        server.reply_tool_calls([("Finish", {"summary": "done"})])
        model = LiteLLMModel("openai/test-model", api_base=server.base_url, api_key="test", context_window=100_000,
                             retry_base_delay_s=0.01)
        summary, _ = run(workspace, model)
    assert (summary.status, summary.turns, len(server.requests)) == ("finished", 1, 2)


def test_context_overflow_is_fitted_keeping_the_task(workspace):
    big = "x = 1  # filler\n" * 4000  # ~64 kB per Read: several turns cannot all fit in 12k tokens
    (workspace.root / "kernels" / "big.h").write_text(big)
    reads = [reply(call("Read", f"read{i}", path="kernels/big.h")) for i in range(6)]
    model = ScriptedModel([*reads, reply(call("Finish", summary="done"))], context_window=12_000)
    summary, session = run(workspace, model)
    assert summary.status == "finished"
    from kernelpilot.agent.context import count_tokens

    last = model.received[-1]
    assert count_tokens(last) <= 12_000
    assert last[0]["role"] == "system" and last[1]["content"].startswith("Optimise this problem")
    # Only what the model is sent was trimmed: the transcript keeps each output as the tool returned it.
    reads = [record for record in records_of(session, "tool") if record["name"] == "Read"]
    assert len(reads) == 6
    sent_first = [m["content"] for m in last if m.get("tool_call_id") == "read0"]
    assert not sent_first or len(sent_first[0]) < len(reads[0]["message"]["content"])


@pytest.mark.parametrize(
    ("settings", "status", "turns"),
    [
        (Settings(max_turns=3), "max-turns", 3),
        (Settings(max_tokens=30), "token-budget", 2),  # 15 tokens a reply
        (Settings(max_cost_usd=0.0025), "cost-budget", 3),  # $0.001 a reply
        (Settings(wall_time_s=1e-9), "wall-time", 1),
    ],
)
def test_budgets_stop_the_run(workspace, settings, status, turns):
    model = ScriptedModel([reply(call("Glob", f"g{i}", pattern="*.py")) for i in range(10)])
    summary, session = run(workspace, model, settings)
    assert (summary.status, summary.turns) == (status, turns)
    assert records_of(session, "end")[-1]["status"] == status


def test_a_script_that_runs_out_ends_with_its_status(workspace):
    summary, _ = run(workspace, ScriptedModel([reply(call("Glob", pattern="*"))]))
    assert (summary.status, summary.turns) == ("script-exhausted", 2)


def judged(candidate_ms: float, compile_ms: float = 10.0) -> EvalResult:
    timing = lambda ms: Timing(median_ms=ms, p10_ms=ms, p90_ms=ms, mean_ms=ms, runs=5)  # noqa: E731
    bench = BenchResult(ok=True, candidate=timing(candidate_ms), compiled=timing(compile_ms),
                        speedup_vs_compile=compile_ms / candidate_ms, speedup_vs_eager=2 * compile_ms / candidate_ms)
    return EvalResult(problem_id="p", workspace="ws", verify=VerifyResult(ok=True), bench=bench, reward=3)


def test_target_met_stops_after_patience_turns_without_improvement():
    settings = Settings(target_speedup=1.05, patience=2, max_turns=100)
    state = RunState(turn=5, best=judged(9.0), best_turn=4)
    assert stop_reason(state, settings) is None  # one quiet turn so far
    state.turn = 6
    assert stop_reason(state, settings) == "target-met"
    state.best = judged(9.8)  # verified, but only 1.02x: the target is not met, so keep going
    assert stop_reason(state, settings) is None


# ------------------------------------------------------------------------------------ Ctrl-C, resume


def test_ctrl_c_saves_the_session_and_resume_continues_with_nothing_lost(workspace):
    first = ScriptedModel([
        reply(call("TodoWrite", "t", todos=[{"content": "plan", "status": "in_progress"}])),
        reply(call("Glob", "g", pattern="*.py")),
        KeyboardInterrupt(),
    ])
    summary, session = run(workspace, first)
    assert (summary.status, summary.turns) == ("interrupted", 3)

    resumed = Session.resume(workspace.root, session.id)
    second = ScriptedModel([reply(call("Finish", "f", summary="done"))])
    ctx = ToolContext(workspace=workspace, judge=None)
    final = run_agent(resumed.messages, second, default_tools(), ctx, Settings(), resumed)
    assert (final.status, final.turns) == ("finished", 4)
    assert final.prompt_tokens == 30  # the tokens of the first run are carried over
    assert ctx.todos == [TodoItem("plan", "in_progress")]
    assert final.finish_summary == "done"
    sent = second.received[0]
    assert sent[: len(first.received[-1])] == first.received[-1], "the resumed model sees the whole conversation"
    assert any(m.get("tool_call_id") == "g" for m in sent)


def test_resume_answers_a_call_the_interruption_cut_off(workspace):
    class InterruptedTool:
        name, description, parameters = "Glob", "interrupts", {"type": "object", "properties": {}}

        def run(self, args, ctx):
            raise KeyboardInterrupt

    messages, session = start(workspace)
    model = ScriptedModel([reply(call("Glob", "cut"))])
    summary = run_agent(messages, model, [InterruptedTool()], ToolContext(workspace=workspace, judge=None), Settings(), session)
    assert summary.status == "interrupted"
    resumed = Session.resume(workspace.root)
    assert resumed.messages[-1] == {"role": "tool", "tool_call_id": "cut", "content": INTERRUPTED_CALL}


# ------------------------------------------------------------------------------------------- prompts


def test_prompts_render_with_every_fact_and_fail_on_a_missing_variable(workspace):
    facts = TaskFacts(gpu_name="NVIDIA H100", bandwidth_gbs=3000.0, matmul_tflops=50.0, eager_ms=8.7, compile_ms=6.8,
                      floor_ms=4.3, bound="memory", bytes=6.4e9, flops=1e9)
    system, task = task_messages(workspace.problem(), workspace, Settings(target_speedup=1.2), facts)
    assert "only" in system["content"].lower() and "prediction" in system["content"]
    assert "## The loop" in system["content"]  # SKILL.md is included
    for expected in ("NVIDIA H100", "3000 GB/s", "8.7 ms", "6.8 ms", "4.3 ms (memory-bound", "1.2x faster",
                     f"Workspace: {workspace.root}", "return x * 2.0"):
        assert expected in task["content"], expected
    unknown = task_messages(workspace.problem(), workspace, Settings(), TaskFacts())[1]["content"]
    assert "measured by the first Profile" in unknown and "GPU: not known" in unknown
    import jinja2

    with pytest.raises(jinja2.UndefinedError):
        render_prompt("system")


def test_known_facts_read_the_caches_with_the_benches_own_key(workspace, tmp_path, monkeypatch):
    from kernelpilot.harness import confine
    from kernelpilot.harness.bench import Baselines, baseline_key, store_baselines
    from kernelpilot.harness.cache import store_entry
    from kernelpilot.harness.roofline import CEILINGS_KIND, problem_cost

    monkeypatch.setattr(confine, "landlock_available", lambda: True)
    problem = workspace.problem()
    cache = tmp_path / "cache"
    assert baseline_cache_key(problem.problem_id, "cpu", "float32") == baseline_key(problem, device="cpu", dtype="float32")
    assert known_facts(None, problem.problem_id, cache) == TaskFacts()
    cost = problem_cost(problem, device="cpu", cache_dir=cache)
    timing = lambda ms: Timing(median_ms=ms, p10_ms=ms, p90_ms=ms, mean_ms=ms, runs=5)  # noqa: E731
    store_baselines(baseline_cache_key(problem.problem_id, "cpu", cost.dtype), Baselines(eager=timing(2.0), compiled=timing(1.0)), cache)
    store_entry(CEILINGS_KIND, {"gpu": "cpu"}, {"bandwidth_gbs": 100.0, "matmul_tflops": {"float32": 1.0, "tf32": 1.0}}, cache)
    facts = known_facts("cpu", problem.problem_id, cache)
    assert (facts.eager_ms, facts.compile_ms, facts.bandwidth_gbs, facts.bound) == (2.0, 1.0, 100.0, "memory")
    assert facts.floor_ms == pytest.approx(cost.bytes / 100e9 * 1e3)
    # Without Landlock a candidate could have signed them: the folder is not read (as the judge does not read it).
    monkeypatch.setattr(confine, "landlock_available", lambda: False)
    assert known_facts("cpu", problem.problem_id, cache) == TaskFacts(gpu_name="cpu")


# ------------------------------------------------------------------------------------------- on a GPU

# The candidate kernel: a thread-block cluster per row reads it from HBM once (sources in tests/agent/data, so nvcc can
# compile them as they are); rows that do not fit the cluster take a two-pass fallback in the same file.
SOFTMAX_SOURCES = Path(__file__).with_name("data") / "softmax_cluster"
SOFTMAX_CU = (SOFTMAX_SOURCES / "softmax_rows.cu").read_text()
SOFTMAX_BINDING = (SOFTMAX_SOURCES / "softmax_rows_binding.cpp").read_text()

SOFTMAX_MODEL_NEW = """
from pathlib import Path

from torch import nn

from kernelpilot.ops import workspace_ops
from kernelpilot.problem import load_problem

kp_ops = workspace_ops(__file__)
Model = load_problem(Path(__file__).with_name("model.py"), validate=False).model_cls


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.__dict__.update(vars(Model()))

    def forward(self, x):
        return kp_ops.softmax_rows(x.contiguous())
"""


@pytest.mark.gpu
def test_scripted_online_softmax_run_ends_verified_and_faster(tmp_path):
    from kernelpilot.harness.judge import Judge

    ws, _ = init_workspace(REPO_ROOT / "examples" / "softmax_long_rows.py", tmp_path / "ws")
    model = ScriptedModel([
        reply(call("Bash", "rm", command="rm " + " ".join(EXAMPLE_KERNELS))),
        reply(call("Write", "cu", path="kernels/softmax_rows.cu", content=SOFTMAX_CU),
              call("Write", "bind", path="kernels/softmax_rows_binding.cpp", content=SOFTMAX_BINDING),
              call("Write", "mn", path="model_new.py", content=SOFTMAX_MODEL_NEW)),
        reply(call("Compile", "c")),
        reply(call("Profile", "p")),
        reply(call("Finish", "f", summary="softmax reading each row from HBM once, a cluster per row")),
    ])
    with Judge(cache_dir=tmp_path / "cache") as judge:
        summary, session = run(ws, model, Settings(), judge)
    compile_output = next(r for r in records_of(session, "tool") if r["name"] == "Compile")
    assert summary.best is not None, compile_output["message"]["content"]
    assert summary.status == "finished"
    bench = summary.best.bench
    speedup = lambda value: "n/a" if value is None else f"{value:.2f}x"  # noqa: E731 - None: that baseline failed
    figures = (f"candidate {bench.candidate.median_ms:.3f} ms, {speedup(bench.speedup_vs_eager)} vs eager, "
               f"{speedup(bench.speedup_vs_compile)} vs compile" if bench is not None and bench.ok else "not timed")
    print(f"softmax_long_rows: reward {summary.best.reward}, {figures}")
    assert summary.best.reward == 3, f"{summary.best.message} ({figures})"
