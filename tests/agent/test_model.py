"""The model layer: litellm against a loopback OpenAI-compatible server, the text-action format, output and
context sizing, the scripted model and model resolution."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kernelpilot.agent
from kernelpilot.agent import ModelReply, RecoverableError, RunEnded, ToolCall
from kernelpilot.agent.context import count_tokens, fit_context, truncate_output
from kernelpilot.agent.model import LiteLLMModel, MalformedReply, ModelError, ScriptedModel
from kernelpilot.agent.text_actions import as_text_conversation, parse_text_actions, split_text_reply, text_tool_instructions
from kernelpilot.models import resolve_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "Bash",
            "description": "Run a shell command in the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout_s": {"type": "integer"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "Finish",
            "description": "End the run with a summary.",
            "parameters": {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]},
        },
    },
]
TASK = [
    {"role": "system", "content": "You write CUDA kernels."},
    {"role": "user", "content": "Make examples/softmax.py faster."},
]


def make_model(server, **kwargs) -> LiteLLMModel:
    options = {"api_key": "test-key", "retry_base_delay_s": 0.001, "timeout_s": 10} | kwargs
    return LiteLLMModel("openai/test-model", api_base=server.base_url, **options)


def tool_turn(call_id: str, command: str, output: str) -> list[dict]:
    """An assistant message calling Bash and the tool message answering it."""
    arguments = json.dumps({"command": command})
    call = {"id": call_id, "type": "function", "function": {"name": "Bash", "arguments": arguments}}
    return [
        {"role": "assistant", "content": f"Running {command}.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": output},
    ]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- through litellm and a real HTTP server ------------------------------------------------------------------


def test_plain_reply_with_usage(openai_server):
    openai_server.reply_text("I will read the problem first.", prompt_tokens=123, completion_tokens=45)
    reply = make_model(openai_server).query(TASK, TOOLS)
    assert reply.content == "I will read the problem first."
    assert reply.tool_calls == []
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (123, 45)
    assert reply.usage.cost_usd is None  # a local model has no price in litellm's map
    [request] = openai_server.requests
    assert request["model"] == "test-model"
    assert request["messages"] == TASK
    assert request["tools"] == TOOLS


def test_cost_of_a_priced_model(openai_server):
    openai_server.reply_text("ok", prompt_tokens=1_000_000, completion_tokens=0)
    model = LiteLLMModel("openai/gpt-4o", api_base=openai_server.base_url, api_key="k", context_window=128_000)
    cost = model.query(TASK, TOOLS).usage.cost_usd
    assert cost is not None and 0.5 < cost < 50  # litellm's price for a million gpt-4o input tokens


def test_tool_call_reply_becomes_tool_calls(openai_server):
    openai_server.reply_tool_calls([("Bash", {"command": "nvidia-smi"}), ("Finish", {"summary": "done"})],
                                   content="Checking the GPU.")
    reply = make_model(openai_server).query(TASK, TOOLS)
    assert reply.content == "Checking the GPU."
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [
        ("Bash", {"command": "nvidia-smi"}), ("Finish", {"summary": "done"})]
    assert all(c.id.startswith("call_") for c in reply.tool_calls)
    assert json.loads(reply.tool_calls[0].raw_arguments) == {"command": "nvidia-smi"}


def test_rate_limit_is_retried_after_the_wait_the_server_asks(openai_server):
    openai_server.fail(429, times=1, retry_after="0.4", message="Rate limit reached")
    openai_server.reply_text("ok")
    started = time.monotonic()
    reply = make_model(openai_server).query(TASK, TOOLS)
    assert reply.content == "ok"
    assert len(openai_server.requests) == 2
    assert time.monotonic() - started >= 0.4  # base delay is 1 ms: only Retry-After explains the wait


def test_server_errors_until_retries_run_out(openai_server):
    openai_server.fail(500, times=10, message="engine crashed")
    with pytest.raises(ModelError) as caught:
        make_model(openai_server, max_retries=2).query(TASK, TOOLS)
    assert len(openai_server.requests) == 3
    message = str(caught.value)
    assert "\n" not in message
    assert message == "openai/test-model kept failing (HTTP 500) after 3 attempts: engine crashed."
    assert "--resume" in caught.value.hint


def test_client_errors_are_not_retried(openai_server):
    openai_server.fail(401, times=5, message="Incorrect API key provided")
    with pytest.raises(ModelError) as caught:
        make_model(openai_server).query(TASK, TOOLS)
    assert len(openai_server.requests) == 1
    assert "refused" in str(caught.value) and "Incorrect API key provided" in str(caught.value)
    assert "--api-key" in caught.value.hint


def test_server_down_is_one_sentence_at_once():
    # Nothing listens at the address before the first answer: a wrong --api-base or a server not started, which
    # waiting will not fix. It used to be retried with backoff, some 10 s of a newcomer's first run.
    model = LiteLLMModel("openai/test-model", api_base=f"http://127.0.0.1:{closed_port()}/v1", api_key="k",
                         retry_base_delay_s=5.0)  # fmt: skip
    started = time.monotonic()
    with pytest.raises(ModelError) as caught:
        model.query(TASK, TOOLS)
    assert time.monotonic() - started < 4.0, "no retry waited"
    message = str(caught.value)
    assert message.startswith("Could not connect to http://127.0.0.1:") and "on the first attempt" in message
    assert "\n" not in message
    assert "--api-base" in caught.value.hint


def test_a_server_that_answered_then_refuses_is_retried(openai_server):
    # Once the server has answered, a refused connection may be a restart (a vLLM reloading): retried with backoff.
    openai_server.reply_text("ok")
    model = make_model(openai_server, max_retries=2)
    assert model.query(TASK, TOOLS).content == "ok"
    model.api_base = f"http://127.0.0.1:{closed_port()}/v1"  # where it answered, nothing listens now
    with pytest.raises(ModelError) as caught:
        model.query(TASK, TOOLS)
    assert "Could not connect" in str(caught.value) and "after 3 attempts" in str(caught.value)


def test_a_stalled_server_times_out(openai_server):
    model = make_model(openai_server, timeout_s=0.3, max_retries=1)
    # A first answer, untimed: the first query in a process imports litellm (seconds on a busy machine).
    openai_server.reply_text("warm")
    assert model.query(TASK, TOOLS).content == "warm"
    openai_server.stall(10, times=2)
    started = time.monotonic()
    with pytest.raises(ModelError, match=r"did not answer within 0.3 s, after 2 attempts"):
        model.query(TASK, TOOLS)
    assert len(openai_server.requests) == 3
    assert time.monotonic() - started < 5, "an attempt waited for the stalled answer"


def test_context_overflow_from_the_provider_trims_and_resends(openai_server):
    log = "".join(f"step {i}: loaded {i * 37} bytes from buffer {i % 11}\n" for i in range(120))
    messages = TASK + [m for i in range(6) for m in tool_turn(f"c{i}", f"cat log{i}", log)]
    counter = make_model(openai_server)
    needed = counter.count_tokens(messages)
    described = counter.count_tokens([{"role": "system", "content": json.dumps(TOOLS)}])
    # A window where the conversation fits by our count with about 15% to spare, so the provider's verdict decides.
    model = make_model(openai_server, max_tokens=100, context_window=int(needed * 1.3) + 100 + described)
    openai_server.fail(400, message="This model's maximum context length is 8192 tokens.",
                       code="context_length_exceeded")
    openai_server.reply_text("ok")
    assert model.query(messages, TOOLS).content == "ok"
    first, second = openai_server.requests
    assert first["messages"] == messages
    assert model.count_tokens(second["messages"]) < needed
    assert second["messages"][0] == TASK[0] and second["messages"][-1] == messages[-1]
    assert_every_call_answered(second["messages"])


def test_context_overflow_that_trimming_cannot_fix(openai_server):
    openai_server.fail(400, times=5, message="This model's maximum context length is 10 tokens.",
                       code="context_length_exceeded")
    with pytest.raises(ModelError, match="does not fit in openai/test-model's context window"):
        make_model(openai_server).query(TASK, TOOLS)
    assert len(openai_server.requests) == 3  # budget 1, 0.75, 0.56 of the window, then it gives up


def test_conversation_larger_than_the_window_fails_before_sending(openai_server):
    huge_task = [TASK[0], {"role": "user", "content": "y" * 20_000}]
    with pytest.raises(ModelError, match="context window of 2000"):
        make_model(openai_server, context_window=2000).query(huge_task, TOOLS)
    assert openai_server.requests == []


def test_text_actions_through_the_server(openai_server):
    openai_server.reply_text('Let me look.\n<tool_call>{"name": "Bash", "arguments": {"command": "ls"}}</tool_call>')
    history = TASK + tool_turn("call_1", "pwd", "/work/kp-softmax")
    reply = make_model(openai_server, native_tools=False).query(history, TOOLS)
    assert reply.content == "Let me look."
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("Bash", {"command": "ls"})]
    [request] = openai_server.requests
    assert "tools" not in request
    assert [m["role"] for m in request["messages"]] == ["system", "user", "assistant", "user"]
    assert "<tool_call>" in request["messages"][0]["content"]  # the format is explained
    assert '"command": "pwd"' in request["messages"][2]["content"]  # its own earlier call, in the format
    assert request["messages"][3]["content"] == "Result of Bash:\n/work/kp-softmax"


def test_server_without_tool_support_switches_to_text_actions(openai_server):
    openai_server.fail(400, message='"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser')
    openai_server.reply_text('<tool_call>{"name": "Finish", "arguments": {"summary": "done"}}</tool_call>')
    model = make_model(openai_server)
    reply = model.query(TASK, TOOLS)
    assert [c.name for c in reply.tool_calls] == ["Finish"]
    assert "tools" in openai_server.requests[0] and "tools" not in openai_server.requests[1]
    assert model.native_tools is False


def test_invalid_native_arguments_are_recoverable(openai_server):
    openai_server.reply_tool_calls([("Bash", '{"command": "ls"')], content="Listing.", completion_tokens=7)
    with pytest.raises(MalformedReply) as caught:
        make_model(openai_server).query(TASK, TOOLS)
    assert isinstance(caught.value, RecoverableError)
    assert "arguments of your Bash call are not valid JSON" in str(caught.value)
    assert caught.value.content == "Listing." and caught.value.usage.completion_tokens == 7


def test_missing_key_is_reported_before_any_request(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ModelError, match="No API key is set for gpt-4o") as caught:
        LiteLLMModel("gpt-4o").query(TASK, TOOLS)
    assert "OPENAI_API_KEY" in caught.value.hint


def test_unknown_provider_is_reported():
    with pytest.raises(ModelError, match="cannot tell which provider serves the model 'nonsense'") as caught:
        LiteLLMModel("nonsense").query(TASK, TOOLS)
    assert "openai/<served name>" in caught.value.hint


def test_keyless_local_server_works(openai_server, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    openai_server.reply_text("ok")
    assert make_model(openai_server, api_key=None).query(TASK, TOOLS).content == "ok"


# --- the text-action format ------------------------------------------------------------------------------------


def test_parse_one_tagged_call():
    text = 'Plan.\n<tool_call>\n{"name": "Bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
    [call] = parse_text_actions(text)
    assert (call.name, call.arguments) == ("Bash", {"command": "ls -la"})
    assert json.loads(call.raw_arguments) == {"command": "ls -la"}


def test_parse_fenced_calls_with_and_without_tags():
    fenced_in_tag = '<tool_call>\n```json\n{"name": "Bash", "arguments": {"command": "ls"}}\n```\n</tool_call>'
    fenced_alone = 'I will finish.\n```json\n{"name": "Finish", "arguments": {"summary": "ok"}}\n```\nThanks.'
    assert [c.name for c in parse_text_actions(fenced_in_tag)] == ["Bash"]
    prose, [call] = split_text_reply(fenced_alone)
    assert (call.name, call.arguments, prose) == ("Finish", {"summary": "ok"}, "I will finish.\n\nThanks.")


def test_parse_several_calls_prose_and_lenient_forms():
    text = (
        "First compile, then verify.\n"
        '<tool_call>{"name": "Compile", "arguments": {}} that compiles</tool_call>\n'
        "<tool_call>{'name': 'Verify', 'arguments': {'trials': 3, 'strict': true}}</tool_call>\n"
        '<tool_call>{"name": "Write", "arguments": {"path": "a.cu", "content": "line1\nline2"}}'
    )
    prose, calls = split_text_reply(text)
    assert [(c.name, c.arguments) for c in calls] == [
        ("Compile", {}),
        ("Verify", {"trials": 3, "strict": True}),
        ("Write", {"path": "a.cu", "content": "line1\nline2"}),
    ]
    assert prose == "First compile, then verify."
    assert len({c.id for c in calls}) == 3


def test_plain_prose_has_no_calls():
    assert parse_text_actions("I think the kernel is memory bound.\n```cuda\n__global__ void k() {}\n```") == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('<tool_call>{"name": "Bash", "arguments": {"command": "ls",}</tool_call>', "Tool call 1 is not valid JSON"),
        ("<tool_call>Bash ls</tool_call>", "Tool call 1 holds no JSON object"),
        ('<tool_call>{"arguments": {"command": "ls"}}</tool_call>', 'Tool call 1 has no "name"'),
        ('<tool_call>{"name": "Bash", "arguments": ["ls"]}</tool_call>', "are a list, not an object"),
        ('<tool_call>{"name": "Finish", "arguments": {}}</tool_call><tool_call>{"name": }</tool_call>',
         "Tool call 2 is not valid JSON"),
    ],
)
def test_malformed_calls_say_what_is_wrong_and_the_format(text, expected):
    with pytest.raises(RecoverableError) as caught:
        parse_text_actions(text)
    assert expected in str(caught.value)
    assert '<tool_call>{"name": "TOOL_NAME", "arguments": {...}}</tool_call>' in str(caught.value)


def test_instructions_describe_every_tool_and_round_trip():
    instructions = text_tool_instructions(TOOLS)
    assert "### Bash" in instructions and "### Finish" in instructions
    assert '"required": ["command"]' in instructions
    history = TASK + tool_turn("call_9", "ls", "a.cu")
    converted = as_text_conversation(history, TOOLS)
    assert converted[0]["content"].endswith(instructions)
    [call] = parse_text_actions(converted[2]["content"])  # what the model is shown is what it may write
    assert (call.name, call.arguments) == ("Bash", {"command": "ls"})


# --- output and context sizing ---------------------------------------------------------------------------------


def test_truncate_output_keeps_short_text():
    assert truncate_output("short", 100) == "short"


def test_truncate_output_keeps_head_and_tail_within_the_limit():
    text = "".join(f"line {i:04d}\n" for i in range(1000))
    cut = truncate_output(text, 500)
    assert len(cut) <= 500
    assert cut.startswith("line 0000\n") and cut.endswith("line 0999\n")
    head, note, tail = cut.partition("\n[... ")
    removed = int(tail.split(" characters cut ...]\n")[0])
    assert len(head) + removed + len(tail.split(" characters cut ...]\n")[1]) == len(text)


def test_fit_context_returns_a_copy_when_it_fits():
    messages = TASK + tool_turn("c1", "ls", "a.cu")
    fitted = fit_context(messages, max_tokens=10_000, count_tokens=count_tokens)
    assert fitted == messages
    fitted[0]["content"] = "changed"
    assert messages[0]["content"] == "You write CUDA kernels."


def test_fit_context_shrinks_old_outputs_first():
    messages = TASK + [m for i in range(4) for m in tool_turn(f"c{i}", "make", f"output {i} " + "z" * 6000)]
    fitted = fit_context(messages, max_tokens=count_tokens(messages) - 2000, count_tokens=count_tokens)
    assert len(fitted) == len(messages)  # nothing dropped: cutting the oldest output was enough
    assert "characters cut" in fitted[3]["content"]
    assert fitted[-1] == messages[-1] and fitted[-3] == messages[-3]
    assert count_tokens(fitted) <= count_tokens(messages) - 2000


def test_fit_context_drops_whole_turns_and_keeps_pairs():
    turns = [tool_turn(f"c{i}", f"step {i}", "w" * 3000) for i in range(10)]
    turns.insert(5, [{"role": "assistant", "content": "Thinking aloud."}, {"role": "user", "content": "Call a tool."}])
    messages = TASK + [m for turn in turns for m in turn]
    fitted = fit_context(messages, max_tokens=1500, count_tokens=count_tokens)
    assert count_tokens(fitted) <= 1500
    assert fitted[0] == TASK[0]
    assert fitted[1]["content"].startswith(TASK[1]["content"]) and "removed to fit" in fitted[1]["content"]
    assert fitted[-1]["tool_call_id"] == "c9"  # the latest turn is kept
    assert_every_call_answered(fitted)


def test_fit_context_returns_its_smallest_attempt_when_nothing_fits():
    messages = [TASK[0], {"role": "user", "content": "q" * 9000}] + tool_turn("c1", "ls", "r" * 9000)
    fitted = fit_context(messages, max_tokens=100, count_tokens=count_tokens)
    assert fitted[:2] == messages[:2]
    assert len(fitted[-1]["content"]) < 1000
    assert_every_call_answered(fitted)


def assert_every_call_answered(messages: list[dict]) -> None:
    """Each tool_call id is answered by a tool message after it, and each tool message answers an earlier call."""
    pending: set[str] = set()
    for message in messages:
        if message["role"] == "assistant":
            assert not pending, f"unanswered tool calls {pending}"
            pending = {call["id"] for call in message.get("tool_calls", [])}
        elif message["role"] == "tool":
            assert message["tool_call_id"] in pending
            pending.discard(message["tool_call_id"])
    assert not pending


# --- scripted model and resolution -----------------------------------------------------------------------------


def test_scripted_model_replays_then_ends():
    replies = [ModelReply("one", [ToolCall("c1", "Compile", {})]), KeyboardInterrupt(), ModelReply("two")]
    model = ScriptedModel(replies)
    assert model.query(TASK, TOOLS).tool_calls[0].name == "Compile"
    with pytest.raises(KeyboardInterrupt):
        model.query(TASK, TOOLS)
    assert model.query(TASK, TOOLS).content == "two"
    with pytest.raises(RunEnded) as ended:
        model.query(TASK, TOOLS)
    assert ended.value.status == "script-exhausted"
    assert len(model.received) == 4 and model.received[0] == TASK


def test_resolve_model_with_a_model_string():
    model = resolve_model("openai/test-model", "http://127.0.0.1:1/v1", "k")
    assert isinstance(model, LiteLLMModel)
    assert (model.name, model.api_base, model.api_key) == ("openai/test-model", "http://127.0.0.1:1/v1", "k")


def test_resolve_model_without_a_model_or_the_policy(monkeypatch):
    monkeypatch.setitem(sys.modules, "kernelpilot.policy", None)  # makes `import kernelpilot.policy` fail
    with pytest.raises(ModelError, match="No model is configured") as caught:
        resolve_model(None, None, None)
    for named in ("--model", "--api-base", "KERNELPILOT_MODEL", "KERNELPILOT_API_BASE", "OPENAI_API_KEY"):
        assert named in caught.value.hint


def test_resolve_model_with_an_api_base_but_no_model():
    with pytest.raises(ModelError, match="without --model") as caught:
        resolve_model(None, "http://localhost:8000/v1", None)
    assert "http://localhost:8000/v1/models" in caught.value.hint


def test_the_agent_package_never_names_the_policy_package():
    # The policy is a Model built on the agent's types, so the agent importing it back, even lazily, makes a circle;
    # `kernelpilot.models` is where the two meet.
    agent = Path(kernelpilot.agent.__file__).parent
    naming = [path.relative_to(agent) for path in sorted(agent.rglob("*.py")) if "kernelpilot.policy" in path.read_text()]
    assert naming == []


def test_importing_the_model_layer_does_not_import_litellm():
    code = "import sys, kernelpilot.cli, kernelpilot.agent.model; print('litellm' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
