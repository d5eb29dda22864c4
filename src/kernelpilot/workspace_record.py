"""What kernelpilot made a workspace with, kept where the agent cannot write it.

The manifest (.kernelpilot/manifest.json) holds the problem's id and the SHA-256 of every protected file, but it
lives in the workspace, which the agent's tools write: a program run from Bash can rewrite the reference (model.py)
so that it agrees with a wrong kernel, and the manifest so that it agrees with the reference. So `init` also stores
the problem id and the hashes as a signed entry in kernelpilot's cache folder (`harness/cache.py`: kind
"workspace", keyed by the workspace's folder), which Landlock keeps the agent's commands and the candidates'
sandboxes from writing. The tamper check (`workspace.tampered_files`) compares the protected files with that record
where there is one, and names a manifest that disagrees with it; a workspace without one (made by an older
kernelpilot, moved, or cloned) is checked against its manifest alone, as before.

The lock file that `accept` writes (kernelpilot.lock.json: the hashes of the files it verified, its figures) is in
the workspace too, and `load`, `swap` and `check` believe it. So each lock `accept` writes is recorded the same way,
by its SHA-256: a lock that no `accept` wrote into this workspace is refused where the workspace has recorded
locks (any lock accept ever wrote here passes: a `git checkout` of an older accepted version still loads). A
workspace with none recorded (a clone) keeps trusting its lock, as before.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

KIND = "workspace"
LOCK_KIND, LOCKED_KIND = "workspace-lock", "workspace-locked"


def store_record(root: Path, problem_id: str, files: dict[str, str]) -> bool:
    """Sign `problem_id` and the protected files' hashes as the record of the workspace at `root`; False where the
    cache folder cannot be written (the workspace is then checked against its manifest)."""
    from kernelpilot.harness.cache import store_entry

    try:
        store_entry(KIND, _key(root), {"problem_id": problem_id, "files": dict(files)})
    except OSError:
        return False
    return True


def stored_record(root: Path) -> dict | None:
    """The signed record of the workspace at `root` ({"problem_id", "files"}), or None when there is none."""
    from kernelpilot.harness.cache import load_entry

    value = load_entry(KIND, _key(root))
    well_formed = (isinstance(value, dict) and isinstance(value.get("problem_id"), str)
                   and isinstance(value.get("files"), dict))  # fmt: skip
    return value if well_formed else None


def store_lock(root: Path, text: str) -> None:
    """Record the lock text `accept` wrote into the workspace at `root` (nothing where the cache cannot be written)."""
    from kernelpilot.harness.cache import store_entry

    try:
        store_entry(LOCK_KIND, {**_key(root), "sha256": _digest(text)}, True)
        store_entry(LOCKED_KIND, _key(root), True)
    except OSError:
        pass


def lock_written_here(root: Path, text: str) -> bool | None:
    """Whether `accept` wrote this lock text into the workspace at `root`; None when it has no lock recorded."""
    from kernelpilot.harness.cache import load_entry

    if load_entry(LOCK_KIND, {**_key(root), "sha256": _digest(text)}) is True:
        return True
    return False if load_entry(LOCKED_KIND, _key(root)) is True else None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _key(root: Path) -> dict[str, str]:
    return {"workspace": str(Path(root).resolve())}
