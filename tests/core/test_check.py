"""`kernelpilot check` and its pre-commit hook: finding lock files, the verdicts, skipping without a GPU, the
pre-commit framework running the hook on a temp repository, a whole accept -> check -> regression round on the
CPU harness, and on a GPU the same round with the workspace's CUDA example kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import git
import pytest
from rich.console import Console
from typer.testing import CliRunner

from kernelpilot.check import CheckReport, compare, find_lock_files, run_check
from kernelpilot.cli import app
from kernelpilot.cli.render_git import render_check
from kernelpilot.lockfile import LOCK_NAME, lock_from_eval, read_lock, write_lock
from kernelpilot.results import VariantCheck
from kernelpilot.workspace import EXAMPLE_KERNELS, init_workspace
from kp_testing import (
    EXAMPLE_KERNEL_CANDIDATE,
    run_cache_dir,
    scale_mul_binding,
    scale_mul_candidate,
    scale_problem,
    scale_shift_problem,
    write_problem,
)

# The workspaces, results and git set-up of the accept tests (tests/core/vcs_testing.py, conftest.py).
from vcs_testing import GPU, HALF_VERIFIED_DOUBLE_FAILED, make_repo, make_workspace, verified_result

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("isolated_git")


def gpu_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def accepted_workspace(folder: Path):
    """A workspace with a lock file recorded on an H100 (as `accept` writes it)."""
    ws = make_workspace(folder)
    write_lock(ws, lock_from_eval(ws, verified_result(ws)))
    return ws


# ----------------------------------------------------------------------------------- finding lock files


def test_lock_files_are_found_from_changed_files_folders_or_the_current_folder(tmp_path, monkeypatch):
    first = accepted_workspace(tmp_path / "a")
    second = accepted_workspace(tmp_path / "b")
    never_accepted = make_workspace(tmp_path / "c")
    hidden = accepted_workspace(tmp_path / ".venv" / "lib")
    first_lock, second_lock = first.root / LOCK_NAME, second.root / LOCK_NAME

    assert find_lock_files([first.kernels_dir / "affine.cu", first.model_new_path]) == [first_lock]
    assert find_lock_files([second_lock, never_accepted.kernels_dir / "affine.cu"]) == [second_lock]
    assert find_lock_files([tmp_path]) == [first_lock, second_lock]
    assert find_lock_files([hidden.kernels_dir / "affine.cu"]) == [hidden.root / LOCK_NAME], "named files always count"
    monkeypatch.chdir(tmp_path)
    assert find_lock_files([]) == [first_lock, second_lock]


# ------------------------------------------------------------------------------------------- verdicts


@pytest.mark.parametrize(
    ("gpu", "candidate_ms", "passed", "timing", "reason"),
    [
        (GPU, 0.2575, True, "same GPU", ""),  # 3% slower: within 5%
        (GPU, 0.2, True, "same GPU", ""),  # faster
        (GPU, 0.275, False, "same GPU", "10.0% slower than recorded (tolerance 5%)."),
        ("NVIDIA A100-SXM4-80GB", 0.75, True, "other GPU", ""),
    ],
)
def test_compare_fails_a_slowdown_beyond_the_tolerance_only_on_the_same_gpu(
    tmp_path, gpu, candidate_ms, passed, timing, reason
):
    ws = make_workspace(tmp_path)
    lock = lock_from_eval(ws, verified_result(ws, candidate_ms=0.25))
    now = verified_result(ws, candidate_ms=candidate_ms)
    now.bench.gpu = gpu

    outcome = compare(lock, now, tolerance=0.05)

    assert (outcome.passed, outcome.correct, outcome.timing, outcome.reason) == (passed, True, timing, reason)
    assert outcome.recorded_ms == 0.25 and outcome.current_ms == candidate_ms
    other_gpu_note = f"recorded on {GPU}, this is {gpu}: only correctness was checked."
    assert outcome.gpu_note == ("" if gpu == GPU else other_gpu_note)


def test_compare_fails_a_wrong_answer_and_a_candidate_that_can_no_longer_be_timed(tmp_path):
    ws = make_workspace(tmp_path)
    lock = lock_from_eval(ws, verified_result(ws))
    wrong = verified_result(ws)
    wrong.verify.ok, wrong.reward, wrong.error_kind, wrong.message = (
        False,
        -1,
        "mismatch",
        "max abs error 0.5 at [3, 1].",
    )
    untimed = verified_result(ws)
    untimed.bench.ok, untimed.reward, untimed.message = False, 1, "correct, but not timed: timing timed out."

    wrong_outcome, untimed_outcome = compare(lock, wrong, 0.05), compare(lock, untimed, 0.05)

    assert (wrong_outcome.passed, wrong_outcome.correct) == (False, False)
    assert wrong_outcome.reason == "mismatch: max abs error 0.5 at [3, 1]."
    assert (untimed_outcome.passed, untimed_outcome.correct) == (False, True)
    assert "could not be timed here" in untimed_outcome.reason


def test_compare_fails_when_a_shape_variant_verified_at_accept_no_longer_verifies(tmp_path):
    ws = make_workspace(tmp_path)
    lock = lock_from_eval(ws, verified_result(ws, variants=HALF_VERIFIED_DOUBLE_FAILED))
    still = verified_result(ws, variants=[VariantCheck("half", "verified", inputs=[[32, 64]])])
    lost = verified_result(ws, variants=[VariantCheck("half", "failed", inputs=[[32, 64]], message="mismatch: trial 1")])
    unasked = verified_result(ws)

    assert compare(lock, still, 0.05).passed, "double failed at accept too: it is not asked for again"
    for now, what in ((lost, "failed: mismatch: trial 1"), (unasked, "not verified")):
        outcome = compare(lock, now, 0.05)
        assert (outcome.passed, outcome.correct) == (False, False)
        assert outcome.reason == f"verified at accept at the half shapes, and now {what}"
    lock.shapes = None  # a lock written before shapes were recorded asks for no variant
    assert compare(lock, unasked, 0.05).passed


def test_the_report_is_a_table_with_verdicts_reasons_and_files_changed_since_accept(tmp_path):
    ws = make_workspace(tmp_path)
    lock = lock_from_eval(ws, verified_result(ws, candidate_ms=0.25))
    slow = compare(lock, verified_result(ws, candidate_ms=0.5), 0.05)
    slow.workspace, slow.changed = "kp-affine", ["kernels/affine.cu"]
    fine = compare(lock, verified_result(ws, candidate_ms=0.25), 0.05)
    fine.workspace = "kp-other"
    console = Console(record=True, width=200)

    render_check(console, CheckReport(outcomes=[slow, fine], device=GPU))

    text = console.export_text()
    for expected in (f"kernelpilot check on {GPU}", "FAIL", "pass", "+100.0%", "0.25", "same GPU",
                     "kp-affine: 100.0% slower than recorded (tolerance 5%).",
                     "changed since the lock was written: kernels/affine.cu", "2 checked, 1 failed"):  # fmt: skip
        assert expected in text, expected


# -------------------------------------------------------------------------------------------- no GPU


def test_check_with_no_lock_files_has_nothing_to_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    outcome = CliRunner().invoke(app, ["check"])
    assert outcome.exit_code == 0
    assert "no kernelpilot.lock.json found" in outcome.output


@pytest.mark.skipif("gpu_visible()", reason="a GPU is visible here")
def test_check_without_a_gpu_says_so_and_passes_unless_a_gpu_is_required(tmp_path):
    ws = accepted_workspace(tmp_path)
    kernel = str(ws.kernels_dir / "affine.cu")

    skipped = run_check([Path(kernel)])
    assert skipped.skipped.startswith("no CUDA GPU is visible, so 1 accepted kernel went unchecked")
    assert not skipped.failed

    required = subprocess.run(
        [sys.executable, "-m", "kernelpilot", "check", "--require-gpu", kernel],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert required.returncode != 0
    lines = required.stderr.strip().splitlines()
    assert lines[0] == "error: No CUDA GPU is visible, and --require-gpu needs one to check 1 accepted kernel."
    assert len(lines) == 2 and lines[1].startswith("hint:")
    assert "Traceback" not in required.stdout + required.stderr


# ---------------------------------------------------------------------------------- the pre-commit hook


def hook_environment(tmp_path: Path) -> dict[str, str]:
    """pre-commit with its own cache folder, and this environment's `kernelpilot` first on PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PRE_COMMIT_HOME"] = str(tmp_path / "pre-commit-home")
    return env


@pytest.fixture
def user_repo(tmp_path) -> tuple[git.Repo, Path]:
    """A user's repository with an accepted workspace, its files staged, and `kernelpilot` able to run from PATH."""
    pytest.importorskip("pre_commit")
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("kernelpilot's own checkout is not a git repository, so pre-commit cannot fetch the hook from it")
    repo = make_repo(tmp_path / "user")
    ws = accepted_workspace(tmp_path / "user")
    (Path(repo.working_tree_dir) / "README.md").write_text("# user project\n")
    repo.git.add("--all")
    return repo, ws.kernels_dir / "affine.cu"


@pytest.mark.skipif("gpu_visible()", reason="a GPU is visible here, so the hook would really time the kernel")
def test_pre_commit_runs_the_hook_from_this_repository_and_it_skips_without_a_gpu(user_repo, tmp_path):
    repo, kernel = user_repo
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pre_commit",
            "try-repo",
            str(REPO_ROOT),
            "kernelpilot-check",
            "--verbose",
            "--files",
            str(kernel.relative_to(repo.working_tree_dir)),
            "README.md",
        ],  # fmt: skip
        cwd=repo.working_tree_dir,
        env=hook_environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "kernelpilot check" in run.stdout and "Passed" in run.stdout
    assert "no CUDA GPU is visible, so 1 accepted kernel went unchecked" in " ".join(run.stdout.split())


@pytest.mark.skipif("gpu_visible()", reason="a GPU is visible here")
def test_the_installed_hook_with_require_gpu_blocks_the_commit_without_a_gpu(user_repo, tmp_path):
    repo, _ = user_repo
    head_of_this_repo = git.Repo(REPO_ROOT).head.commit.hexsha
    config = f"""
    repos:
      - repo: {REPO_ROOT}
        rev: {head_of_this_repo}
        hooks:
          - id: kernelpilot-check
            args: [--require-gpu]
    """
    (Path(repo.working_tree_dir) / ".pre-commit-config.yaml").write_text(textwrap.dedent(config))
    repo.git.add(".pre-commit-config.yaml")
    env = hook_environment(tmp_path)
    subprocess.run([sys.executable, "-m", "pre_commit", "install"], cwd=repo.working_tree_dir, env=env, check=True,
                   capture_output=True)  # fmt: skip

    committed = subprocess.run(["git", "commit", "-m", "add the accepted kernel"], cwd=repo.working_tree_dir, env=env,
                               capture_output=True, text=True, timeout=300)  # fmt: skip

    output = committed.stdout + committed.stderr  # git hands a hook's output to stderr
    assert committed.returncode != 0, output
    assert "kernelpilot check" in output and "Failed" in output
    assert "--require-gpu needs one" in " ".join(output.split())
    assert not repo.head.is_valid(), "the commit was blocked"


# -------------------------------------------------------------------------- whole rounds in a worker


@pytest.fixture
def harness_environment(tmp_path, monkeypatch):
    """The judge's baselines cached in a temp folder; an arch to build for where no GPU says which."""
    monkeypatch.setenv("KERNELPILOT_CACHE_DIR", str(run_cache_dir(tmp_path)))
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")


def cli(*args: str):
    outcome = CliRunner().invoke(app, list(args))
    assert "Traceback" not in outcome.output, outcome.output
    return outcome


@pytest.mark.cuda_build
def test_cpu_accept_then_check_passes_and_catches_a_slowdown_and_a_wrong_answer(tmp_path, harness_environment):
    repo = make_repo(tmp_path / "project")
    problem = write_problem(tmp_path, scale_problem(rows=256, features=1024))
    ws, _ = init_workspace(problem, tmp_path / "project" / "kp-scale")
    for example in EXAMPLE_KERNELS:
        (ws.root / example).unlink()
    binding = ws.kernels_dir / "scale_mul_binding.cpp"
    binding.write_text(scale_mul_binding())
    ws.model_new_path.write_text(scale_mul_candidate(features=1024))
    root = str(ws.root)

    accepted = cli("accept", root, "--device", "cpu", "--trials", "2")
    assert accepted.exit_code == 0, accepted.output
    lock = read_lock(ws.root / LOCK_NAME)
    assert lock.environment.gpu == "cpu" and lock.timings.candidate.median_ms > 0
    assert lock.verification.seeds and len(lock.verification.seeds) == 2
    assert f"kp-scale/{LOCK_NAME}" in repo.head.commit.stats.files
    assert "committed" in accepted.output and "kernelpilot: accept kp-scale:" in accepted.output
    assert [(s.variant, s.inputs) for s in lock.shapes.verified] == [
        ("problem", [[256, 1024]]), ("half", [[128, 1024]]), ("double", [[512, 1024]])]  # fmt: skip
    assert lock.shapes.failed == []
    assert [s.variant for s in lock.shapes.not_applicable] == ["half-sequence", "double-sequence"]  # a 2-d input
    assert "shapes half" in accepted.output and "verified at (512, 1024)" in accepted.output

    # CPU timings of a shared machine wander more than a GPU's: accept and check may each run while other processes
    # hold the cores, so the same kernel can time twice as slow (a 2-core CI machine under xdist). A 5x band
    # (tolerance 400%) passes that and still fails the 64 passes below, which time some 50x slower.
    unchanged = cli("check", root, "--device", "cpu", "--tolerance", "4.0")
    assert unchanged.exit_code == 0, unchanged.output
    assert "kernelpilot check on cpu" in unchanged.output and "same GPU" in unchanged.output
    assert "1 checked, all passed" in unchanged.output

    binding.write_text(scale_mul_binding(repeats=64))
    slower = cli("check", root, "--device", "cpu", "--tolerance", "4.0")
    assert slower.exit_code == 1, slower.output
    assert "slower than recorded (tolerance 400%)" in slower.output
    assert "changed since the lock was written: kernels/scale_mul_binding.cpp" in slower.output

    binding.write_text(scale_mul_binding(offset=1.0))
    wrong = cli("check", root, "--device", "cpu")
    assert wrong.exit_code == 1, wrong.output
    assert "mismatch" in wrong.output

    # Specialised to the problem's 256 rows: still correct there, but no longer at the batch sizes verified at accept.
    binding.write_text(scale_mul_binding(rows=256))
    specialised = cli("check", root, "--device", "cpu", "--tolerance", "100")
    assert specialised.exit_code == 1, specialised.output
    assert "verified at accept at the half shapes, and now failed" in " ".join(specialised.output.split())
    # accept takes it all the same, and records the variants it fails.
    reaccepted = cli("accept", root, "--device", "cpu", "--trials", "2", "--no-commit")
    assert reaccepted.exit_code == 0, reaccepted.output
    shapes = read_lock(ws.root / LOCK_NAME).shapes
    assert [s.variant for s in shapes.verified] == ["problem"]
    assert [(s.variant, s.inputs) for s in shapes.failed] == [("half", [[128, 1024]]), ("double", [[512, 1024]])]
    assert all("compiled for 256 rows" in s.message for s in shapes.failed), shapes.failed
    assert "(recorded, not a verdict)" in reaccepted.output


@pytest.mark.gpu
def test_gpu_check_passes_on_the_accepted_example_kernel_and_fails_when_a_4x_slower_one_is_swapped_in(
    tmp_path, harness_environment
):
    repo = make_repo(tmp_path / "project")
    problem = write_problem(tmp_path, scale_shift_problem(rows=8192, columns=8192))
    ws, _ = init_workspace(problem, tmp_path / "project" / "kp-affine")
    ws.model_new_path.write_text(EXAMPLE_KERNEL_CANDIDATE)
    root = str(ws.root)

    accepted = cli("accept", root)
    assert accepted.exit_code == 0, accepted.output
    lock = read_lock(ws.root / LOCK_NAME)
    assert lock.environment.gpu and lock.environment.gpu != "cpu" and lock.environment.cuda
    assert lock.timings.speedup_vs_eager is not None
    assert f"kp-affine/{LOCK_NAME}" in repo.head.commit.stats.files

    unchanged = cli("check", root)
    assert unchanged.exit_code == 0, unchanged.output
    assert "all passed" in unchanged.output

    kernel = ws.kernels_dir / "example_scale_shift.cu"
    launch = (
        "scale_shift_kernel<<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>"
        "(x, y, n, vector_count, a, b);"
    )
    assert launch in kernel.read_text()
    # The same answer, computed four times over: four launches nothing can merge.
    kernel.write_text(kernel.read_text().replace(launch, f"for (int pass = 0; pass < 4; ++pass) {launch}"))
    slower = cli("check", root)
    assert slower.exit_code == 1, slower.output
    assert "slower than recorded" in slower.output
