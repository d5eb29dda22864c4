"""Precompiled torch headers for the C++ side of a build (bindings and the registration), made once per compiler,
torch and flag set, and shared by every workspace.

Parsing torch's headers is most of a binding's compile: on a 2-core machine, g++ -O1 takes 8.2 s on the example
binding and 4.3 s on the registration (kp_module.cpp); with the header precompiled, 2.9 s and 2.8 s. The header
(`kp_torch.h`: torch/types.h, torch/library.h and c10's CUDA guard and stream, what the bindings include) is
compiled once to `kp_torch.h.gch` (about 20 s and 0.5 GB), and every C++ compile gets `-include kp_torch.h`: g++
reads the .gch in its place where it was made with compatible flags, and parses the header as usual where it was
not, so the objects never depend on whether it was used.

Where it lives: `$KERNELPILOT_PCH_DIR`, else `<cache dir>/pch`, one folder per key. A candidate that could write
there would compile its code into every later build, so a build uses one only where sandboxes are confined
(Landlock: they write only their own folders); `KERNELPILOT_PCH=0` turns it off.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

HEADER_NAME = "kp_torch.h"
HEADER_TEXT = """\
// Written by kernelpilot (pch.py): the torch headers every binding includes, precompiled once and shared.
#include <torch/types.h>
#include <torch/library.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
"""
ENABLE_ENV = "KERNELPILOT_PCH"
DIR_ENV = "KERNELPILOT_PCH_DIR"
# How long a build waits for another process making the same header before it compiles without one.
WAIT_S = 300.0
COMPILE_TIMEOUT_S = 600.0
FAILED_NAME = "failed.txt"


def pch_root() -> Path:
    explicit = os.environ.get(DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    from kernelpilot.harness.cache import default_cache_dir

    return default_cache_dir() / "pch"


def include_flags(cxx: str, flags: list[str], sources: list[Path]) -> list[str]:
    """`-include` of the shared header for a build of `sources` (nothing where none has a C++ source or none is used)."""
    header = precompiled_header(cxx, flags) if any(source.suffix == ".cpp" for source in sources) else None
    return ["-include", str(header)] if header else []


def precompiled_header(cxx: str, flags: list[str]) -> Path | None:
    """The header to pass as `-include`, its .gch made on first use under a lock; None where no header is used
    (turned off, not g++, sandboxes not confined, or its compile failed once: that failure is kept in its folder)."""
    if os.environ.get(ENABLE_ENV, "1") == "0" or not _is_gcc(cxx) or not _sandboxes_confined():
        return None
    folder = pch_root() / _key(cxx, flags)
    header, compiled = folder / HEADER_NAME, folder / f"{HEADER_NAME}.gch"
    if compiled.is_file():
        return header
    if (folder / FAILED_NAME).is_file():
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / ".lock").open("a") as lock:
            if not _wait_for(lock.fileno(), WAIT_S):
                return None
            if not compiled.is_file():
                _compile(cxx, flags, folder)
    except OSError:
        return None  # a folder we cannot write: compile as without one
    return header if compiled.is_file() else None


def _compile(cxx: str, flags: list[str], folder: Path) -> None:
    header = folder / HEADER_NAME
    if not header.is_file() or header.read_text() != HEADER_TEXT:
        _write_atomically(header, HEADER_TEXT)
    partial = folder / f".{os.getpid()}.gch"
    command = [cxx, *flags, "-x", "c++-header", str(header), "-o", str(partial)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        partial.unlink(missing_ok=True)
        return  # not kept as a failure: a busy machine may do it next time
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        _write_atomically(folder / FAILED_NAME, f"$ {' '.join(command)}\n{done.stderr[-4000:]}")
        return
    os.replace(partial, folder / f"{HEADER_NAME}.gch")


def _key(cxx: str, flags: list[str]) -> str:
    """What a .gch depends on: the compiler (its path and version), the flags and the header's text."""
    canonical = json.dumps([*_compiler(cxx), flags, HEADER_TEXT])
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def _is_gcc(cxx: str) -> bool:
    """g++ (its .gch and -include); clang's precompiled headers work differently and are not used."""
    return _compiler(cxx)[1].startswith("gcc version ")


@functools.lru_cache(maxsize=8)
def _compiler(cxx: str) -> tuple[str, str]:
    """The compiler's resolved path and its version line, asked once per process (every build renders its flags).
    `-v` ends with "gcc version 12.2.0 (...)" for g++ under any name (c++, g++-12), "clang version ..." for clang."""
    resolved = str(Path(shutil.which(cxx) or cxx).resolve())
    try:
        done = subprocess.run([cxx, "-v"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return resolved, ""
    lines = [line for line in done.stderr.splitlines() if " version " in line] if done.returncode == 0 else []
    return resolved, lines[-1] if lines else ""


def _sandboxes_confined() -> bool:
    from kernelpilot.harness.confine import landlock_available

    return landlock_available()


def _wait_for(descriptor: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)
