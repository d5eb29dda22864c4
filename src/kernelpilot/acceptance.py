"""Accepting a candidate: judge it for acceptance, at the problem's shapes and at their leading-dim variants, then
write its lock file and (unless told not to) commit it.

Every way a user accepts a kernel goes through `accept_candidate`: `kernelpilot accept`, `optimize --commit` and
the TUI's accept key. So every lock file records the shapes verified (`Lock.shapes`), which `kernelpilot check`
verifies again. `accept` judges the workspace afresh; the other two already hold a judged result (the agent's
best, a watched edit's), whose timings stand for the same files, so only its verification is redone with the
variants (`judge_for_acceptance`). Rendering stays with the callers (cli/, tui/).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kernelpilot.errors import KernelpilotError
from kernelpilot.results import EvalResult, VerifyResult, least_confined

if TYPE_CHECKING:
    from kernelpilot.harness.judge import Judge
    from kernelpilot.vcs import CommitInfo
    from kernelpilot.workspace import Workspace


@dataclass
class Accepted:
    """What accepting did: the result the lock file records, where the lock file is, and the commit (None when
    only the lock file was written)."""

    result: EvalResult
    lock_path: Path
    commit: CommitInfo | None = None


def accept_candidate(
    judge: Judge | None,
    ws: Workspace,
    judged: EvalResult | None = None,
    *,
    trials: int = 5,
    atol: float = 1e-2,
    rtol: float = 1e-2,
    commit: bool = True,
    message: str | None = None,
    on_judged: Callable[[EvalResult], None] | None = None,
) -> Accepted:
    """Judge the workspace's candidate for acceptance (`judge_for_acceptance`), then write its lock file and, with
    `commit`, commit it with the workspace's files (`vcs.accept`, `message` its subject).

    With `commit`, git is asked first whether it can commit, before any judging. `on_judged` sees the result before
    anything is written (the CLI renders it there). Raises VcsError when git refuses, LockFileError when the result
    is not a verified candidate of `ws`, and KernelpilotError when there is no judge to verify with.
    """
    from kernelpilot.lockfile import lock_from_eval, lock_path, write_lock
    from kernelpilot.vcs import accept as commit_accepted, check_ready_to_commit

    if commit:
        check_ready_to_commit(ws.root)  # before the judge's minutes, not after
    if judge is None:
        raise KernelpilotError(
            "There is no judge here to verify the candidate at the shape variants before it is accepted.",
            hint=f"`kernelpilot accept {ws.root}` verifies and commits it.",
        )
    result = judge_for_acceptance(judge, ws, judged, trials=trials, atol=atol, rtol=rtol)
    if on_judged is not None:
        on_judged(result)
    if commit:
        return Accepted(result, lock_path(ws), commit_accepted(ws, result, message=message))
    return Accepted(result, write_lock(ws, lock_from_eval(ws, result)))


def judge_for_acceptance(
    judge: Judge, ws: Workspace, judged: EvalResult | None = None, *, trials: int = 5, atol: float = 1e-2,
    rtol: float = 1e-2,
) -> EvalResult:  # fmt: skip
    """The result a lock file records: verified at the problem's shapes and at the leading-dim VARIANTS.

    With no `judged` result, a full evaluation with the variants (`trials`, `atol`, `rtol`). A `judged` result of
    the workspace's files as they are (the agent's best once it is back in the workspace) keeps its timings, and
    its verification is redone with the variants, with its own trial count and tolerances, after an incremental
    build of the files as they are (a build reported earlier may have been pruned, or made from other sources).
    A `judged` result whose verification already covers the variants, or that is not verified (the lock file
    refuses it with its reason), comes back as it is. A failed verification comes back as the failed result. The
    result's confinement is the least confined of the judgements it is made of.
    """
    from kernelpilot.harness.variants import VARIANTS

    if judged is None:
        return judge.evaluate(ws.root, trials=trials, atol=atol, rtol=rtol, variants=VARIANTS)
    verify = judged.verify
    if verify is None or not verify.ok or _covers(verify, VARIANTS):
        return judged
    # Build (incremental), the tamper check and the verification with the variants, as any evaluation has them;
    # the timing is the judged result's own.
    fresh = judge.evaluate(ws.root, trials=max(len(verify.trials), 1), atol=verify.atol, rtol=verify.rtol,
                           bench=False, variants=VARIANTS)  # fmt: skip
    if fresh.verify is None or not fresh.verify.ok:
        return fresh
    return dataclasses.replace(judged, build=fresh.build, verify=fresh.verify,
                               confinement=least_confined(judged.confinement, fresh.confinement))  # fmt: skip


def _covers(verify: VerifyResult, variants: tuple[str, ...]) -> bool:
    return set(variants) <= {check.variant for check in verify.variants}
