"""What the agent's tools return, typed: one small dataclass per kind of answer, turned into the model's text in one
place (`agent/observations.py`) and kept as plain data in the transcript, from which `session.tool_result` rebuilds
them. The judge tools answer with the judge's own results (BuildResult, VerifyOutcome, EvalResult).

A field marked `TRANSCRIPT_OMITS` (a file's lines, a command's output) is left out of the transcript's data: the
tool message beside it already holds that text as the model read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Union

from kernelpilot.results import BuildResult, EvalResult, VerifyResult, to_dict

TRANSCRIPT_OMITS = {"transcript": False}


@dataclass
class VerifyOutcome:
    """What Verify found: the build it judged, and the verification when that build succeeded."""

    build: BuildResult
    verify: VerifyResult | None = None

    @property
    def ok(self) -> bool:
        return self.verify is not None and self.verify.ok


# What a judge tool returns: Compile a build, Verify a build and its verification, Profile the whole judgement.
JudgeResult = Union[BuildResult, VerifyOutcome, EvalResult]
JUDGE_RESULT_CLASSES = (BuildResult, VerifyOutcome, EvalResult)


@dataclass
class GlobMatches:
    """Glob: the workspace paths matching `pattern`, sorted (folders end in /), the first of `total`."""

    pattern: str
    matches: list[str] = field(default_factory=list)
    total: int = 0


@dataclass
class FileRead:
    """Read: lines `offset`..`last_line` of a file of `line_count` lines (long lines already cut)."""

    path: str
    offset: int = 1
    last_line: int = 0
    line_count: int = 0
    shown: list[str] = field(default_factory=list, metadata=TRANSCRIPT_OMITS)


@dataclass
class FileWritten:
    """Write: a file created or overwritten, and the diff from what it held before; `unchanged`: it already held
    that content and was not written (its time stays, so the incremental build does not recompile it)."""

    path: str
    created: bool
    lines: int
    diff: str = ""
    unchanged: bool = False


@dataclass
class FileEdited:
    """MultiEdit: `edits` exact replacements applied to one file, and the diff they made."""

    path: str
    edits: int
    added: int = 0
    removed: int = 0
    diff: str = ""


@dataclass
class CommandRun:
    """Bash: what a command did, with its output (head and tail when long) and the protected files put back after it."""

    command: str
    exit_code: int | None
    timed_out: bool = False
    timeout_s: float = 0.0
    seconds: float = 0.0
    output_chars: int = 0
    cut_chars: int = 0  # characters cut from the middle of the output
    restored: list[str] = field(default_factory=list)
    not_restored: list[str] = field(default_factory=list)
    output: str = field(default="", metadata=TRANSCRIPT_OMITS)


@dataclass
class TodoItem:
    """One step of the model's plan."""

    content: str
    status: str  # pending | in_progress | completed


@dataclass
class TodoList:
    """TodoWrite: the whole plan as it stands now."""

    todos: list[TodoItem] = field(default_factory=list)


@dataclass
class RunFinished:
    """Finish: the model ends the run with its summary (its claim; only the judge's results count)."""

    summary: str


@dataclass
class NcuLaunch:
    """One kernel launch as Nsight Compute measured it (None where ncu reported no value)."""

    id: int
    kernel: str
    duration_us: float | None = None
    dram_pct: float | None = None
    sm_pct: float | None = None
    occupancy_pct: float | None = None
    registers: float | None = None
    block_size: float | None = None
    grid_size: float | None = None


@dataclass
class NcuReport:
    """Ncu: the launches it profiled; or why it cannot run here, or the build that failed."""

    available: bool = True
    reason: str = ""  # one sentence saying why ncu cannot run here, when it is not available
    build: BuildResult | None = None  # set only when the build failed, so nothing was profiled
    kernel: str | None = None  # the regex of kernel names asked for
    exit_code: int | None = None
    timed_out: bool = False
    timeout_s: float = 0.0
    launches: list[NcuLaunch] = field(default_factory=list)
    output_tail: str = ""  # the last lines of ncu's own output, which say why it profiled nothing


@dataclass
class ToolError:
    """A call the model can fix (unknown tool, bad arguments, a refused path or command), and what was wrong."""

    message: str


ToolResult = Union[JudgeResult, GlobMatches, FileRead, FileWritten, FileEdited, CommandRun, TodoList, RunFinished,
                   NcuReport, ToolError]  # fmt: skip
# A tool record names its result's type; a record from before it did is read by its tool's result type.
RESULT_TYPES_BY_TOOL: dict[str, type] = {
    "Bash": CommandRun, "Glob": GlobMatches, "Read": FileRead, "Write": FileWritten, "MultiEdit": FileEdited,
    "TodoWrite": TodoList, "Compile": BuildResult, "Verify": VerifyOutcome, "Profile": EvalResult, "Ncu": NcuReport,
    "Finish": RunFinished,
}  # fmt: skip
RESULT_TYPES_BY_NAME: dict[str, type] = {cls.__name__: cls for cls in (*RESULT_TYPES_BY_TOOL.values(), ToolError)}


def transcript_data(result: ToolResult) -> dict[str, Any]:
    """`result` as plain data for the transcript, without the fields marked TRANSCRIPT_OMITS."""
    data = to_dict(result)
    for omitted in dataclasses.fields(result):
        if omitted.metadata.get("transcript", True) is False:
            data.pop(omitted.name)
    return data
