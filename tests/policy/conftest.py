"""The policy tests' GPU judge: one worker per test module, shared by its GPU tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def judge():
    from kernelpilot.harness.judge import Judge

    with Judge() as judge:
        yield judge
