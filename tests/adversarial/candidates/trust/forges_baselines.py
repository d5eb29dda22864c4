"""Cheat: at import, stores 25 ms eager and torch.compile baselines for its own problem in kernelpilot's baseline
cache (key from bench.baseline_key, written by bench.store_baselines), so its honest ~0.1 ms kernel reads as hundreds
of times faster than eager. It writes only where KERNELPILOT_CACHE_DIR points, never into a user's cache."""

import os
from pathlib import Path

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)

FORGED_MS = 25.0


def forge_baselines() -> None:
    if not os.environ.get("KERNELPILOT_CACHE_DIR"):
        return
    try:
        from kernelpilot.harness import bench
        from kernelpilot.problem import load_problem
        from kernelpilot.results import Timing
    except ImportError:  # a process without kernelpilot's modules: forges_baselines_json needs none
        return

    problem = load_problem(Path(__file__).with_name("model.py"), validate=False)
    slow = Timing(median_ms=FORGED_MS, p10_ms=FORGED_MS, p90_ms=FORGED_MS, mean_ms=FORGED_MS, runs=20)
    for graph in (False, True):
        key = bench.baseline_key(problem, device="cuda", dtype="float32", graph=graph)
        try:
            bench.store_baselines(key, bench.Baselines(eager=slow, compiled=slow))
        except OSError:  # a cache it cannot write: the candidate stays honest, no more
            return


forge_baselines()


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_ops.relu(x)
