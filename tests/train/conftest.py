"""Fixtures of the training tests."""

import pytest
from train_testing import write_transcript


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
