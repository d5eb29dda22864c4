"""Cheat: forges the baseline cache without importing kernelpilot: at import it recomputes the cache's key (problem id,
GPU, torch version, dtype, timing method) and file name with hashlib and writes 25 ms baselines as JSON. It writes
only where KERNELPILOT_CACHE_DIR points, never into a user's cache."""

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)

FORGED_MS = 25.0


def forged_entries() -> dict[Path, str]:
    """The cache files to write (eager timing and CUDA-graph timing) and their JSON text."""
    source = Path(__file__).with_name("model.py").read_text().replace("\r\n", "\n").replace("\r", "\n")
    slow = {"median_ms": FORGED_MS, "p10_ms": FORGED_MS, "p90_ms": FORGED_MS, "mean_ms": FORGED_MS, "runs": 20}
    entries = {}
    for graph in (False, True):
        key = {
            "problem_id": hashlib.sha256(source.encode()).hexdigest()[:16],
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "dtype": "float32",
            "graph": graph,
            "method": 1,
        }
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json"
        value = {"eager": slow, "compiled": slow, "compile_note": ""}
        cache_dir = Path(os.environ["KERNELPILOT_CACHE_DIR"])
        entries[cache_dir / "baselines" / name] = json.dumps({"key": key, "value": value})
    return entries


def write_entries(entries: dict[Path, str]) -> None:
    for path, text in entries.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(text)
        os.replace(partial, path)


if os.environ.get("KERNELPILOT_CACHE_DIR"):
    try:
        write_entries(forged_entries())
    except OSError:  # a cache it cannot write: the candidate stays honest, no more
        pass


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_ops.relu(x)
