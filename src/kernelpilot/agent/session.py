"""Sessions: the JSONL transcript of a run, resuming from it, and the best verified candidate it found.

Each record is one JSON line, written and fsynced as it happens, so a crash or Ctrl-C loses at most the line being
written. Records: `start` (problem, model, settings), `message` (system/user/assistant, with usage), `tool` (the
tool message plus its arguments, its typed result as data with the result's type name, and seconds), `eval` (a
judge result and whether it became the best), `step` (a checkpoint after every turn: todos, elapsed time), `resume`
and `end` (status and summary). Resuming rebuilds the conversation and the run's counters from these records alone.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelpilot.agent.tool_results import (
    JUDGE_RESULT_CLASSES,
    RESULT_TYPES_BY_NAME,
    RESULT_TYPES_BY_TOOL,
    JudgeResult,
    RunFinished,
    TodoItem,
    ToolError,
    ToolResult,
)
from kernelpilot.agent.vouched import keep_best, kept_best, line_digest, vouch, vouched
from kernelpilot.errors import KernelpilotError
from kernelpilot.results import EvalResult, from_dict, to_dict
from kernelpilot.workspace_files import append_text, make_folder, remove, write_file

if TYPE_CHECKING:
    from kernelpilot.agent import Usage
    from kernelpilot.workspace import Workspace

SESSIONS_DIR = ".kernelpilot/sessions"
BEST_DIR = ".kernelpilot/best"
DIGEST = "_sha256"  # added to each record read: the digest of its line, which `vouched.py` entries name
# A faster time counts as an improvement only beyond timing noise (medians on a warm GPU move by about 1%).
MIN_IMPROVEMENT = 0.01
# What the loop answered a refused call with before records named their result's type (now a ToolError's text).
LEGACY_ERROR_PREFIX = "Error:"
INTERRUPTED_CALL = "This call was interrupted before it finished; nothing it did was recorded. Check the files before relying on them."


class SessionError(KernelpilotError):
    """A session to resume or replay cannot be found or read."""


@dataclass
class RunState:
    """The counters a run carries across turns and resumes."""

    turn: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    cost_known: bool = True  # False once any reply's price was unknown
    elapsed_s: float = 0.0
    best: EvalResult | None = None
    best_turn: int = 0
    evals: list[EvalResult] = field(default_factory=list)
    todos: list[TodoItem] = field(default_factory=list)
    judged_calls: dict[str, JudgeResult] = field(default_factory=dict)  # each judge tool call's result, by call id
    finish_summary: str | None = None  # what the model said when it called Finish

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add_usage(self, usage: Usage) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        if usage.cost_usd is None:
            self.cost_known = False
        else:
            self.cost_usd += usage.cost_usd


class Session:
    """An append-only transcript file and the state rebuilt from it."""

    def __init__(self, path: Path, messages: list[dict[str, Any]] | None = None, state: RunState | None = None):
        self.path = path
        self.messages = messages or []
        self.state = state or RunState()

    @property
    def id(self) -> str:
        return self.path.stem

    @classmethod
    def create(cls, ws_root: Path, **start: Any) -> Session:
        """A new transcript under `ws_root`/.kernelpilot/sessions/, opened with a `start` record."""
        session_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
        path = Path(ws_root) / SESSIONS_DIR / f"{session_id}.jsonl"
        make_folder(path.parent, Path(ws_root))  # refusing a link on the way (`workspace_files.py`)
        session = cls(path)
        session.append("start", session=session_id, **start)
        return session

    @classmethod
    def resume(cls, ws_root: Path, session_id: str | None = None) -> Session:
        """The session `session_id` (default: the newest) of a workspace, with its messages and state rebuilt."""
        path = find_session(Path(ws_root), session_id)
        records = read_records(path)
        session = cls(path, rebuild_messages(records), rebuild_state(records, path))
        session.append("resume", turn=session.state.turn)
        return session

    def append(self, record_type: str, **fields: Any) -> str:
        """Write one record and force it to disk before returning; returns the line's digest (`vouched.py`)."""
        record = {"type": record_type, "time": round(time.time(), 6), **to_dict(fields)}  # (µs: sessions started
        # in the same millisecond still list in the order they started)
        line = json.dumps(record, default=str)
        # A link the agent puts in the transcript's place is replaced, not appended through (`workspace_files.py`);
        # the folders on the way are checked from the workspace, .kernelpilot/sessions/ up.
        folders = self.path.parents
        append_text(self.path, line + "\n", folders[2] if len(folders) > 2 else folders[0])
        return line_digest(line)

    def append_vouched(self, record_type: str, **fields: Any) -> str:
        """`append` a verdict or the end, vouched for where the agent cannot write (`vouched.py`)."""
        digest = self.append(record_type, **fields)
        vouch(self.path, digest)
        return digest


# --------------------------------------------------------------------------------------------- reading


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a transcript; a last line cut off by a crash is dropped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise SessionError(f"Cannot read the session {path} ({err.strerror or err}).", hint="Check the path.") from None
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append({**json.loads(line), DIGEST: line_digest(line)})
        except ValueError:
            if number < len(lines):
                raise SessionError(f"Line {number} of {path} is not JSON.", hint="The transcript was edited or corrupted.") from None
    if not records or records[0].get("type") != "start":
        raise SessionError(f"{path} is not a kernelpilot session transcript.", hint="Pass a .jsonl file from .kernelpilot/sessions/.")
    return records


def rebuild_messages(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as sent to the model, with calls cut off by an interruption answered as such."""
    messages: list[dict[str, Any]] = []
    pending: list[str] = []  # tool_call ids of the last assistant message still unanswered
    for record in records:
        if record["type"] not in ("message", "tool"):
            continue
        message = record["message"]
        if message["role"] != "tool":
            messages += [_interrupted(call_id) for call_id in pending]
            pending = [call["id"] for call in message.get("tool_calls") or []]
        elif message.get("tool_call_id") in pending:
            pending.remove(message["tool_call_id"])
        messages.append(message)
    return messages + [_interrupted(call_id) for call_id in pending]


def _interrupted(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": INTERRUPTED_CALL}


def rebuild_state(records: list[dict[str, Any]], transcript: Path) -> RunState:
    """Turns, tokens, cost, evals, the best candidate, todos, the judge tools' results and Finish's summary, from
    the records of `transcript`; a verdict counts only where kernelpilot vouched for its line (`vouched.py`)."""
    from kernelpilot.agent import Usage

    state = RunState()
    for record in records:
        state.turn = max(state.turn, record.get("turn") or 0)
        if record["type"] == "message" and record.get("usage"):
            state.add_usage(from_dict(Usage, record["usage"]))
        elif record["type"] == "eval" and vouched(transcript, record.get(DIGEST)):
            result = from_dict(EvalResult, record["eval"])
            state.evals.append(result)
            if record.get("improved"):
                state.best, state.best_turn = result, record["turn"]
        elif record["type"] == "tool":
            result = tool_result(record)
            if isinstance(result, JUDGE_RESULT_CLASSES):
                state.judged_calls[record["message"]["tool_call_id"]] = result
            elif isinstance(result, RunFinished):
                state.finish_summary = result.summary
        elif record["type"] == "step":
            state.todos = from_dict(list[TodoItem], record.get("todos") or [])
            state.elapsed_s = record.get("elapsed_s") or state.elapsed_s
    return state


def tool_result(record: dict[str, Any]) -> ToolResult | None:
    """The typed result of a `tool` record, rebuilt from its data by the type the record names; None for a record
    with no data. A record from before records named their type is read by its tool's result type, when it fits."""
    data = record.get("data")
    if not data:
        return None
    if "result_type" in record:
        result_type = RESULT_TYPES_BY_NAME.get(record["result_type"])
        return from_dict(result_type, data) if result_type is not None else None
    legacy_type = RESULT_TYPES_BY_TOOL.get(record.get("name", ""))
    try:
        return from_dict(legacy_type, data) if legacy_type is not None else None
    except TypeError:  # data an older kernelpilot wrote that the type no longer fits: no typed result
        return None


def refused_call(record: dict[str, Any]) -> bool:
    """True when a `tool` record answers a call the loop refused with a ToolError (unknown tool, bad arguments, a
    refused path or command). A record from before records named their result's type holds only the text the model
    read, which then began with "Error:"."""
    if "result_type" in record:
        return record["result_type"] == ToolError.__name__
    return str(record["message"].get("content", "")).startswith(LEGACY_ERROR_PREFIX)


def find_session(ws_root: Path, session_id: str | None) -> Path:
    """The transcript file of `session_id` (a file path works too), or the last one written to in the workspace."""
    if session_id and Path(session_id).is_file():
        return Path(session_id)
    folder = ws_root / SESSIONS_DIR
    candidates = sorted(folder.glob("*.jsonl"), key=lambda path: path.stat().st_mtime_ns)
    if session_id:
        candidates = [path for path in candidates if path.stem == session_id or path.stem.startswith(session_id)]
    if not candidates:
        which = f"session {session_id}" if session_id else "session"
        raise SessionError(f"No {which} found in {folder}.", hint="List them with `kernelpilot sessions DIR`.")
    return candidates[-1]


@dataclass
class SessionInfo:
    """One line of `kernelpilot sessions`."""

    id: str
    path: Path
    problem: str
    model: str
    started: float
    status: str  # the end record's status, or "unfinished"
    turns: int
    best_speedup_vs_compile: float | None
    reward: int | None


def list_sessions(root: Path) -> list[SessionInfo]:
    """Sessions of the workspace at `root` and of workspaces directly inside it, oldest first."""
    if not Path(root).is_dir():
        raise KernelpilotError(
            f"{root} does not exist or is not a folder.", hint="Pass a workspace, or a folder of workspaces."
        )
    paths = [*Path(root).glob(f"{SESSIONS_DIR}/*.jsonl"), *Path(root).glob(f"*/{SESSIONS_DIR}/*.jsonl")]
    infos = []
    for path in paths:
        try:
            infos.append(_session_info(path, read_records(path)))
        except SessionError:
            continue  # a foreign or damaged file is not a session to list
    return sorted(infos, key=lambda info: (info.started, str(info.path)))  # (ties: a stable order)


def _session_info(path: Path, records: list[dict[str, Any]]) -> SessionInfo:
    start, state, last = records[0], rebuild_state(records, path), records[-1]
    ended = last["type"] == "end" and vouched(path, last.get(DIGEST))
    best = state.best
    return SessionInfo(
        id=path.stem,
        path=path,
        problem=start.get("problem", ""),
        model=start.get("model") or "",
        started=start["time"],
        status=last["status"] if ended else "unfinished",
        turns=state.turn,
        best_speedup_vs_compile=best.bench.speedup_vs_compile if best and best.bench else None,
        reward=best.reward if best else None,
    )


# ------------------------------------------------------------------------------------- best candidate


def candidate_rank(result: EvalResult) -> tuple[int, float] | None:
    """How good a judged candidate is: None unless verified correct; timed ones rank by their median time."""
    if result.verify is None or not result.verify.ok or result.reward < 1:
        return None
    bench = result.bench
    if bench is None or not bench.ok or bench.candidate is None:
        return (0, 0.0)
    return (1, -bench.candidate.median_ms)


def is_improvement(result: EvalResult, best: EvalResult | None) -> bool:
    """True when `result` is verified and beats `best`: timed beats untimed, and faster by more than noise."""
    rank = candidate_rank(result)
    if rank is None:
        return False
    best_rank = candidate_rank(best) if best is not None else None
    if best_rank is None or rank[0] > best_rank[0]:
        return True
    return rank[0] == 1 and -rank[1] < -best_rank[1] * (1 - MIN_IMPROVEMENT)


def target_met(best: EvalResult | None, target_speedup: float) -> bool:
    """The best verified candidate reaches `target_speedup` vs torch.compile."""
    speedup = best.bench.speedup_vs_compile if best is not None and best.bench is not None else None
    return speedup is not None and speedup >= target_speedup


def candidate_files(root: Path) -> Iterator[Path]:
    """The candidate's own files under `root`, relative: model_new.py and kernels/ minus the protected ones. A link
    is none of them: what it leads to (a key outside the workspace, say) is never kept or copied out as the
    candidate's (tests/adversarial/test_planted_links.py); the build refuses one under kernels/ by name."""
    from kernelpilot.workspace import PROTECTED_FILES

    model_new = root / "model_new.py"
    if model_new.is_file() and not model_new.is_symlink():
        yield Path("model_new.py")
    kernels = root / "kernels"
    for path in sorted(kernels.rglob("*")) if kernels.is_dir() and not kernels.is_symlink() else []:
        relative = path.relative_to(root)
        if path.is_file() and not path.is_symlink() and relative.as_posix() not in PROTECTED_FILES:
            yield relative


def save_best(ws: Workspace, transcript: Path, digest: str) -> None:
    """Keep the workspace's current candidate as the session's best, for the verdict line `digest`: where the agent
    cannot write (`vouched.py`), and a copy under .kernelpilot/best/ to look at."""
    files = {relative.as_posix(): (ws.root / relative).read_bytes() for relative in candidate_files(ws.root)}
    keep_best(transcript, digest, files)
    best_dir = ws.root / BEST_DIR
    remove(best_dir, ws.root)  # kernelpilot's alone: a link in its place goes, not what it leads to
    copy_candidate(ws.root, best_dir, ws.root)


def restore_best(ws: Workspace, transcript: Path) -> bool:
    """Put the session's best candidate back into the workspace (its kernels/ replaced), as the judge saw it (not
    the copy in the workspace, which the agent may have changed); False when none was kept."""
    from kernelpilot.workspace import PROTECTED_FILES

    kept = kept_best(transcript)
    if kept is None:
        return False
    for stale in list(candidate_files(ws.root)):
        remove(ws.root / stale, ws.root)
    for name, data in kept[1].items():
        target = ws.root / name
        if not target.resolve().is_relative_to(ws.root.resolve()) or name in PROTECTED_FILES:
            continue  # (names were written by kernelpilot; a damaged entry still writes nothing outside)
        write_file(target, data, ws.root)
    return True


def copy_candidate(source_root: Path, dest_root: Path, within: Path) -> list[Path]:
    """Copy model_new.py and the kernel sources from one folder to another (in `within`, the folder the writes trust:
    `workspace_files.py`); returns the files written."""
    written = []
    for relative in candidate_files(source_root):
        write_file(dest_root / relative, (source_root / relative).read_bytes(), within)
        written.append(dest_root / relative)
    return written


# ------------------------------------------------------------------------------------------- describing


def describe_eval(result: EvalResult) -> str:
    """One line for a judged candidate: correctness, times and speedups, reward."""
    if result.verify is None or not result.verify.ok:
        return f"not verified ({result.error_kind or 'failed'}: {result.message}), reward {result.reward}"
    bench = result.bench
    if bench is None or not bench.ok or bench.candidate is None:
        return f"correct, not timed, reward {result.reward}"
    compile_text = f"{bench.speedup_vs_compile:.2f}x vs compile" if bench.speedup_vs_compile is not None else "no compile baseline"
    eager_text = f"{bench.speedup_vs_eager:.2f}x vs eager" if bench.speedup_vs_eager is not None else "no eager baseline"
    return f"correct, {bench.candidate.median_ms:.4g} ms, {eager_text}, {compile_text}, reward {result.reward}"
