"""Fixtures and markers of the training tests."""

import pytest
from train_testing import write_transcript


@pytest.fixture
def transcripts(tmp_path):
    return {
        "good": write_transcript(tmp_path / "good.jsonl", reward=2),
        "claims_only": write_transcript(tmp_path / "claims.jsonl", reward=-1, claim_success=True),
        "never_judged": write_transcript(tmp_path / "unjudged.jsonl", claim_success=True),
        "invalid_call": write_transcript(tmp_path / "invalid.jsonl", reward=1, refused="unknown tool Verfy"),
        "loop": write_transcript(tmp_path / "loop.jsonl", reward=1, repeats=4),
        "long": write_transcript(tmp_path / "long.jsonl", reward=3, filler=200_000),
        "verifier_failed": write_transcript(tmp_path / "harness.jsonl", reward=2, verify_error="harness"),
    }


# Seconds to a minute each (tiny real training runs, spawned filter processes, datasets round trips).
SLOW = {
    "test_a_finished_stage_is_skipped_on_resume",
    "test_a_model_error_ends_the_cli_run_in_one_sentence_keeping_the_tasks_so_far",
    "test_a_tiny_grpo_run_reads_tasks_and_logs_rewards",
    "test_a_tiny_sft_run_trains_on_the_rft_data",
    "test_a_tiny_value_model_trains_and_loads_as_a_token_level_critic",
    "test_composed_tasks_pass_the_filters",
    "test_dataset_loads_with_datasets",
    "test_dataset_round_trip",
    "test_hangs_and_crashes_drop_only_their_task",
    "test_replies_are_filtered_counted_and_decontaminated_like_composed_tasks",
    "test_the_agentic_stage_writes_verls_config_and_says_how_to_launch_it",
    "test_the_pipeline_composes_with_the_model_its_synth_table_names",
    "test_train_commands_from_the_cli",
    "test_train_run_chains_synth_warmup_rft_and_critic_from_one_config",
    "test_verl_config_names_our_reward_function_and_data",
}


def pytest_itemcollected(item):
    # Called for the items of this folder only (a collection hook through the item's own path).
    if item.originalname in SLOW:
        item.add_marker(pytest.mark.slow)
