"""Sessions: the JSONL transcript, rebuilding a conversation and state from it, listing and replaying, and the
best-candidate bookkeeping (with fabricated judge results: this tests the ranking logic, not the judge)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from kernelpilot.agent import Usage
from kernelpilot.agent.session import (
    INTERRUPTED_CALL,
    Session,
    SessionError,
    candidate_rank,
    is_improvement,
    list_sessions,
    read_records,
    restore_best,
    save_best,
    target_met,
    tool_result,
)
from kernelpilot.agent.tool_results import FileWritten, RunFinished, TodoItem
from kernelpilot.cli.render_agent import render_session_list, render_transcript
from kernelpilot.results import BenchResult, EvalResult, Timing, VerifyResult
from kernelpilot.workspace import Workspace


def judged(candidate_ms: float | None, *, correct: bool = True, compile_ms: float = 10.0, eager_ms: float = 20.0) -> EvalResult:
    """A judge result as Profile would leave it: verified (or not) and timed (when candidate_ms is given)."""
    result = EvalResult(problem_id="p", workspace="/ws", verify=VerifyResult(ok=correct), reward=1 if correct else -1)
    if correct and candidate_ms is not None:
        timing = lambda ms: Timing(median_ms=ms, p10_ms=ms, p90_ms=ms, mean_ms=ms, runs=10)  # noqa: E731
        result.bench = BenchResult(ok=True, candidate=timing(candidate_ms), eager=timing(eager_ms), compiled=timing(compile_ms),
                                   speedup_vs_eager=eager_ms / candidate_ms, speedup_vs_compile=compile_ms / candidate_ms)
        result.reward = 3 if compile_ms / candidate_ms > 1.05 else 2 if eager_ms / candidate_ms > 1.05 else 1
    return result


# ------------------------------------------------------------------------------------- best candidate


def test_only_verified_results_rank_and_timed_beats_untimed():
    assert candidate_rank(judged(1.0, correct=False)) is None
    assert candidate_rank(judged(None)) == (0, 0.0)
    assert is_improvement(judged(None), None)
    assert is_improvement(judged(9.0), judged(None))
    assert not is_improvement(judged(None), judged(9.0))
    assert not is_improvement(judged(1.0, correct=False), None)


def test_improvement_must_beat_timing_noise():
    best = judged(10.0)
    assert is_improvement(judged(9.0), best)
    assert not is_improvement(judged(9.95), best)  # 0.5% faster is noise
    assert not is_improvement(judged(11.0), best)


def test_a_wrong_answer_never_counts_even_with_a_good_reward_claim():
    claimed = judged(1.0)
    claimed.verify = VerifyResult(ok=False, error_kind="guard")
    assert candidate_rank(claimed) is None


def test_target_is_judged_against_torch_compile():
    assert target_met(judged(9.0, compile_ms=10.0), 1.05)
    assert not target_met(judged(9.8, compile_ms=10.0), 1.05)
    assert not target_met(judged(None), 1.05)
    assert not target_met(None, 1.05)


def test_best_files_survive_a_worse_edit_and_come_back(tmp_path):
    ws = Workspace(tmp_path)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "model_new.py").write_text("good")
    (tmp_path / "kernels" / "fast.cu").write_text("fast kernel")
    (tmp_path / "kernels" / "kp_module.cpp").write_text("protected")
    transcript = tmp_path / ".kernelpilot" / "sessions" / "20261129-000000-abcd.jsonl"
    save_best(ws, transcript, "0" * 64)
    (tmp_path / "model_new.py").write_text("worse")
    (tmp_path / "kernels" / "fast.cu").unlink()
    (tmp_path / "kernels" / "slow.cu").write_text("slow kernel")
    assert restore_best(ws, transcript)
    assert (tmp_path / "model_new.py").read_text() == "good"
    assert (tmp_path / "kernels" / "fast.cu").read_text() == "fast kernel"
    assert not (tmp_path / "kernels" / "slow.cu").exists()
    assert (tmp_path / "kernels" / "kp_module.cpp").read_text() == "protected"  # never copied or deleted


def test_restore_without_a_best_changes_nothing(tmp_path):
    (tmp_path / "model_new.py").write_text("draft")
    assert not restore_best(Workspace(tmp_path), tmp_path / ".kernelpilot" / "sessions" / "20261129-000000-abcd.jsonl")
    assert (tmp_path / "model_new.py").read_text() == "draft"


# ------------------------------------------------------------------------------------------ transcript


def record_turn(session: Session, turn: int, calls: list[str], answered: list[str], usage: Usage | None = None) -> None:
    tool_calls = [{"id": c, "type": "function", "function": {"name": "Bash", "arguments": "{}"}} for c in calls]
    session.append("message", turn=turn, message={"role": "assistant", "content": "", "tool_calls": tool_calls},
                   usage=usage or Usage(10, 5, 0.01))
    for call_id in answered:
        session.append("tool", turn=turn, message={"role": "tool", "tool_call_id": call_id, "content": "ok"},
                       name="Bash", arguments={}, data={"exit": 0}, seconds=0.1)


def test_records_are_json_lines_with_type_and_time(tmp_path):
    session = Session.create(tmp_path, problem="p.py", model="m")
    session.append_vouched("eval", turn=1, eval=judged(5.0), improved=True)
    lines = session.path.read_text().splitlines()
    assert session.path.parent == tmp_path / ".kernelpilot" / "sessions"
    assert [json.loads(line)["type"] for line in lines] == ["start", "eval"]
    assert json.loads(lines[1])["eval"]["bench"]["candidate"]["median_ms"] == 5.0
    assert all("time" in json.loads(line) for line in lines)


def test_resume_rebuilds_messages_and_state(tmp_path):
    session = Session.create(tmp_path, problem="p.py", model="m")
    session.append("message", turn=0, message={"role": "system", "content": "sys"})
    record_turn(session, 1, ["a"], ["a"])
    session.append_vouched("eval", turn=1, eval=judged(8.0), improved=True)
    session.append("step", turn=1, elapsed_s=12.5, todos=[{"content": "x", "status": "pending"}])
    record_turn(session, 2, ["b"], ["b"], usage=Usage(100, 50, None))
    session.append_vouched("eval", turn=2, eval=judged(9.0), improved=False)

    resumed = Session.resume(tmp_path)
    assert resumed.id == session.id
    assert [m["role"] for m in resumed.messages] == ["system", "assistant", "tool", "assistant", "tool"]
    state = resumed.state
    assert (state.turn, state.prompt_tokens, state.completion_tokens) == (2, 110, 55)
    assert not state.cost_known  # one reply had no price
    assert state.best.bench.candidate.median_ms == 8.0 and state.best_turn == 1
    assert len(state.evals) == 2 and state.elapsed_s == 12.5
    assert state.todos == [TodoItem("x", "pending")]
    assert read_records(session.path)[-1]["type"] == "resume"


def test_tool_records_give_back_typed_results_old_transcripts_included(tmp_path):
    finished = {"type": "tool", "name": "Finish", "result_type": "RunFinished", "data": {"summary": "done"}}
    assert tool_result(finished) == RunFinished("done")
    # Written before records named their result's type: read by the tool's result type when the data fits it.
    old_write = {"type": "tool", "name": "Write", "data": {"path": "kernels/a.cu", "created": True, "diff": "+x\n", "lines": 1}}
    assert tool_result(old_write) == FileWritten("kernels/a.cu", created=True, lines=1, diff="+x\n")
    assert tool_result({"type": "tool", "name": "Bash", "data": {"exit": 0}}) is None
    assert tool_result({"type": "tool", "name": "Read", "data": None}) is None  # a refused call, before errors were typed

    session = Session.create(tmp_path, problem="p.py", model="m")
    record_turn(session, 1, ["a"], ["a"])
    session.append("tool", turn=2, message={"role": "tool", "tool_call_id": "f", "content": "Run finished: done"},
                   name="Finish", arguments={"summary": "done"}, data={"summary": "done"}, result_type="RunFinished")
    assert Session.resume(tmp_path).state.finish_summary == "done"


def test_calls_cut_off_by_an_interruption_are_answered_on_resume(tmp_path):
    session = Session.create(tmp_path, problem="p.py", model="m")
    record_turn(session, 1, ["a", "b"], ["a"])
    messages = Session.resume(tmp_path).messages
    assert messages[-1] == {"role": "tool", "tool_call_id": "b", "content": INTERRUPTED_CALL}
    assert [m.get("tool_call_id") for m in messages] == [None, "a", "b"]


def test_a_line_cut_by_a_crash_is_dropped_but_corruption_elsewhere_is_an_error(tmp_path):
    session = Session.create(tmp_path, problem="p.py", model="m")
    record_turn(session, 1, ["a"], ["a"])
    with session.path.open("a") as handle:
        handle.write('{"type": "message", "turn": 2, "mess')
    assert Session.resume(tmp_path).state.turn == 1
    lines = session.path.read_text().splitlines()
    session.path.write_text("\n".join([lines[0], "not json", *lines[1:]]) + "\n")
    with pytest.raises(SessionError, match="Line 2"):
        read_records(session.path)


def test_resume_names_what_is_missing(tmp_path):
    with pytest.raises(SessionError, match="No session found"):
        Session.resume(tmp_path)
    Session.create(tmp_path, problem="p.py", model="m")
    with pytest.raises(SessionError, match="No session nope found"):
        Session.resume(tmp_path, "nope")


def test_list_and_render_sessions(tmp_path):
    first = Session.create(tmp_path / "kp-a", problem="/x/a.py", model="openai/m")
    first.append_vouched("eval", turn=3, eval=judged(5.0, compile_ms=10.0), improved=True)
    first.append_vouched("end", status="target-met", summary={})
    second = Session.create(tmp_path / "kp-b", problem="/x/b.py", model="builtin")
    (tmp_path / "kp-b" / ".kernelpilot" / "sessions" / "junk.jsonl").write_text("junk\n")

    infos = list_sessions(tmp_path)
    assert [info.id for info in infos] == [first.id, second.id]
    assert (infos[0].status, infos[0].turns, infos[0].best_speedup_vs_compile, infos[0].reward) == ("target-met", 3, 2.0, 3)
    assert infos[1].status == "unfinished" and infos[1].reward is None

    console = Console(record=True, width=160)
    render_session_list(console, infos)
    text = console.export_text()
    assert first.id in text and "target-met" in text and "2.00x" in text


def test_sessions_started_within_one_millisecond_list_in_the_order_they_started(tmp_path, monkeypatch):
    import kernelpilot.agent.session as session_module

    clock = iter(1_800_000_000.0001 + step * 0.0001 for step in range(1000))  # 0.1 ms apart
    monkeypatch.setattr(session_module.time, "time", lambda: next(clock))
    # "kp-b" sorts before "kp-z" by path: only the recorded start can put kp-z first.
    first = Session.create(tmp_path / "kp-z", problem="/x/z.py", model="m")
    second = Session.create(tmp_path / "kp-b", problem="/x/b.py", model="m")
    assert [info.id for info in list_sessions(tmp_path)] == [first.id, second.id]


def test_replay_shows_turns_calls_results_and_evals(tmp_path):
    session = Session.create(tmp_path, problem="p.py", model="m")
    session.append("message", turn=1, message={"role": "assistant", "content": "I predict 2x [fewer bytes]", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "Profile", "arguments": "{}"}}]})
    session.append("tool", turn=1, message={"role": "tool", "tool_call_id": "a", "content": "candidate 5 ms"}, name="Profile", seconds=2.0)
    session.append_vouched("eval", turn=1, eval=judged(5.0), improved=True)
    session.append_vouched("end", status="finished", summary={})
    console = Console(record=True, width=200)
    render_transcript(console, session.path)
    text = console.export_text()
    for expected in ("turn 1", "I predict 2x [fewer bytes]", "→ Profile", "candidate 5 ms", "new best", "2.00x vs compile", "finished"):
        assert expected in text


def test_replay_of_a_file_that_is_not_a_session(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"type": "other"}\n')
    with pytest.raises(SessionError, match="not a kernelpilot session"):
        read_records(path)
    with pytest.raises(SessionError, match="Cannot read"):
        read_records(Path(tmp_path / "missing.jsonl"))
