"""Lock files and `accept` commits, in real git repositories in temp folders: exactly the workspace's files, the
numbers in the message, the user's other changes untouched, and one-sentence refusals where git cannot commit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import git
import pytest
from typer.testing import CliRunner

from kernelpilot.cli import app
from kernelpilot.lockfile import (
    LOCK_NAME,
    LockFileError,
    candidate_files,
    changed_files,
    lock_from_eval,
    read_lock,
    write_lock,
)
from kernelpilot.results import NOT_APPLICABLE, VariantCheck
from kernelpilot.vcs import VcsError, accept, commit_message
from kernelpilot.workspace import GITIGNORE_PATH, MANIFEST_PATH, PROTECTED_FILES, Workspace
from vcs_testing import GPU, HALF_VERIFIED_DOUBLE_FAILED, make_repo, make_workspace, verified_result

pytestmark = pytest.mark.usefixtures("isolated_git")


def commit_all(repo: git.Repo, files: dict[str, str], message: str) -> None:
    for name, text in files.items():
        path = Path(repo.working_tree_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    repo.git.add("--", *files)
    repo.git.commit("-m", message)


@pytest.fixture
def repo_and_workspace(tmp_path) -> tuple[git.Repo, Workspace]:
    repo = make_repo(tmp_path / "project")
    commit_all(repo, {"README.md": "# project\n", "notes.txt": "first\n"}, "start")
    return repo, make_workspace(tmp_path / "project")


def committed_files(repo: git.Repo) -> set[str]:
    return set(repo.head.commit.stats.files)


# ------------------------------------------------------------------------------------------- lock file


def test_lock_file_round_trip_keeps_every_recorded_figure(tmp_path):
    ws = make_workspace(tmp_path)
    lock = lock_from_eval(ws, verified_result(ws))
    path = write_lock(ws, lock)

    assert path == ws.root / LOCK_NAME
    assert read_lock(path) == lock
    data = json.loads(path.read_text())
    assert next(iter(data)) == "version" and data["version"] == 1
    assert data["problem_id"] == ws.problem_id
    assert data["environment"]["gpu"] == GPU and data["environment"]["torch"]
    assert data["verification"] == {"atol": 1e-3, "rtol": 1e-3, "seeds": [0, 7919, 15838]}
    assert data["timings"]["candidate"]["median_ms"] == 0.25
    assert data["timings"]["eager"]["median_ms"] == 0.5 and data["timings"]["compile"]["median_ms"] == 0.4
    assert data["timings"]["speedup_vs_compile"] == pytest.approx(1.6)
    assert data["timings"]["candidate"]["spread"] == pytest.approx(0.05)
    assert data["reward"] == 3
    assert sorted(data["files"]) == [
        "kernels/affine.cu",
        "kernels/affine.cuh",
        "kernels/affine_binding.cpp",
        "model_new.py",
    ]
    assert all(len(digest) == 64 for digest in data["files"].values())


def test_the_lock_records_the_shapes_verified_failed_and_not_applicable_and_reads_them_back(tmp_path):
    ws = make_workspace(tmp_path)
    not_applicable = VariantCheck("triple", NOT_APPLICABLE, message="the reference rejects them: ...")
    lock = lock_from_eval(ws, verified_result(ws, variants=[*HALF_VERIFIED_DOUBLE_FAILED, not_applicable]))

    assert read_lock(write_lock(ws, lock)) == lock
    shapes = json.loads((ws.root / LOCK_NAME).read_text())["shapes"]
    assert shapes == {
        "verified": [{"variant": "problem", "inputs": [[64, 64]], "message": ""},
                     {"variant": "half", "inputs": [[32, 64]], "message": ""}],
        "failed": [{"variant": "double", "inputs": [[128, 64]], "message": "RuntimeError: compiled for 64 rows"}],
        "not_applicable": [{"variant": "triple", "inputs": None, "message": "the reference rejects them: ..."}],
    }  # fmt: skip
    assert lock.shapes.verified_variants == ["half"]
    assert "shapes     verified at problem, half; failed at double; not applicable: triple" in commit_message("kp", lock)


def test_a_lock_written_before_shapes_were_recorded_still_reads(tmp_path, monkeypatch):
    ws = make_workspace(tmp_path)
    path = write_lock(ws, lock_from_eval(ws, verified_result(ws)))
    data = json.loads(path.read_text())
    del data["shapes"]
    path.write_text(json.dumps(data))
    # An older kernelpilot recorded no lock in its cache folder (workspace_record.py): such a lock is read as it is.
    monkeypatch.setenv("KERNELPILOT_CACHE_DIR", str(tmp_path / "an-older-kernelpilots-cache"))

    old = read_lock(path)

    assert old.shapes is None and old.problem_id == ws.problem_id and old.timings.candidate.median_ms == 0.25


def test_candidate_files_are_kernel_sources_and_model_new_never_protected_files_or_other_files(tmp_path):
    ws = make_workspace(tmp_path)
    (ws.kernels_dir / "todo.txt").write_text("later\n")
    (ws.kernels_dir / "affine.cu~").write_text("editor backup\n")
    assert candidate_files(ws) == [
        "kernels/affine.cu",
        "kernels/affine.cuh",
        "kernels/affine_binding.cpp",
        "model_new.py",
    ]


def test_changed_files_names_edited_added_and_removed_files(tmp_path):
    ws = make_workspace(tmp_path)
    lock = lock_from_eval(ws, verified_result(ws))
    (ws.kernels_dir / "affine.cu").write_text("// faster\n")
    (ws.kernels_dir / "affine.cuh").unlink()
    (ws.kernels_dir / "reduce.cu").write_text("// new\n")
    assert changed_files(ws, lock) == ["kernels/affine.cu", "kernels/affine.cuh", "kernels/reduce.cu"]


def test_an_unverified_result_gets_no_lock(tmp_path):
    ws = make_workspace(tmp_path)
    wrong = verified_result(ws)
    wrong.verify.ok, wrong.reward, wrong.error_kind, wrong.message = False, -1, "mismatch", "max abs error 0.5."
    with pytest.raises(
        LockFileError, match="Only a verified candidate can be accepted, and this one is not: max abs error"
    ):
        lock_from_eval(ws, wrong)
    other = verified_result(ws)
    other.problem_id = "0123456789abcdef"
    with pytest.raises(LockFileError, match="not this workspace's"):
        lock_from_eval(ws, other)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "There is no lock file"),
        ("{not json", "cannot be read"),
        ('{"version": 99}', "is not a version-1 kernelpilot lock file"),
        ('{"version": 1, "problem_id": "x"}', "is malformed"),
    ],
)
def test_unusable_lock_files_are_one_sentence_errors(tmp_path, text, message):
    path = tmp_path / LOCK_NAME
    if text is not None:
        path.write_text(text)
    with pytest.raises(LockFileError, match=message) as caught:
        read_lock(path)
    assert caught.value.hint


# --------------------------------------------------------------------------------------------- commits


def test_accept_commits_exactly_the_workspace_files_with_the_numbers_and_leaves_other_changes_alone(repo_and_workspace):
    repo, ws = repo_and_workspace
    root = Path(repo.working_tree_dir)
    (root / "README.md").write_text("# project, staged edit\n")
    repo.git.add("README.md")
    (root / "notes.txt").write_text("unstaged edit\n")
    (root / "scratch.py").write_text("untracked\n")
    (ws.root / "notes.md").write_text("the user's own notes in the workspace\n")
    (ws.kernels_dir / "todo.txt").write_text("not a kernel source\n")
    environment_before = dict(os.environ)

    info = accept(ws, verified_result(ws))

    names = {*PROTECTED_FILES, MANIFEST_PATH, GITIGNORE_PATH, LOCK_NAME, "model_new.py", "kernels/affine.cu",
             "kernels/affine.cuh", "kernels/affine_binding.cpp"}  # fmt: skip
    assert committed_files(repo) == {f"kp-affine/{name}" for name in names}
    assert set(info.files) == committed_files(repo) and info.sha == repo.head.commit.hexsha
    assert info.subject == f"kernelpilot: accept kp-affine: 0.25 ms, 2.00x vs eager, 1.60x vs compile on {GPU}"
    for figure in ("eager      0.5 ms", "compile    0.4 ms", "3 trials, atol 0.001", "reward     3", ws.problem_id):
        assert figure in info.message, figure
    commit = repo.head.commit
    assert (commit.author.name, commit.author.email) == ("Ada Lovelace (kernelpilot)", "ada@example.com")
    assert commit.committer.name == "Ada Lovelace (kernelpilot)"
    assert dict(os.environ) == environment_before

    assert [d.a_path for d in repo.index.diff("HEAD")] == ["README.md"], "the staged edit is still staged, uncommitted"
    assert [d.a_path for d in repo.index.diff(None)] == ["notes.txt"], "the unstaged edit is still unstaged"
    assert set(repo.untracked_files) == {"scratch.py", "kp-affine/notes.md", "kp-affine/kernels/todo.txt"}
    assert (root / "notes.txt").read_text() == "unstaged edit\n"


def test_a_second_accept_commits_only_what_changed_and_records_a_deleted_kernel(repo_and_workspace):
    repo, ws = repo_and_workspace
    accept(ws, verified_result(ws))
    (ws.kernels_dir / "affine.cu").write_text("// y = x * 2 + 1, vectorised\n")
    (ws.kernels_dir / "affine.cuh").unlink()

    info = accept(ws, verified_result(ws, candidate_ms=0.2), message="faster affine kernel")

    assert committed_files(repo) == {
        "kp-affine/kernels/affine.cu",
        "kp-affine/kernels/affine.cuh",
        f"kp-affine/{LOCK_NAME}",
    }
    assert "kp-affine/kernels/affine.cuh" not in {item.path for item in repo.head.commit.tree.traverse()}
    assert info.subject == "faster affine kernel"
    assert "candidate  0.2 ms" in info.message
    assert read_lock(ws.root / LOCK_NAME).timings.candidate.median_ms == 0.2


def test_accepting_the_same_result_twice_has_nothing_to_commit(repo_and_workspace):
    repo, ws = repo_and_workspace
    result = verified_result(ws)
    accept(ws, result)
    head = repo.head.commit.hexsha
    with pytest.raises(VcsError, match="Nothing to commit"):
        accept(ws, result)
    assert repo.head.commit.hexsha == head


def test_accept_makes_the_first_commit_of_a_new_repository(tmp_path):
    repo = make_repo(tmp_path / "fresh")
    ws = make_workspace(tmp_path / "fresh")
    info = accept(ws, verified_result(ws))
    assert repo.head.commit.hexsha == info.sha and not repo.head.commit.parents
    assert f"kp-affine/{LOCK_NAME}" in info.files


def test_accept_on_a_detached_head_refuses_and_commits_nothing(repo_and_workspace):
    repo, ws = repo_and_workspace
    repo.git.checkout("--detach")
    head = repo.head.commit.hexsha
    with pytest.raises(VcsError, match="HEAD is detached, so there is no branch to commit") as caught:
        accept(ws, verified_result(ws))
    assert "--no-commit" in caught.value.hint
    assert repo.head.commit.hexsha == head
    assert not (ws.root / LOCK_NAME).exists()


@pytest.mark.parametrize("operation", ["merge", "rebase"])
def test_accept_during_a_conflicted_merge_or_rebase_refuses(repo_and_workspace, operation):
    repo, ws = repo_and_workspace
    repo.git.switch("-c", "other")
    commit_all(repo, {"notes.txt": "theirs\n"}, "theirs")
    repo.git.switch("main")
    commit_all(repo, {"notes.txt": "ours\n"}, "ours")
    with pytest.raises(git.GitCommandError):
        getattr(repo.git, operation)("other")  # stops on the conflict in notes.txt
    head = repo.head.commit.hexsha

    with pytest.raises(VcsError, match=f"A {operation} is in progress") as caught:
        accept(ws, verified_result(ws))
    assert f"git {operation} --abort" in caught.value.hint
    assert repo.head.commit.hexsha == head


def test_accept_outside_a_repository_refuses(tmp_path):
    ws = make_workspace(tmp_path / "no-repo")
    with pytest.raises(VcsError, match="is not inside a git repository") as caught:
        accept(ws, verified_result(ws))
    assert "--no-commit" in caught.value.hint


def test_a_git_failure_is_one_sentence_with_gits_reason(repo_and_workspace):
    repo, ws = repo_and_workspace
    (Path(repo.working_tree_dir) / ".gitignore").write_text("*.cuh\n")
    with pytest.raises(VcsError, match=r"^git could not commit the accepted candidate: .*ignored") as caught:
        accept(ws, verified_result(ws))
    assert "\n" not in caught.value.message


def test_cli_accept_outside_a_repository_fails_before_evaluating(tmp_path):
    ws = make_workspace(tmp_path / "no-repo")
    outcome = CliRunner().invoke(app, ["accept", str(ws.root)])
    assert outcome.exit_code != 0
    assert "is not inside a git repository" in outcome.output and "--no-commit" in outcome.output
    assert "Traceback" not in outcome.output
    assert not (ws.root / "build").exists(), "nothing was built before the refusal"
