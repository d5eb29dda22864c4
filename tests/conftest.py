"""Shared test configuration: GPU and CUDA-build markers skip with a reason where they cannot run."""

from __future__ import annotations

import os
import shutil

import pytest



def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - any import problem means no GPU for tests
        return False


def _cuda_build_reason() -> str | None:
    """Why a compile-only CUDA build cannot run here, or None when it can."""
    try:
        import torch
    except Exception:  # noqa: BLE001
        return "torch is not importable"
    if torch.version.cuda is None:
        return "the installed torch is a CPU build, which cannot build CUDA extensions"
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        return "nvcc is not on PATH and CUDA_HOME is not set"
    return None


def pytest_collection_modifyitems(config, items):
    gpu = _has_gpu()
    cuda_reason = _cuda_build_reason()
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)"))
        if "cuda_build" in item.keywords and cuda_reason:
            item.add_marker(pytest.mark.skip(reason=cuda_reason))


@pytest.fixture
def openai_server():
    """A loopback OpenAI-compatible server replaying scripted replies (tests/openai_server.py)."""
    from openai_server import ScriptedOpenAIServer

    with ScriptedOpenAIServer() as server:
        yield server
