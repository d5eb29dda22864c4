"""`acceptance`: what every accept path (the CLI's, `optimize --commit`, the TUI's key) records, with a judge that
answers as the worker does. A result judged without the variants is verified again with them (its own trials and
tolerances, no timing) and keeps its timings; one that already has them, or is not verified, is not judged again;
a failed re-verification is refused; no result means one full evaluation with the variants; git is asked first."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kernelpilot.acceptance import accept_candidate, judge_for_acceptance
from kernelpilot.errors import KernelpilotError
from kernelpilot.harness.variants import VARIANTS
from kernelpilot.lockfile import LOCK_NAME, LockFileError, read_lock
from kernelpilot.results import LANDLOCK, NOT_APPLICABLE, UNCONFINED, UNCONFINED_NOTE, EvalResult, TrialResult, VariantCheck, VerifyResult
from kernelpilot.vcs import VcsError
from vcs_testing import GPU, make_repo, make_workspace, verified_result

pytestmark = pytest.mark.usefixtures("isolated_git")

VERIFIED_VARIANTS = [VariantCheck("half", "verified", inputs=[[32, 64]]),
                     VariantCheck("double", "verified", inputs=[[128, 64]]),
                     VariantCheck("half-sequence", NOT_APPLICABLE, message="no tensor input has three or more dims"),
                     VariantCheck("double-sequence", NOT_APPLICABLE, message="no tensor input has three or more dims")]  # fmt: skip


class RecordingJudge:
    """Answers `evaluate` as the judge would for a candidate correct at every shape (or wrong, with `ok=False`), its
    sandboxes confined by Landlock (or as `confinement` says)."""

    def __init__(self, ok: bool = True, confinement: str = LANDLOCK):
        self.ok, self.calls, self.confinement = ok, [], confinement

    def evaluate(self, root, **judging) -> EvalResult:
        self.calls.append(judging)
        from kernelpilot.workspace import open_workspace

        result = EvalResult(open_workspace(root).problem_id, str(root))
        trials = [TrialResult(seed=500 + index, ok=self.ok) for index in range(judging["trials"])]
        result.verify = VerifyResult(ok=self.ok, trials=trials, atol=judging["atol"], rtol=judging["rtol"],
                                     input_shapes=[[64, 64]], message="" if self.ok else "trial 0: mismatch",
                                     variants=VERIFIED_VARIANTS if self.ok and judging["variants"] else [],
                                     confinement=self.confinement)  # fmt: skip
        result.confinement = self.confinement
        if self.ok:
            result.reward = 1
        else:
            result.error_kind, result.message, result.reward = "mismatch", "trial 0: mismatch", -1
        return result


def test_a_result_judged_without_the_variants_is_verified_again_with_them_and_keeps_its_timings(tmp_path):
    ws = make_workspace(tmp_path)
    best, judge = verified_result(ws), RecordingJudge()
    result = judge_for_acceptance(judge, ws, best)

    assert judge.calls == [{"trials": 3, "atol": 1e-3, "rtol": 1e-3, "bench": False, "variants": VARIANTS}]
    assert [check.variant for check in result.verify.variants] == list(VARIANTS)
    assert [trial.seed for trial in result.verify.trials] == [500, 501, 502]
    assert result.bench == best.bench and result.reward == 3
    assert best.verify.variants == [], "the caller's result is left as it was"

    already = dataclasses.replace(best, verify=result.verify)
    assert judge_for_acceptance(judge, ws, already) is already and len(judge.calls) == 1
    wrong = dataclasses.replace(best, verify=VerifyResult(ok=False), reward=-1)
    assert judge_for_acceptance(judge, ws, wrong) is wrong and len(judge.calls) == 1


def test_accepting_records_the_variants_and_a_failed_reverification_is_refused(tmp_path):
    repo = make_repo(tmp_path / "project")
    ws = make_workspace(tmp_path / "project")
    accepted = accept_candidate(RecordingJudge(), ws, verified_result(ws))
    assert accepted.commit is not None and accepted.commit.sha == repo.head.commit.hexsha
    lock = read_lock(ws.root / LOCK_NAME)
    assert [(s.variant, s.inputs) for s in lock.shapes.verified] == [
        ("problem", [[64, 64]]), ("half", [[32, 64]]), ("double", [[128, 64]])]  # fmt: skip
    assert lock.environment.gpu == GPU and lock.timings.candidate.median_ms == 0.25

    with pytest.raises(LockFileError, match="trial 0: mismatch"):
        accept_candidate(RecordingJudge(ok=False), ws, verified_result(ws, candidate_ms=0.2))
    assert repo.head.commit.hexsha == accepted.commit.sha and read_lock(ws.root / LOCK_NAME) == lock


def test_with_no_result_one_full_evaluation_with_the_variants_is_accepted_without_committing(tmp_path):
    ws = make_workspace(tmp_path)  # no repository: without commit, git is not asked
    judge, seen = RecordingJudge(), []
    accepted = accept_candidate(judge, ws, trials=2, atol=1e-2, rtol=1e-2, commit=False, on_judged=seen.append)
    assert judge.calls == [{"trials": 2, "atol": 1e-2, "rtol": 1e-2, "variants": VARIANTS}]
    assert seen == [accepted.result] and accepted.commit is None and accepted.lock_path == ws.root / LOCK_NAME
    assert read_lock(accepted.lock_path).shapes.verified_variants == ["half", "double"]


def test_git_is_asked_before_judging_and_no_judge_is_one_sentence(tmp_path):
    ws = make_workspace(tmp_path / "no-repo")
    judge = RecordingJudge()
    with pytest.raises(VcsError, match="is not inside a git repository"):
        accept_candidate(judge, ws, verified_result(ws))
    assert judge.calls == []

    make_repo(tmp_path / "repo")
    ws = make_workspace(tmp_path / "repo")
    with pytest.raises(KernelpilotError, match="no judge here to verify") as caught:
        accept_candidate(None, ws, verified_result(ws))
    assert f"kernelpilot accept {ws.root}" in caught.value.hint


@pytest.mark.parametrize("judged_in, verified_in", [(UNCONFINED, LANDLOCK), (LANDLOCK, UNCONFINED), (LANDLOCK, LANDLOCK)])
def test_the_lock_file_and_the_commit_say_when_the_judge_was_unconfined(tmp_path, judged_in, verified_in, monkeypatch):
    """A result verified again at the variants keeps the least confined of its two judgements; the lock file records
    it, and the commit says the figures are unverified; a lock file from before it was recorded reads as unknown."""
    repo = make_repo(tmp_path / "project")
    ws = make_workspace(tmp_path / "project")
    best = dataclasses.replace(verified_result(ws), confinement=judged_in)
    accepted = accept_candidate(RecordingJudge(confinement=verified_in), ws, best)

    expected = UNCONFINED if UNCONFINED in (judged_in, verified_in) else LANDLOCK
    assert accepted.result.confinement == expected
    assert read_lock(accepted.lock_path).confinement == expected
    unverified = f"judge      unverified: {UNCONFINED_NOTE}" in repo.head.commit.message
    assert unverified == (expected == UNCONFINED), repo.head.commit.message

    written_before = json.loads(accepted.lock_path.read_text())
    del written_before["confinement"]
    accepted.lock_path.write_text(json.dumps(written_before))
    # An older kernelpilot recorded no lock in its cache folder (workspace_record.py): such a lock is read as it is.
    monkeypatch.setenv("KERNELPILOT_CACHE_DIR", str(tmp_path / "an-older-kernelpilots-cache"))
    assert read_lock(accepted.lock_path).confinement is None
