"""What the training tests share: session transcripts shaped like agent/session.py writes them, and a tiny
randomly initialised Llama with a character-level tokenizer built locally (nothing from a hub)."""

import json
from pathlib import Path

from kernelpilot.agent.vouched import line_digest, vouch

def _call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def write_transcript(
    path: Path, *, reward=None, refused=None, repeats=1, claim_success=False, filler=0, verify_error=None, legacy=False
):
    """A session transcript shaped like agent/session.py writes them; Verify's data says `verify_error` when given.

    `refused`: the loop refused each Verify call with this ToolError message. `legacy`: tool records without their
    result's type, as transcripts were before records named it (a refused call then only reads "Error: ...").
    """
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
        if refused is None:
            content, result_type = "ok", "VerifyOutcome"
            data = {"build": None, "verify": {"ok": verify_error is None, "error_kind": verify_error}}
        else:
            content, result_type, data = f"Error: {refused}", "ToolError", {"message": refused}
        record = {
            "type": "tool",
            "turn": turn,
            "name": "Verify",
            "arguments": {"trials": 3},
            "message": {"role": "tool", "tool_call_id": call["id"], "content": content},
            "data": data,
            "result_type": result_type,
        }
        if legacy:
            del record["result_type"]
        records.append(record)
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
    lines = [json.dumps(record) for record in records]
    path.write_text("".join(line + "\n" for line in lines))
    for record, line in zip(records, lines):
        if record["type"] in ("eval", "end"):  # the loop vouches for its verdicts and end (agent/vouched.py)
            vouch(path, line_digest(line))
    return path


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
