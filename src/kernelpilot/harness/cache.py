"""On-disk JSON cache of measurements (baselines, GPU ceilings, problem costs), keyed by what they depend on.

A measurement is stored as `<cache dir>/<kind>/<hash of key>.json` holding both the key and the value, so a
lookup checks the key itself and never trusts a hash alone. Writes go to a temporary file and are renamed into
place, so workers on several GPUs can share the folder without a reader ever seeing half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def default_cache_dir() -> Path:
    """$KERNELPILOT_CACHE_DIR, else $XDG_CACHE_HOME/kernelpilot, else ~/.cache/kernelpilot."""
    explicit = os.environ.get("KERNELPILOT_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kernelpilot"


def device_name(device: str) -> str:
    """The name a measurement on `device` depends on: the GPU's model name, or "cpu"."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return dev.type


def environment_key(device: str) -> dict[str, str]:
    """The hardware and software a timing depends on: device name and torch version."""
    import torch

    return {"gpu": device_name(device), "torch": torch.__version__}


def _entry_path(cache_dir: Path, kind: str, key: dict[str, Any]) -> Path:
    canonical = json.dumps(key, sort_keys=True)
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:24]
    return cache_dir / kind / f"{digest}.json"


def load_entry(kind: str, key: dict[str, Any], cache_dir: Path | None = None) -> Any | None:
    """The value stored under `key`, or None when absent, unreadable or stored under a different key."""
    path = _entry_path(cache_dir or default_cache_dir(), kind, key)
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != json.loads(json.dumps(key)):
        return None
    return stored.get("value")


def store_entry(kind: str, key: dict[str, Any], value: Any, cache_dir: Path | None = None) -> Path:
    """Store a JSON-able `value` under `key` atomically; returns the file written."""
    path = _entry_path(cache_dir or default_cache_dir(), kind, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = json.dumps({"key": key, "value": value}, indent=1, sort_keys=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
