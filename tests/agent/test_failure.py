"""Why a run ended without a verified candidate (agent/failure.py): the failing check of a judge result, its kind
and first line, and for a whole run the judge's last result, else the model's own words when the judge never
checked a candidate. The suite's result files carry this; the real runs are in test_cli_optimize.py."""

from __future__ import annotations

from kernelpilot.agent import JudgeRecord, VerifyOutcome
from kernelpilot.agent.failure import MESSAGE_CHARACTERS, NO_CANDIDATE, UNPROFILED, RunFailure, judged_failure, run_failure
from kernelpilot.agent.loop import RunSummary
from kernelpilot.results import BuildResult, Diagnostic, EvalResult, GuardFinding, TrialResult, VerifyResult


def build(ok: bool = True, diagnostics: list[Diagnostic] | None = None, error: str | None = None) -> BuildResult:
    return BuildResult(ok=ok, workspace="/w", extension_name="kp_kernels", arch="9.0", diagnostics=diagnostics or [],
                       error=error)  # fmt: skip


def summary(status: str = "finished", best: EvalResult | None = None, said: str | None = None) -> RunSummary:
    return RunSummary(status, "s", turns=3, prompt_tokens=0, completion_tokens=0, cost_usd=None, best=best,
                      finish_summary=said)  # fmt: skip


def record(*results) -> JudgeRecord:
    judged = JudgeRecord()
    for number, result in enumerate(results):
        judged.by_call[f"call-{number}"] = result
    return judged


def test_a_failed_build_names_the_first_compiler_error_not_ninjas_echo():
    failed = build(False, [Diagnostic("error", "FAILED: a.o", tool="ninja"),
                           Diagnostic("error", "identifier \"y\" is undefined", "kernels/a.cu", 12, 5)],
                   error="2 errors")  # fmt: skip
    expected = RunFailure("build", 'kernels/a.cu:12:5: identifier "y" is undefined')
    assert judged_failure(failed) == expected
    assert judged_failure(VerifyOutcome(failed)) == expected, "Verify skipped for a failed build says why"
    assert judged_failure(EvalResult("p", "/w", build=failed, error_kind="build", message="2 errors")) == expected
    assert judged_failure(build(False, error="ninja is not installed.")) == RunFailure("build", "ninja is not installed.")


def test_a_failed_verification_gives_its_kind_and_first_line():
    mismatch = VerifyResult(ok=False, trials=[TrialResult(seed=7, ok=False, max_abs_error=0.5, max_rel_error=1.0)],
                            error_kind="mismatch", message="trial 1 (seed 7): output 0 differs\nworst at [3]")  # fmt: skip
    assert judged_failure(VerifyOutcome(build(), mismatch)) == RunFailure("mismatch", "trial 1 (seed 7): output 0 differs")
    guard = VerifyResult(ok=False, guards=[GuardFinding("torch-compute", "fail", "forward called aten::mul")],
                         error_kind="guard", message="guard torch-compute failed: forward called aten::mul")  # fmt: skip
    profiled = EvalResult("p", "/w", build=build(), verify=guard, error_kind="guard", message=guard.message)
    assert judged_failure(profiled) == RunFailure("guard", "guard torch-compute failed: forward called aten::mul")
    timeout = VerifyResult(ok=False, error_kind="timeout", message="the verification did not finish within 300 s.")
    assert judged_failure(VerifyOutcome(build(), timeout)).kind == "timeout"
    silent = VerifyResult(ok=False, trials=[TrialResult(seed=1, ok=False)])  # no kind, no message: the verdict line
    assert judged_failure(VerifyOutcome(build(), silent)) == RunFailure(
        "mismatch", "Verify FAILED (mismatch): 0/1 trials within |actual - expected| <= 0.01 + 0.01 * |expected|.")


def test_a_judgement_that_failed_before_any_check_and_one_that_passed():
    tampered = EvalResult("p", "/w", error_kind="tampered", message="protected workspace files were changed: model.py.")
    assert judged_failure(tampered) == RunFailure("tampered", "protected workspace files were changed: model.py.")
    assert judged_failure(build()) is None
    assert judged_failure(VerifyOutcome(build(), VerifyResult(ok=True))) is None
    untimed = EvalResult("p", "/w", build=build(), verify=VerifyResult(ok=True), reward=1, error_kind="runtime",
                         message="correct, but not timed: no GPU")  # fmt: skip
    assert judged_failure(untimed) is None, "correct is not a failure"


def test_a_run_is_told_by_the_judges_last_result_else_by_the_models_words():
    broken = build(False, error="1 error")
    assert run_failure(summary(), record(broken)) == RunFailure("build", "1 error")
    # The last result is what the candidate is now: an earlier failure the model fixed does not count.
    assert run_failure(summary("max-turns"), record(broken, build())) == RunFailure(
        UNPROFILED, "the build passed, but no Profile judged the candidate before the run ended (max-turns)")
    unsupported = "No kernels written for cumsum: Not supported by the built-in policy: aten.cumsum.\nMore words."
    assert run_failure(summary(said=unsupported), record()) == RunFailure(
        NO_CANDIDATE, "No kernels written for cumsum: Not supported by the built-in policy: aten.cumsum.")
    assert run_failure(summary("max-turns"), record()) == RunFailure(
        NO_CANDIDATE, "the run ended (max-turns) before the judge checked one")
    long_words = run_failure(summary(said="x" * 2000), record()).message
    assert len(long_words) == MESSAGE_CHARACTERS and long_words.endswith("…")


def test_a_verified_or_interrupted_run_has_no_failure():
    verified = EvalResult("p", "/w", build=build(), verify=VerifyResult(ok=True), reward=1)
    assert run_failure(summary(best=verified), record(build(False))) is None
    assert run_failure(summary("interrupted"), record(build(False))) is None
