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
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    shutil.copyfile(library, folder / library.name)
    (folder / SOURCES_RECORD).write_text(json.dumps({"key": key, "resources": []}))
    return folder


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    """A scaffolded workspace, a CPU judge with a cache of its own, and the judge's build of the workspace. Each test
    leaves the workspace's sources as they were."""
    from kernelpilot.workspace import init_workspace

    folder = tmp_path_factory.mktemp("planted")
    ws, _ = init_workspace(write_problem(folder, scale_problem(rows=8, features=16)), folder / "ws")
    with Judge("cpu", arch=ARCH, cache_dir=folder / "judge-cache") as judge:
        honest = judge.build(ws.root)
        assert honest.ok and not honest.reused
        yield judge, ws, honest


@pytest.mark.cuda_build
def test_a_version_planted_under_the_record_of_other_sources_is_not_what_the_judge_builds(judged, kernel):
    from kernelpilot.build_versions import sources_key

    judge, ws, honest = judged
    # The agent writes other sources and plants the honest library under their record: a library that is not
    # built from them. The record's key is one the agent can compute (build.ninja, torch's version, kernels/).
    kernel.write_text(kernel.read_text() + "\n// not what the planted library was built from\n")
    key = sources_key(ws.root, (ws.root / "build" / "build.ninja").read_text())
    planted = _planted(ws.root, Path(honest.library), key)

    build = judge.build(ws.root)

    assert build.ok and not build.reused, "the judge loaded a library it did not build from these sources"
    assert build.compiled == [kernel.relative_to(ws.root).as_posix()]
    assert Path(build.library).parent != planted


@pytest.mark.cuda_build
def test_a_library_swapped_into_a_version_the_judge_built_is_not_reused(judged, kernel):
    judge, ws, honest = judged
    original = kernel.read_text()
    # Another build, then the agent swaps other bytes into the honest version's library and writes its sources
    # back: the folder's record still names them.
    kernel.write_text(original + "\n// another version\n")
    assert judge.build(ws.root).ok
    Path(honest.library).write_bytes(Path(honest.library).read_bytes() + b"\0swapped in by the agent")
    kernel.write_text(original)

    build = judge.build(ws.root)

    assert build.ok and not build.reused and build.compiled == [kernel.relative_to(ws.root).as_posix()]
    assert b"swapped in by the agent" not in Path(build.library).read_bytes()


def test_a_library_planted_where_the_next_version_goes_is_replaced_by_the_build(tmp_path):
    """Versions are named by their library's content: an agent that knows what a build will link (the same objects
    link to the same bytes) can plant other bytes in that folder before the build publishes there."""
    from kernelpilot.build_versions import publish_version

    build_dir = tmp_path / "build"
    build_dir.mkdir()
    library = build_dir / "kp_kernels.so"
    library.write_bytes(b"the library the build linked")
    import hashlib

    folder = build_dir / "versions" / hashlib.sha256(library.read_bytes()).hexdigest()[:16]
    folder.mkdir(parents=True)
    (folder / "kp_kernels.so").write_bytes(b"planted")

    published = publish_version(build_dir)

    assert published == folder / "kp_kernels.so" and published.read_bytes() == b"the library the build linked"


@pytest.mark.parametrize("link", ["build", "build/versions"])
def test_a_build_folder_linked_out_of_the_workspace_is_refused_in_one_sentence(tmp_path, link):
    """The agent's processes may write only inside the workspace, but a link there may lead anywhere, and the
    judge's worker, which builds, is not confined."""
    from kernelpilot.errors import WorkspaceError

    root = tmp_path / "ws"
    (root / "kernels").mkdir(parents=True)
    (root / "kernels" / "k.cpp").write_text("int k() { return 1; }\n")
    elsewhere = tmp_path / "judge-cache"
    elsewhere.mkdir()
    (root / link).parent.mkdir(parents=True, exist_ok=True)
    (root / link).symlink_to(elsewhere)

    with pytest.raises(WorkspaceError, match="is a link, so a build would write wherever it leads"):
        build_workspace(root, arch=ARCH)
    assert list(elsewhere.iterdir()) == []


@pytest.mark.cuda_build
def test_an_object_of_other_sources_put_back_newer_than_its_source_is_compiled_again(judged, kernel):
    """ninja links an object that is newer than its source without compiling it: an object the judge compiled from
    other sources, put back with a later time (on disk, in ninja's log and in its deps), would be linked as the
    build of the sources beside it."""
    import os

    judge, ws, _ = judged
    original = kernel.read_text()
    obj = ws.root / "build" / f"{kernel.name}.o"
    kernel.write_text(original + "\n// the version whose object is kept\n")
    assert judge.build(ws.root).compiled == [kernel.relative_to(ws.root).as_posix()]
    kept = obj.read_bytes()
    kernel.write_text(original + "\n// the sources the agent leaves behind\n")
    obj.write_bytes(kept)
    later = kernel.stat().st_mtime + 60
    os.utime(obj, (later, later))
    # ninja trusts the time its log recorded for an output over the file's own: the agent rewrites that too.
    log = ws.root / "build" / ".ninja_log"
    lines = log.read_text().splitlines()
    for number, line in enumerate(lines):
        fields = line.split("\t")
        if len(fields) == 5 and fields[3] == obj.name:
            fields[2] = str(int(later * 1e9))
            lines[number] = "\t".join(fields)
    log.write_text("\n".join(lines) + "\n")
    _set_deps_time(ws.root / "build" / ".ninja_deps", obj.name, int(later * 1e9))

    build = judge.build(ws.root)

    assert build.ok and build.compiled == [kernel.relative_to(ws.root).as_posix()], build.compiled


def _set_deps_time(path: Path, output: str, mtime_ns: int) -> None:
    """Rewrite the time .ninja_deps (format 4) recorded for `output`'s dependencies: records are a 4-byte size, then
    a path (its bytes, padding, the one's complement of its id) or, with the size's top bit set, the output's id, an
    8-byte time and the inputs' ids."""
    import struct

    data = bytearray(path.read_bytes())
    offset, ids, target = 16, 0, None  # "# ninjadeps\n" and the version
    while offset < len(data):
        (size,) = struct.unpack_from("<I", data, offset)
        body = offset + 4
        if size & 0x80000000:
            (out_id,) = struct.unpack_from("<i", data, body)
            if out_id == target:
                struct.pack_into("<Q", data, body + 4, mtime_ns)
        else:
            if data[body:body + size - 4].rstrip(b"\0").decode() == output:
                target = ids
            ids += 1
        offset = body + (size & 0x7FFFFFFF)
    path.write_bytes(bytes(data))
