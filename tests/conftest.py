"""Shared test configuration: the test layers (markers), their skips, and how tests are spread over xdist workers.

Layers, fastest first: `unit` (the default: a test marked with none of the others gets it), `slow` (seconds each:
subprocesses, tiny training runs, timing loops; marked per test by a folder's conftest.py), `cuda_build`
(compiles with nvcc or the CUDA build of torch, no GPU) and `gpu`. Tests that cannot run here are skipped with a
reason: `gpu` without a GPU, `cuda_build` without the CUDA build of torch and nvcc.

With pytest-xdist (`-n auto --dist loadgroup`), tests that share an expensive fixture wider than one test (a
module- or session-scoped build or judge) run on one worker, so the fixture is made once; GPU tests run on one
worker, one at a time, so their timings do not disturb each other.
"""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
LAYERS = ("slow", "cuda_build", "gpu")

# Every build of a test run, in any worker or subprocess, shares one precompiled torch header (kernelpilot/pch.py),
# made by the first build that needs it, rather than one per test's own cache folder (about 20 s each).
os.environ.setdefault("KERNELPILOT_PCH_DIR", str(Path(tempfile.gettempdir()) / f"kernelpilot-tests-pch-{os.getuid()}"))


def _share_the_cores_between_xdist_workers() -> None:
    """Under xdist every core already runs a worker, so torch's intra-op threads (OpenMP) in a worker and in the
    processes it starts (the judge's sandboxes inherit OMP_ settings) get the worker's share of the cores.

    With torch's default of one thread per core, each CPU op of a sandbox waited on a thread that another worker's
    process held: on a 2-core machine under `-n auto` the eager time of a small problem went from 0.1 ms to 2-6 ms
    while the candidate's single-threaded C++ kept its time, the spinning threads burned CPU time, and a cached
    CPU baseline that such a measurement refuted (more than 10x off) was measured again, torch.compile included
    (about 35 s of CPU each). Set only under xdist (`-n 0` keeps torch's default) and never over the user's own."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // workers)))


_share_the_cores_between_xdist_workers()


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


def _shared_fixture_group(item) -> str | None:
    """The xdist group of a test that uses one of our fixtures wider than a test: the fixture's name when it is
    session-scoped, else the test's module (module-scoped fixtures live there or in a conftest beside it)."""
    fixture_info = getattr(item, "_fixtureinfo", None)
    if fixture_info is None:
        return None
    module_wide = False
    for name, definitions in fixture_info.name2fixturedefs.items():
        definition = definitions[-1]
        if definition.scope not in ("module", "session") or not _ours(definition.func):
            continue
        if definition.scope == "session":
            return f"session-fixture-{name}"
        module_wide = True
    return item.nodeid.split("::")[0] if module_wide else None


def _ours(function) -> bool:
    try:
        return Path(inspect.getfile(function)).resolve().is_relative_to(TESTS)
    except (TypeError, OSError):
        return False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # Runs after the folder conftests' pytest_itemcollected (which add `slow`), and first among this hook's
    # implementations: before `-m` deselects, and before xdist's worker appends each test's group to its node id
    # (which is how loadgroup sends a group to one worker; a group marked after that is ignored).
    gpu = _has_gpu()
    cuda_reason = _cuda_build_reason()
    xdist = config.pluginmanager.hasplugin("xdist")
    for item in items:
        if not any(item.get_closest_marker(layer) for layer in LAYERS):
            item.add_marker(pytest.mark.unit)
        if item.get_closest_marker("gpu") and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)"))
        if item.get_closest_marker("cuda_build") and cuda_reason:
            item.add_marker(pytest.mark.skip(reason=cuda_reason))
        if xdist:
            group = "gpu" if item.get_closest_marker("gpu") else _shared_fixture_group(item)
            if group:
                item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def openai_server():
    """A loopback OpenAI-compatible server replaying scripted replies (tests/openai_server.py)."""
    from openai_server import ScriptedOpenAIServer

    with ScriptedOpenAIServer() as server:
        yield server
