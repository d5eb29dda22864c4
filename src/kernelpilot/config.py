"""Run settings (model, api base, budgets, tolerances, paths) from flags > env > kernelpilot.toml > defaults.

Flags are the CLI's explicit values (None when not given); the environment uses `KERNELPILOT_<FIELD>` names
(KERNELPILOT_MODEL, KERNELPILOT_MAX_TURNS, ...); kernelpilot.toml is the first one found from the current folder
upwards, with the same field names as top-level keys (or under a [kernelpilot] table).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelpilot.errors import KernelpilotError

CONFIG_FILE = "kernelpilot.toml"
ENV_PREFIX = "KERNELPILOT_"
MAX_TURNS_LIMIT = 200


class ConfigError(KernelpilotError):
    """A setting has a value kernelpilot cannot use."""


@dataclass
class Settings:
    """What one `optimize` run may use and aims for."""

    model: str | None = None  # litellm provider string, e.g. "openai/gpt-5"; None: the built-in policy
    api_base: str | None = None
    api_key: str | None = None
    max_turns: int = 40
    wall_time_s: float | None = None  # None: no wall-time budget
    max_cost_usd: float | None = None
    max_tokens: int | None = None  # prompt + completion tokens over the whole run
    target_speedup: float = 1.05  # vs torch.compile; met when the best verified candidate reaches it
    patience: int = 5  # turns without improvement, once the target is met, before stopping
    trials: int = 5
    atol: float = 1e-2
    rtol: float = 1e-2
    device: str | None = None  # cuda, cuda:N or cpu; None: the judge's default (cuda)
    workspace: Path | None = None  # None: ./kp-<problem name>
    output: Path | None = None  # None: model_new.py beside the problem file


def load_settings(
    flags: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    start: Path | None = None,
) -> Settings:
    """Settings with each field taken from `flags`, else the environment, else kernelpilot.toml, else the default."""
    env = os.environ if env is None else env
    config_path = find_config(start or Path.cwd())
    layers = [
        ("a flag", {k: v for k, v in (flags or {}).items() if v is not None}),
        ("the environment", _from_env(env)),
        (str(config_path), _from_toml(config_path) if config_path else {}),
    ]
    values: dict[str, Any] = {}
    for field in dataclasses.fields(Settings):
        for source, layer in layers:
            if field.name in layer:
                values[field.name] = _coerce(field.name, layer[field.name], source)
                break
    settings = Settings(**values)
    _validate(settings)
    return settings


def find_config(start: Path) -> Path | None:
    """The nearest kernelpilot.toml in `start` or one of its parents."""
    for folder in (start.resolve(), *start.resolve().parents):
        if (folder / CONFIG_FILE).is_file():
            return folder / CONFIG_FILE
    return None


def _from_env(env: Mapping[str, str]) -> dict[str, str]:
    names = (field.name for field in dataclasses.fields(Settings))
    return {name: env[ENV_PREFIX + name.upper()] for name in names if env.get(ENV_PREFIX + name.upper())}


def _from_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"{path} cannot be read as TOML ({err}).", hint="Fix the file or remove it.") from None
    table = data.get("kernelpilot", data)
    known = {field.name for field in dataclasses.fields(Settings)}
    unknown = sorted(set(table) - known - {"kernelpilot"})
    if unknown:
        raise ConfigError(
            f"{path} has unknown settings: {', '.join(unknown)}.", hint=f"Known settings: {', '.join(sorted(known))}."
        )
    return table


def _coerce(name: str, value: Any, source: str) -> Any:
    """`value` as the type of Settings.<name>; ConfigError naming the setting and where it came from."""
    kind = _field_type(name)
    try:
        if kind is Path:
            return Path(str(value)).expanduser()
        if kind is bool or isinstance(value, bool):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"Setting {name} from {source} must be {_type_word(kind)}, got {value!r}.",
            hint=f"Set it with --{name.replace('_', '-')} or {ENV_PREFIX}{name.upper()}.",
        ) from None


def _field_type(name: str) -> type:
    hint = typing.get_type_hints(Settings)[name]
    concrete = [arg for arg in typing.get_args(hint) if arg is not type(None)] or [hint]
    return concrete[0]


def _type_word(kind: type) -> str:
    return {int: "a whole number", float: "a number", str: "text", Path: "a path"}.get(kind, kind.__name__)


def _validate(settings: Settings) -> None:
    if not 1 <= settings.max_turns <= MAX_TURNS_LIMIT:
        raise ConfigError(
            f"max_turns must be between 1 and {MAX_TURNS_LIMIT}, got {settings.max_turns}.",
            hint="Pass --max-turns with a value in that range.",
        )
    positive = ("target_speedup", "trials", "wall_time_s", "max_cost_usd", "max_tokens")
    for name in positive:
        value = getattr(settings, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}.", hint=f"Set {name} to a value above 0.")
    for name in ("patience", "atol", "rtol"):
        if getattr(settings, name) < 0:
            raise ConfigError(f"{name} must not be negative, got {getattr(settings, name)}.", hint=f"Set {name} to 0 or more.")
