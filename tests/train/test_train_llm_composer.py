"""The LLM composer of `train synth`, through litellm and a real loopback OpenAI-compatible server.

The server's replies stand in for a model: a valid problem, prose with no code block, a problem that fails to load,
a copy of a benchmark problem. Every reply goes through the real execution filters on the CPU (torch.compile with
backend="aot_eager", as in test_train_synth.py) and decontamination. How replies are read (repeats, malformed
replies) is checked with the agent's ScriptedModel, with no filters run.
"""

import json
import socket

from typer.testing import CliRunner

from kernelpilot.agent import ModelReply
from kernelpilot.agent.model import LiteLLMModel, MalformedReply, ScriptedModel
from kernelpilot.cli import app
from kernelpilot.train.compose import compose_tasks, sample_chains
from kernelpilot.train.llm_composer import (
    compose_messages,
    compose_with_model,
    problem_in,
)
from kernelpilot.train.pipeline import STAGES, load_config, run_pipeline
from kernelpilot.train.synth import crawl_operators, synthesize
from kernelpilot.train.synth_dataset import read_tasks, write_dataset
from kp_testing import nonempty

BACKEND = "aot_eager"
MODEL = "openai/test-model"

GATED_RESIDUAL = '''"""LayerNorm of a residual whose branch is a GELU of a linear projection."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 2
SEQUENCE = 8
FEATURES = 32


class Model(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.proj = nn.Linear(features, features)
        self.norm = nn.LayerNorm(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + F.gelu(self.proj(x)))


def get_inputs():
    return [torch.randn(BATCH, SEQUENCE, FEATURES)]


def get_init_inputs():
    return [FEATURES]
'''

CONV_RELU = '''"""Conv2d, ReLU, then a per-channel bias."""

import torch
import torch.nn as nn

BATCH = 2
CHANNELS = 8
HEIGHT = 16
WIDTH = 16


class Model(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bias = nn.Parameter(torch.randn(channels, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x)) + self.bias


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, HEIGHT, WIDTH)]


def get_init_inputs():
    return [CHANNELS]
'''

NO_INIT_INPUTS = GATED_RESIDUAL.replace("def get_init_inputs():", "def init_inputs():")


def fenced(code: str) -> str:
    return f"Here is the problem.\n\n```python\n{code}```\n\nIt fuses the operators above."


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_prompts_are_seeded_and_give_each_operator_its_usage_and_shape():
    operators = crawl_operators().operators
    chains = sample_chains(operators, 8, seed=5, scale="small")
    again = sample_chains(operators, 8, seed=5, scale="small")
    assert [compose_messages(chain) for chain in chains] == [compose_messages(chain) for chain in again]
    assert [chain.ops for chain in chains] == [task.ops for task in compose_tasks(operators, 8, seed=5, scale="small")]
    other_seed = sample_chains(operators, 8, seed=6, scale="small")
    assert [chain.ops for chain in chains] != [chain.ops for chain in other_seed]
    for chain in chains:
        [message] = compose_messages(chain)
        for step in nonempty(chain.steps, "steps"):
            assert f"`{step.operator}`: `{step.usage}` -> {step.shape}" in message["content"]
        for name, value in chain.constants.items():
            assert f"`{name} = {value}`" in message["content"]


def test_the_problem_is_read_from_the_reply():
    assert problem_in(fenced(GATED_RESIDUAL)) == GATED_RESIDUAL
    sketch = "```python\nx = F.gelu(x)\n```\n"
    assert problem_in(sketch + fenced(CONV_RELU)) == CONV_RELU, "the block defining Model, not the sketch before it"
    assert problem_in("```\nprint('one unlabelled block')\n```") == "print('one unlabelled block')\n"
    assert problem_in("I would fuse the GELU into the linear layer's epilogue.") is None
    assert problem_in("```python\na = 1\n```\n```python\nb = 2\n```") is None, "two blocks and neither is a problem"


def test_a_repeated_or_unreadable_reply_gives_no_task():
    replies = [
        ModelReply(fenced(GATED_RESIDUAL)),
        ModelReply(fenced(GATED_RESIDUAL)),
        MalformedReply("The arguments of your Write call are not valid JSON"),
        ModelReply(fenced(CONV_RELU)),
    ]
    composition = compose_with_model(ScriptedModel(replies), crawl_operators().operators, 4, seed=2, scale="small")
    assert [task.code for task in composition.tasks] == [GATED_RESIDUAL, CONV_RELU]
    assert composition.unusable == {"llm-duplicate": 1, "llm-unparseable": 1}
    assert {task.composer for task in composition.tasks} == {"llm:scripted"}


def test_replies_are_filtered_counted_and_decontaminated_like_composed_tasks(openai_server, tmp_path):
    benchmark = tmp_path / "bench"
    benchmark.mkdir()
    (benchmark / "conv_relu.py").write_text(CONV_RELU)
    openai_server.reply_text(fenced(GATED_RESIDUAL))
    openai_server.reply_text("Sorry, I cannot write that problem.")
    openai_server.reply_text(fenced(NO_INIT_INPUTS))
    openai_server.reply_text(fenced(CONV_RELU))
    model = LiteLLMModel(MODEL, api_base=openai_server.base_url, api_key="test", native_tools=True)

    report = synthesize(4, seed=1, scale="small", devices=["cpu"], compile_backend=BACKEND, benchmark_dir=benchmark,
                        model=model)  # fmt: skip

    assert report.composer == f"llm:{MODEL}" and report.model_error is None
    assert report.composed == 4 and [task.code for task in report.kept] == [GATED_RESIDUAL]
    dropped = {reason: count for reason, count in report.dropped_by_filter.items() if count}
    assert dropped == {
        "llm-unparseable": 1,
        "llm-invalid-problem: task.py has no function named get_init_inputs().": 1,
        "contaminated": 1,
    }
    assert report.contaminated[0].benchmark_file.endswith("conv_relu.py")
    sampled = sample_chains(crawl_operators().operators, 4, seed=1, scale="small")
    assert [request["messages"] for request in openai_server.requests] == [compose_messages(c) for c in sampled]
    assert "tools" not in openai_server.requests[0], "one plain-text query per task"

    write_dataset(report, tmp_path / "tasks", settings={"seed": 1, "scale": "small", "devices": "cpu"})
    [task] = read_tasks(tmp_path / "tasks")
    assert (task.composer, task.ops, task.layout) == (f"llm:{MODEL}", sampled[0].ops, sampled[0].layout)
    card = (tmp_path / "tasks" / "README.md").read_text()
    assert f"composer: llm:{MODEL}" in card and "llm-unparseable 1" in card


def test_a_model_error_ends_the_cli_run_in_one_sentence_keeping_the_tasks_so_far(openai_server, tmp_path):
    openai_server.reply_text(fenced(GATED_RESIDUAL))
    openai_server.fail(401, message="Incorrect API key provided")
    out = tmp_path / "tasks"
    result = CliRunner().invoke(app, [
        "train", "synth", "--composer", "llm", "--model", MODEL, "--api-base", openai_server.base_url,
        "--api-key", "test", "--count", "3", "--scale", "small", "--devices", "cpu", "--compile-backend", BACKEND,
        "--out", str(out),
    ])  # fmt: skip

    assert result.exit_code == 2 and "Traceback" not in result.output
    error_lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "was refused" in error_lines[0] and "Incorrect API key" in error_lines[0]
    assert len(openai_server.requests) == 2, "no query after the model error"
    assert [task.code for task in read_tasks(out)] == [GATED_RESIDUAL]
    report = json.loads((out / "report.json").read_text())
    assert report["composer"] == f"llm:{MODEL}" and "was refused" in report["model_error"]
    assert (report["settings"]["composer"], report["settings"]["model"]) == ("llm", MODEL)


def test_the_pipeline_composes_with_the_model_its_synth_table_names(openai_server, tmp_path):
    openai_server.reply_text(fenced(GATED_RESIDUAL))
    (tmp_path / "train.toml").write_text(f"""
run_dir = "run"

[synth]
count = 1
scale = "small"
devices = ["cpu"]
compile_backend = "{BACKEND}"
composer = "llm"
model = "{MODEL}"
api_base = "{openai_server.base_url}"
api_key = "secret-key"
""")
    [outcome] = run_pipeline(load_config(tmp_path / "train.toml"), STAGES, base_dir=tmp_path)
    assert [task.composer for task in read_tasks(outcome.out_dir)] == [f"llm:{MODEL}"]
    assert "secret-key" not in (outcome.out_dir / "report.json").read_text(), "the key stays out of the dataset"


def test_a_server_that_is_down_stops_composition_with_one_sentence(tmp_path):
    model = LiteLLMModel(MODEL, api_base=f"http://127.0.0.1:{closed_port()}/v1", api_key="test", native_tools=True,
                         max_retries=1, retry_base_delay_s=0.001)  # fmt: skip
    report = synthesize(2, seed=1, scale="small", devices=["cpu"], compile_backend=BACKEND, model=model)
    assert report.composed == 0 and report.kept == []
    message = report.model_error.message
    assert message.startswith("Could not connect to http://127.0.0.1:") and "\n" not in message
    assert "--api-base" in report.model_error.hint


def test_the_llm_composer_needs_a_model_and_the_deterministic_one_takes_none(tmp_path):
    runner = CliRunner()
    no_model = runner.invoke(app, ["train", "synth", "--composer", "llm", "--out", str(tmp_path / "a")])
    assert no_model.exit_code == 2 and "needs a model" in no_model.output and "--model" in no_model.output
    stray_model = runner.invoke(app, ["train", "synth", "--model", MODEL, "--out", str(tmp_path / "b")])
    assert stray_model.exit_code == 2 and "--composer llm" in stray_model.output
    unknown = runner.invoke(app, ["train", "synth", "--composer", "gpt", "--out", str(tmp_path / "c")])
    assert unknown.exit_code == 2 and "Unknown composer 'gpt'" in unknown.output
    assert not any((tmp_path / name).exists() for name in "abc"), "refused before anything runs"
