"""Git commits of accepted candidates: the workspace's files and its lock file, with the numbers in the message.

Only the named paths are committed (`git commit --only -- PATHS`), so the user's other staged and unstaged
changes stay exactly as they were. Author and committer are the user's identity marked "(kernelpilot)", given
to that one git process through gitpython (never through os.environ). Every git failure is caught as one tuple
of errors and reported in a sentence.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import git

from kernelpilot.errors import KernelpilotError
from kernelpilot.lockfile import (
    LOCK_NAME,
    Lock,
    RecordedTiming,
    Shapes,
    Timings,
    candidate_files,
    lock_from_eval,
    write_lock,
)
from kernelpilot.results import LANDLOCK, UNCONFINED, UNCONFINED_NOTE, EvalResult
from kernelpilot.workspace import GITIGNORE_PATH, MANIFEST_PATH, PROTECTED_FILES, Workspace, open_workspace

GIT_ERRORS = (git.GitError, OSError, ValueError)
# Marker files git leaves in its folder while an operation waits for the user to finish it.
_IN_PROGRESS_MARKERS = (
    ("merge", "MERGE_HEAD"),
    ("rebase", "rebase-merge"),
    ("rebase", "rebase-apply"),
    ("cherry-pick", "CHERRY_PICK_HEAD"),
    ("revert", "REVERT_HEAD"),
)
_NO_COMMIT_HINT = "Or pass --no-commit to write kernelpilot.lock.json without committing."
_GIT_OUTPUT_LABEL = re.compile(r"^(stderr|stdout): '")


class VcsError(KernelpilotError):
    """Git refuses or fails to commit an accepted candidate."""


@dataclass
class CommitInfo:
    """A commit made by `accept`."""

    sha: str
    message: str
    files: list[str]  # repository-relative paths the commit changed

    @property
    def short_sha(self) -> str:
        return self.sha[:7]

    @property
    def subject(self) -> str:
        return self.message.splitlines()[0]


def accept(ws: Workspace | Path | str, eval_result: EvalResult, *, message: str | None = None) -> CommitInfo:
    """Write the lock file of a verified result and commit it with the workspace's files, nothing else.

    `message` replaces the subject line; the body always carries the numbers. Raises LockFileError for a result
    that is not verified and VcsError when git refuses (no repository, detached HEAD, merge or rebase under way).
    """
    ws = ws if isinstance(ws, Workspace) else open_workspace(ws)
    lock = lock_from_eval(ws, eval_result)
    refuse_planted_repositories(ws)
    try:
        repo = open_repository(ws.root.parent)  # (the workspace itself is refused above as a repository's root)
        ensure_committable(repo)
        write_lock(ws, lock)
        paths = workspace_paths(repo, ws)
        return _commit(repo, paths, commit_message(_display_name(repo, ws), lock, subject=message))
    except GIT_ERRORS as err:
        raise VcsError(
            f"git could not commit the accepted candidate: {_git_reason(err)}.", hint=_NO_COMMIT_HINT
        ) from None


def refuse_planted_repositories(ws: Workspace) -> None:
    """VcsError where the workspace holds a `.git` (a folder, file or link) anywhere: kernelpilot never makes one, the
    agent's tools may, and git run there would commit into it and run what its config names (core.fsmonitor, hooks)
    as the user, outside any sandbox."""
    planted = sorted(Path(folder) / name for folder, folders, files in os.walk(ws.root)
                     for name in folders + files if name == ".git")  # fmt: skip (a link too, even one leading nowhere)
    if planted:
        shown = ", ".join(path.relative_to(ws.root).as_posix() for path in planted)
        raise VcsError(
            f"The workspace {ws.root} holds a .git of its own ({shown}), which kernelpilot never makes: git would "
            "commit there and run the commands its configuration names, so nothing was committed.",
            hint=f"Delete it (rm -rf {ws.root / planted[0].relative_to(ws.root)}) and accept again. {_NO_COMMIT_HINT}",
        )


def check_ready_to_commit(path: Path) -> None:
    """Raise VcsError unless `path` is in a repository on a branch with no merge or rebase under way."""
    try:
        ensure_committable(open_repository(path))
    except GIT_ERRORS as err:
        raise VcsError(
            f"git cannot tell whether {path} can be committed: {_git_reason(err)}.", hint=_NO_COMMIT_HINT
        ) from None


def open_repository(path: Path) -> git.Repo:
    """The repository whose working tree holds `path`; VcsError when there is none."""
    try:
        repo = git.Repo(path, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise VcsError(
            f"{path} is not inside a git repository, so there is nothing to commit to.",
            hint=f"Run `git init` in the project folder first. {_NO_COMMIT_HINT}",
        ) from None
    if repo.bare:
        raise VcsError(f"The repository at {repo.git_dir} is bare and has no working tree.", hint=_NO_COMMIT_HINT)
    return repo


def ensure_committable(repo: git.Repo) -> None:
    """VcsError on a detached HEAD or while a merge, rebase, cherry-pick or revert waits to be finished."""
    # Operations first: a rebase also detaches HEAD, and the rebase is what the user needs to hear about.
    git_dir = Path(repo.git_dir)
    for operation, marker in _IN_PROGRESS_MARKERS:
        if (git_dir / marker).exists():
            raise VcsError(
                f"A {operation} is in progress in {repo.working_tree_dir}, and committing now would become part of it.",
                hint=f"Finish it or abort it (`git {operation} --abort`) first. {_NO_COMMIT_HINT}",
            )
    if repo.head.is_detached:
        raise VcsError(
            "HEAD is detached, so there is no branch to commit the accepted kernel to.",
            hint=f"Switch to a branch first (`git switch -c NAME`). {_NO_COMMIT_HINT}",
        )


def workspace_paths(repo: git.Repo, ws: Workspace) -> list[str]:
    """Repository-relative paths an accept commits: what a clone needs to rebuild and re-check the candidate.

    That is the protected files and the manifest (committed once, unchanged afterwards), the workspace's
    .gitignore when it has one (so a clone's builds stay out of git too), the candidate's files, the lock file,
    and kernel files git tracks that were deleted (so a clone does not build a removed kernel).
    """
    root = Path(repo.working_tree_dir).resolve()
    prefix = ws.root.relative_to(root)
    names = {*PROTECTED_FILES, MANIFEST_PATH, LOCK_NAME, *candidate_files(ws)}
    if (ws.root / GITIGNORE_PATH).is_file():
        names.add(GITIGNORE_PATH)
    paths = {(prefix / name).as_posix() for name in names}
    deleted = repo.git.ls_files("--deleted", "--", (prefix / "kernels").as_posix()).splitlines()
    return sorted(paths | set(deleted))


def commit_message(name: str, lock: Lock, *, subject: str | None = None) -> str:
    """The subject (the numbers, unless `subject` is given) and a body with every recorded figure."""
    timings, env, verification = lock.timings, lock.environment, lock.verification
    numbers = _headline(timings, env.gpu)
    speedups = _speedup_text(timings.speedup_vs_eager), _speedup_text(timings.speedup_vs_compile)
    body = [
        f"problem    {lock.problem_id}",
        f"verified   {len(verification.seeds)} trials, atol {verification.atol:g}, rtol {verification.rtol:g}",
        f"candidate  {_timing_text(timings.candidate)}",
        f"eager      {_timing_text(timings.eager)}",
        f"compile    {_timing_text(timings.compile)}",
        f"speedup    {speedups[0]} vs eager, {speedups[1]} vs torch.compile",
        f"reward     {lock.reward}",
        f"on         {env.gpu or 'no timing device'}, torch {env.torch}, CUDA {env.cuda or 'none'}",
    ]
    if lock.shapes is not None:
        body.append(f"shapes     {_shapes_text(lock.shapes)}")
    if lock.confinement == UNCONFINED:
        body.append(f"judge      unverified: {UNCONFINED_NOTE}")
    elif lock.confinement == LANDLOCK:
        body.append("judge      its sandboxes confined by Landlock")
    return "\n".join([subject or f"kernelpilot: accept {name}: {numbers}", "", *body]) + "\n"


# ------------------------------------------------------------------------------------------- helpers


def _commit(repo: git.Repo, paths: list[str], message: str) -> CommitInfo:
    # New files must be known to git before a partial commit can name them; `add` of a deleted path stages
    # its removal. Only these paths change in the index, and `commit --only` takes exactly them.
    repo.git.add("--", *paths)
    if not repo.git.status("--porcelain", "--", *paths):
        raise VcsError(
            "Nothing to commit: the workspace's files and lock file are as the last commit has them.",
            hint="Change a kernel and evaluate it again before accepting.",
        )
    # --no-verify: the candidate was just verified and timed by the judge; a pre-commit `kernelpilot check`
    # would only time it again.
    repo.git.commit("--only", "--no-verify", "-m", message, "--", *paths, env=_identity(repo))
    head = repo.head.commit
    return CommitInfo(sha=head.hexsha, message=head.message, files=sorted(str(name) for name in head.stats.files))


def _identity(repo: git.Repo) -> dict[str, str]:
    """GIT_AUTHOR_* / GIT_COMMITTER_* for one git process: the user's name marked "(kernelpilot)"."""
    user = git.Actor.committer(repo.config_reader())
    actor = git.Actor(f"{user.name} (kernelpilot)", user.email)
    return {
        "GIT_AUTHOR_NAME": actor.name,
        "GIT_AUTHOR_EMAIL": actor.email,
        "GIT_COMMITTER_NAME": actor.name,
        "GIT_COMMITTER_EMAIL": actor.email,
    }


def _display_name(repo: git.Repo, ws: Workspace) -> str:
    relative = ws.root.relative_to(Path(repo.working_tree_dir).resolve()).as_posix()
    return ws.root.name if relative == "." else relative


def _headline(timings: Timings, gpu: str | None) -> str:
    if timings.candidate is None:
        return "verified, not timed"
    return (
        f"{timings.candidate.median_ms:.4g} ms, {_speedup_text(timings.speedup_vs_eager)} vs eager, "
        f"{_speedup_text(timings.speedup_vs_compile)} vs compile on {gpu}"
    )


def _timing_text(timing: RecordedTiming | None) -> str:
    if timing is None:
        return "not timed"
    return f"{timing.median_ms:.4g} ms (p10-p90 {timing.p10_ms:.4g}-{timing.p90_ms:.4g}, {timing.runs} runs)"


def _shapes_text(shapes: Shapes) -> str:
    parts = [f"verified at {', '.join(shape_set.variant for shape_set in shapes.verified)}"]
    if shapes.failed:
        parts.append(f"failed at {', '.join(shape_set.variant for shape_set in shapes.failed)}")
    if shapes.not_applicable:
        parts.append(f"not applicable: {', '.join(shape_set.variant for shape_set in shapes.not_applicable)}")
    return "; ".join(parts)


def _speedup_text(speedup: float | None) -> str:
    return f"{speedup:.2f}x" if speedup is not None else "-"


def _git_reason(err: BaseException) -> str:
    """git's own one-line reason (its first fatal/error line) or the exception's first line."""
    if isinstance(err, git.GitCommandError):
        for output in (err.stderr, err.stdout):
            text = _GIT_OUTPUT_LABEL.sub("", (output or "").strip()).rstrip("'")
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            if lines:
                # "...ignored by one of your .gitignore files:" reads best with the path that follows it.
                reason = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
                return reason.removeprefix("fatal: ").removeprefix("error: ").rstrip(".")
        return f"`git {err.command[1] if len(err.command) > 1 else ''}` exited with status {err.status}"
    text = str(err).strip()
    return text.splitlines()[0].rstrip(".") if text else type(err).__name__
