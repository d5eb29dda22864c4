"""Settings: flags > environment > kernelpilot.toml > defaults, type conversion, and one-sentence errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelpilot.config import ConfigError, Settings, find_config, load_settings


def test_defaults_when_nothing_is_set(tmp_path):
    assert load_settings({}, env={}, start=tmp_path) == Settings()


def test_flags_beat_env_beat_toml(tmp_path):
    (tmp_path / "kernelpilot.toml").write_text('model = "from-toml"\nmax_turns = 7\npatience = 2\nworkspace = "~/ws"\n')
    env = {"KERNELPILOT_MODEL": "from-env", "KERNELPILOT_MAX_TURNS": "9"}
    settings = load_settings({"model": "from-flag", "max_turns": None}, env=env, start=tmp_path)
    assert settings.model == "from-flag"
    assert settings.max_turns == 9  # a flag left at None does not hide the environment
    assert settings.patience == 2
    assert settings.workspace == Path("~/ws").expanduser()


def test_toml_is_found_in_a_parent_and_may_use_a_table(tmp_path):
    (tmp_path / "kernelpilot.toml").write_text('[kernelpilot]\ntarget_speedup = 1.5\n')
    nested = tmp_path / "a" / "b"
    nested.mkdir(parents=True)
    assert find_config(nested) == tmp_path / "kernelpilot.toml"
    assert load_settings({}, env={}, start=nested).target_speedup == 1.5


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"max_turns": 201}, {}, "max_turns must be between 1 and 200"),
        ({"max_turns": 0}, {}, "max_turns must be between 1 and 200"),
        ({}, {"KERNELPILOT_MAX_TURNS": "many"}, "max_turns from the environment must be a whole number"),
        ({"target_speedup": -1.0}, {}, "target_speedup must be positive"),
        ({"patience": -1}, {}, "patience must not be negative"),
    ],
)
def test_bad_values_are_one_sentence(tmp_path, flags, env, message):
    with pytest.raises(ConfigError, match=message) as caught:
        load_settings(flags, env=env, start=tmp_path)
    assert caught.value.hint


def test_unknown_or_broken_toml_is_named(tmp_path):
    (tmp_path / "kernelpilot.toml").write_text("modle = 'x'\n")
    with pytest.raises(ConfigError, match="unknown settings: modle"):
        load_settings({}, env={}, start=tmp_path)
    (tmp_path / "kernelpilot.toml").write_text("model = \n")
    with pytest.raises(ConfigError, match="cannot be read as TOML"):
        load_settings({}, env={}, start=tmp_path)
    (tmp_path / "kernelpilot.toml").write_text("max_turns = true\n")
    with pytest.raises(ConfigError, match="must be a whole number"):
        load_settings({}, env={}, start=tmp_path)
