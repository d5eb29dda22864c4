"""The build folder against an agent that plants builds: it is inside the workspace, which the agent's tools may
write. A build of sources that a kept version was built from is that version, with nothing compiled
(`build_versions.py`); were the record that says which sources a version was built from the workspace's alone, an
agent could plant a library built from other sources (or not built at all) under the record of the sources it
leaves behind, and the judge would load and time that library as those sources. The records the judge trusts are
signed entries in its own cache folder, keyed by the library's content."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kernelpilot.build import build_workspace
from kernelpilot.build_versions import SOURCES_RECORD
from kernelpilot.harness.judge import Judge
from kp_testing import scale_problem, write_problem

ARCH = "9.0"


def _planted(root: Path, library: Path, key: str) -> Path:
    """What an agent's Bash can write: a version folder holding `library` (any bytes) and a record naming `key`."""
    folder = root / "build" / "versions" / "0123456789abcdef"
    folder.mkdir(parents=True)
    shutil.copyfile(library, folder / library.name)
    (folder / SOURCES_RECORD).write_text(json.dumps({"key": key, "resources": []}))
    return folder


@pytest.mark.cuda_build
def test_a_version_planted_under_the_record_of_other_sources_is_not_what_the_judge_builds(tmp_path):
    from kernelpilot.workspace import init_workspace

    ws, _ = init_workspace(write_problem(tmp_path, scale_problem(rows=8, features=16)), tmp_path / "ws")
    cache = tmp_path / "judge-cache"
    with Judge("cpu", arch=ARCH, cache_dir=cache) as judge:
        honest = judge.build(ws.root)
        assert honest.ok and not honest.reused
        # The agent writes other sources and plants the honest library under their record: a library that is not
        # built from them. The record's key is one the agent can compute (build.ninja, torch's version, kernels/).
        kernel = next(ws.root.glob("kernels/*.cu"))
        kernel.write_text(kernel.read_text() + "\n// not what the planted library was built from\n")
        from kernelpilot.build_versions import sources_key

        key = sources_key(ws.root, (ws.root / "build" / "build.ninja").read_text())
        planted = _planted(ws.root, Path(honest.library), key)

        build = judge.build(ws.root)

    assert build.ok and not build.reused, "the judge loaded a library it did not build from these sources"
    assert build.compiled == [kernel.relative_to(ws.root).as_posix()]
    assert Path(build.library).parent != planted


@pytest.mark.cuda_build
def test_a_library_swapped_into_a_version_the_judge_built_is_not_reused(tmp_path):
    from kernelpilot.workspace import init_workspace

    ws, _ = init_workspace(write_problem(tmp_path, scale_problem(rows=8, features=16)), tmp_path / "ws")
    kernel = next(ws.root.glob("kernels/*.cu"))
    original = kernel.read_text()
    with Judge("cpu", arch=ARCH, cache_dir=tmp_path / "judge-cache") as judge:
        honest = judge.build(ws.root)
        # Another build, then the agent swaps other bytes into the honest version's library and writes its sources
        # back: the folder's record still names them.
        kernel.write_text(original + "\n// another version\n")
        assert judge.build(ws.root).ok
        Path(honest.library).write_bytes(Path(honest.library).read_bytes() + b"\0planted")
        kernel.write_text(original)

        build = judge.build(ws.root)

    assert build.ok and not build.reused and build.compiled == [kernel.relative_to(ws.root).as_posix()]
