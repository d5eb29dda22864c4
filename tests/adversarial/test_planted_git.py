"""A git repository planted in the workspace against `accept --commit` (issue #14).

`accept` commits the workspace's files into the user's repository by running git, unconfined, as the user. The
agent's Bash may write anything inside the workspace, a `.git` of its own included, and git picks the nearest
repository up from where it runs: a planted one, whose config is the agent's (`core.fsmonitor` is a command git runs
on `status` and `add`; `core.hooksPath` names the hooks, a post-commit hook among them, which `--no-verify` does not
skip). Against kernelpilot as it was (a46f2cd) the planted command ran and the commit went into the planted
repository, reported as the user's.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import git
import pytest

from kernelpilot.vcs import VcsError, accept
from vcs_testing import make_repo, make_workspace, verified_result


@pytest.fixture
def isolated_git(tmp_path, monkeypatch):
    (tmp_path / "gitconfig").write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


def _plant_repository(ws_root: Path, marker: Path, how: str) -> None:
    """What the agent's Bash can do in its workspace: a repository of its own there, configured to run a command."""
    subprocess.run(["git", "init", "-q", str(ws_root)], check=True)
    command = f"sh -c 'echo ran >> {marker}'"
    if how == "fsmonitor":
        subprocess.run(["git", "-C", str(ws_root), "config", "core.fsmonitor", command], check=True)
    else:
        hooks = ws_root / "hooks"
        hooks.mkdir()
        (hooks / "post-commit").write_text(f"#!/bin/sh\n{command}\n")
        (hooks / "post-commit").chmod(0o755)
        subprocess.run(["git", "-C", str(ws_root), "config", "core.hooksPath", str(hooks)], check=True)


@pytest.mark.parametrize("how", ["fsmonitor", "hooks"])
def test_a_repository_planted_in_the_workspace_runs_nothing_and_gets_no_commit(tmp_path, isolated_git, how):
    repo = make_repo(tmp_path / "project")
    ws = make_workspace(tmp_path / "project")
    marker = tmp_path / "ran"
    _plant_repository(ws.root, marker, how)
    before = repo.head.commit.hexsha if repo.head.is_valid() else None
    with pytest.raises(VcsError, match=r"\.git of its own"):
        accept(ws, verified_result(ws))
    assert not marker.exists(), "git ran the planted repository's command"
    assert (repo.head.commit.hexsha if repo.head.is_valid() else None) == before
    assert not git.Repo(ws.root).head.is_valid(), "the accept was committed into the planted repository"


def test_a_git_file_or_link_planted_deeper_in_the_workspace_is_refused_too(tmp_path, isolated_git):
    repo = make_repo(tmp_path / "project")
    ws = make_workspace(tmp_path / "project")
    (ws.root / "kernels" / ".git").write_text(f"gitdir: {tmp_path / 'elsewhere'}\n")
    (ws.root / ".git").symlink_to(tmp_path / "nowhere")
    with pytest.raises(VcsError, match=r"\(\.git, kernels/\.git\)"):
        accept(ws, verified_result(ws))
    assert not repo.head.is_valid()
