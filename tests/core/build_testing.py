"""A small workspace to build (a torch-free .cu with headers and a binding), and file edits, for the build tests."""

from __future__ import annotations

import textwrap
from pathlib import Path

ARCH = "9.0"  # compile-only builds need no GPU


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path.name} no longer contains {old!r}"
    path.write_text(text.replace(old, new))


SCALE_H = """
    #pragma once
    #include <cstdint>
    #include <cuda_runtime.h>
    void launch_scale(const float* x, float* y, float a, int64_t n, cudaStream_t stream);
"""

TUNING_H = """
    #pragma once
    constexpr int kThreads = 256;
"""

SCALE_CU = """
    #include "scale.h"
    #include "tuning.h"

    __global__ void scale_kernel(const float* x, float* y, float a, int64_t n) {
      const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      if (i < n) y[i] = x[i] * a;
    }

    void launch_scale(const float* x, float* y, float a, int64_t n, cudaStream_t stream) {
      scale_kernel<<<(n + kThreads - 1) / kThreads, kThreads, 0, stream>>>(x, y, a, n);
    }
"""

SCALE_BINDING_CPP = """
    #include <torch/library.h>
    #include <torch/types.h>
    #include "scale.h"

    torch::Tensor scale(const torch::Tensor& x, double a) {
      TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32, "scale: x must be a float32 CUDA tensor");
      torch::Tensor y = torch::empty_like(x);
      launch_scale(x.data_ptr<float>(), y.data_ptr<float>(), static_cast<float>(a), x.numel(), nullptr);
      return y;
    }

    TORCH_LIBRARY(kp_build_test, m) { m.def("scale", &scale); }
"""


def scale_workspace(root: Path) -> Path:
    """A folder with kernels/ only: a torch-free .cu and its headers, and a binding that registers an op."""
    for name, text in [
        ("scale.h", SCALE_H), ("tuning.h", TUNING_H), ("scale.cu", SCALE_CU), ("scale_binding.cpp", SCALE_BINDING_CPP)
    ]:
        write(root / "kernels" / name, text)
    return root
