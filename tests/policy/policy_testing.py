"""What the policy tests share: small problems written from a forward, the policy's analysis of a problem, a CPU
reference (the package's executable spec, policy/cpu_spec.py) that evaluates an analysis' groups with torch (so a
partition is checked for meaning, not only shape),
nvcc compiles of generated sources (`needs_nvcc`, `compile_cu`), compile-only workspace builds, and the GPU
verification of every launch candidate (with the `judge` fixture of conftest.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from kernelpilot.policy.analysis import analyze
from kernelpilot.policy.cpu_spec import evaluate
from kernelpilot.policy.families import launch_candidates, render_all, render_kernel
from kernelpilot.policy.ir import Analysis, Group
from kernelpilot.problem import load_problem
from kp_testing import REPO_ROOT, nonempty


def write_problem(folder: Path, name: str, forward: str, inputs: str, init: str = "") -> Path:
    """A small KernelBench-format problem from the source of its forward method, inputs and __init__ lines."""
    source = f'''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
{textwrap.indent(textwrap.dedent(init), " " * 8) if init else ""}
{textwrap.indent(textwrap.dedent(forward), " " * 4)}


def get_inputs():
    return [{inputs}]


def get_init_inputs():
    return []
'''
    path = folder / f"{name}.py"
    path.write_text(source)
    return path


def analysed(path: Path, faithful: bool = False) -> Analysis:
    return analyze(load_problem(path), faithful=faithful)


def check_against_model(path: Path, atol: float = 1e-5, equal_nan: bool = False, faithful: bool = False) -> Analysis:
    """The analysis of `path` (`faithful`: analyze's) evaluated on CPU inputs equals Model's output (NaN where it is
    NaN: `equal_nan`)."""
    problem = load_problem(path)
    analysis = analyze(problem, faithful=faithful)
    assert analysis.supported, analysis.blockers()
    model = problem.make_model()
    inputs = problem.make_inputs(seed=0)
    names = [p for p in problem.forward_signature().parameters]
    tensors = {("input", name): value for name, value in zip(names, inputs)}
    tensors.update({("parameter", name): t.detach() for name, t in model.state_dict().items()})
    expected = model(*inputs)
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    actual = evaluate(analysis, tensors)
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=atol, equal_nan=equal_nan)
    return analysis


def only_group(analysis: Analysis) -> Group:
    assert analysis.supported, analysis.blockers()
    (group,) = analysis.groups
    return group


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME")
    candidate = Path(home) / "bin" / "nvcc" if home else None
    return str(candidate) if candidate and candidate.exists() else shutil.which("nvcc")


def needs_nvcc(test):
    """A test that compiles with nvcc itself: marked `cuda_build` (so `-m "not cuda_build"` leaves it out), and
    skipped with a reason where no nvcc is found."""
    no_nvcc = pytest.mark.skipif(_nvcc() is None, reason="nvcc is not on PATH and CUDA_HOME is not set")
    return pytest.mark.cuda_build(no_nvcc(test))


def compile_cu(source: str, folder: Path) -> str:
    """Compile a torch-free .cu for sm_90 next to the workspace's kp_cuda.h, warning-free; return ptxas' report.

    Device code only (`-cubin`): nvcc's front end still parses and checks the whole file, host code included, but
    the host compiler does not run, which halves the time; workspace builds (`built_workspace`) compile the host
    side for real. A source calling cuBLASLt or cuDNN gets its headers from where the project's build finds them."""
    from kernelpilot.build import LIBRARIES, find_library, resolve_cuda_home

    shutil.copy(REPO_ROOT / "templates" / "kernels" / "kp_cuda.h", folder / "kp_cuda.h")
    (folder / "kernel.cu").write_text(source)
    includes = []
    for library in LIBRARIES:
        if f"#include <{library.header}>" in source:
            includes += ["-isystem", str(find_library(library, resolve_cuda_home()).include_dir)]
    done = subprocess.run(
        [_nvcc(), "-std=c++17", "-cubin", "-arch=sm_90", "-Xptxas", "-v", *includes, "kernel.cu", "-o", "kernel.cubin"],
        cwd=folder, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warning" not in done.stderr, done.stderr[-3000:]
    return done.stderr


def built_workspace(problem_path: Path, folder: Path):
    """The policy's workspace for a problem, built compile-only for sm_90; the build must succeed."""
    from kernelpilot.build import build_workspace

    ws = policy_workspace(problem_path, folder)
    result = build_workspace(ws.root, arch="9.0")
    assert result.ok, result.log[-3000:]
    return ws, result


def forward_problem(folder: Path, name: str, arguments: str, returned: str, inputs: str) -> Path:
    """A problem whose forward takes `arguments` and returns the expression `returned`."""
    return write_problem(folder, name, f"def forward(self, {arguments}):\n    return {returned}", inputs)


def assert_every_launch_candidate_compiles(
    problem_path: Path, folder: Path, without_spills: bool = False, faithful: bool = False
) -> None:
    """nvcc-compile every launch candidate of every generated group of a problem (compile-only, sm_90; `faithful`:
    of analyze's faithful form); with `without_spills`, ptxas must report no spill for any kernel (both vector
    widths)."""
    for group in nonempty(analysed(problem_path, faithful=faithful).generated_groups, "generated groups"):
        for config in nonempty(launch_candidates(group), "launch candidates"):
            report = compile_cu(render_kernel(group, config).content, folder)
            spills = re.findall(r"(\d+) bytes spill", report)
            assert not without_spills or (spills and set(spills) == {"0"}), (group.name, config.label, report)


def policy_workspace(problem_path: Path, folder: Path, faithful: bool = False):
    """A workspace for the problem under `folder`, holding the policy's files (first launch configurations; the
    rounding-faithful form with `faithful`)."""
    from kernelpilot.workspace import init_workspace

    ws, _ = init_workspace(problem_path, folder / "ws")
    write_policy_files(ws, faithful)
    return ws


def write_policy_files(ws, faithful: bool = False) -> None:
    problem = ws.problem()
    for file in render_all(problem, analyze(problem, faithful=faithful)):
        (ws.root / file.path).write_text(file.content)


def assert_generated_kernels_verify(judge, problem_path: Path, folder: Path) -> str:
    """Build the policy's files for the problem and verify them on the GPU. As the policy does, a mismatch of that
    first answer falls back to the rounding-faithful kernels when they differ. Returns the form that verified:
    "fused" (the first answer) or "faithful"."""
    ws = policy_workspace(problem_path, folder)
    form, verify = "fused", _verified(judge, ws.root)
    problem = ws.problem()
    if verify.error_kind == "mismatch" and analyze(problem, faithful=True) != analyze(problem):
        write_policy_files(ws, faithful=True)  # it only splits groups off: every earlier kernel is overwritten
        form, verify = "faithful", _verified(judge, ws.root)
    assert verify.ok, (form, verify.error_kind, verify.message, [t.message for t in verify.trials])
    return form


def _verified(judge, root: Path, trials: int = 3):
    build = judge.build(root)
    assert build.ok, build.log[-3000:]
    return judge.verify(root, build, trials=trials)


def assert_every_launch_candidate_verifies(judge, problem_path: Path, folder: Path, faithful: bool = False,
                                           later_may_mismatch: bool = False) -> None:  # fmt: skip
    """Build and verify the policy's files once per launch candidate: the index-th of every group (or its last);
    `faithful`: of analyze's rounding-faithful form; `later_may_mismatch`: candidates after the first may fail
    verification with a mismatch (not with a crash or a guard finding)."""
    ws = policy_workspace(problem_path, folder, faithful)
    groups = nonempty(analyze(ws.problem(), faithful=faithful).generated_groups, "generated groups")
    for index in range(max(len(launch_candidates(g)) for g in groups)):
        for group in groups:  # the index-th candidate, or the last one a group has
            candidates = launch_candidates(group)
            kernel = render_kernel(group, candidates[min(index, len(candidates) - 1)])
            (ws.root / kernel.path).write_text(kernel.content)
        build = judge.build(ws.root)
        assert build.ok, build.log[-3000:]
        verify = judge.verify(ws.root, build, trials=2)
        allowed = verify.ok or (later_may_mismatch and index > 0 and verify.error_kind == "mismatch")
        assert allowed, (index, verify.error_kind, verify.message, [t.message for t in verify.trials])

