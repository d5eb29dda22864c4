"""The agent's tools: one small class per action the model can take on its workspace and the judge.

Each tool has a name, a description written for the model, a JSON schema of its arguments (validated here,
without dependencies, before it runs) and `run(args, ctx) -> ToolOutput`: text for the model and a plain dict for
the transcript and the TUI. Anything the model can fix (a bad argument, a missing file, a refused command) is a
RecoverableError whose message becomes its next observation.

The judge tools return typed results (`ToolOutput.result`: a BuildResult, a VerifyOutcome or an EvalResult),
rendered for the model by `agent/observations.py`, and note them in `ctx.judged` (a JudgeRecord). Only those
count; the model's own claims (Finish's summary) never do.

Bash's checks (writes and `cd` outside the workspace refused before running, by shell_guard.py; protected files
restored after) are guard rails for an honest model that slips, not a security sandbox: a program can still write
anywhere it likes.
"""

from __future__ import annotations

import abc
import contextlib
import csv
import difflib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from kernelpilot.agent import JudgeResult, RecoverableError, Tool, ToolContext, ToolOutput, VerifyOutcome
from kernelpilot.agent.observations import build_text, render
from kernelpilot.agent.shell_guard import BOOKKEEPING_DIR, SCRATCH_DIR, WriteGuard
from kernelpilot.results import BuildResult, to_dict
from kernelpilot.workspace import PROTECTED_FILES, tampered_files

if TYPE_CHECKING:
    from kernelpilot.workspace import Workspace

BASH_DEFAULT_TIMEOUT_S = 120
BASH_MAX_TIMEOUT_S = 600
BASH_OUTPUT_LIMIT = 20_000  # characters the model sees of one command's output
GLOB_LIMIT = 200
READ_DEFAULT_LINES = 2000
READ_LINE_LIMIT = 2000  # characters shown of one line
READ_OUTPUT_LIMIT = 60_000
MAX_TRIALS = 20
MAX_LAUNCHES_SHOWN = 20
NCU_TIMEOUT_S = 300

PRISTINE_DIR = ".kernelpilot/pristine"  # known-good copies of the protected files
EDITABLE_KERNEL_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")
EDITABLE_FILES_TEXT = "kernels/*.cu, kernels/*.cuh, kernels/*.h, kernels/*.cpp, model_new.py and notes/*.md"
PROTECTED_REASON = "it is kernelpilot's (the reference or the build infrastructure) and must stay unchanged"


# ------------------------------------------------------------------------------------ argument schemas


def validate_arguments(tool_name: str, schema: dict[str, Any], args: Any) -> None:
    """Raise RecoverableError naming the first way `args` breaks `schema` (the JSON-schema subset our tools use)."""
    if not isinstance(args, dict):
        raise RecoverableError(f"{tool_name} takes a JSON object of arguments, not {_json_type(args)}.")
    _check_value(args, schema, tool_name, "")


def _check_value(value: Any, schema: dict[str, Any], tool_name: str, where: str) -> None:
    expected = schema.get("type")
    if expected and not _has_json_type(value, expected):
        raise RecoverableError(f"{tool_name}: {_argument(where)} must be {_a(expected)}, not {_json_type(value)}.")
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(json.dumps(option) for option in schema["enum"])
        raise RecoverableError(f"{tool_name}: {_argument(where)} must be one of {allowed}, not {json.dumps(value)}.")
    if expected == "object":
        _check_object(value, schema, tool_name, where)
    elif expected == "array":
        if len(value) < schema.get("minItems", 0):
            raise RecoverableError(f"{tool_name}: {_argument(where)} needs at least {schema['minItems']} item(s).")
        for index, item in enumerate(value):
            _check_value(item, schema.get("items", {}), tool_name, f"{where}[{index}]")
    elif expected == "string" and len(value) < schema.get("minLength", 0):
        raise RecoverableError(f"{tool_name}: {_argument(where)} must not be empty.")
    elif expected == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None and value < low:
            raise RecoverableError(f"{tool_name}: {_argument(where)} must be at least {low}, not {value}.")
        if high is not None and value > high:
            raise RecoverableError(f"{tool_name}: {_argument(where)} must be at most {high}, not {value}.")


def _check_object(value: dict[str, Any], schema: dict[str, Any], tool_name: str, where: str) -> None:
    properties = schema.get("properties", {})
    prefix = f"{where}." if where else ""
    for name in schema.get("required", []):
        if name not in value:
            raise RecoverableError(f"{tool_name}: the argument `{prefix}{name}` is required.")
    unknown = [name for name in value if name not in properties]
    if unknown and schema.get("additionalProperties") is False:
        takes = ", ".join(properties) or "no arguments"
        raise RecoverableError(f"{tool_name}: unknown argument `{prefix}{unknown[0]}`; it takes: {takes}.")
    for name, item in value.items():
        if name in properties:
            _check_value(item, properties[name], tool_name, f"{prefix}{name}")


def _has_json_type(value: Any, expected: str) -> bool:
    if expected == "integer":
        return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a number
    return _json_type(value) == expected or (expected == "number" and _json_type(value) == "integer")


def _json_type(value: Any) -> str:
    for python_type, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                              (list, "array"), (dict, "object")):  # fmt: skip
        if isinstance(value, python_type):
            return name
    return "null" if value is None else type(value).__name__


def _argument(where: str) -> str:
    return f"`{where}`" if where else "the arguments"


def _a(type_name: str) -> str:
    return f"an {type_name}" if type_name[0] in "aeiou" else f"a {type_name}"


def _object_schema(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required or [], "additionalProperties": False}


class _CheckedTool(abc.ABC):
    """A tool whose arguments are checked against its schema before `execute` runs."""

    name: str
    description: str
    parameters: dict[str, Any]

    def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        validate_arguments(self.name, self.parameters, args)
        return self.execute(args, ctx)

    @abc.abstractmethod
    def execute(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        """Do the tool's work with arguments that match its schema."""


# --------------------------------------------------------------------------------- workspace paths


def resolve_in_workspace(ws: Workspace, raw: str) -> Path:
    """`raw` (relative to the workspace root, or absolute) as a resolved path; RecoverableError when outside."""
    if not raw.strip():
        raise RecoverableError("The path is empty; give one relative to the workspace root, e.g. kernels/softmax.cu.")
    root = ws.root.resolve()
    path = (root / raw).resolve()
    if not path.is_relative_to(root):
        raise RecoverableError(
            f"{raw} is outside the workspace {root}; paths are relative to the workspace root, e.g. kernels/softmax.cu."
        )
    return path


def relative_name(ws: Workspace, path: Path) -> str:
    return path.relative_to(ws.root.resolve()).as_posix() or "."


def require_editable(ws: Workspace, path: Path) -> str:
    """The workspace-relative name of `path` when the model may write it; RecoverableError saying why not."""
    name = relative_name(ws, path)
    if name in PROTECTED_FILES:
        raise RecoverableError(f"{name} is protected: {PROTECTED_REASON}. You may write {EDITABLE_FILES_TEXT}.")
    parts = PurePosixPath(name).parts
    editable = (
        parts == ("model_new.py",)
        or (len(parts) == 2 and parts[0] == "kernels" and name.endswith(EDITABLE_KERNEL_SUFFIXES))
        or (len(parts) == 2 and parts[0] == "notes" and name.endswith(".md"))
    )
    if not editable:
        raise RecoverableError(f"{name} is not a file the agent may write: only {EDITABLE_FILES_TEXT}.")
    return name


def unified_diff(name: str, before: str, after: str) -> str:
    old_lines, new_lines = before.splitlines(keepends=True), after.splitlines(keepends=True)
    lines = difflib.unified_diff(old_lines, new_lines, f"a/{name}", f"b/{name}")
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


def _diff_counts(diff: str) -> tuple[int, int]:
    lines = diff.splitlines()
    added = sum(1 for line in lines if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in lines if line.startswith("-") and not line.startswith("---"))
    return added, removed


# --------------------------------------------------------------------------------------- file tools


class GlobTool(_CheckedTool):
    name = "Glob"
    description = (
        "List workspace files matching a glob pattern relative to the workspace root, e.g. `kernels/*.cu` or "
        "`**/*.py` (`**` spans folders). Returns the matching paths, sorted, one per line (folders end in /), "
        f"at most {GLOB_LIMIT}. Use it to see what exists before reading or editing."
    )
    parameters = _object_schema(
        {"pattern": {"type": "string", "minLength": 1, "description": "e.g. kernels/*.cu"}}, ["pattern"]
    )

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        pattern = args["pattern"]
        root = ctx.workspace.root.resolve()
        if PurePosixPath(pattern).is_absolute() or ".." in PurePosixPath(pattern).parts:
            raise RecoverableError(
                f"Glob pattern {pattern} leaves the workspace; give one relative to its root, e.g. kernels/*.cu."
            )
        matches = sorted(_glob_entry(path, root) for path in _glob(root, pattern) if _listable(path, root))
        if not matches:
            return ToolOutput(text=f"No file matches {pattern}.", data={"pattern": pattern, "matches": []})
        shown = matches[:GLOB_LIMIT]
        text = "\n".join(shown)
        if len(matches) > GLOB_LIMIT:
            text += f"\n(showing {GLOB_LIMIT} of {len(matches)} matches; narrow the pattern to see the rest)"
        return ToolOutput(text=text, data={"pattern": pattern, "matches": shown, "total": len(matches)})


def _glob(root: Path, pattern: str) -> list[Path]:
    try:
        return list(root.glob(pattern))
    except (ValueError, IndexError):  # pathlib's ways of rejecting a pattern such as "."
        raise RecoverableError(
            f"{pattern} is not a glob pattern pathlib accepts; try e.g. `*` or `kernels/*.cu`."
        ) from None


def _listable(path: Path, root: Path) -> bool:
    """Inside the workspace, not its root, and not in .kernelpilot/ (kernelpilot's bookkeeping, not the model's)."""
    parts = path.relative_to(root).parts
    return path.resolve().is_relative_to(root) and bool(parts) and parts[0] != BOOKKEEPING_DIR


def _glob_entry(path: Path, root: Path) -> str:
    name = path.relative_to(root).as_posix()
    return f"{name}/" if path.is_dir() else name


class ReadTool(_CheckedTool):
    name = "Read"
    description = (
        "Read a text file of the workspace (model.py, model_new.py, kernels/*, SKILL.md, ...) with numbered lines. "
        f"`offset` is the first line to show (1-based), `limit` how many lines (default {READ_DEFAULT_LINES}); long "
        "output says where to continue. Read a file before editing it with MultiEdit."
    )
    parameters = _object_schema(
        {
            "path": {"type": "string", "minLength": 1, "description": "relative to the workspace root"},
            "offset": {"type": "integer", "minimum": 1, "description": "first line to show, 1-based"},
            "limit": {"type": "integer", "minimum": 1, "description": "number of lines to show"},
        },
        ["path"],
    )

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        path = resolve_in_workspace(ctx.workspace, args["path"])
        name = relative_name(ctx.workspace, path)
        lines = read_text_file(path, name).splitlines()
        offset, limit = args.get("offset", 1), args.get("limit", READ_DEFAULT_LINES)
        if not lines:
            return ToolOutput(text=f"{name} is empty.", data={"path": name, "lines": 0})
        if offset > len(lines):
            raise RecoverableError(f"{name} has {len(lines)} lines, so offset {offset} is past its end.")
        shown, size, last = [], 0, offset - 1
        for number in range(offset, min(offset + limit, len(lines) + 1)):
            line = lines[number - 1]
            if len(line) > READ_LINE_LIMIT:
                line = line[:READ_LINE_LIMIT] + f" [... {len(line) - READ_LINE_LIMIT} more characters]"
            size += len(line) + 8
            if shown and size > READ_OUTPUT_LIMIT:
                break
            shown.append(f"{number:6d}\t{line}")
            last = number
        text = "\n".join(shown)
        if last < len(lines):
            text += f"\n(lines {offset}-{last} of {len(lines)}; continue with offset={last + 1})"
        return ToolOutput(text=text, data={"path": name, "offset": offset, "last_line": last, "lines": len(lines)})


def read_text_file(path: Path, name: str) -> str:
    """The file's text; RecoverableError for a missing file, a folder or a binary file."""
    if path.is_dir():
        raise RecoverableError(f"{name} is a folder; list it with Glob (pattern `{name}/*`).")
    if not path.is_file():
        raise RecoverableError(f"{name} does not exist; find files with Glob.")
    data = path.read_bytes()
    binary = RecoverableError(f"{name} is a binary file ({len(data)} bytes); Read shows text files only.")
    if b"\0" in data[:8192]:
        raise binary
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise binary from None


class WriteTool(_CheckedTool):
    name = "Write"
    description = (
        "Create or overwrite a whole file with `content`. Allowed: kernels/*.cu, *.cuh, *.h, *.cpp (not kernelpilot's "
        "kp_* files), model_new.py and notes/*.md. Use it for new files; change existing ones with MultiEdit. "
        "Returns what changed."
    )
    parameters = _object_schema(
        {
            "path": {"type": "string", "minLength": 1, "description": "relative to the workspace root"},
            "content": {"type": "string", "description": "the complete new file"},
        },
        ["path", "content"],
    )

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        path = resolve_in_workspace(ctx.workspace, args["path"])
        name = require_editable(ctx.workspace, path)
        if path.is_dir():
            raise RecoverableError(f"{name} is a folder, not a file.")
        created = not path.exists()
        before = "" if created else path.read_text(encoding="utf-8", errors="replace")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(args["content"], encoding="utf-8")
        diff = unified_diff(name, before, args["content"])
        line_count = len(args["content"].splitlines())
        verb = "Created" if created else "Overwrote"
        return ToolOutput(
            text=f"{verb} {name} ({line_count} lines).",
            data={"path": name, "created": created, "diff": diff, "lines": line_count},
        )


class MultiEditTool(_CheckedTool):
    name = "MultiEdit"
    description = (
        "Edit one existing file with exact text replacements, applied in order, all or nothing: if any edit fails, "
        "the file is left unchanged. Each `old_string` must match the file exactly (whitespace included) and only "
        "once, unless `replace_all` is true; include surrounding lines to make it unique. Returns a summary; the "
        "error says what did not match and the closest line. Create new files with Write."
    )
    parameters = _object_schema(
        {
            "path": {"type": "string", "minLength": 1, "description": "relative to the workspace root"},
            "edits": {
                "type": "array",
                "minItems": 1,
                "items": _object_schema(
                    {
                        "old_string": {"type": "string", "description": "exact text to replace"},
                        "new_string": {"type": "string", "description": "the replacement"},
                        "replace_all": {"type": "boolean", "description": "replace every occurrence (default false)"},
                    },
                    ["old_string", "new_string"],
                ),
            },
        },
        ["path", "edits"],
    )

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        path = resolve_in_workspace(ctx.workspace, args["path"])
        name = require_editable(ctx.workspace, path)
        if not path.exists():
            raise RecoverableError(f"{name} does not exist; create it with Write.")
        before = read_text_file(path, name)
        after = before
        for number, edit in enumerate(args["edits"], start=1):
            after = apply_edit(after, edit, f"Edit {number} of {len(args['edits'])} on {name}")
        path.write_text(after, encoding="utf-8")
        diff = unified_diff(name, before, after)
        added, removed = _diff_counts(diff)
        return ToolOutput(
            text=f"Applied {len(args['edits'])} edit(s) to {name} (+{added} -{removed} lines).",
            data={"path": name, "edits": len(args["edits"]), "diff": diff},
        )


def apply_edit(text: str, edit: dict[str, Any], label: str) -> str:
    """`text` with one exact replacement; RecoverableError (nothing applied) when it cannot be made unambiguously."""
    old, new = edit["old_string"], edit["new_string"]
    if not old:
        raise RecoverableError(f"{label}: old_string is empty; to write a whole file use Write.")
    if old == new:
        raise RecoverableError(f"{label}: old_string and new_string are the same, so the edit changes nothing.")
    count = text.count(old)
    if count == 0:
        raise RecoverableError(f"{label}: old_string was not found. {_closest_line_hint(text, old)}")
    if count > 1 and not edit.get("replace_all", False):
        lines = _match_lines(text, old)
        raise RecoverableError(
            f"{label}: old_string occurs {count} times (lines {', '.join(map(str, lines))}); include more surrounding "
            "text to make it unique, or set replace_all to true."
        )
    return text.replace(old, new)


def _closest_line_hint(text: str, old: str) -> str:
    wanted = next((line.strip() for line in old.splitlines() if line.strip()), old.strip())
    lines = text.splitlines()
    stripped = [line.strip() for line in lines]
    close = difflib.get_close_matches(wanted, stripped, n=1, cutoff=0.5)
    if not close:
        return "No line of the file resembles its first line; Read the file again."
    number = stripped.index(close[0]) + 1
    return f"The closest line is {number}: {lines[number - 1]!r}; Read the file and copy the text exactly."


def _match_lines(text: str, old: str) -> list[int]:
    starts, position = [], text.find(old)
    while position != -1:
        starts.append(text.count("\n", 0, position) + 1)
        position = text.find(old, position + 1)
    return starts


# -------------------------------------------------------------------------------------------- Bash


class BashTool(_CheckedTool):
    name = "Bash"
    description = (
        "Run a bash command in the workspace root (HOME and TMPDIR are a scratch folder inside it; no stdin). "
        f"Returns the combined stdout and stderr (long output keeps its head and tail) and the exit code. Timeout "
        f"{BASH_DEFAULT_TIMEOUT_S} s unless `timeout_s` says otherwise (at most {BASH_MAX_TIMEOUT_S}). Commands that "
        "would write or cd outside the workspace are refused, and protected files (model.py, setup.py, kp_* files, "
        "...) are restored if a command changes them. Use it to inspect, grep, run quick Python checks; build and "
        "test with Compile, Verify and Profile."
    )
    parameters = _object_schema(
        {
            "command": {"type": "string", "minLength": 1, "description": "the bash command line"},
            "timeout_s": {"type": "integer", "minimum": 1, "maximum": BASH_MAX_TIMEOUT_S, "description": "seconds"},
        },
        ["command"],
    )

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        ws, command = ctx.workspace, args["command"]
        root, scratch = ws.root.resolve(), ws.root.resolve() / SCRATCH_DIR
        WriteGuard(root, scratch).check(command)
        scratch.mkdir(parents=True, exist_ok=True)
        keep_pristine_copies(ws)
        environment = dict(os.environ, HOME=str(scratch), TMPDIR=str(scratch), PWD=str(root))
        timeout = args.get("timeout_s", BASH_DEFAULT_TIMEOUT_S)
        run = run_process(["bash", "-c", command], cwd=root, env=environment, timeout=timeout)
        restored, lost = restore_protected(ws)
        output, cut = cap_middle(run.output, BASH_OUTPUT_LIMIT)
        text = _bash_text(output, run, timeout, restored, lost)
        data = {"command": command, "exit_code": run.returncode, "timed_out": run.timed_out,
                "seconds": run.seconds, "output_chars": len(run.output), "cut_chars": cut,
                "restored": restored, "not_restored": lost}  # fmt: skip
        return ToolOutput(text=text, data=data)


def _bash_text(output: str, run: ProcessRun, timeout: int, restored: list[str], lost: list[str]) -> str:
    parts = [output.rstrip("\n") or "(no output)"]
    if run.timed_out:
        parts.append(f"[timed out after {timeout} s: the command and its child processes were killed]")
    elif run.returncode != 0:
        parts.append(f"[exit code {run.returncode}]")
    if restored:
        parts.append(f"[kernelpilot restored {', '.join(restored)}: protected, {PROTECTED_REASON}; "
                     "put your work in kernels/ and model_new.py]")  # fmt: skip
    if lost:
        parts.append(f"[protected files changed and not restorable: {', '.join(lost)}; the judge will reject the "
                     "workspace until they are restored (`kernelpilot init` brings back deleted ones)]")  # fmt: skip
    return "\n".join(parts)


@dataclass
class ProcessRun:
    """What a subprocess did: its merged output, exit code, whether it was killed for time, and how long it took."""

    output: str
    returncode: int | None
    timed_out: bool
    seconds: float


def run_process(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> ProcessRun:
    """Run `argv` with no stdin in its own process group; on timeout kill the whole group (children included)."""
    started = time.monotonic()
    process = subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        raw, _ = process.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
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
    """Keep a copy of every protected file that is intact under .kernelpilot/pristine/, to restore it from later."""
    tampered = set(tampered_files(ws))
    for name in PROTECTED_FILES:
        copy, original = ws.root / PRISTINE_DIR / name, ws.root / name
        if name in tampered or (copy.is_file() and copy.read_bytes() == original.read_bytes()):
            continue
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.unlink(missing_ok=True)
        shutil.copy2(original, copy)


def restore_protected(ws: Workspace) -> tuple[list[str], list[str]]:
    """Put back changed or deleted protected files from their pristine copies; return (restored, not restorable)."""
    tampered = tampered_files(ws)
    for name in tampered:
        copy, target = ws.root / PRISTINE_DIR / name, ws.root / name
        if not copy.is_file():
            continue
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(copy, target)  # with its mode: model.py is read-only again
    still_tampered = set(tampered_files(ws)) if tampered else set()
    restored = [name for name in tampered if name not in still_tampered]
    return restored, [name for name in tampered if name in still_tampered]


# ------------------------------------------------------------------------------------ plan and finish


class TodoWriteTool(_CheckedTool):
    name = "TodoWrite"
    description = (
        "Replace your plan: the whole todo list, each item with `content` and `status` (pending, in_progress, "
        "completed; at most one in_progress). The user sees it. Update it as you start and finish steps. Returns "
        "the list as shown."
    )
    parameters = _object_schema(
        {
            "todos": {
                "type": "array",
                "items": _object_schema(
                    {
                        "content": {"type": "string", "minLength": 1, "description": "the step"},
                        "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
                    },
                    ["content", "status"],
                ),
            }
        },
        ["todos"],
    )

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        todos = [{"content": item["content"], "status": item["status"]} for item in args["todos"]]
        in_progress = [item["content"] for item in todos if item["status"] == "in_progress"]
        if len(in_progress) > 1:
            raise RecoverableError(
                f"TodoWrite: {len(in_progress)} items are in_progress ({'; '.join(in_progress)}); mark at most one."
            )
        ctx.todos = todos
        return ToolOutput(text=render_todos(todos), data={"todos": todos})


def render_todos(todos: list[dict[str, Any]]) -> str:
    if not todos:
        return "Todo list cleared."
    marks = {"pending": "[ ]", "in_progress": "[>]", "completed": "[x]"}
    done = sum(1 for item in todos if item["status"] == "completed")
    items = [f"  {marks[item['status']]} {item['content']}" for item in todos]
    return "\n".join([f"Todo list ({done}/{len(todos)} done):", *items])


class FinishTool(_CheckedTool):
    name = "Finish"
    description = (
        "End the run with a short summary of what you did and what the last Verify/Profile showed. Only results "
        "the judge verified count, so Verify and Profile your final kernel before finishing."
    )
    parameters = _object_schema(
        {"summary": {"type": "string", "minLength": 1, "description": "what was achieved"}}, ["summary"]
    )

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        return ToolOutput(text=f"Run finished: {args['summary']}", data={"summary": args["summary"]}, finished=True)


# ------------------------------------------------------------------------------------ harness tools


def _judge(ctx: ToolContext, tool_name: str) -> Any:
    if ctx.judge is None:
        raise RecoverableError(f"{tool_name} needs the judge, and this run has none; only the file tools work here.")
    return ctx.judge


def judging_settings(ctx: ToolContext) -> dict[str, Any]:
    """The run's trials and tolerances (`ctx.settings`, set by the loop's caller)."""
    return {"trials": ctx.settings.trials, "atol": ctx.settings.atol, "rtol": ctx.settings.rtol}


def _build(ctx: ToolContext, tool_name: str) -> BuildResult:
    """Build the workspace (incremental: only changed sources recompile) and remember the result."""
    build = _judge(ctx, tool_name).build(ctx.workspace.root)
    ctx.judged.note(build)
    return build


def judged_output(result: JudgeResult) -> ToolOutput:
    """A judge tool's answer: its typed result, rendered for the model, and as plain data for the transcript."""
    return ToolOutput(text=render(result), data=to_dict(result), result=result)


class CompileTool(_CheckedTool):
    name = "Compile"
    description = (
        "Build kernels/ into the kp_kernels extension (incremental: only changed files recompile). Returns ok or "
        "failed, the files recompiled, compiler errors as file:line: message, and per-kernel registers, shared "
        "memory and spills from ptxas. Compile after editing kernels, before Verify."
    )
    parameters = _object_schema({})

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        return judged_output(_build(ctx, self.name))


class VerifyTool(_CheckedTool):
    name = "Verify"
    description = (
        "Build if needed, then check ModelNew against Model on fresh random inputs (`trials`, default: the run's "
        "setting, usually 5) and run the anti-cheat guards. Returns pass/fail per trial, max absolute and relative "
        "error, where the worst element is, and guard findings. A candidate counts only once it passes."
    )
    parameters = _object_schema(
        {"trials": {"type": "integer", "minimum": 1, "maximum": MAX_TRIALS, "description": "how many"}}
    )

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        build = _build(ctx, self.name)
        if not build.ok:
            return judged_output(VerifyOutcome(build))
        judging = judging_settings(ctx)
        judging["trials"] = args.get("trials", judging["trials"])  # the model may ask for more or fewer
        outcome = VerifyOutcome(build, ctx.judge.verify(ctx.workspace.root, build, **judging))
        ctx.judged.note(outcome)
        return judged_output(outcome)


class ProfileTool(_CheckedTool):
    name = "Profile"
    description = (
        "The full judgement: build, verify, then time the candidate against PyTorch eager and torch.compile on the "
        "GPU. Returns the times (median and spread), speedups, % of speed-of-light, the reward (-1 broken or wrong, "
        "1 correct, 2 faster than eager, 3 faster than eager and torch.compile) and the candidate's top kernels. "
        "Run it before and after each optimisation."
    )
    parameters = _object_schema({})

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        result = _judge(ctx, self.name).evaluate(ctx.workspace.root, **judging_settings(ctx))
        ctx.judged.note(result)
        return judged_output(result)


# --------------------------------------------------------------------------------------------- Ncu

NCU_METRICS = {
    "gpu__time_duration.sum": "duration",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "launch__registers_per_thread": "registers",
    "launch__block_size": "block_size",
    "launch__grid_size": "grid_size",
}
_MICROSECONDS_PER_UNIT = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
                          "second": 1e6, "s": 1e6}  # fmt: skip
BUSY_PERCENT = 60.0  # a unit above this share of its peak is what limits the kernel

# Runs in the profiled process: loads the candidate the way the harness does, then profiles one forward call
# (after a warm-up call, so lazy initialisation stays out) between cudaProfilerStart and cudaProfilerStop.
# On a CPU device it only loads and calls, which lets tests check the loading without a GPU.
NCU_DRIVER = """
import json, sys
from pathlib import Path
import torch
from kernelpilot.harness.candidate import load_candidate, make_candidate_model
from kernelpilot.results import BuildResult, from_dict
from kernelpilot.workspace import open_workspace

workspace = open_workspace(sys.argv[1])
build = from_dict(BuildResult, json.loads(Path(sys.argv[2]).read_text()))
device = torch.device(sys.argv[3])
problem = workspace.problem()
model = make_candidate_model(problem, load_candidate(workspace, build), device)
inputs = problem.make_inputs(device, seed=0)
on_gpu = device.type == "cuda"
with torch.no_grad():
    model(*inputs)
    if on_gpu:
        torch.cuda.synchronize(device)
        torch.cuda.profiler.start()
    model(*inputs)
    if on_gpu:
        torch.cuda.synchronize(device)
        torch.cuda.profiler.stop()
"""


class NcuTool(_CheckedTool):
    name = "Ncu"
    description = (
        "Profile the candidate's kernels with Nsight Compute (ncu) over one forward call: per launch its duration, "
        "DRAM and SM throughput (% of peak), achieved occupancy, registers per thread and launch shape, and which "
        "limit it hits. `kernel` (a regex) restricts it to matching kernel names. Slow (kernels are replayed); use "
        "it to learn why a kernel is slow. Where ncu or a GPU is missing it says so."
    )
    parameters = _object_schema({"kernel": {"type": "string", "minLength": 1, "description": "regex of kernel names"}})

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        unavailable = ncu_unavailable_reason(ctx)
        if unavailable:
            return ToolOutput(text=unavailable, data={"available": False, "reason": unavailable})
        build = _build(ctx, self.name)
        if not build.ok:
            text = "Ncu skipped: the build failed.\n" + build_text(build)
            return ToolOutput(text=text, data={"available": True, "build": to_dict(build)})
        run, report = run_ncu(ctx.workspace, build, ctx.judge.device, args.get("kernel"))
        launches = parse_ncu_csv(report + "\n" + run.output)
        data = {"available": True, "exit_code": run.returncode, "timed_out": run.timed_out, "launches": launches}
        return ToolOutput(text=ncu_text(run, launches, args.get("kernel")), data=data)


def ncu_unavailable_reason(ctx: ToolContext) -> str | None:
    """One sentence saying why ncu cannot run here, or None when it can."""
    instead = "use Profile for times and the kernel breakdown."
    if shutil.which("ncu") is None:
        return f"ncu (Nsight Compute) is not installed on this machine, so Ncu is unavailable; {instead}"
    if ctx.judge is None or ctx.judge.device == "cpu":
        return f"This run has no GPU, so ncu cannot profile kernels here; {instead}"
    return None


def run_ncu(ws: Workspace, build: BuildResult, device: str, kernel: str | None) -> tuple[ProcessRun, str]:
    """Run the driver under ncu; return the run and ncu's CSV report."""
    scratch = ws.root / SCRATCH_DIR
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch, prefix="ncu-") as folder:
        build_json, report = Path(folder) / "build.json", Path(folder) / "report.csv"
        build_json.write_text(json.dumps(to_dict(build)))
        command = ["ncu", "--csv", "--log-file", str(report), "--print-units", "base", "--profile-from-start", "off",
                   "--metrics", ",".join(NCU_METRICS)]  # fmt: skip
        if kernel:
            command += ["--kernel-name", f"regex:{kernel}"]
        command += [sys.executable, "-c", NCU_DRIVER, str(ws.root), str(build_json), device]
        run = run_process(command, cwd=ws.root, env=driver_environment(), timeout=NCU_TIMEOUT_S)
        return run, report.read_text(errors="replace") if report.is_file() else ""


def driver_environment() -> dict[str, str]:
    """This environment with this very kernelpilot importable, as the judge's worker has it."""
    import kernelpilot

    source_root = str(Path(kernelpilot.__file__).resolve().parents[1])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH")) if p))


def parse_ncu_csv(text: str) -> list[dict[str, Any]]:
    """ncu's `--csv` rows (one per launch and metric) as one dict per launch: id, kernel and the metrics by label."""
    rows = csv.DictReader(line for line in text.splitlines() if line.startswith('"'))
    launches: dict[str, dict[str, Any]] = {}
    for row in rows:
        metric = NCU_METRICS.get(row.get("Metric Name") or "")
        if metric is None or row.get("ID") in (None, "ID"):
            continue
        launch = launches.setdefault(row["ID"], {"id": int(row["ID"]), "kernel": row.get("Kernel Name", "?")})
        value = _ncu_number(row.get("Metric Value", ""))
        if metric == "duration" and value is not None:
            metric, value = "duration_us", value * _MICROSECONDS_PER_UNIT.get(row.get("Metric Unit", ""), 1e-3)
        launch[metric] = value
    return sorted(launches.values(), key=lambda launch: launch["id"])


def _ncu_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))  # ncu groups thousands with commas
    except ValueError:
        return None


def ncu_text(run: ProcessRun, launches: list[dict[str, Any]], kernel: str | None) -> str:
    """ncu's findings for the model, or why it found nothing."""
    if run.timed_out:
        return f"ncu did not finish within {NCU_TIMEOUT_S} s and was stopped; profile fewer kernels with `kernel`."
    if not launches:
        reason = f"no kernel matched {kernel!r}" if kernel and run.returncode == 0 else f"exit code {run.returncode}"
        tail = "\n".join(run.output.strip().splitlines()[-30:])
        return f"ncu profiled no kernel ({reason}).\n{tail}".rstrip()
    lines = [f"ncu: {len(launches)} kernel launch(es) in one forward call:"]
    lines += [f"  {_launch_text(launch)}" for launch in launches[:MAX_LAUNCHES_SHOWN]]
    if len(launches) > MAX_LAUNCHES_SHOWN:
        lines.append(f"  ({len(launches) - MAX_LAUNCHES_SHOWN} more launches not shown; narrow them with `kernel`)")
    return "\n".join(lines)


def _launch_text(launch: dict[str, Any]) -> str:
    def shown(key: str, template: str) -> str | None:
        return template.format(launch[key]) if launch.get(key) is not None else None

    parts = [
        shown("duration_us", "{:.4g} us"),
        shown("dram_pct", "DRAM {:.1f}%"),
        shown("sm_pct", "SM {:.1f}%"),
        shown("occupancy_pct", "occupancy {:.1f}%"),
        shown("registers", "{:.0f} regs"),
        shown("block_size", "block {:.0f}"),
        shown("grid_size", "grid {:.0f}"),
    ]
    return f"{launch['kernel']}: " + ", ".join(part for part in parts if part) + f" -> {_limiter(launch)}"


def _limiter(launch: dict[str, Any]) -> str:
    if launch.get("dram_pct") is None and launch.get("sm_pct") is None:
        return "limit unknown (no throughput counters)"
    dram, sm = launch.get("dram_pct") or 0.0, launch.get("sm_pct") or 0.0
    if dram >= BUSY_PERCENT and dram >= sm:
        return "memory-bound (DRAM busy): move fewer bytes"
    if sm >= BUSY_PERCENT:
        return "compute-bound (SM busy): fewer or cheaper instructions, tensor cores"
    return "latency-bound (neither DRAM nor SM busy): more parallel work in flight, fewer stalls"


# ------------------------------------------------------------------------------------------ registry


def default_tools() -> list[Tool]:
    """Every tool the agent gets, in the order the model sees them."""
    return [BashTool(), GlobTool(), ReadTool(), WriteTool(), MultiEditTool(), TodoWriteTool(), CompileTool(),
            VerifyTool(), ProfileTool(), NcuTool(), FinishTool()]  # fmt: skip


def tool_schemas(tools: list[Tool]) -> list[dict[str, Any]]:
    """The tools in OpenAI function-calling format."""
    return [
        {
            "type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
        }
        for tool in tools
    ]


def find_tool(tools: list[Tool], name: str) -> Tool:
    """The tool called `name`; RecoverableError listing the valid names when there is none."""
    for tool in tools:
        if tool.name == name:
            return tool
    raise RecoverableError(f"There is no tool named {name!r}; the tools are: {', '.join(tool.name for tool in tools)}.")
