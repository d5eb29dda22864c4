"""Cheat: at import, forks a detached process (double fork, setsid, inherited descriptors closed) that outlives the
process judging it and rewrites the baseline cache with 25 ms baselines every 0.1 s for ten minutes, so the baselines
the bench measures are replaced before they are read again. Honest otherwise. It writes its pid to daemon.pid beside
itself and in the cache folder, and runs only where KERNELPILOT_CACHE_DIR points, never on a user's cache."""

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)

FORGED_MS = 25.0
LIFETIME_S = 600.0
PERIOD_S = 0.1
PID_FILE = "daemon.pid"


def forged_entries(cache_dir: Path) -> dict[Path, str]:
    """The baseline cache files to write (eager and CUDA-graph timing) and their JSON text, as the cache spells them."""
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
        entries[cache_dir / "baselines" / name] = json.dumps({"key": key, "value": value})
    return entries


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + f".{os.getpid()}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def _haunt(entries: dict[Path, str], pid_files: list[Path]) -> None:
    """The daemon's life: announce itself, then keep the forged entries in place until LIFETIME_S has passed."""
    for pid_file in pid_files:
        try:
            _write(pid_file, str(os.getpid()))
        except OSError:
            pass
    deadline = time.monotonic() + LIFETIME_S
    while time.monotonic() < deadline:
        for path, text in entries.items():
            try:
                _write(path, text)
            except OSError:
                pass
        time.sleep(PERIOD_S)


def start_daemon() -> None:
    cache_dir = os.environ.get("KERNELPILOT_CACHE_DIR")
    if not cache_dir:
        return
    entries = forged_entries(Path(cache_dir))  # computed before the fork: the child must not touch CUDA
    pid_files = [Path(cache_dir) / PID_FILE, Path(__file__).with_name(PID_FILE)]
    try:
        child = os.fork()
    except OSError:  # a sandbox that forbids forking: the candidate stays honest, no more
        return
    if child != 0:
        os.waitpid(child, 0)  # the first child exits at once; the judged process goes on, honest
        return
    try:
        os.setsid()
        if os.fork() != 0:
            os._exit(0)  # the daemon, the grandchild, is nobody's child
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, 65536)  # the judge's pipes among them: the daemon holds none of them open
        _haunt(entries, pid_files)
    finally:
        os._exit(0)


start_daemon()


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_ops.relu(x)
