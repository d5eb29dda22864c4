#!/usr/bin/env python3
"""What a CPU judge's evaluation costs when its baselines are measured anew (no GPU needed).

    python scripts/bench_cpu_baselines.py [--runs 3] [--out FILE]

Each run scaffolds a workspace for y = x * scale (32 x 64 fp32) answered by a C++ candidate, builds it, then times
one `Judge("cpu").evaluate` with a judge cache folder of its own, so the eager and torch.compile baselines (each in
a fresh sandbox) are measured again: what a user's first `kernelpilot eval --device cpu` of a problem pays, and
what most CPU tests that time a candidate pay. Prints the seconds of each run and their median; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kernelpilot.harness.judge import Judge
from kernelpilot.workspace import EXAMPLE_KERNELS, init_workspace

PROBLEM = '''import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, features: int = 64):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return x * self.scale


def get_inputs():
    return [torch.randn(32, 64)]


def get_init_inputs():
    return [64]
'''

BINDING = '''#include <torch/types.h>

#include "kp_registry.h"

namespace {

torch::Tensor scale_mul(const torch::Tensor& x, const torch::Tensor& scale) {
  TORCH_CHECK(x.is_contiguous() && scale.is_contiguous(), "scale_mul: contiguous tensors only");
  torch::Tensor y = torch::empty_like(x);
  if (x.is_meta()) return y;
  const float* xs = x.data_ptr<float>();
  const float* ss = scale.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) ys[i] = xs[i] * ss[i % scale.numel()];
  return y;
}

}  // namespace

KP_OP("scale_mul(Tensor x, Tensor scale) -> Tensor", scale_mul);
'''

CANDIDATE = '''from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def __init__(self, features: int = 64):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return kp_ops.scale_mul(x, self.scale)
'''


def one_run(folder: Path) -> dict:
    problem = folder / "problem.py"
    problem.write_text(PROBLEM)
    ws, _ = init_workspace(problem, folder / "ws", device="cpu")
    for example in EXAMPLE_KERNELS:
        (ws.root / example).unlink()
    (ws.root / "kernels" / "scale_mul_binding.cpp").write_text(BINDING)
    (ws.root / "model_new.py").write_text("import torch\n" + CANDIDATE)
    with Judge("cpu", arch="9.0", cache_dir=folder / "judge-cache") as judge:
        build = judge.build(ws.root)
        if not build.ok:
            raise SystemExit(f"the candidate did not build: {build.error}")
        started = time.perf_counter()
        result = judge.evaluate(ws.root, trials=2)
        seconds = time.perf_counter() - started
    if result.reward < 1 or result.bench is None or result.bench.compiled is None:
        raise SystemExit(f"the evaluation did not verify and time the candidate: {result.message}")
    return {"seconds": round(seconds, 2), "eager_ms": result.bench.eager.median_ms,
            "compile_ms": result.bench.compiled.median_ms}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the runs")
    args = parser.parse_args()
    runs = []
    for index in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="kp-cpu-baselines-") as folder:
            runs.append(one_run(Path(folder)))
        print(f"run {index + 1}: evaluate {runs[-1]['seconds']} s", flush=True)
    median = statistics.median(run["seconds"] for run in runs)
    print(f"median {median:.1f} s over {len(runs)} runs (min {min(r['seconds'] for r in runs)}, "
          f"max {max(r['seconds'] for r in runs)})")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, "median_s": median}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
