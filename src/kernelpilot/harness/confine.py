"""The sandbox confines itself before any candidate code runs: no new privileges, death with the judge, and
(where the kernel has Landlock) writes only to its own folders.

Reading stays open (Python, torch, the workspace's sources and its built extension must be read), but a candidate
can then write nowhere except the sandbox's private home, temp and cache folders, the judge's shared-tensor folder
and /dev (the GPU's device files): not the baseline cache, not the workspace, not the Python installation (a .pth
file there would run code in every later Python process, the judge's included), not another sandbox's caches.
Landlock needs Linux 5.13; elsewhere the sandbox says it is unconfined and runs as before, and the judge, told so
before any candidate code runs, no longer trusts its cache folder (`cache.py`).

`python -m kernelpilot.harness.confine [FOLDER...] -- COMMAND...` runs a command under the same write confinement
(the agent's Bash: its programs write only in the workspace and /dev; with no FOLDER, where Landlock is missing,
unconfined) and outlives it by nothing: it runs the command as a child, is the child subreaper of everything the
command starts (a daemon that leaves its session included), and when the command ends, or this process is told to
stop, kills all of them (`orphans.py`). A process an agent's command left running could otherwise change the
workspace while the judge builds or verifies it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

WRITABLE_ENV = "KERNELPILOT_SANDBOX_WRITABLE"  # os.pathsep-separated folders the sandbox may write under

_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same on x86-64 and arm64
_LANDLOCK_CREATE_RULESET_VERSION, _LANDLOCK_RULE_PATH_BENEATH = 1, 1
# Every right that changes the file system (Landlock ABI 1), then REFER (ABI 2) and TRUNCATE (ABI 3).
_WRITE_RIGHTS = {1: sum(1 << bit for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12)), 2: 1 << 13, 3: 1 << 14}


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def harden() -> str:
    """Apply every confinement this system allows; returns how the file system is confined ("landlock" | "none")."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if os.getppid() == 1:  # the judge died before the death signal was armed
        os._exit(4)
    writable = [path for path in os.environ.get(WRITABLE_ENV, "").split(os.pathsep) if path]
    return "landlock" if writable and restrict_writes(libc, [*writable, "/dev"]) else "none"


def landlock_available() -> bool:
    """Whether this kernel offers Landlock, so that `harden` can confine a process's writes."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION)) >= 1


def restrict_writes(libc: ctypes.CDLL, writable: list[str]) -> bool:
    """Allow this process (and its children) to write only under `writable`; False when Landlock is missing."""
    abi = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION))
    if abi < 1:
        return False
    rights = sum(right for version, right in _WRITE_RIGHTS.items() if version <= abi)
    attr = _RulesetAttr(rights)
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        return False
    try:
        for path in writable:
            try:
                folder = os.open(path, os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY)
            except OSError:
                continue
            rule = _PathBeneath(rights, folder)
            added = libc.syscall(_SYS_ADD_RULE, ruleset, ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH), ctypes.byref(rule), ctypes.c_uint32(0))
            os.close(folder)
            if added != 0:
                return False
        return libc.syscall(_SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) == 0
    finally:
        os.close(ruleset)


def run_confined(argv: list[str]) -> None:
    """`[FOLDER...] -- COMMAND...`: run COMMAND with no new privileges, able to write only under the FOLDERs and
    /dev (where Landlock cannot confine it, it does not run: exit 126; with no FOLDER it is not confined), then kill
    every process it left; exit with its status."""
    from kernelpilot.harness.orphans import become_subreaper, kill_descendants

    if "--" not in argv or argv.index("--") == len(argv) - 1:
        sys.stderr.write("usage: python -m kernelpilot.harness.confine [FOLDER...] -- COMMAND...\n")
        os._exit(2)
    split = argv.index("--")
    writable, command = argv[:split], argv[split + 1 :]
    stopped = []

    def stop(signum: int, _frame: object) -> None:
        stopped.append(signum)
        kill_descendants()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)  # exec gives the command the default handlers back
    become_subreaper()
    child = os.fork()
    if child == 0:
        _exec_confined(writable, command)
    status = 0
    while True:  # any child: orphans handed to this process are reaped as they end, not left as zombies
        try:
            pid, code = os.wait()
        except ChildProcessError:  # killed and reaped by `stop`
            break
        except InterruptedError:
            continue
        if pid == child:
            status = code
            break
    kill_descendants()
    os._exit(128 + stopped[0] if stopped else _exit_code(status))


def _exec_confined(writable: list[str], command: list[str]) -> None:
    """In the forked child: no new privileges, Landlock's write rule when FOLDERs were given, then exec."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if writable and not restrict_writes(libc, [*writable, "/dev"]):
        sys.stderr.write("kernelpilot: Landlock could not confine this command's writes, so it did not run.\n")
        os._exit(126)
    try:
        os.execvp(command[0], command)
    except OSError as err:
        sys.stderr.write(f"kernelpilot: cannot run {command[0]}: {err.strerror or err}\n")
        os._exit(127)


def _exit_code(status: int) -> int:
    """A shell's exit code for a wait status: the code, or 128 + the signal that ended it."""
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    run_confined(sys.argv[1:])
