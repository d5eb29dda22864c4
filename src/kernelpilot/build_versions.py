"""A workspace's built versions: each linked library copied to build/versions/<content hash>/ (a path unique to its
content, so one process can load build after build), the most recent few kept, and each one's record of the
sources it was built from, so that a build of the same sources again (the policy writing its fastest
configuration back, a fix that restores the last good source) is that version, with nothing compiled.

The record that counts is the builder's, signed in its cache folder (the judge's own for the judge's builds), not
the one in the workspace: the agent's tools write the workspace, and could plant a library under the record of
sources it was not built from (tests/adversarial/test_planted_builds.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from kernelpilot.harness.cache import MemoryCache, load_entry, store_entry
from kernelpilot.results import BuildResult, KernelResources, from_dict, to_dict
from kernelpilot.workspace import EXTENSION_NAME
from kernelpilot.workspace_files import is_plain_file, make_folder, write_file

# The most recently built versions kept: room for a search's builds ahead (build_ahead.MAX_AHEAD) and a few more.
KEEP_VERSIONS = 24
Cache = Path | MemoryCache | None  # where the signed records are: a cache folder, a judge's memory, the default
_VERSION_NAME = re.compile(r"[0-9a-f]{16}")  # what publish_version names a version folder


def publish_version(build_dir: Path) -> Path:
    """Copy the linked library to versions/<content hash>/, a path unique to this content, and mark it just built.

    A file already there is replaced unless it holds these very bytes: anyone who can write the workspace could have
    put other bytes under the name the next build's content will take (tests/adversarial/test_planted_builds.py), or
    a link there, or in that folder's place (refused: `workspace_files.py`)."""
    library = build_dir / f"{EXTENSION_NAME}.so"
    content = library.read_bytes()
    versioned = build_dir / "versions" / hashlib.sha256(content).hexdigest()[:16] / library.name
    make_folder(versioned.parent, build_dir.parent)
    if not (is_plain_file(versioned) and versioned.read_bytes() == content):
        write_file(versioned, content, build_dir.parent)  # whole: a concurrent loader never sees half a library
    os.utime(versioned.parent)  # a build back to older content makes that version recent again for pruning
    return versioned


def prune_versions(versions_dir: Path, *, keep: int = KEEP_VERSIONS, pinned: Iterable[Path] = ()) -> list[Path]:
    """Delete the version folders of `versions_dir` but the `keep` most recently built and the `pinned` ones.

    Only folders named as publish_version names them are considered; anything else in `versions_dir` stays.
    Deleting a library that a running process has loaded is safe on Linux: unlinking removes only the name,
    and the process's mapping keeps the file's data until it is unmapped. Returns the folders deleted.
    """
    if not versions_dir.is_dir():
        return []
    versions = [
        folder for folder in versions_dir.iterdir()
        if _VERSION_NAME.fullmatch(folder.name) and folder.is_dir() and not folder.is_symlink()
    ]
    versions.sort(key=lambda folder: (folder.stat().st_mtime_ns, folder.name), reverse=True)
    kept = {folder.name for folder in versions[:keep]} | {Path(folder).name for folder in pinned}
    stale = [folder for folder in versions if folder.name not in kept]
    for folder in stale:
        shutil.rmtree(folder)
    return stale


SOURCES_RECORD = "sources.json"  # in a version folder: the key of the sources it was built from (a hint, see below)
# The builder's signed record of each library it built, in its cache folder (harness/cache.py), by the library's
# SHA-256: the sources key it was built from and its kernels' resources. The workspace's own sources.json, which the
# agent's tools can write, only says which version folders to check; a version is reused only where the signed record
# of its library's content names the same sources.
RECORD_KIND = "build"
SOURCE_SUFFIXES = (".cu", ".cpp", ".cuh", ".h", ".hpp")  # kernel sources and headers: whose #include lines are read
_OUTSIDE_INCLUDE = re.compile(r'#\s*include\s*"(?:/|[^"]*\.\.)')


def sources_key(root: Path, ninja_text: str) -> str | None:
    """What a build's output depends on: build.ninja (compilers, flags, include and library paths, architecture),
    torch's version and every file under kernels/, by name and content. None when a source includes a file
    outside kernels/ by a quoted path (the key would not see it changing), so that build always runs ninja."""
    import torch

    digest = hashlib.sha256(ninja_text.encode())
    digest.update(torch.__version__.encode())
    kernels = root / "kernels"
    for path in sorted(p for p in kernels.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.suffix in SOURCE_SUFFIXES and _OUTSIDE_INCLUDE.search(data.decode(errors="replace")):
            return None
        name = path.relative_to(kernels).as_posix().encode()
        digest.update(len(name).to_bytes(8, "little") + name + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def record_sources(version: Path, key: str, resources: list[KernelResources], cache: Cache = None) -> None:
    """Record that `version` was built from the sources of `key`: signed in `cache` (None: the default cache folder),
    and as a hint in the version folder."""
    resources_data = [to_dict(r) for r in resources]
    store_entry(RECORD_KIND, {"library": file_digest(version / f"{EXTENSION_NAME}.so")},
                {"key": key, "resources": resources_data}, cache)  # fmt: skip
    # The workspace is build/versions/<version>/ up: the folders on the way are checked from there.
    write_file(version / SOURCES_RECORD, json.dumps({"key": key}), version.parents[2])


def built_from(version: Path, key: str, cache: Cache = None) -> dict | None:
    """The signed record of the version folder's library when it says the library was built from the sources of
    `key` (its "resources" are the kernels' ptxas reports); None otherwise: not a version folder, a hint naming
    other sources, or a library with no signed record (planted, changed, or recorded in another cache)."""
    library = version / f"{EXTENSION_NAME}.so"
    if not (_VERSION_NAME.fullmatch(version.name) and not version.is_symlink() and library.is_file()):
        return None
    try:
        if json.loads((version / SOURCES_RECORD).read_text()).get("key") != key:
            return None
    except (OSError, ValueError, AttributeError):
        return None
    record = load_entry(RECORD_KIND, {"library": file_digest(library)}, cache)
    return record if isinstance(record, dict) and record.get("key") == key else None


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's content, by which the signed records of libraries and objects are kept."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def reused_version(root: Path, build_dir: Path, key: str, arch: str, cache: Cache = None) -> BuildResult | None:
    """The kept version built from exactly these sources (the newest, where builds of them differ in their bytes, as
    nvcc's output does), as this build's result, marked just built so it is the newest for loading and pruning; or
    None. A search that goes back to a configuration it built before (the policy writing its fastest back, a fix
    that restores the last good source) so compiles nothing."""
    versions = build_dir / "versions"
    records = {folder: built_from(folder, key, cache) for folder in versions.iterdir()} if versions.is_dir() else {}
    matching = [folder for folder, record in records.items() if record is not None]
    if not matching:
        return None
    folder = max(matching, key=lambda folder: (folder.stat().st_mtime_ns, folder.name))
    os.utime(folder)
    resources = [from_dict(KernelResources, item) for item in records[folder].get("resources", [])]
    return BuildResult(ok=True, workspace=str(root), extension_name=EXTENSION_NAME, arch=arch,
                       library=str(folder / f"{EXTENSION_NAME}.so"), resources=resources, reused=True)  # fmt: skip
