"""What the policy tests share: small problems written from a forward, the policy's analysis of a problem, a CPU
reference that evaluates an analysis' groups with torch (so a partition is checked for meaning, not only shape),
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
import torch.nn.functional as F

from kernelpilot.policy.analysis import Analysis, Call, Const, Field, Gather, Group, Load, Matmul, Reduce, Stack, analyze
from kernelpilot.policy.codegen import launch_candidates, render_all, render_kernel
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


TORCH_OPS = {
    "neg": torch.neg, "exp": torch.exp, "exp_fast": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "abs": torch.abs, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": torch.relu,
    "silu": F.silu, "identity": lambda x: x, "square": lambda x: x * x, "reciprocal": torch.reciprocal,
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "add": torch.add, "sub": torch.sub,
    "mul": torch.mul, "div": torch.div, "maximum": torch.maximum, "minimum": torch.minimum,
    "where": lambda c, a, b: torch.where(c != 0, a, b), "logsumexp_finish": lambda m, s: m + torch.log(s),
    "clamp": lambda x, low, high: torch.minimum(torch.maximum(x, low), high),
    "gt": lambda a, b: (a > b).double(), "ne": lambda a, b: (a != b).double(), "xlogy": torch.xlogy,
    "eq": lambda a, b: (a == b).double(), "logical_not": lambda a: (a == 0).double(),
    "to_bfloat16": lambda x: x.to(torch.bfloat16).double(), "to_float16": lambda x: x.to(torch.float16).double(),
}  # fmt: skip


def evaluate(analysis: Analysis, tensors: dict[tuple[str, str], torch.Tensor]) -> list[torch.Tensor]:
    """Run the analysis' groups with torch (float64) on the CPU; return forward's outputs."""
    memory = dict(tensors)
    for group in analysis.groups:
        memory[("group", group.name)] = evaluate_group(group, memory)
    return [
        torch.as_strided(memory[("group", leaf.source.name)], leaf.shape, leaf.strides, leaf.offset)
        for leaf in analysis.outputs
    ]


def evaluate_group(group: Group, memory: dict) -> torch.Tensor:
    if group.kind == "matmul":
        return evaluate_matmul(group.matmul, memory)
    if group.kind == "conv":
        return evaluate_conv(group.conv, memory)
    values: dict = {}

    def value(node):
        if node in values:
            return values[node]
        if isinstance(node, Load):
            access = group.accesses[group.loads[node]]
            source = group.tensors[access.tensor]
            flat = memory[(source.kind, source.name)].double().flatten()
            result = torch.as_strided(flat, group.shape, access.strides, access.offset)
        elif isinstance(node, Const):
            result = torch.tensor(node.value, dtype=torch.float64)
        elif isinstance(node, Call):
            result = TORCH_OPS[node.op](*[value(arg) for arg in node.args])
        elif isinstance(node, Field):
            reduce = node.reduce
            weighted = None if reduce.weighted is None else value(reduce.weighted).expand(reduce.shape)
            result = statistic(reduce, node.name, value(reduce.value).expand(reduce.shape), weighted)
        elif isinstance(node, Gather):
            result = gathered(node, value(node.value).expand(node.shape), value(node.index).expand(node.shape))
        elif isinstance(node, Stack):  # several values per row, written one after another
            result = torch.stack([value(item).expand(group.shape) for item in node.values])
        values[node] = result
        return result

    stacked = (len(group.expr.values),) if isinstance(group.expr, Stack) else ()
    result = value(group.expr).expand(*stacked, *group.shape)
    if group.per_row:  # one value per row or column: the first along the reduced dims
        start = result.dim() - group.row_dims - group.inner_dims
        result = result[(slice(None),) * start + (slice(0, 1),) * group.row_dims]
    # A kernel writes its output contiguously; later groups and outputs view that memory.
    return result.reshape(group.output.shape).to(getattr(torch, group.output.dtype)).contiguous()


def gathered(gather: Gather, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each row of `rows` at its target column (index is constant along a row); 0 where the target is ignored."""
    target = index[..., :1]
    picked = rows.gather(-1, target.long().clamp(0, rows.shape[-1] - 1))
    return picked if gather.ignore is None else torch.where(target == gather.ignore, 0.0, picked)


def viewed(leaf, memory: dict) -> torch.Tensor:
    return torch.as_strided(memory[(leaf.source.kind, leaf.source.name)].double().flatten(), leaf.shape, leaf.strides, leaf.offset)


def evaluate_matmul(matmul: Matmul, memory: dict) -> torch.Tensor:
    """What cuBLASLt's call computes: act(alpha * (a @ b) + residual + bias), rounded once to the output dtype."""
    result = matmul.alpha * (viewed(matmul.a, memory) @ viewed(matmul.b, memory)).reshape(matmul.shape)
    for addend in (matmul.residual, matmul.bias):
        if addend is not None:
            result = result + viewed(addend, memory)
    if matmul.activation:
        result = TORCH_OPS[matmul.activation](result)
    return result.to(getattr(torch, matmul.dtype)).contiguous()


def evaluate_conv(conv, memory: dict) -> torch.Tensor:
    """What cuDNN's call computes: act(convolution(input, weight) + bias), rounded once to the output dtype."""
    bias = viewed(conv.bias, memory) if conv.bias is not None else None
    weight = viewed(conv.weight, memory)
    result = torch.convolution(viewed(conv.input, memory), weight, bias, list(conv.stride), list(conv.padding),
                               list(conv.dilation), False, [0] * len(conv.stride), conv.groups)  # fmt: skip
    if conv.activation:
        result = TORCH_OPS[conv.activation](result)
    return result.to(getattr(torch, conv.dtype)).contiguous()


def statistic(reduce: Reduce, name: str, values: torch.Tensor, weighted: torch.Tensor | None = None) -> torch.Tensor:
    """One number per row (or column), shaped to broadcast over the reduce's iteration shape (its reduced dims
    kept as 1s). `weighted`: what a softmax_weighted statistic weighs by exp(values - max)."""
    end = values.dim() - reduce.inner
    dims = tuple(range(end - reduce.dims, end))
    maximum = values.amax(dims, keepdim=True)
    mean = values.mean(dims, keepdim=True)
    return {
        ("softmax_weighted", "max"): lambda: maximum,
        ("softmax_weighted", "sum"): lambda: (values - maximum).exp().sum(dims, keepdim=True),
        ("softmax_weighted", "weighted"): lambda: ((values - maximum).exp() * weighted).sum(dims, keepdim=True),
        ("sum", "sum"): lambda: values.sum(dims, keepdim=True),
        ("max", "max"): lambda: maximum,
        ("min", "min"): lambda: values.amin(dims, keepdim=True),
        ("online_softmax", "max"): lambda: maximum,
        ("online_softmax", "sum"): lambda: (values - maximum).exp().sum(dims, keepdim=True),
        ("welford", "mean"): lambda: mean,
        ("welford", "m2"): lambda: ((values - mean) ** 2).sum(dims, keepdim=True),
    }[(reduce.kind, name)]()


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

    A source calling cuBLASLt or cuDNN gets its headers from where the project's build finds them."""
    from kernelpilot.build import LIBRARIES, find_library, resolve_cuda_home

    shutil.copy(REPO_ROOT / "templates" / "kernels" / "kp_cuda.h", folder / "kp_cuda.h")
    (folder / "kernel.cu").write_text(source)
    includes = []
    for library in LIBRARIES:
        if f"#include <{library.header}>" in source:
            includes += ["-isystem", str(find_library(library, resolve_cuda_home()).include_dir)]
    done = subprocess.run(
        [_nvcc(), "-std=c++17", "-c", "-arch=sm_90", "-Xptxas", "-v", *includes, "kernel.cu", "-o", "kernel.o"],
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

