"""Locate the data folders shipped with kernelpilot (templates/, skills/, prompts/, examples/) and render from them."""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jinja2

_REPO_ROOT = Path(__file__).resolve().parents[2]


def data_dir(name: str) -> Path:
    """Return the folder `name` (templates, skills, prompts), from a source checkout or an installed wheel."""
    in_checkout = _REPO_ROOT / name
    if in_checkout.is_dir() and (_REPO_ROOT / "pyproject.toml").is_file():
        return in_checkout
    return Path(str(resources.files(f"kernelpilot._data.{name}")))


def install_hint(extra: str) -> str:
    """How to install one of kernelpilot's extras here: editable from a source checkout, else from the index."""
    if not (_REPO_ROOT / "pyproject.toml").is_file():
        return f"pip install 'kernelpilot[{extra}]'"
    where = "." if Path.cwd().resolve() == _REPO_ROOT else str(_REPO_ROOT)
    return f"pip install -e '{where}[{extra}]'"


@functools.lru_cache(maxsize=None)
def template_environment(name: str) -> jinja2.Environment:
    """Jinja2 over the data folder `name`: a variable a template uses but was not given is an error, and block
    tags leave no blank lines behind, so a rendered file reads as its template is laid out.

    One environment per folder, kept: it keeps each template compiled (compiling one takes tens of milliseconds,
    and the policy renders two files per kernel of a network with hundreds), and reloads a template whose file
    changed since."""
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(data_dir(name)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
