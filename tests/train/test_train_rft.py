"""RFT: the trajectory filters on hand-written transcripts, the chat-format SFT data, and a tiny real SFTTrainer run."""

import json
import os

import pytest

from kernelpilot.train.rft import (
    FilterLimits,
    SftSettings,
    build_sft_dataset,
    filter_trajectories,
    load_trajectory,
    rejection_reason,
    run_sft,
)
from train_testing import tiny_model_and_tokenizer, write_transcript


def test_filters_keep_only_judged_positive_clean_short_trajectories(transcripts):
    kept, dropped = filter_trajectories(
        [load_trajectory(p) for p in transcripts.values()], FilterLimits(max_tokens=20_000)
    )
    assert [t.path for t in kept] == [transcripts["good"]]
    assert dropped == {
        "verifier-failed": 1, "no-positive-outcome": 2, "invalid-tool-call": 1, "repeated-action": 1, "over-long": 1
    }


def test_a_refused_call_is_read_from_its_records_result_type_and_from_the_text_of_older_records(tmp_path):
    limits = FilterLimits(max_tokens=20_000)
    legacy = write_transcript(tmp_path / "legacy.jsonl", reward=1, refused="unknown tool Verfy", legacy=True)
    assert rejection_reason(load_trajectory(legacy), limits) == "invalid-tool-call"
    typed = load_trajectory(write_transcript(tmp_path / "typed.jsonl", reward=1))
    typed.tool_records[0]["message"]["content"] = "Error: what the kernel itself printed"
    assert rejection_reason(typed, limits) is None, "a result that is not a ToolError is no refused call"


def test_sft_data_is_chat_format_with_tool_calls(transcripts, tmp_path):
    report = build_sft_dataset([transcripts["good"], transcripts["loop"]], tmp_path / "sft.jsonl")
    assert (report.read, report.kept) == (2, 1)
    [row] = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    roles = [m["role"] for m in row["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert row["messages"][2]["tool_calls"][0]["function"] == {"name": "Verify", "arguments": {"trials": 3}}
    assert "Finish" in {tool["function"]["name"] for tool in row["tools"]}


# A chat template for the test tokenizer: roles, contents and tool calls as plain text.


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_tiny_sft_run_trains_on_the_rft_data(transcripts, tmp_path, monkeypatch, lora_rank):
    pytest.importorskip("trl", reason="trl is not installed (pip install 'kernelpilot[train]')")
    if lora_rank:
        pytest.importorskip("peft", reason="peft is not installed (pip install 'kernelpilot[train]')")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = build_sft_dataset([transcripts["good"]], tmp_path / "sft.jsonl").output
    model, tokenizer = tiny_model_and_tokenizer()
    settings = SftSettings(
        model="tiny-llama",
        data=data,
        output_dir=tmp_path / "out",
        max_steps=2,
        learning_rate=1e-3,
        max_length=1024,
        lora_rank=lora_rank,
    )
    metrics = run_sft(settings, tokenizer=tokenizer, model=model)
    assert metrics["train_loss"] > 0
    assert any(name.endswith(".safetensors") for name in os.listdir(tmp_path / "out"))
