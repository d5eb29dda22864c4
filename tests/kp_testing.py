"""The repository's root and examples folder; the problem files and candidate sources several test files build
workspaces from, and the helper that writes a problem file: tiny KernelBench-format problems, and a C++ `scale_mul`
binding that torch's CUDA build compiles with g++ as a CPU stand-in for a CUDA kernel where no GPU is present."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = REPO_ROOT / "examples"

# y = 2x: the problem the agent loop, `optimize` and the TUI hand to a run.
DOUBLE_PROBLEM = """
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x * 2.0


def get_inputs():
    return [torch.randn(16, 32)]


def get_init_inputs():
    return []
"""

SCALE_PROBLEM = """
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, features: int = FEATURES):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return x * self.scale


def get_inputs():
    return [torch.randn(ROWS, FEATURES)]


def get_init_inputs():
    return [FEATURES]
"""

SCALE_SHIFT_PROBLEM = """
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x * 2.0 + 1.0


def get_inputs():
    return [torch.randn(ROWS, COLUMNS)]


def get_init_inputs():
    return []
"""

SCALE_MUL_CANDIDATE = """
import torch
from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def __init__(self, features: int = FEATURES):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(features))

    def forward(self, x):
        return kp_ops.scale_mul(x, self.scale)
"""

# The scale-shift problem answered by the CUDA example kernel every new workspace holds.
EXAMPLE_KERNEL_CANDIDATE = """
from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return kp_ops.scale_shift(x, 2.0, 1.0)
"""

# y = x * scale per column, REPEATS times over (a compiler barrier keeps every pass), plus OFFSET.
SCALE_MUL_BINDING = """
#include <torch/types.h>

#include "kp_registry.h"

namespace {

torch::Tensor scale_mul(const torch::Tensor& x, const torch::Tensor& scale) {
  TORCH_CHECK(x.is_contiguous() && scale.is_contiguous(), "scale_mul: contiguous tensors only");
  ROWS_CHECK
  torch::Tensor y = torch::empty_like(x);
  if (x.is_meta()) return y;
  const float* xs = x.data_ptr<float>();
  const float* ss = scale.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t features = scale.numel();
  for (int repeat = 0; repeat < REPEATS; ++repeat) {
    for (int64_t i = 0; i < x.numel(); ++i) ys[i] = xs[i] * ss[i % features] + OFFSET;
    asm volatile("" ::: "memory");
  }
  return y;
}

}  // namespace

KP_OP("scale_mul(Tensor x, Tensor scale) -> Tensor", scale_mul);
"""


def scale_problem(rows: int, features: int) -> str:
    """y = x * scale, a learned scale per column of a (rows, features) input."""
    return SCALE_PROBLEM.replace("ROWS", str(rows)).replace("FEATURES", str(features))


def scale_shift_problem(rows: int, columns: int) -> str:
    """y = 2x + 1 on a (rows, columns) input: what the workspace's example kernel computes."""
    return SCALE_SHIFT_PROBLEM.replace("ROWS", str(rows)).replace("COLUMNS", str(columns))


def scale_mul_candidate(features: int) -> str:
    """A ModelNew for `scale_problem(_, features)` that calls the `scale_mul` binding."""
    return SCALE_MUL_CANDIDATE.replace("FEATURES", str(features))


def scale_mul_binding(offset: float = 0.0, repeats: int = 1, rows: int | None = None) -> str:
    """The C++ `scale_mul` binding; a non-zero offset makes it wrong, more repeats make it slower, `rows` makes it
    refuse inputs of any other number of rows (as a kernel specialised to the problem's shapes)."""
    check = f'TORCH_CHECK(x.size(0) == {rows}, "scale_mul: compiled for {rows} rows");' if rows is not None else ""
    return SCALE_MUL_BINDING.replace("REPEATS", str(repeats)).replace("OFFSET", f"{offset!r}f").replace("ROWS_CHECK", check)


def nonempty(items, what: str = "items") -> list:
    """`items` as a list, asserted not empty: a loop of asserts over nothing would pass without checking anything."""
    items = list(items)
    assert items, f"no {what} to check"
    return items


def write_problem(folder: Path, source: str, name: str = "problem.py") -> Path:
    """Write a problem source (dedented) to folder/name, creating the folder; returns the file's path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return path


# A problem the built-in policy names as unsupported (a sort), for its refusal and the suite's reason.
UNSUPPORTED_PROBLEM = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.sort(x, dim=-1).values * 2.0


def get_inputs():
    return [torch.randn(64, 1024)]


def get_init_inputs():
    return []
"""


def run_cache_dir(tmp_path: Path) -> Path:
    """A judge cache folder (signed baselines) shared by every test of this run that times on the CPU, in every
    xdist worker: torch.compile's baseline there takes 20-40 s a problem, and several tests time the same small
    problems. The run's own temp folder, so nothing carries over from another run; tests of the cache itself keep
    folders of their own."""
    for folder in tmp_path.parents:  # pytest's /tmp/pytest-of-<user>/pytest-<run>, from any folder under it
        if folder.parent.name.startswith("pytest-of-"):
            return folder / "kernelpilot-cache"
    run_root = tmp_path.parents[1] if os.environ.get("PYTEST_XDIST_WORKER") else tmp_path.parent  # --basetemp
    return run_root / "kernelpilot-cache"
