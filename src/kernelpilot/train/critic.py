"""`train critic`: pretrain a value model on scored rollouts before agentic PPO, with transformers' Trainer.

Every transcript (kept or not: the critic must learn what failure looks like too) becomes one example: the
conversation rendered by the tokenizer's chat template, labelled with the judge's best reward in it. The model is a
causal LM with a one-output regression head (`AutoModelForSequenceClassification`, num_labels=1), trained with MSE to
predict the episode's reward from its text. Its head is named like a token-classification head (`score`), so verl's
critic (`AutoModelForTokenClassification`, num_labels=1) loads the checkpoint as its initial value function.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelpilot.train.rft import TrainerKnobs


@dataclass
class CriticSettings(TrainerKnobs):
    """What `run_critic` trains: the base model (local path or hub id), the transcripts, and the main knobs."""

    model: str
    output_dir: Path


def value_examples(transcripts: Iterable[Path]) -> list[dict[str, Any]]:
    """One example per transcript: its messages and the judge's best reward in it (-1 when nothing was verified).

    A transcript on which kernelpilot's verifier broke is left out: its -1 would teach the critic a harness bug.
    """
    from kernelpilot.train.rft import load_trajectory, sft_example, verifier_failed

    examples = []
    for path in transcripts:
        trajectory = load_trajectory(path)
        if verifier_failed(trajectory):
            continue
        examples.append({"messages": sft_example(trajectory, [])["messages"], "reward": float(trajectory.best_reward)})
    return examples


def run_critic(
    settings: CriticSettings, transcripts: Iterable[Path], tokenizer: Any = None, model: Any = None
) -> dict[str, Any]:
    """Train the value model on the transcripts; returns the metrics. Saves model and tokenizer to `output_dir`."""
    from kernelpilot.train.rft import require_training_engine, trainer_arguments

    require_training_engine("transformers", "datasets")
    from datasets import Dataset
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(settings.model)
    model = model or AutoModelForSequenceClassification.from_pretrained(
        settings.model, num_labels=1, problem_type="regression"
    )
    if model.config.pad_token_id is None:  # the head reads the last non-pad token, so padding must be known
        model.config.pad_token_id = tokenizer.pad_token_id

    def encode(example: dict[str, Any]) -> dict[str, Any]:
        text = tokenizer.apply_chat_template(example["messages"], tokenize=False)
        encoded = tokenizer(text, truncation=True, max_length=settings.max_length)
        return {**encoded, "labels": example["reward"]}

    dataset = Dataset.from_list(value_examples(transcripts))
    dataset = dataset.map(encode, remove_columns=dataset.column_names)
    args = TrainingArguments(**trainer_arguments(settings), num_train_epochs=settings.epochs)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=DataCollatorWithPadding(tokenizer))
    metrics = trainer.train().metrics
    trainer.save_model(str(settings.output_dir))
    tokenizer.save_pretrained(str(settings.output_dir))
    return metrics
