"""Bash and process handling: a command runs in the workspace in its own process group (killed whole on timeout),
its output capped in the middle; writes and `cd` outside the workspace are refused before it runs
(shell_guard.py) and protected files are restored after. Those are guard rails for an honest model that slips;
the boundary is Landlock: where the kernel has it, the command's processes can write only inside the workspace
and /dev (`harness/confine.py`), so a program it runs cannot change another trajectory's workspace, the judge's
caches or kernelpilot's own files. Without Landlock a program can still write anywhere the user can. Either way no
process a command starts outlives it: a background job or a daemon that left the session is killed when the
command ends (`harness/confine.py`), so nothing the agent started runs while the judge builds or verifies."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelpilot.agent import ToolContext
from kernelpilot.agent.shell_guard import SCRATCH_DIR, WriteGuard
from kernelpilot.agent.tool_results import CommandRun
from kernelpilot.agent.tools.schema import CheckedTool, object_schema
from kernelpilot.errors import WorkspaceError
from kernelpilot.workspace import PROTECTED_FILES, tampered_files
from kernelpilot.workspace_files import copy_file, is_plain_file, own_folder, remove

if TYPE_CHECKING:
    from kernelpilot.workspace import Workspace

BASH_DEFAULT_TIMEOUT_S = 120
BASH_MAX_TIMEOUT_S = 600
BASH_OUTPUT_LIMIT = 20_000  # characters the model sees of one command's output
PRISTINE_DIR = ".kernelpilot/pristine"  # known-good copies of the protected files


class BashTool(CheckedTool):
    name = "Bash"
    description = (
        "Run a bash command in the workspace root (HOME and TMPDIR are a scratch folder inside it; no stdin). "
        f"Returns the combined stdout and stderr (long output keeps its head and tail) and the exit code. Timeout "
        f"{BASH_DEFAULT_TIMEOUT_S} s unless `timeout_s` says otherwise (at most {BASH_MAX_TIMEOUT_S}). Commands that "
        "would write or cd outside the workspace are refused, programs they run can write only inside it, and "
        "protected files (model.py, setup.py, kp_* files, "
        "...) are restored if a command changes them. Use it to inspect, grep, run quick Python checks; build and "
        "test with Compile, Verify and Profile."
    )
    parameters = object_schema(
        {
            "command": {"type": "string", "minLength": 1, "description": "the bash command line"},
            "timeout_s": {"type": "integer", "minimum": 1, "maximum": BASH_MAX_TIMEOUT_S, "description": "seconds"},
        },
        ["command"],
    )

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> CommandRun:
        ws, command = ctx.workspace, args["command"]
        root, scratch = ws.root.resolve(), ws.root.resolve() / SCRATCH_DIR
        WriteGuard(root, scratch).check(command)
        own_folder(scratch, root)
        keep_pristine_copies(ws)
        environment = dict(os.environ, HOME=str(scratch), TMPDIR=str(scratch), PWD=str(root))
        timeout = args.get("timeout_s", BASH_DEFAULT_TIMEOUT_S)
        run = run_process(confined(["bash", "-c", command], writable=[root]), cwd=root, env=environment, timeout=timeout)
        restored, lost = restore_protected(ws)
        output, cut = cap_middle(run.output, BASH_OUTPUT_LIMIT)
        return CommandRun(command, run.returncode, run.timed_out, timeout, run.seconds, len(run.output), cut,
                          restored, lost, output)  # fmt: skip


def confined(argv: list[str], *, writable: list[Path]) -> list[str]:
    """`argv` run so that it writes only under `writable` (and /dev) where the kernel has Landlock (elsewhere it is
    not confined), and so that no process it starts outlives it (`harness/confine.py`)."""
    from kernelpilot.harness.confine import landlock_available

    folders = [str(folder) for folder in writable] if landlock_available() else []
    return [sys.executable, "-m", "kernelpilot.harness.confine", *folders, "--", *argv]


@dataclass
class ProcessRun:
    """What a subprocess did: its merged output, exit code, whether it was killed for time, and how long it took."""

    output: str
    returncode: int | None
    timed_out: bool
    seconds: float


def run_process(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> ProcessRun:
    """Run `argv` with no stdin in its own process group; on timeout stop it (SIGTERM, then SIGKILL to the whole
    group, children included)."""
    started = time.monotonic()
    process = subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        raw, _ = process.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        # A confined command's reaper kills all it started on SIGTERM, those that left the group included; then
        # the group is killed whole, whatever it runs.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        try:
            raw, _ = process.communicate(timeout=5)
        except subprocess.TimeoutExpired as still_open:  # a process that left the group still holds the pipe
            process.kill()
            raw = still_open.output or b""
        timed_out = True
    seconds = round(time.monotonic() - started, 3)
    return ProcessRun(raw.decode("utf-8", errors="replace"), process.returncode, timed_out, seconds)


def cap_middle(text: str, limit: int) -> tuple[str, int]:
    """`text` cut to about `limit` characters keeping its head and tail at line boundaries; also how much was cut."""
    if len(text) <= limit:
        return text, 0
    head = text[: limit // 2]
    head = head[: head.rfind("\n") + 1] or head
    tail = text[-(limit // 2) :]
    tail = tail[tail.find("\n") + 1 :] if "\n" in tail[:-1] else tail
    middle = text[len(head) : len(text) - len(tail)]
    note = f"[... {len(middle)} characters ({middle.count(chr(10))} lines) cut from the middle of the output ...]\n"
    return head + note + tail, len(middle)


def keep_pristine_copies(ws: Workspace) -> None:
    """Keep a copy of every protected file that is intact under .kernelpilot/pristine/, to restore it from later.

    The folder is kernelpilot's alone, and its writes never follow a link (`workspace_files.py`): a link the agent's
    commands put in place of it or of a folder in it is removed (not what it leads to), and the copies made again."""
    tampered = set(tampered_files(ws))
    pristine = own_folder(ws.root / PRISTINE_DIR, ws.root)
    for name in PROTECTED_FILES:
        copy, original = pristine / name, ws.root / name
        if name in tampered or (is_plain_file(copy) and copy.read_bytes() == original.read_bytes()):
            continue
        own_folder(copy.parent, pristine)
        copy_file(original, copy, pristine, keep_time=True)


def restore_protected(ws: Workspace) -> tuple[list[str], list[str]]:
    """Put back changed or deleted protected files from their pristine copies; return (restored, not restorable).
    A file that cannot be put back without following a link (kernels/ made a link, say) is not restorable."""
    tampered = tampered_files(ws)
    for name in tampered:
        copy, target = ws.root / PRISTINE_DIR / name, ws.root / name
        if not copy.is_file():
            continue
        with contextlib.suppress(WorkspaceError):
            remove(target, ws.root)
            copy_file(copy, target, ws.root, keep_time=True)  # with its mode: model.py is read-only again
    still_tampered = set(tampered_files(ws)) if tampered else set()
    restored = [name for name in tampered if name not in still_tampered]
    return restored, [name for name in tampered if name in still_tampered]
