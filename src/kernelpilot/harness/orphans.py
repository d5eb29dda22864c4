"""TRUSTED side: no process a candidate starts outlives its sandbox.

A candidate can fork a daemon that leaves its process group (setsid) to act later: rewrite a cache, tamper with the
next candidate's files, watch the judge. The worker makes itself a child subreaper, so such orphans become its
children instead of init's, and after every step it kills every child of its own it did not start (and reaps them).
Linux only; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children (Linux); False where that is not possible."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children(pid: int | None = None) -> set[int]:
    """The pids whose parent is `pid` (this process by default), from /proc."""
    pid = os.getpid() if pid is None else pid
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def kill_orphans(keep: set[int]) -> list[int]:
    """SIGKILL (and reap) every child of this process not in `keep`; returns the pids killed."""
    killed = []
    for pid in sorted(children() - keep):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    return killed


def kill_descendants(rounds: int = 1000) -> int:
    """As a child subreaper: SIGKILL and reap every child, then the orphans that come to this process as their
    parents die, until none is left (or `rounds` is spent); returns how many were killed."""
    killed = 0
    for _ in range(rounds):
        found = children()
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        for pid in found:
            try:
                os.waitpid(pid, 0)  # once reaped, its own children have been handed to this process
            except ChildProcessError:
                pass
    return killed
