"""RFT: the trajectory filters on hand-written transcripts, the chat-format SFT data, and a tiny real SFTTrainer run."""

import json
import os
from pathlib import Path

import pytest

from kernelpilot.train.rft import (
    FilterLimits,
    SftSettings,
    build_sft_dataset,
    filter_trajectories,
    load_trajectory,
    run_sft,
)


def _call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def write_transcript(
    path: Path, *, reward=None, tool_content="ok", repeats=1, claim_success=False, filler=0, verify_error=None
):
    """A session transcript shaped like agent/session.py writes them; Verify's data says `verify_error` when given."""
    records = [
        {"type": "start", "time": 0, "problem": "p.py", "model": "test"},
        {"type": "message", "turn": 0, "message": {"role": "system", "content": "You write kernels." + "x" * filler}},
        {"type": "message", "turn": 0, "message": {"role": "user", "content": "Make it fast."}},
    ]
    for turn in range(1, repeats + 1):
        call = _call(f"c{turn}", "Verify", {"trials": 3})
        records.append(
            {
                "type": "message",
                "turn": turn,
                "message": {"role": "assistant", "content": "verify", "tool_calls": [call]},
            }
        )
        records.append(
            {
                "type": "tool",
                "turn": turn,
                "name": "Verify",
                "arguments": {"trials": 3},
                "message": {"role": "tool", "tool_call_id": call["id"], "content": tool_content},
                "data": {"build": None, "verify": {"ok": verify_error is None, "error_kind": verify_error}},
            }
        )
    if reward is not None:
        records.append(
            {
                "type": "eval",
                "turn": repeats,
                "improved": reward >= 1,
                "eval": {"problem_id": "p", "workspace": "w", "reward": reward},
            }
        )
    finish = _call("f", "Finish", {"summary": "3x faster, all correct" if claim_success else "done"})
    records.append(
        {
            "type": "message",
            "turn": repeats + 1,
            "message": {"role": "assistant", "content": "", "tool_calls": [finish]},
        }
    )
    records.append(
        {
            "type": "tool",
            "turn": repeats + 1,
            "name": "Finish",
            "arguments": {"summary": "done"},
            "message": {"role": "tool", "tool_call_id": "f", "content": "finished"},
        }
    )
    records.append({"type": "end", "status": "finished"})
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.fixture
def transcripts(tmp_path):
    return {
        "good": write_transcript(tmp_path / "good.jsonl", reward=2),
        "claims_only": write_transcript(tmp_path / "claims.jsonl", reward=-1, claim_success=True),
        "never_judged": write_transcript(tmp_path / "unjudged.jsonl", claim_success=True),
        "invalid_call": write_transcript(
            tmp_path / "invalid.jsonl", reward=1, tool_content="Error: unknown tool Verfy"
        ),
        "loop": write_transcript(tmp_path / "loop.jsonl", reward=1, repeats=4),
        "long": write_transcript(tmp_path / "long.jsonl", reward=3, filler=200_000),
        "verifier_failed": write_transcript(tmp_path / "harness.jsonl", reward=2, verify_error="harness"),
    }


def test_filters_keep_only_judged_positive_clean_short_trajectories(transcripts):
    kept, dropped = filter_trajectories(
        [load_trajectory(p) for p in transcripts.values()], FilterLimits(max_tokens=20_000)
    )
    assert [t.path for t in kept] == [transcripts["good"]]
    assert dropped == {
        "verifier-failed": 1, "no-positive-outcome": 2, "invalid-tool-call": 1, "repeated-action": 1, "over-long": 1
    }


def test_sft_data_is_chat_format_with_tool_calls(transcripts, tmp_path):
    report = build_sft_dataset([transcripts["good"], transcripts["loop"]], tmp_path / "sft.jsonl")
    assert (report.read, report.kept) == (2, 1)
    [row] = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    roles = [m["role"] for m in row["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert row["messages"][2]["tool_calls"][0]["function"] == {"name": "Verify", "arguments": {"trials": 3}}
    assert "Finish" in {tool["function"]["name"] for tool in row["tools"]}


# A chat template for the test tokenizer: roles, contents and tool calls as plain text.
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}"
    "[{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}]"
    "{% endfor %}"
    "\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tiny_model_and_tokenizer():
    """A randomly initialised 2-layer Llama and a character-level tokenizer built locally: nothing from a hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<unk>", *alphabet])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    return LlamaForCausalLM(config), tokenizer


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
