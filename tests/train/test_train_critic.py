"""`train critic`: a value model regressed on the judge's rewards of scored rollouts; verl's critic class loads it."""

import pytest

from kernelpilot.train.critic import CriticSettings, run_critic, value_examples
from train_testing import tiny_model_and_tokenizer


def test_every_transcript_is_an_example_labelled_with_the_judges_reward(transcripts):
    examples = value_examples(transcripts.values())
    assert sorted(example["reward"] for example in examples) == [-1.0, -1.0, 1.0, 1.0, 2.0, 3.0]
    assert all(example["messages"][0]["role"] == "system" for example in examples)


def test_a_tiny_value_model_trains_and_loads_as_a_token_level_critic(transcripts, tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'kernelpilot[train]')")
    pytest.importorskip("datasets", reason="datasets is not installed (pip install 'kernelpilot[train]')")
    import torch
    from transformers import LlamaForSequenceClassification, LlamaForTokenClassification

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    causal, tokenizer = tiny_model_and_tokenizer()
    config = causal.config
    config.num_labels, config.problem_type = 1, "regression"
    model = LlamaForSequenceClassification(config)
    paths = [transcripts[name] for name in ("good", "claims_only", "loop")]
    settings = CriticSettings(
        model="tiny", output_dir=tmp_path / "critic", max_steps=2, learning_rate=1e-3, batch_size=3, max_length=2048
    )
    metrics = run_critic(settings, paths, tokenizer=tokenizer, model=model)
    assert metrics["train_loss"] > 0
    critic = LlamaForTokenClassification.from_pretrained(tmp_path / "critic", num_labels=1)
    assert torch.equal(critic.score.weight, model.score.weight.cpu())
