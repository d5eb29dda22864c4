"""Cheats on the time between timed runs, where no clock runs (candidates/ahead/, on the CPU).

Ahead: the judge draws each timed run's inputs itself and sends the run's seed with the request; when the seeds of
a series were the first one plus 0, 1, 2, ..., the candidate's process could draw the next run's inputs as soon as
it had replied, compute the answer while the judge drew the same inputs, and copy it out when the run came: every
answer right, the time a copy's. Run seeds that nobody can tell from the ones before leave it computing answers for
inputs that never come.

Behind: the process returns nothing in its window and writes the answer into the judge's slot after its reply,
while the judge draws the inputs again and runs the reference for its check (reward 3 at an empty call's time at
a070717). The judge now copies a checked run's slots as the reply comes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelpilot.harness.judge import Judge, candidate_workspace
from kp_testing import run_cache_dir

HERE = Path(__file__).parent
PROBLEM = HERE / "problems" / "naive_matmul.py"
CANDIDATES = HERE / "candidates" / "ahead"


@pytest.mark.cuda_build
def test_an_answer_computed_between_timed_runs_is_not_handed_out(tmp_path):
    with Judge("cpu", arch="9.0", cache_dir=run_cache_dir(tmp_path)) as judge:
        with candidate_workspace(PROBLEM, CANDIDATES / "honest_matmul.py") as root:
            honest = judge.evaluate(root, trials=2)
        with candidate_workspace(PROBLEM, CANDIDATES / "computes_ahead.py") as root:
            cheat = judge.evaluate(root, trials=2)
    assert honest.bench is not None and honest.bench.ok, honest.message
    honest_ms = honest.bench.candidate.median_ms
    if cheat.bench is not None and cheat.bench.ok:  # it must have done the work in its timed windows
        assert cheat.bench.candidate.median_ms >= 0.5 * honest_ms, (cheat.bench.candidate, honest_ms)
    else:  # or the work it did between runs showed on the judge's clock
        assert cheat.error_kind == "guard" and "unaccounted-time" in cheat.message, cheat.message


@pytest.mark.cuda_build
def test_an_answer_written_into_the_slot_after_the_reply_is_not_read(tmp_path):
    """The other side of the same gap: the answer computed after the run's reply, while the judge draws the inputs
    again for its check, and written into the slot before the judge reads it. The judge keeps a copy of a
    checked run's slots as the reply comes, before it does anything else."""
    with Judge("cpu", arch="9.0", cache_dir=run_cache_dir(tmp_path)) as judge:
        with candidate_workspace(PROBLEM, CANDIDATES / "computes_behind.py") as root:
            cheat = judge.evaluate(root, trials=2)
    assert cheat.error_kind == "mismatch" and "timed call" in cheat.message, cheat.message
