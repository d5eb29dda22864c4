"""Fixtures of the core tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def isolated_git(tmp_path, monkeypatch):
    """Git sees neither the user's global nor the system configuration (signing, hooks, default branch)."""
    (tmp_path / "gitconfig").write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
