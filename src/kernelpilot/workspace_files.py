"""Writes the trusted side makes in a workspace, which never follow a link planted there.

The workspace is written by the agent's tools and by the candidate's code: Landlock keeps their writes inside it, but
a link they make there may lead anywhere. The judge's worker, the agent's own process and `init`/`accept` are not
confined, and write build outputs, records and copies into the workspace; a write through such a link lands outside
it (tests/adversarial/test_planted_links.py: build/build.ninja made a link to a .pth file in site-packages, which
Python would run in every later kernelpilot process). So each of those writes goes through here:

- the folders are opened one at a time from one the caller trusts (`within`: the workspace root, in which the build
  folder is) without following links, and a link where a folder is expected is refused in one sentence (where the folder
  is kernelpilot's alone, `own_folder` removes the link instead and makes the folder);
- a file is written as a new file in its folder (O_CREAT | O_EXCL | O_NOFOLLOW) and renamed over its name, which
  replaces a link or anything else there instead of writing where it leads; a file opened to append to (a lock, a
  transcript) is opened with O_NOFOLLOW, and a link or other non-file in its place is removed first.

The opened folders are descriptors, so a link swapped in while a write is under way is not followed either.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from kernelpilot.errors import WorkspaceError

_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@contextlib.contextmanager
def open_folder(path: Path, within: Path, *, create: bool = True) -> Iterator[int]:
    """A descriptor of the folder `path` (made where missing, with `create`), opened one component at a time from
    `within` (trusted: followed if it is a link) without following a link; WorkspaceError for a link or a file where a
    folder is, FileNotFoundError for a missing one without `create`."""
    parts = Path(path).relative_to(within).parts
    if create:
        Path(within).mkdir(parents=True, exist_ok=True)  # trusted, as the folders above it
    descriptor = os.open(within, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        walked = Path(within)
        for part in parts:
            walked = walked / part
            child = _open_child_folder(descriptor, part, walked, create)
            os.close(descriptor)
            descriptor = child
        yield descriptor
    finally:
        os.close(descriptor)


def _open_child_folder(parent: int, name: str, path: Path, create: bool) -> int:
    try:
        return _open_folder_at(parent, name, path)
    except FileNotFoundError:
        if not create:
            raise
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o777, dir_fd=parent)
    return _open_folder_at(parent, name, path)


def _open_folder_at(parent: int, name: str, path: Path) -> int:
    try:
        return os.open(name, _FOLDER, dir_fd=parent)
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise _not_a_folder(path, os.lstat(name, dir_fd=parent)) from None


def _not_a_folder(path: Path, status: os.stat_result) -> WorkspaceError:
    if stat.S_ISLNK(status.st_mode):
        return WorkspaceError(f"{path} is a link, so kernelpilot would write wherever it leads.",
                              hint=f"remove it (rm {path}); kernelpilot makes a folder there")  # fmt: skip
    return WorkspaceError(f"{path} is a file where kernelpilot keeps a folder.",
                          hint=f"remove it (rm {path}); kernelpilot makes a folder there")  # fmt: skip


def make_folder(path: Path, within: Path) -> Path:
    """Make `path` and the folders between it and `within` where missing, refusing a link on the way."""
    with open_folder(path, within):
        return Path(path)


def own_folder(path: Path, within: Path) -> Path:
    """Make `path` a folder, removing a link or a file in its place first (the link, never what it leads to): for a
    folder that is kernelpilot's alone (a scratch folder, a folder of copies), where only a planted link can be. The
    folders above it are checked as `open_folder` checks them."""
    try:
        return make_folder(path, within)
    except WorkspaceError:
        remove(path, within)
        return make_folder(path, within)


def write_file(path: Path, data: str | bytes, within: Path, *, mode: int | None = None,
               mtime_ns: int | None = None) -> None:  # fmt: skip
    """Put a new file holding `data` (text as UTF-8) at `path`, whatever was there (a link is replaced, not followed).

    `mode`: its permissions (default: as a new file gets them); `mtime_ns`: its modification time (default: now).
    Readers see the old file or the new one, never half of one."""
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    path = Path(path)
    with open_folder(path.parent, within) as folder:
        partial = f".{path.name}.{secrets.token_hex(4)}.partial"
        descriptor = os.open(partial, _NEW_FILE, 0o666, dir_fd=folder)
        try:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(payload)
                handle.flush()
                if mode is not None:
                    os.fchmod(handle.fileno(), mode)
                if mtime_ns is not None:
                    os.utime(handle.fileno(), ns=(mtime_ns, mtime_ns))
            _replace(partial, path, folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial, dir_fd=folder)
            raise


def _replace(partial: str, path: Path, folder: int) -> None:
    try:
        os.replace(partial, path.name, src_dir_fd=folder, dst_dir_fd=folder)
    except IsADirectoryError:
        raise WorkspaceError(f"{path} is a folder where kernelpilot writes a file.",
                             hint=f"remove it (rm -r {path}); kernelpilot writes the file there") from None


def copy_file(source: Path, target: Path, within: Path, *, keep_time: bool = False) -> None:
    """`write_file` of `source`'s content and permissions at `target` (and its modification time with `keep_time`,
    as ninja compares times); `source` is read as it is (the caller checks it is not a link where that matters)."""
    status = os.stat(source)
    write_file(target, Path(source).read_bytes(), within, mode=stat.S_IMODE(status.st_mode),
               mtime_ns=status.st_mtime_ns if keep_time else None)  # fmt: skip


@contextlib.contextmanager
def open_to_append(path: Path, within: Path) -> Iterator[int]:
    """A descriptor of the file `path` opened to append to (made when missing); a link or anything but a file in its
    place is removed first, never followed or opened (a FIFO would block)."""
    path = Path(path)
    with open_folder(path.parent, within) as folder:
        descriptor = _open_append(path.name, folder)
        try:
            os.set_blocking(descriptor, True)
            yield descriptor
        finally:
            os.close(descriptor)


def _open_append(name: str, folder: int) -> int:
    for _ in range(3):  # what was removed may be planted again before the next try
        try:
            descriptor = os.open(name, _APPEND, 0o666, dir_fd=folder)
        except OSError as err:
            if err.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a link, a FIFO, a folder
                raise
        else:
            if stat.S_ISREG(os.fstat(descriptor).st_mode):
                return descriptor
            os.close(descriptor)
        _remove_entry(name, folder)
    raise WorkspaceError(f"Something keeps putting a link or a non-file where kernelpilot writes {name}.")


def append_text(path: Path, text: str, within: Path) -> None:
    """Append `text` (UTF-8) to the file `path` and force it to disk, as `open_to_append` opens it."""
    with open_to_append(path, within) as descriptor:
        payload = memoryview(text.encode("utf-8"))
        while payload:
            payload = payload[os.write(descriptor, payload):]
        os.fsync(descriptor)


def remove(path: Path, within: Path) -> None:
    """Remove `path`: a link or a file is unlinked, a folder removed with all in it, never following a link (neither
    at `path` nor in it nor on the way from `within`); nothing when it is missing."""
    path = Path(path)
    try:
        with open_folder(path.parent, within, create=False) as folder:
            _remove_entry(path.name, folder)
    except FileNotFoundError:
        pass


def _remove_entry(name: str, folder: int) -> None:
    try:
        status = os.lstat(name, dir_fd=folder)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(status.st_mode):
        shutil.rmtree(name, dir_fd=folder)  # by descriptors: a link inside is unlinked, never followed
    else:
        os.unlink(name, dir_fd=folder)


def is_plain_file(path: Path) -> bool:
    """Whether `path` is a file and not a link (to one or to anything else)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
