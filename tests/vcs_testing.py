"""What the accept and check tests share: a verified, timed result as the judge reports it, a git repository with
an author, and a workspace whose example kernel is replaced by the user's own kernel files."""

from __future__ import annotations

from pathlib import Path

import git

from kernelpilot.results import BenchResult, EvalResult, KernelTime, Timing, TrialResult, VariantCheck, VerifyResult
from kernelpilot.workspace import EXAMPLE_KERNELS, Workspace, init_workspace
from kp_testing import scale_shift_problem, write_problem

GPU = "NVIDIA H100 80GB HBM3"


def timing(median_ms: float) -> Timing:
    return Timing(median_ms=median_ms, p10_ms=median_ms * 0.98, p90_ms=median_ms * 1.03, mean_ms=median_ms, runs=100)


def verified_result(ws: Workspace, candidate_ms: float = 0.25, variants: list[VariantCheck] | None = None) -> EvalResult:
    """An EvalResult as the judge reports a correct, timed candidate of `ws` (verified at 64x64, and at `variants`)."""
    return EvalResult(
        problem_id=ws.problem_id,
        workspace=str(ws.root),
        verify=VerifyResult(
            ok=True, trials=[TrialResult(seed=seed, ok=True) for seed in (0, 7919, 15838)], atol=1e-3, rtol=1e-3,
            input_shapes=[[64, 64]], variants=list(variants or []),
        ),
        bench=BenchResult(
            ok=True,
            gpu=GPU,
            candidate=timing(candidate_ms),
            eager=timing(0.5),
            compiled=timing(0.4),
            speedup_vs_eager=0.5 / candidate_ms,
            speedup_vs_compile=0.4 / candidate_ms,
            kernels=[KernelTime(name="scale_shift_kernel", total_ms=candidate_ms, calls=1)],
        ),
        reward=3,
    )


# A candidate verified at half its batch, failing at double it, where the variants are asked for.
HALF_VERIFIED_DOUBLE_FAILED = [
    VariantCheck("half", "verified", inputs=[[32, 64]], message="2 trials passed"),
    VariantCheck("double", "failed", inputs=[[128, 64]], message="RuntimeError: compiled for 64 rows", error_kind="runtime"),
]


def make_repo(path: Path) -> git.Repo:
    repo = git.Repo.init(path, initial_branch="main")
    with repo.config_writer() as config:
        config.set_value("user", "name", "Ada Lovelace")
        config.set_value("user", "email", "ada@example.com")
    return repo


def make_workspace(folder: Path) -> Workspace:
    """A workspace whose example kernel is replaced by the user's own kernel files."""
    problem = write_problem(folder, scale_shift_problem(rows=64, columns=64))
    ws, _ = init_workspace(problem, folder / "kp-affine")
    problem.unlink()
    for example in EXAMPLE_KERNELS:
        (ws.root / example).unlink()
    (ws.kernels_dir / "affine.cu").write_text("// y = x * 2 + 1\n")
    (ws.kernels_dir / "affine.cuh").write_text("// launcher declaration\n")
    (ws.kernels_dir / "affine_binding.cpp").write_text("// binding\n")
    return ws
