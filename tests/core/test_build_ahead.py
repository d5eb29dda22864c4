"""Builds ahead (`build_ahead.py`): other versions of a workspace's kernels compiled side by side, from the
workspace's objects, so that a later build of one of them compiles nothing; and the build folder that names no
path of its workspace, which makes that possible (a moved workspace builds nothing again). Real nvcc and g++ builds,
no GPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from build_testing import ARCH

from kernelpilot.agent.observations import build_text
from kernelpilot.build import build_workspace
from kernelpilot.build_ahead import MAX_AHEAD, build_with_ahead, check_version
from kernelpilot.build_versions import SOURCES_RECORD
from kernelpilot.errors import WorkspaceError
from kernelpilot.results import AheadBuilds, BuildResult

CU = "kernels/scale.cu"


def _files(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under kernels/ with its content and time."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted((root / "kernels").iterdir())}


def _key(build: BuildResult) -> str:
    """The sources key a build's version folder names."""
    return json.loads((Path(build.library).parent / SOURCES_RECORD).read_text())["key"]


def _version(original: str, number: int) -> dict[str, str]:
    """scale.cu with a line no build test writes, so that no kept version has it already."""
    return {CU: f"{original}\n// built ahead, version {number}\n"}


@pytest.mark.cuda_build
def test_versions_built_ahead_compile_only_what_they_change_and_a_later_build_of_one_compiles_nothing(built):
    root, _ = built
    cu = root / CU
    original = cu.read_text()
    # Sources built by no earlier build, so ninja runs and brings every object up to date (a build that reused a
    # kept version leaves the objects as they were).
    cu.write_text(_version(original, 99)[CU])
    assert build_workspace(root, arch=ARCH).compiled
    # The workspace's own edit, built side by side with the versions: each copy starts from the objects as they
    # were, overrides that edit and compiles its own .cu.
    cu.write_text(_version(original, 0)[CU])
    before = _files(root)
    versions = [_version(original, 1), _version(original, 2), _version(original, 0), _version(original, 1)]

    try:
        own = build_with_ahead(root, versions, arch=ARCH, jobs=2)
        assert _files(root) == before, "the workspace's own files are left as they were"
    finally:
        cu.write_text(original)

    assert own.ok and own.compiled == [CU] and own.linked
    report = own.ahead
    # The third is the workspace's own sources, the fourth the same as the first: neither gets a build of its own.
    assert (report.asked, report.built, report.kept_before, report.failed) == (4, 2, 2, [])
    # Each copy compiled its .cu and reused the binding's object, which it took from the workspace's build folder.
    assert report.compiled == [CU, CU]
    assert not (root / "build" / "ahead").exists()
    assert "Built ahead: 4 version(s) in " in build_text(own)

    cu.write_text(versions[1][CU])
    try:
        later = build_workspace(root, arch=ARCH)
    finally:
        cu.write_text(original)
    assert later.ok and later.reused and later.compiled == [] and not later.linked
    assert [kernel.source for kernel in later.resources] == [CU], "the version keeps its ptxas report"
    assert build_workspace(root, arch=ARCH).ok


@pytest.mark.cuda_build
def test_a_version_that_does_not_compile_is_counted_and_leaves_the_workspace_built(built):
    root, _ = built
    original = (root / CU).read_text()
    versions = [{CU: f"{original}\n#error not this one\n"}, _version(original, 3)]

    own = build_with_ahead(root, versions, arch=ARCH, jobs=2)

    assert own.ok and (own.ahead.built, own.ahead.failed) == (1, [0])
    assert "1 failed to compile (ahead[0]; writing one and building shows its errors)" in build_text(own)
    again = build_workspace(root, arch=ARCH)
    assert again.ok and again.compiled == [] and _key(again) == _key(own)


@pytest.mark.cuda_build
def test_a_moved_workspace_builds_nothing_again(built, tmp_path):
    """build.ninja names the sources and kernels/ relative to the build folder, so its objects stay valid."""
    root, _ = built
    # Without its kept versions, so that ninja runs; once, as a build that reused a version leaves ninja's objects
    # behind the sources (it compiled nothing).
    moved, moved_again = tmp_path / "moved", tmp_path / "moved again"
    shutil.copytree(root, moved, copy_function=shutil.copy2, ignore=shutil.ignore_patterns("versions", "*.lock"))
    assert build_workspace(moved, arch=ARCH).ok
    shutil.copytree(moved, moved_again, copy_function=shutil.copy2, ignore=shutil.ignore_patterns("versions", "*.lock"))

    result = build_workspace(moved_again, arch=ARCH)

    assert result.ok and result.compiled == [] and not result.reused  # (it links: every build that runs ninja does)
    assert Path(result.library).is_relative_to(moved_again / "build" / "versions")


@pytest.mark.parametrize(
    "version, problem",
    [({}, "gives no file"),
     ({"model_new.py": "x"}, "not a file under kernels/"),
     ({"kernels/../model_new.py": "x"}, "not a file under kernels/"),
     ({"/etc/kernels/a.cu": "x"}, "not a file under kernels/"),
     ({"kernels/notes.txt": "x"}, "not a kernel source or header"),
     ({"kernels/kp_module.cpp": "x"}, "kernels/kp_module.cpp cannot change: it is kernelpilot's"),
     ({"kernels/a.cu": 3}, "is not text")],
)  # fmt: skip
def test_versions_that_are_not_kernel_files_are_refused_in_one_sentence(version, problem, tmp_path):
    assert problem in check_version(version)
    (tmp_path / "kernels").mkdir()
    with pytest.raises(WorkspaceError, match="A version to build ahead is refused: .*" + problem):
        build_with_ahead(tmp_path, [version], arch=ARCH)
    assert check_version({"kernels/a.cu": "x", "kernels/sub/b.cuh": "y"}) is None


def test_more_versions_than_built_at_once_are_refused(tmp_path):
    with pytest.raises(WorkspaceError, match=f"at most {MAX_AHEAD} are built at once"):
        build_with_ahead(tmp_path, [{CU: str(k)} for k in range(MAX_AHEAD + 1)], arch=ARCH)


def test_the_report_names_what_was_built_before_and_what_failed():
    report = AheadBuilds(asked=5, built=2, kept_before=1, failed=[1, 4], seconds=3.25)
    line = build_text(BuildResult(ok=True, workspace="w", extension_name="kp_kernels", arch="9.0", ahead=report))
    assert line.splitlines()[-1] == ("Built ahead: 5 version(s) in 3.2 s: 2 compiled, 1 built before, 2 failed to "
                                     "compile (ahead[1, 4]; writing one and building shows its errors).")  # fmt: skip
