"""Locate the data folders shipped with kernelpilot: templates/, skills/, prompts/, examples/."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]


def data_dir(name: str) -> Path:
    """Return the folder `name` (templates, skills, prompts), from a source checkout or an installed wheel."""
    in_checkout = _REPO_ROOT / name
    if in_checkout.is_dir() and (_REPO_ROOT / "pyproject.toml").is_file():
        return in_checkout
    return Path(str(resources.files(f"kernelpilot._data.{name}")))
