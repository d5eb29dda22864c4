"""Builds ahead: other versions of a workspace's kernel files, compiled side by side with its build, so that a later
build of any of them is a kept version with nothing compiled (`build_versions.reused_version`).

A search over launch configurations writes one .cu after another and builds each: 3-4 s of nvcc on one core per
try. Asked for ahead, the versions compile at once, one core each, beside the workspace's own build and while nothing
is being timed (the judge's Compile step, never a Profile's timing), so a Compile with versions ahead takes about as
long as one without.

Each version is built in a copy of the workspace under build/ahead/<n>/: kernels/ with the version's files written
over it, and the build folder's objects, ninja logs and ptxas reports with their times kept, so ninja compiles only
the files the version changes (and any the workspace's own build compiles), then links. build.ninja names no path
of the workspace (build.py), so the copy's build has the key that a build of the same files in the workspace would
have. Its version folder moves into the workspace's build/versions/ with its signed record, and build/ahead/ is
removed.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from kernelpilot.build import (Toolchain, build_lock, build_locked, find_toolchain, kernel_sources, render_ninja,
                               resolve_arch)
from kernelpilot.build_versions import (KEEP_VERSIONS, SOURCE_SUFFIXES, Cache, built_from, prune_versions,
                                       sources_key)
from kernelpilot.errors import WorkspaceError
from kernelpilot.results import AheadBuilds, BuildResult
from kernelpilot.workspace import PROTECTED_FILES, PROTECTED_REASON, Workspace
from kernelpilot.workspace_files import is_plain_file, make_folder, remove, write_file

# At most this many versions per request: with the workspace's own and the kept ones, they fit in KEEP_VERSIONS.
MAX_AHEAD = 16
AHEAD_DIR = "ahead"  # in the build folder
# What a copy's build folder needs from the workspace's so that ninja recompiles only what the version changed.
_BUILD_STATE = (".ninja_log", ".ninja_deps")


def check_version(version: Mapping[str, str]) -> str | None:
    """Why `version` ({path: content}, paths like kernels/foo.cu) cannot be built ahead, in one sentence, or None."""
    if not version:
        return "a version gives no file"
    for path, content in version.items():
        parts = PurePosixPath(path).parts
        if len(parts) < 2 or parts[0] != "kernels" or ".." in parts or PurePosixPath(path).is_absolute():
            return f"{path!r} is not a file under kernels/ (give paths like kernels/foo.cu)"
        if PurePosixPath(path).suffix not in SOURCE_SUFFIXES:
            return f"{path!r} is not a kernel source or header ({', '.join(SOURCE_SUFFIXES)})"
        if PurePosixPath(path).as_posix() in PROTECTED_FILES:
            return f"{path} cannot change: {PROTECTED_REASON}"
        if not isinstance(content, str):
            return f"the content of {path!r} is not text"
    return None


def build_with_ahead(root: Path, versions: Sequence[Mapping[str, str]], *, arch: str | None = None,
                     jobs: int | None = None, cache: Cache = None) -> BuildResult:  # fmt: skip
    """Build the workspace as `build_workspace` does and, side by side with it, each of `versions` (workspace-relative
    path -> content, written over a copy of kernels/) into its kept versions; the result's `ahead` counts them. Up to
    `jobs` builds run at once (default: every core), the workspace's with `jobs` jobs, each version's with one.

    Each copy starts from the workspace's objects as they are before its build, so it compiles the files its
    version changes and any file the workspace's build compiles too (an edit the copy does not override). A version
    that fails to compile is only counted: its build in the workspace will show the errors. Raises WorkspaceError
    for a version that `check_version` refuses or for more than MAX_AHEAD versions.
    """
    started = time.perf_counter()
    if len(versions) > MAX_AHEAD:
        raise WorkspaceError(f"{len(versions)} versions were asked to be built ahead; at most {MAX_AHEAD} are built "
                             "at once.", hint="ask for the ones the next turns will try")  # fmt: skip
    for version in versions:
        if (problem := check_version(version)) is not None:
            raise WorkspaceError(f"A version to build ahead is refused: {problem}.")
    ws = Workspace(Path(root).resolve())
    sources = kernel_sources(ws)
    arch = resolve_arch(arch)
    toolchain = find_toolchain()
    cores = jobs or os.cpu_count() or 1
    report = AheadBuilds(asked=len(versions))
    ahead_dir = ws.build_dir / AHEAD_DIR
    with build_lock(ws.build_dir):
        try:
            copies = _copies(ws, versions, ahead_dir, arch, toolchain, cache, report)
            with ThreadPoolExecutor(max_workers=max(1, min(len(copies) + 1, cores))) as pool:
                own = pool.submit(build_locked, ws.root, ws.build_dir, sources, arch, toolchain, cores, False,
                                  cache=cache)  # fmt: skip
                builds = list(pool.map(lambda copy: _build_copy(copy, arch, toolchain, cache), [c for _, c in copies]))
                result = own.result()
            _adopt_all(ws, copies, builds, report)
        finally:
            remove(ahead_dir, ws.root)
    result.seconds = report.seconds = round(time.perf_counter() - started, 3)
    result.ahead = report
    return result


def _adopt_all(ws: Workspace, copies: list[tuple[int, Workspace]], builds: list[BuildResult],
               report: AheadBuilds) -> None:  # fmt: skip
    """Move each built copy's library into the workspace's versions; count what was built and what failed."""
    for (index, _), result in zip(copies, builds):
        report.compiled += result.compiled
        if result.ok and result.library:
            _adopt(Path(result.library).parent, ws.build_dir / "versions")
            report.built += 1
        else:
            report.failed.append(index)
    prune_versions(ws.build_dir / "versions", keep=KEEP_VERSIONS)


def _copies(ws: Workspace, versions: Sequence[Mapping[str, str]], ahead_dir: Path, arch: str, toolchain: Toolchain,
            cache: Cache, report: AheadBuilds) -> list[tuple[int, Workspace]]:  # fmt: skip
    """A copy of the workspace per version still to build, as (index, copy). A version that is already a kept
    version, the same as an earlier one, or the workspace's own sources gets none and is counted in
    `report.kept_before`. The folder of the copies is the builder's alone: whatever is there (a link the workspace's
    writer made, say) is removed, and a folder made."""
    remove(ahead_dir, ws.root)
    make_folder(ahead_dir, ws.root)
    copies: list[tuple[int, Workspace]] = []
    own = sources_key(ws.root, render_ninja(ws.root, kernel_sources(ws), toolchain, arch))
    keys: set[str] = {own} if own is not None else set()  # the workspace's own build makes that one
    for index, version in enumerate(versions):
        copy = Workspace(ahead_dir / str(index))
        shutil.copytree(ws.kernels_dir, copy.kernels_dir, copy_function=shutil.copy2)
        for relative, content in version.items():
            target = copy.root / relative
            if is_plain_file(target) and target.read_text(errors="replace") == content:
                continue  # unchanged: it keeps its time, so its object is not compiled again
            write_file(target, content, copy.root)
        key = sources_key(copy.root, render_ninja(copy.root, kernel_sources(copy), toolchain, arch))
        if key is not None and (key in keys or _kept(ws.build_dir / "versions", key, cache)):
            report.kept_before += 1
            shutil.rmtree(copy.root)
            continue
        if key is not None:
            keys.add(key)
        _copy_build_state(ws.build_dir, copy.build_dir)
        copies.append((index, copy))
    return copies


def _kept(versions_dir: Path, key: str, cache: Cache) -> bool:
    """Whether a kept version was built from the sources of `key` (read only: its time is not touched)."""
    return versions_dir.is_dir() and any(built_from(folder, key, cache) for folder in versions_dir.iterdir())


def _copy_build_state(build_dir: Path, target: Path) -> None:
    """The objects, ninja's logs and the ptxas reports of `build_dir`, times kept; not the linked library or the
    versions, nor a link (whatever it leads to is not the build's)."""
    target.mkdir(parents=True)
    for path in build_dir.iterdir():
        if is_plain_file(path) and (path.name.endswith(".o") or path.name in _BUILD_STATE):
            shutil.copy2(path, target / path.name)
    resources = build_dir / "resources"
    if resources.is_dir() and not resources.is_symlink():
        (target / "resources").mkdir()
        for path in resources.iterdir():
            if is_plain_file(path):
                shutil.copy2(path, target / "resources" / path.name)


def _build_copy(copy: Workspace, arch: str, toolchain: Toolchain, cache: Cache) -> BuildResult:
    """Build a copy with one job (no lock: the copy is this request's alone); its record is signed in `cache`."""
    return build_locked(copy.root, copy.build_dir, kernel_sources(copy), arch, toolchain, 1, False, cache=cache)


def _adopt(version: Path, versions_dir: Path) -> None:
    """Move a copy's version folder into the workspace's versions (a folder of that name is the same library)."""
    target = versions_dir / version.name
    if target.is_dir() and not target.is_symlink():
        os.utime(target)
        return
    remove(target, versions_dir.parent.parent)  # a link (or a file) the workspace's writer put there
    make_folder(versions_dir, versions_dir.parent.parent)
    os.replace(version, target)  # one rename on one file system: a loader never sees half a folder
