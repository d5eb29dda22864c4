"""The build folder's objects, checked against the builder's signed records before ninja runs.

ninja compiles a source only when its object is missing or older than what it depends on, and links only when the
library is older than its objects. The build folder is in the workspace, which the agent's tools write: an object
planted there (or an old one put back) with a newer time would be linked in place of its source, and a library put
there would be published as the build of the sources beside it. So before ninja runs, every object whose builder's
record (an HMAC-signed cache entry keyed by the object's SHA-256, as for versions in `build_versions.py`) does not
name its source and the workspace headers it includes (from ninja's deps, read right after its compile) as they
are now is deleted, the linked library is deleted (the build always
links), and links in the build folder are removed. After ninja, each object it compiled is recorded.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from kernelpilot.build_versions import Cache, file_digest
from kernelpilot.harness.cache import load_entry, store_entry
from kernelpilot.workspace import EXTENSION_NAME

RECORD_KIND = "object"
_HEADER_SUFFIXES = (".h", ".cuh", ".hpp")


def object_name(source: Path) -> str:
    """kernels/foo.cu -> foo.cu.o: one object per source, so a .cu and a .cpp of one stem never collide."""
    return f"{source.name}.o"


def _object_key(root: Path, source: Path, headers: list[str]) -> str:
    """What an object was compiled from in the workspace: its source and the workspace headers it includes (by name
    and content; a header that is gone counts as empty)."""
    digest = hashlib.sha256()
    for relative in [source.relative_to(root).as_posix(), *sorted(headers)]:
        path = root / relative
        data = path.read_bytes() if path.is_file() else b""
        digest.update(len(relative).to_bytes(8, "little") + relative.encode() + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def _workspace_headers(root: Path, build_dir: Path, ninja: str, obj: str) -> list[str]:
    """The workspace files an object just compiled includes, from ninja's deps log (`ninja -t deps`), which this
    build's compile has just written: workspace-relative paths."""
    listed = subprocess.run([ninja, "-C", str(build_dir), "-t", "deps", obj], capture_output=True, text=True,
                            timeout=60).stdout  # fmt: skip
    headers = []
    kernels = (root / "kernels").resolve()
    for line in listed.splitlines()[1:]:
        path = (build_dir / line.strip()).resolve() if line.strip() else None
        if path is not None and path.is_relative_to(kernels) and path.suffix in _HEADER_SUFFIXES:
            headers.append(path.relative_to(root.resolve()).as_posix())
    return headers


def drop_unrecorded(root: Path, build_dir: Path, sources: list[Path], cache: Cache = None) -> list[str]:
    """Before ninja: delete each object of `sources` that this builder's records do not say was compiled from the
    source and headers as they are now, the linked library, and any link in `build_dir`; return the objects deleted
    (their sources are compiled again)."""
    for entry in build_dir.iterdir():
        if entry.is_symlink():
            entry.unlink()
    (build_dir / f"{EXTENSION_NAME}.so").unlink(missing_ok=True)
    dropped = []
    for source in sources:
        obj = build_dir / object_name(source)
        if not obj.is_file():
            continue
        record = load_entry(RECORD_KIND, {"object": file_digest(obj)}, cache)
        headers = record.get("headers") if isinstance(record, dict) else None
        if not isinstance(headers, list) or record.get("key") != _object_key(root, source, headers):
            obj.unlink()
            dropped.append(source.relative_to(root).as_posix())
    return dropped


def record_compiled(root: Path, build_dir: Path, ninja: str, compiled: list[str], cache: Cache = None) -> None:
    """After ninja: record each object it compiled (`compiled`: workspace-relative sources) as built from its source
    and the workspace headers it includes, as they are now."""
    for relative in compiled:
        source = root / relative
        obj = build_dir / object_name(source)
        if source.is_file() and obj.is_file() and not obj.is_symlink():
            headers = _workspace_headers(root, build_dir, ninja, obj.name)
            store_entry(RECORD_KIND, {"object": file_digest(obj)},
                        {"key": _object_key(root, source, headers), "headers": headers}, cache)  # fmt: skip
