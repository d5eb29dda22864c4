"""The file tools (Glob, Read, Write, MultiEdit) and the workspace path guard: every path stays inside the workspace,
and only the files the model may edit can be written."""

from __future__ import annotations

import difflib
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from kernelpilot.agent import RecoverableError, ToolContext
from kernelpilot.agent.shell_guard import BOOKKEEPING_DIR
from kernelpilot.agent.tool_results import FileEdited, FileRead, FileWritten, GlobMatches
from kernelpilot.agent.tools.schema import CheckedTool, object_schema
from kernelpilot.workspace import PROTECTED_FILES, PROTECTED_REASON

if TYPE_CHECKING:
    from kernelpilot.workspace import Workspace

GLOB_LIMIT = 200
READ_DEFAULT_LINES = 2000
READ_LINE_LIMIT = 2000  # characters shown of one line
READ_OUTPUT_LIMIT = 60_000
EDITABLE_KERNEL_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")
EDITABLE_FILES_TEXT = "kernels/*.cu, kernels/*.cuh, kernels/*.h, kernels/*.cpp, model_new.py and notes/*.md"


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


class GlobTool(CheckedTool):
    name = "Glob"
    description = (
        "List workspace files matching a glob pattern relative to the workspace root, e.g. `kernels/*.cu` or "
        "`**/*.py` (`**` spans folders). Returns the matching paths, sorted, one per line (folders end in /), "
        f"at most {GLOB_LIMIT}. Use it to see what exists before reading or editing."
    )
    parameters = object_schema(
        {"pattern": {"type": "string", "minLength": 1, "description": "e.g. kernels/*.cu"}}, ["pattern"]
    )

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> GlobMatches:
        pattern = args["pattern"]
        root = ctx.workspace.root.resolve()
        if PurePosixPath(pattern).is_absolute() or ".." in PurePosixPath(pattern).parts:
            raise RecoverableError(
                f"Glob pattern {pattern} leaves the workspace; give one relative to its root, e.g. kernels/*.cu."
            )
        matches = sorted(_glob_entry(path, root) for path in _glob(root, pattern) if _listable(path, root))
        return GlobMatches(pattern, matches[:GLOB_LIMIT], len(matches))


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


class ReadTool(CheckedTool):
    name = "Read"
    description = (
        "Read a text file of the workspace (model.py, model_new.py, kernels/*, SKILL.md, ...) with numbered lines. "
        f"`offset` is the first line to show (1-based), `limit` how many lines (default {READ_DEFAULT_LINES}); long "
        "output says where to continue. Read a file before editing it with MultiEdit."
    )
    parameters = object_schema(
        {
            "path": {"type": "string", "minLength": 1, "description": "relative to the workspace root"},
            "offset": {"type": "integer", "minimum": 1, "description": "first line to show, 1-based"},
            "limit": {"type": "integer", "minimum": 1, "description": "number of lines to show"},
        },
        ["path"],
    )

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> FileRead:
        path = resolve_in_workspace(ctx.workspace, args["path"])
        name = relative_name(ctx.workspace, path)
        lines = read_text_file(path, name).splitlines()
        offset, limit = args.get("offset", 1), args.get("limit", READ_DEFAULT_LINES)
        if not lines:
            return FileRead(name)
        if offset > len(lines):
            raise RecoverableError(f"{name} has {len(lines)} lines, so offset {offset} is past its end.")
        shown, size = [], 0
        for line in lines[offset - 1 : offset - 1 + limit]:
            if len(line) > READ_LINE_LIMIT:
                line = line[:READ_LINE_LIMIT] + f" [... {len(line) - READ_LINE_LIMIT} more characters]"
            size += len(line) + 8  # with its number and tab
            if shown and size > READ_OUTPUT_LIMIT:
                break
            shown.append(line)
        return FileRead(name, offset, offset + len(shown) - 1, len(lines), shown)


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


class WriteTool(CheckedTool):
    name = "Write"
    description = (
        "Create or overwrite a whole file with `content`. Allowed: kernels/*.cu, *.cuh, *.h, *.cpp (not kernelpilot's "
        "kp_* files), model_new.py and notes/*.md. Use it for new files; change existing ones with MultiEdit. "
        "Returns what changed."
    )
    parameters = object_schema(
        {
            "path": {"type": "string", "minLength": 1, "description": "relative to the workspace root"},
            "content": {"type": "string", "description": "the complete new file"},
        },
        ["path", "content"],
    )

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> FileWritten:
        path = resolve_in_workspace(ctx.workspace, args["path"])
        name = require_editable(ctx.workspace, path)
        if path.is_dir():
            raise RecoverableError(f"{name} is a folder, not a file.")
        created = not path.exists()
        lines = len(args["content"].splitlines())
        held = b"" if created else path.read_bytes()
        if not created and held == args["content"].encode("utf-8"):
            return FileWritten(name, False, lines, unchanged=True)  # untouched: the build need not recompile it
        before = held.decode("utf-8", errors="replace")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(args["content"], encoding="utf-8")
        return FileWritten(name, created, lines, unified_diff(name, before, args["content"]))


class MultiEditTool(CheckedTool):
    name = "MultiEdit"
    description = (
        "Edit one existing file with exact text replacements, applied in order, all or nothing: if any edit fails, "
        "the file is left unchanged. Each `old_string` must match the file exactly (whitespace included) and only "
        "once, unless `replace_all` is true; include surrounding lines to make it unique. Returns a summary; the "
        "error says what did not match and the closest line. Create new files with Write."
    )
    parameters = object_schema(
        {
            "path": {"type": "string", "minLength": 1, "description": "relative to the workspace root"},
            "edits": {
                "type": "array",
                "minItems": 1,
                "items": object_schema(
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

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> FileEdited:
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
        return FileEdited(name, len(args["edits"]), added, removed, diff)


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
