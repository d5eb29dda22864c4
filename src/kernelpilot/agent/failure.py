"""Why a run ended without a verified candidate, as a kind and one line: the judge's last check when it failed
(its error kind: build, mismatch, guard, timeout, ...), else what the model said when it finished without handing
the judge a candidate (the built-in policy names there what it does not support). `suite` keeps it in each
problem's result and `optimize` shows it; both read it from here, never from the model's text alone when the judge
has spoken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kernelpilot.agent.observations import compiler_errors, diagnostic_line, verify_text
from kernelpilot.agent.tool_results import JudgeResult, VerifyOutcome
from kernelpilot.results import BuildResult, EvalResult, VerifyResult

if TYPE_CHECKING:
    from kernelpilot.agent import JudgeRecord
    from kernelpilot.agent.loop import RunSummary

# Kinds beside the judge's error kinds (harness/failures.py ERROR_KINDS).
NO_CANDIDATE = "no-candidate"  # the judge never checked a candidate in this run
UNPROFILED = "unprofiled"  # the judge's last check passed, but no Profile judged the candidate
MESSAGE_CHARACTERS = 500


@dataclass
class RunFailure:
    """What kept a run from a verified candidate: `kind` (an error kind, or NO_CANDIDATE / UNPROFILED) and one line."""

    kind: str
    message: str


def judged_failure(result: JudgeResult) -> RunFailure | None:
    """The check that failed in one judge result (the build first, then the verification, then the rest of a
    Profile's judgement); None when nothing in it failed."""
    build = result if isinstance(result, BuildResult) else result.build
    if build is not None and not build.ok:
        errors = compiler_errors(build)
        first = diagnostic_line(errors[0]) if errors else build.error or "the build failed"
        return RunFailure("build", _one_line(first))
    verify = None if isinstance(result, BuildResult) else result.verify
    if verify is not None and not verify.ok:
        return RunFailure(verify.error_kind or "mismatch", _verify_line(verify))
    if isinstance(result, EvalResult) and result.reward < 1 and result.error_kind:
        return RunFailure(result.error_kind, _one_line(result.message))
    return None


def run_failure(summary: RunSummary, judged: JudgeRecord) -> RunFailure | None:
    """Why the run of `summary` has no verified candidate, from the judge's results of this run (`judged`); None
    when it has one, or when it was interrupted (a resume goes on with it)."""
    if summary.best is not None or summary.status == "interrupted":
        return None
    last = next(reversed(judged.by_call.values()), None)
    if last is None:
        said = _one_line(summary.finish_summary or "")  # the model's own words: all there is when no check ran
        return RunFailure(NO_CANDIDATE, said or f"the run ended ({summary.status}) before the judge checked one")
    failure = judged_failure(last)
    if failure is not None:
        return failure
    check = {BuildResult: "the build", VerifyOutcome: "the verification"}.get(type(last), "the judgement")
    return RunFailure(UNPROFILED, f"{check} passed, but no Profile judged the candidate before the run ended "
                                  f"({summary.status})")  # fmt: skip


def _verify_line(verify: VerifyResult) -> str:
    # A failed verification's message names the trial, guard or step that failed; its verdict line is the fallback.
    return _one_line(verify.message) or verify_text(verify).splitlines()[0]


def _one_line(text: str) -> str:
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return first if len(first) <= MESSAGE_CHARACTERS else first[: MESSAGE_CHARACTERS - 1] + "…"
