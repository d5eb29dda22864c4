"""TRUSTED side: on-disk JSON cache of measurements (baselines, GPU ceilings, problem costs), keyed by what they
depend on, and signed.

A measurement is stored as `<cache dir>/<kind>/<hash of key>.json` holding the key, the value and an HMAC-SHA256
of both under the judge's key (`<cache dir>/judge.key`, mode 0600, made on first use). A lookup
checks the key itself and the signature, so an entry that anyone without the judge's key wrote or changed (a
candidate forging slow baselines, say) is ignored and measured again. Sandboxes get a cache folder of their own,
and where they run as another user they cannot read the key at all. Writes go to a temporary file and are renamed
into place, so workers on several GPUs can share the folder without a reader ever seeing half a file.

A sandbox of the same user can read the key (Landlock confines writes, not reads), so the signature holds only while
no sandbox can write the folder: confined by Landlock, none can; unconfined (no Landlock), a candidate can sign
whatever it likes. A judge whose sandboxes are not all confined therefore passes a `MemoryCache` where a folder would
go: its entries live in the judge's process only, and the folder is neither read nor written (`worker.py`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
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
    """The hardware and software a timing depends on: device name, torch version and whether float32 math may use
    TF32 (`float32.py`)."""
    import torch

    from kernelpilot.harness.float32 import tf32_allowed

    return {"gpu": device_name(device), "torch": torch.__version__, "tf32": tf32_allowed()}


def _entry_path(cache_dir: Path, kind: str, key: dict[str, Any]) -> Path:
    canonical = json.dumps(key, sort_keys=True)
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:24]
    return cache_dir / kind / f"{digest}.json"


class MemoryCache:
    """Entries kept in this process's memory for its lifetime, in place of a cache folder a candidate could have
    written (see the module's docstring); `note` says why, for a result whose measurements were made anew here."""

    def __init__(self, note: str = ""):
        self.note = note
        self._entries: dict[tuple[str, str], str] = {}

    def load(self, kind: str, key: dict[str, Any]) -> Any | None:
        text = self._entries.get((kind, json.dumps(key, sort_keys=True)))
        return json.loads(text) if text is not None else None  # a copy: a caller cannot change what is kept

    def store(self, kind: str, key: dict[str, Any], value: Any) -> None:
        self._entries[(kind, json.dumps(key, sort_keys=True))] = json.dumps(value)


KEY_FILE = "judge.key"


def signing_key(cache_dir: Path) -> bytes:
    """The judge's signing key for this cache folder, made (32 random bytes, mode 0600) on first use."""
    path = cache_dir / KEY_FILE
    try:
        return bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError):
        pass
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".key", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32))
        os.chmod(tmp, 0o600)
        try:
            os.link(tmp, path)  # never replaces a key another worker made meanwhile
        except FileExistsError:
            pass
    finally:
        Path(tmp).unlink(missing_ok=True)
    return bytes.fromhex(path.read_text().strip())


def _signature(secret: bytes, key: Any, value: Any) -> str:
    canonical = json.dumps({"key": key, "value": value}, sort_keys=True)
    return hmac.new(secret, canonical.encode(), hashlib.sha256).hexdigest()


def load_entry(kind: str, key: dict[str, Any], cache_dir: Path | MemoryCache | None = None) -> Any | None:
    """The value stored under `key`, or None when absent, unreadable, stored under another key or not signed
    with the judge's key."""
    if isinstance(cache_dir, MemoryCache):
        return cache_dir.load(kind, key)
    cache_dir = cache_dir or default_cache_dir()
    path = _entry_path(cache_dir, kind, key)
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != json.loads(json.dumps(key)):
        return None
    try:
        expected = _signature(signing_key(cache_dir), stored["key"], stored.get("value"))
    except OSError:
        return None
    if not hmac.compare_digest(str(stored.get("hmac", "")), expected):
        return None
    return stored.get("value")


def store_entry(kind: str, key: dict[str, Any], value: Any, cache_dir: Path | MemoryCache | None = None) -> Path | None:
    """Store a JSON-able `value` under `key` atomically; returns the file written (None for a MemoryCache)."""
    if isinstance(cache_dir, MemoryCache):
        cache_dir.store(kind, key, value)
        return None
    cache_dir = cache_dir or default_cache_dir()
    path = _entry_path(cache_dir, kind, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    plain_key, plain_value = json.loads(json.dumps(key)), json.loads(json.dumps(value))
    signature = _signature(signing_key(cache_dir), plain_key, plain_value)
    payload = json.dumps({"key": plain_key, "value": plain_value, "hmac": signature}, indent=1, sort_keys=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
