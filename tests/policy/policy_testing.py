"""What the policy tests share: the examples by kind, small problems written from a forward (and a catalogue of
them: SMALL_PROBLEMS, the zoos of layouts, cancelling bf16 sums), the policy's analysis of a problem, a CPU
reference (the package's executable spec, policy/cpu_spec.py) that evaluates an analysis' groups with torch (so a
partition is checked for meaning, not only shape),
nvcc compiles of generated sources (`needs_nvcc`, `compile_cu`, `compile_each_cu`), compile-only workspace builds,
and the GPU
verification of every launch candidate (with the `judge` fixture of conftest.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kernelpilot.policy.analysis import analyze
from kernelpilot.policy.cpu_spec import evaluate
from kernelpilot.policy.families import launch_candidates, render_all, render_kernel
from kernelpilot.policy.ir import Analysis, Group
from kernelpilot.problem import load_problem
from kp_testing import REPO_ROOT, UNSUPPORTED_PROBLEM, nonempty


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


def written(path: Path, text: str) -> Path:
    """`text` written to `path`; the path."""
    path.write_text(text)
    return path


def linked_and_fused_flags(ws, library_path: str, library: str) -> tuple[str, str]:
    """Assert the workspace's link line and its built library name `library` (e.g. "cudnn"); the fused kernels'
    nvcc flags line (for the caller to check that the library's headers stay out of it) and `ldd`'s report."""
    ninja = (ws.build_dir / "build.ninja").read_text()
    assert re.search(rf"^link_flags = .*lib{library}\.so", ninja, re.MULTILINE)
    linked = subprocess.run(["ldd", library_path], capture_output=True, text=True, check=True).stdout
    assert f"lib{library}.so" in linked
    return next(line for line in ninja.splitlines() if line.startswith("cuda_flags = ")), linked


def compile_cu(source: str, folder: Path, *, host_object: bool = False) -> str:
    """Compile a torch-free .cu for sm_90 next to the workspace's kp_cuda.h, warning-free; return ptxas' report.

    Device code only (`-cubin`): nvcc's front end still parses and checks the whole file, host code included, but
    the host compiler does not run, which halves the time; workspace builds (`built_workspace`) compile the host
    side for real; `host_object` compiles both sides into kernel.o, for a test that links a host program. A source
    calling cuBLASLt or cuDNN gets its headers from where the project's build finds them."""
    from kernelpilot.build import LIBRARIES, find_library
    from kernelpilot.toolkit import resolve_cuda_home

    shutil.copy(REPO_ROOT / "templates" / "kernels" / "kp_cuda.h", folder / "kp_cuda.h")
    (folder / "kernel.cu").write_text(source)
    includes = []
    for library in LIBRARIES:
        if f"#include <{library.header}>" in source:
            includes += ["-isystem", str(find_library(library, resolve_cuda_home()).include_dir)]
    output = ["-c", "-o", "kernel.o"] if host_object else ["-cubin", "-o", "kernel.cubin"]
    done = subprocess.run(
        [_nvcc(), "-std=c++17", *output, "-arch=sm_90", "-Xptxas", "-v", *includes, "kernel.cu"],
        cwd=folder, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warning" not in done.stderr, done.stderr[-3000:]
    return done.stderr


# A source's namespace in a batch (ending in a letter, so ptxas' mangled names tell source 1 from source 12).
_BATCH_NAMESPACE = "kp_source_{}_x"
_BATCH_TAG = re.compile(r"kp_source_(\d+)_x")
_DIRECTIVE = re.compile(r"\s*#\s*(\w+)\s*(\w*)")
_NOT_CODE = re.compile(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'", re.DOTALL)


def compile_each_cu(sources: list[str], folder: Path) -> list[str]:
    """Compile every source as `compile_cu` does (device code, sm_90, warning-free); return ptxas' report of each,
    in order. Identical sources are compiled once.

    Most of a small kernel's compile is nvcc parsing the CUDA headers (0.7 s of 1 s), so sources that include the
    same headers and open with the same macros are compiled as one file: their opening lines once, then each
    source's code in a namespace of its own (closed around a header it includes further down, outside any braces, as
    the source does) and its macros undefined after it, so none sees another's names or macros. A source holding any
    other preprocessor line than `#pragma`, `#define` and such an `#include` is compiled alone. Where the one file
    fails or warns, each source is compiled alone, so a failure names its own source and a clash that only the batch
    makes fails nothing."""
    distinct = list(dict.fromkeys(sources))
    reports: dict[str, str] = {}
    batches: dict[tuple[str, ...], list[tuple[str, _Split]]] = {}
    for source in distinct:
        split = _split(source)
        if split is None:
            reports[source] = compile_cu(source, folder)
        else:
            batches.setdefault(split.key, []).append((source, split))
    for members in batches.values():
        batched = _compile_batch([split for _, split in members], folder) if len(members) > 1 else None
        for index, (source, _) in enumerate(members):
            reports[source] = compile_cu(source, folder) if batched is None else batched[index]
    return [reports[source] for source in sources]


@dataclass
class _Split:
    """A source as a batch takes it: its opening preprocessor lines, its code cut at the headers it includes
    further down (`segments` = `includes` + 1), and the macros its code defines."""

    opening: list[str]
    segments: list[list[str]]
    includes: list[str]
    defined: list[str]

    @property
    def key(self) -> tuple[str, ...]:
        """What the sources of one batch share: the opening lines, and the headers included further down."""
        return (*self.opening, "", *self.includes)


def _split(source: str) -> _Split | None:
    lines = source.splitlines()
    opening, start, continued = [], len(lines), False
    for index, line in enumerate(lines):
        stripped = line.strip()
        if continued or stripped.startswith("#"):
            opening.append(line)
            continued = line.endswith("\\")
        elif stripped and not stripped.startswith("//"):
            start = index
            break
    split = _Split(opening, [[]], [], [])
    continued = False
    for line in lines[start:]:
        directive = None if continued else _DIRECTIVE.match(line)
        continued = line.endswith("\\")
        if directive and directive[1] == "include":
            if _brace_depth("\n".join(line for segment in split.segments for line in segment)) != 0:
                return None
            split.includes.append(line.strip())
            split.segments.append([])
            continue
        if directive and directive[1] not in ("pragma", "define"):
            return None
        if directive and directive[1] == "define":
            split.defined.append(directive[2])
        split.segments[-1].append(line)
    return split


def _brace_depth(code: str) -> int:
    code = _NOT_CODE.sub("", code)
    return code.count("{") - code.count("}")


def _compile_batch(splits: list[_Split], folder: Path) -> list[str] | None:
    """One compile of the sources' code after the opening lines they share; each source's share of ptxas' report
    (the file-wide lines go to every share), or None where the compile failed or warned."""
    parts = list(splits[0].opening)
    for index, split in enumerate(splits):
        namespace = _BATCH_NAMESPACE.format(index)
        for segment, include in zip(split.segments, [*split.includes, None]):
            parts += [f"namespace {namespace} {{", *segment, f"}}  // namespace {namespace}"]
            parts += [include] if include else []
        parts += [f"#undef {name}" for name in split.defined]
    try:
        report = compile_cu("\n".join(parts) + "\n", folder)
    except AssertionError:
        return None
    shares: list[list[str]] = [[] for _ in splits]
    owner = None
    for line in report.splitlines():
        if "Compiling entry function" in line or "Function properties for" in line:
            tag = _BATCH_TAG.search(line)
            owner = int(tag[1]) if tag else None
        for share in shares if owner is None else [shares[owner]]:
            share.append(line)
    return ["\n".join(share) + "\n" for share in shares]


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
    candidates = [(group, config)
                  for group in nonempty(analysed(problem_path, faithful=faithful).generated_groups, "generated groups")
                  for config in nonempty(launch_candidates(group), "launch candidates")]  # fmt: skip
    reports = compile_each_cu([render_kernel(group, config).content for group, config in candidates], folder)
    for (group, config), report in zip(candidates, reports):
        spills = re.findall(r"(\d+) bytes spill", report)
        assert not without_spills or (spills and set(spills) == {"0"}), (group.name, config.label, report)


def policy_workspace(problem_path: Path, folder: Path, faithful: bool = False):
    """A workspace for the problem under `folder`, holding the policy's files (first launch configurations; the
    rounding-faithful form with `faithful`) and, as the policy leaves it, not the scaffold's example kernel."""
    from kernelpilot.workspace import EXAMPLE_KERNELS, init_workspace

    ws, _ = init_workspace(problem_path, folder / "ws")
    for name in EXAMPLE_KERNELS:
        (ws.root / name).unlink()
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


# ----------------------------------------------------------------- examples and problems of more than one module

# The examples the policy generates kernels for, by kind.
FUSED_EXAMPLES = [
    "softmax_long_rows", "layernorm", "rmsnorm", "silu_scale_shift", "logsumexp", "l2_normalize", "row_mean",
    "frozen_batchnorm_residual_relu", "softmax_then_mask", "geglu_bf16", "group_norm", "group_norm_silu",
    "cross_entropy", "cross_entropy_bf16_vocab128k", "token_logprobs_bf16", "logits_entropy_bf16", "sum_middle_dim",
    "channel_amax_bf16", "distill_kl_bf16", "cross_entropy_z_loss_bf16", "policy_logprobs_entropy_bf16",
    "cross_entropy_label_smoothing_bf16",
]  # fmt: skip
MATMUL_EXAMPLES = [
    "linear_bias_relu", "matmul_gelu", "small_mlp_block", "mlp_up_gelu_bf16", "out_proj_residual_bf16",
    "coordinate_mlp_relu_fp16", "lora_residual_bf16", "attention_bmm",
]  # fmt: skip
CONV_EXAMPLES = ["conv2d_relu_bias"]
SUPPORTED_EXAMPLES = FUSED_EXAMPLES + MATMUL_EXAMPLES + CONV_EXAMPLES
# The examples whose every kernel takes the batch at run time (policy/leading.py): they should verify at the judge's
# half and double variants too. The others have a kernel that keeps it fixed (a column reduction, a reduced batch,
# stacked per-row values), whose binding refuses another batch.
RUNTIME_BATCH_EXAMPLES = [
    "softmax_long_rows", "layernorm", "rmsnorm", "silu_scale_shift", "logsumexp", "l2_normalize", "row_mean",
    "frozen_batchnorm_residual_relu", "softmax_then_mask", "geglu_bf16", "group_norm", "group_norm_silu",
    "token_logprobs_bf16", "logits_entropy_bf16", "linear_bias_relu", "matmul_gelu", "small_mlp_block",
    "mlp_up_gelu_bf16", "out_proj_residual_bf16", "coordinate_mlp_relu_fp16", "lora_residual_bf16", "attention_bmm",
    "conv2d_relu_bias",
]  # fmt: skip
# ...and those whose every kernel takes the sequence (dim 1 of (batch, tokens, features)) at run time as well.
RUNTIME_SEQUENCE_EXAMPLES = ["layernorm", "rmsnorm", "softmax_then_mask", "mlp_up_gelu_bf16", "out_proj_residual_bf16",
                             "lora_residual_bf16"]  # fmt: skip


# Every example is supported now: a sort along the rows is an op the policy does not generate.
def unsupported_problem(folder: Path) -> Path:
    return written(folder / "model.py", UNSUPPORTED_PROBLEM)


SMALL_PROBLEMS = {
    "softmax": ("def forward(self, x):\n    return torch.softmax(x, dim=-1)", "torch.randn(4, 1000) * 5"),
    "log_softmax": ("def forward(self, x):\n    return F.log_softmax(x, dim=1)", "torch.randn(3, 37)"),
    "layernorm": (
        "def forward(self, x):\n    return self.norm(x)",
        "torch.randn(2, 3, 64) * 3 + 1",
        "self.norm = nn.LayerNorm(64)\nwith torch.no_grad():\n    self.norm.weight.uniform_(0.5, 1.5)\n    self.norm.bias.uniform_(-1, 1)",
    ),
    "rmsnorm": (
        "def forward(self, x):\n    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight",
        "torch.randn(2, 8, 32)",
        "self.weight = nn.Parameter(torch.rand(32) + 0.5)",
    ),
    "silu_scale_shift": ("def forward(self, x):\n    return x * torch.sigmoid(x) * 1.7 - 0.25", "torch.randn(5, 7)"),
    "logsumexp_plus_row_bias": (
        "def forward(self, x, b):\n    return torch.logsumexp(x, dim=-1) + b",
        "torch.randn(6, 50) * 40, torch.randn(6)",
    ),
    "l2_normalize": ("def forward(self, x):\n    return F.normalize(x, dim=-1)", "torch.randn(8, 33)"),
    "row_stats": (
        "def forward(self, x):\n    return x.mean(-1), x.amax(-1, keepdim=True), x.amin(-1), x.sum(-1), x.var(-1)",
        "torch.randn(3, 17)",
    ),
    "broadcast_channels": (
        "def forward(self, x, r):\n    return torch.relu(x * self.scale + self.shift + r)",
        "torch.randn(2, 4, 3, 5), torch.randn(2, 4, 3, 5)",
        "self.scale = nn.Parameter(torch.rand(4, 1, 1))\nself.shift = nn.Parameter(torch.randn(4, 1, 1))",
    ),
    "softmax_then_mask": (
        "def forward(self, s, m):\n    return torch.softmax(s, dim=-1) * m",
        "torch.randn(2, 2, 4, 8), (torch.rand(4, 8) > 0.3).float()",
    ),
    "two_pass_variance": (
        "def forward(self, x):\n    return ((x - x.mean(-1, keepdim=True)) ** 2).mean(-1)",
        "torch.randn(5, 40) + 100",
    ),
    "max_without_keepdim_then_unsqueeze": (
        "def forward(self, x):\n    return torch.exp(x - x.amax(-1)[..., None])",
        "torch.randn(4, 9)",
    ),
    "softmax_of_a_transpose": ("def forward(self, x):\n    return torch.softmax(x.t(), dim=-1)", "torch.randn(12, 5)"),
    "transposed_elementwise": ("def forward(self, x, y):\n    return x.t() * 2 + y", "torch.randn(6, 3), torch.randn(3, 6)"),
    "where_and_compare": (
        "def forward(self, x):\n    return torch.where(x > 0, x, 0.1 * x).clamp(-1, 1)",
        "torch.randn(7, 3)",
    ),
    "clone_then_scale": ("def forward(self, x):\n    return x.clone() * 2", "torch.randn(3, 3)"),
    "gelu_residual_layernorm": (
        "def forward(self, x, y):\n    return F.layer_norm(F.gelu(x) + y, (16,))",
        "torch.randn(4, 16), torch.randn(4, 16)",
    ),
    "group_norm": (
        "def forward(self, x):\n    return self.norm(x)",
        "torch.randn(2, 12, 5, 6) * 3 + 1",
        "self.norm = nn.GroupNorm(4, 12)\nwith torch.no_grad():\n    self.norm.weight.uniform_(0.5, 1.5)\n    self.norm.bias.uniform_(-1, 1)",
    ),
    "group_norm_without_affine": (
        "def forward(self, x):\n    return self.norm(x)",
        "torch.randn(3, 6, 4, 4) + 2",
        "self.norm = nn.GroupNorm(3, 6, affine=False)",
    ),
    "group_norm_one_channel_per_group": (
        "def forward(self, x):\n    return F.group_norm(x, 5, self.weight)",
        "torch.randn(2, 5, 3, 7)",
        "self.weight = nn.Parameter(torch.rand(5) + 0.5)",
    ),
    "group_norm_of_vectors": ("def forward(self, x):\n    return F.group_norm(x, 4)", "torch.randn(6, 16)"),
    "prologue_group_norm_silu_residual": (
        "def forward(self, x, r):\n    return F.silu(self.norm(x * 2 + 1)) + r",
        "torch.randn(2, 8, 3, 4), torch.randn(2, 8, 3, 4)",
        "self.norm = nn.GroupNorm(2, 8)\nwith torch.no_grad():\n    self.norm.bias.uniform_(-1, 1)",
    ),
    "group_norm_statistics": (
        (
            "def forward(self, x):\n    out, mean, rstd = torch.native_group_norm(x, None, None, 2, 8, 9, 4, 1e-5)\n"
            "    return out, mean, rstd * 2"
        ),
        "torch.randn(2, 8, 3, 3) * 4",
    ),
    "layernorm_then_group_norm": (
        "def forward(self, x):\n    return F.group_norm(F.layer_norm(x, (6,)), 2)",
        "torch.randn(2, 4, 5, 6)",
    ),
    "returns_its_input_and_a_view": (
        "def forward(self, x):\n    return x, x.sum(-1).view(2, 3)",
        "torch.randn(6, 4)",
    ),
}


def small_problem(folder: Path, name: str) -> Path:
    forward, inputs, *init = SMALL_PROBLEMS[name]
    return write_problem(folder, name, forward, inputs, init[0] if init else "")


# Every matmul layout and epilogue in one problem, so the build and GPU tests make one workspace for all of them.
MATMUL_ZOO = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(256, 512).to(torch.bfloat16)
        self.proj = nn.Linear(512, 256)
        self.down = nn.Linear(128, 192).half()

    def forward(self, x, h, r, a, b, c, q):
        return (
            F.gelu(self.up(x), approximate="tanh"),  # bf16: bias and tanh GELU through the 3-D views
            torch.relu(self.proj(h) + r),  # fp32: bias, residual and ReLU
            torch.bmm(a, b.transpose(1, 2)),  # batched, B transposed
            F.gelu(a[0] @ c[:, 8:]),  # B a slice (leading dimension 136, offset 8); exact GELU in its own kernel
            a[1].t() @ a[2],  # A transposed, at an offset
            self.down(q),  # fp16 bias
        )


def get_inputs():
    return [
        torch.randn(2, 64, 256, dtype=torch.bfloat16),
        torch.randn(128, 512),
        torch.randn(128, 256),
        torch.randn(4, 96, 64),
        torch.randn(4, 80, 64),
        torch.randn(64, 136),
        torch.randn(32, 128, dtype=torch.float16),
    ]


def get_init_inputs():
    return []
"""


def matmul_zoo_problem(folder: Path) -> Path:
    return written(folder / "matmul_zoo.py", MATMUL_ZOO)


# Every unusual layout in one problem, so the GPU test builds one workspace for all of them.
ZOO = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-1, 1)
        self.scale = nn.Parameter(torch.rand(4, 1, 1) + 0.5)
        self.shift = nn.Parameter(torch.randn(4, 1, 1))
        self.group_norm = nn.GroupNorm(3, 12)
        with torch.no_grad():
            self.group_norm.weight.uniform_(0.5, 1.5)
            self.group_norm.bias.uniform_(-1, 1)

    def forward(self, x, odd, wide, img, half, tiny, maps):
        return (
            torch.softmax(x * 5, dim=-1),  # rows cached in registers
            F.log_softmax(odd, dim=1),  # a row length with no vectors (37)
            torch.softmax(odd.t(), dim=-1),  # strided rows
            ((odd - odd.mean(-1, keepdim=True)) ** 2).mean(-1),  # two levels, one value per row
            torch.logsumexp(wide * 40, dim=-1),  # rows streamed twice
            torch.softmax(wide, dim=-1),  # rows cached in the shared memory of a 2-block cluster
            ((wide - wide.mean(-1, keepdim=True)) ** 2).mean(-1),  # the same, two levels, one value per row
            self.norm(x[:, :64]),  # rows of a slice
            x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
            F.normalize(odd, dim=-1),
            torch.relu(img * self.scale + self.shift),  # per-channel broadcast
            x.t() * 2 + 1,  # transposed elementwise
            torch.where(odd > 0, odd, 0.1 * odd).clamp(-1, 1),
            F.gelu(half, approximate="tanh") * half,  # bf16 elementwise
            torch.softmax(half, dim=-1),  # bf16 rows
            tiny * torch.sigmoid(tiny),  # a scalar tail after the vectors
            F.silu(self.group_norm(maps)) + maps,  # rows of 4 channels x 7x7: no vectors, a weight per channel
        )


def get_inputs():
    return [
        torch.randn(300, 1000),
        torch.randn(3, 37),
        torch.randn(6, 70000),
        torch.randn(2, 4, 3, 5),
        torch.randn(40, 512, dtype=torch.bfloat16),
        torch.randn(5, 7),
        torch.randn(2, 12, 7, 7),
    ]


def get_init_inputs():
    return []
"""


def zoo_problem(folder: Path) -> Path:
    return written(folder / "zoo.py", ZOO)


# The bf16 product 256 + 1 = 257 rounds to 256 (a tie, to even): eager then adds -256 (or halves it and adds -128)
# and gets 0, while one rounding of the whole sum gets 1 (or 0.5), beyond atol = rtol = 1e-2.
CANCELLING_PRODUCTS = {
    "residual": ("r + a @ b", "torch.full((8, 16), -256.0).bfloat16()"),
    "scaled_residual": ("r + (a @ b) * 0.5", "torch.full((8, 16), -128.0).bfloat16()"),
}
CANCELLING_OPERANDS = "torch.tensor([[256.0, 1.0] + [0.0] * 6] * 8).bfloat16(), torch.ones(8, 16).bfloat16(), "


def offset_from_terms(index: int, offset: int, terms: list[dict]) -> int:
    """The offset functions of the templates, in Python."""
    for term in terms:
        if term["last"]:
            return offset + index * term["stride"]
        offset += (index % term["size"]) * term["stride"]
        index //= term["size"]
    return offset


# Examples whose row kernels accumulate online softmax statistics over long or many rows, through every path:
# registers (softmax_then_mask), streamed passes, and shared memory in one block or a cluster.
ONLINE_SOFTMAX_EXAMPLES = ["distill_kl_bf16", "logits_entropy_bf16", "softmax_long_rows", "softmax_then_mask",
                           "cross_entropy_bf16_vocab128k"]  # fmt: skip


def weighted_softmax_sum_problem(folder: Path) -> Path:
    """Long rows where the second level reads a row (y) that the first does not: y is cached in shared memory by
    a pass of its own before level 0. (A max, not a sum: a softmax-weighted sum would fold into one pass.)"""
    return forward_problem(folder, "weighted_softmax_max", "x, y", "(torch.softmax(x, -1) * y).amax(-1)",
                           "torch.randn(8, 100000), torch.randn(8, 100000)")  # fmt: skip


# Rows too few to give every SM a block (row.py splits each over a cluster): a layer norm over three dims with its
# affine weight, a sum (one value per row), an argmax and a log-softmax (two levels, then the row again).
FEW_LONG_ROWS = {
    "layer_norm_3d": ("F.layer_norm(x, (8, 256, 256), self.w, self.b)", "torch.randn(16, 8, 256, 256)"),
    "sum_few_rows": ("x.sum(dim=-1)", "torch.randn(8, 1 << 20)"),
    "argmax_few_rows": ("torch.argmax(x, dim=-1)", "torch.randn(4, 1 << 20)"),
    "log_softmax_few_rows": ("torch.log_softmax(x, -1)", "torch.randn(4, 1 << 20)"),
}


# Rows interleaved in memory (reduced over a middle dim, the next row one element on): KernelBench L1 52's argmin
# over dim 1 of 128x4096x4095, smaller, and a softmax over the channels of a few images.
INTERLEAVED_ROWS = {
    "argmin_middle_dim": ("torch.argmin(x, dim=1)", "torch.rand(64, 256, 4096)"),
    "softmax_channels": ("torch.softmax(x, dim=1)", "torch.randn(4, 64, 256, 256)"),
}


def interleaved_rows_problem(folder: Path, name: str) -> Path:
    returned, inputs = INTERLEAVED_ROWS[name]
    return forward_problem(folder, name, "x", returned, inputs)


def few_long_rows_problem(folder: Path, name: str) -> Path:
    returned, inputs = FEW_LONG_ROWS[name]
    init = "self.w = nn.Parameter(torch.randn(8, 256, 256))\nself.b = nn.Parameter(torch.randn(8, 256, 256))"
    return write_problem(folder, name, f"def forward(self, x):\n    return {returned}", inputs,
                         init=init if "self.w" in returned else "")  # fmt: skip


# Running sums and products (scan.py): long rows in 16-byte vectors, a product, a mask fused into the loads, a dim
# before the last (strided loads, the result copied back in order), short rows shared by four threads, KernelBench's
# exclusive form (a cat of zeros and the scan of all but the last column: a second kernel), an epilogue after it,
# a reverse cumsum (flip, cumsum, flip: one scan from the row's end) and a cumsum of a flipped input.
SCAN_PROBLEMS = {
    "cumsum_rows": ("x", "torch.cumsum(x, dim=1)", "torch.rand(64, 5000)"),
    "cumprod_rows": ("x", "torch.cumprod(1 + x / 64, dim=-1)", "torch.rand(32, 1000)"),
    "masked_cumsum": ("x, mask", "torch.cumsum(x * mask, dim=1)", "torch.randn(16, 4096), torch.rand(16, 4096) > 0.5"),
    "cumsum_middle_dim": ("x", "torch.cumsum(x, dim=1)", "torch.randn(4, 300, 20)"),
    "cumsum_short_rows": ("x", "torch.cumsum(x, dim=-1)", "torch.randn(4096, 40)"),
    "exclusive_cumsum": ("x", "torch.cat((torch.zeros_like(x[:, :1]), torch.cumsum(x[:, :-1], dim=1)), dim=1)",
                         "torch.randn(8, 1001)"),
    "cumsum_then_scale": ("x", "torch.cumsum(x, -1) * 0.5 + 1", "torch.randn(8, 2048)"),
    "reverse_cumsum": ("x", "torch.cumsum(x.flip(1), 1).flip(1)", "torch.randn(16, 4096)"),
    "cumsum_of_flipped": ("x", "torch.cumsum(x.flip(-1), -1)", "torch.randn(8, 1000)"),
}  # fmt: skip


def scan_problem(folder: Path, name: str) -> Path:
    arguments, returned, inputs = SCAN_PROBLEMS[name]
    return forward_problem(folder, name, arguments, returned, inputs)
