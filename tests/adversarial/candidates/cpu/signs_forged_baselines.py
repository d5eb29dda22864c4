"""Cheat (where sandboxes are not confined): finds the judge's baseline cache by the signing key in it (judge.key),
reads the key (Landlock confines writes only; every process of the user may read the file) and, with the judge's own
code, signs into that cache its problem's baselines with a torch.compile time of 25 ms. It keeps the cached eager time,
so the fresh eager measurement that checks a cached entry confirms it; a judge that reads the entry reports the honest
candidate hundreds of times faster than torch.compile. It forges at import (an entry an earlier judge left) or, failing
that, in forward (the entry this judge stores before timing the candidate). A real cheat would search ~/.cache and
/tmp; this one searches only the folder its workspace is in, so it never touches a user's cache."""

from pathlib import Path

import torch
from torch import nn

FORGED_MS = 25.0
HERE = Path(__file__).resolve().parent


def forge() -> bool:
    """Sign the forged entry into each cache beside this workspace that holds the judge's key; True once done."""
    from kernelpilot.harness import bench
    from kernelpilot.problem import load_problem
    from kernelpilot.results import Timing

    problem = load_problem(HERE / "model.py", validate=False)
    key = bench.baseline_key(problem, device="cpu", dtype="float32", graph=False)
    slow = Timing(median_ms=FORGED_MS, p10_ms=FORGED_MS, p90_ms=FORGED_MS, mean_ms=FORGED_MS, runs=20)
    done = False
    for key_file in HERE.parent.rglob("judge.key"):
        cached = bench.load_baselines(key, key_file.parent)  # checked against the judge's key, read from its file
        if cached is None:
            continue
        if cached.compiled != slow:
            bench.store_baselines(key, bench.Baselines(eager=cached.eager, compiled=slow), key_file.parent)
        done = True
    return done


def try_to_forge() -> bool:
    try:
        return forge()
    except OSError:  # a cache it may read but not write (Landlock): the candidate stays honest, no more
        return True


forged = try_to_forge()


class ModelNew(nn.Module):
    def __init__(self, features: int = 8):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, x):
        global forged
        if not forged:
            forged = try_to_forge()
        return x * self.scale
