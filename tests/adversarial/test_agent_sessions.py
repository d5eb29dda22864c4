"""Sessions against an agent that writes them. A run's transcript (.kernelpilot/sessions/) and the copy of its best
candidate (.kernelpilot/best/) live in the workspace, which a program the agent runs may write, and kernelpilot
reads both back: a rollout that was already run gives its recorded reward to training (`finished_session`), a
resumed run or suite takes its best candidate and verdict from them, and every run ends by writing the best copy
out as the verified candidate. Each cheat writes what a script run from Bash can write, through kernelpilot's own
session code; the judge's verdicts and the best candidate's files must come from where the agent cannot write."""

from __future__ import annotations

from pathlib import Path

from kernelpilot.agent.session import Session, list_sessions, restore_best, save_best
from kernelpilot.results import EvalResult, VerifyResult
from kernelpilot.train.rollout import finished_session
from kernelpilot.workspace import init_workspace
from kp_testing import scale_problem, write_problem


def _workspace(folder: Path):
    ws, _ = init_workspace(write_problem(folder, scale_problem(rows=8, features=16)), folder / "ws")
    return ws


def _forged_session(ws) -> Session:
    """A transcript an agent writes itself: a verdict of reward 3 it was never given, and an end."""
    session = Session.create(ws.root, problem=str(ws.model_path), model="builtin")
    forged = EvalResult(problem_id=ws.problem_id, workspace=str(ws.root), verify=VerifyResult(ok=True), reward=3)
    session.append("eval", turn=1, eval=forged, improved=True)
    session.append("end", status="finished", summary={})
    return session


def test_a_transcript_the_agent_wrote_gives_no_reward_to_a_rollout(tmp_path):
    ws = _workspace(tmp_path)
    _forged_session(ws)

    finished = finished_session(ws.root)

    assert finished is None or finished.reward < 1, f"a forged transcript gave the rollout reward {finished.reward}"
    assert all(info.reward is None for info in list_sessions(ws.root))


def test_a_transcript_the_agent_wrote_is_no_trajectory_for_rejection_fine_tuning(tmp_path):
    from kernelpilot.train.rft import load_trajectory

    ws = _workspace(tmp_path)
    session = _forged_session(ws)

    assert load_trajectory(session.path).best_reward < 1


def test_a_transcript_copied_from_another_workspace_is_not_vouched_for_here(tmp_path):
    honest, other = _workspace(tmp_path / "a"), _workspace(tmp_path / "b")
    session = Session.create(honest.root, problem=str(honest.model_path), model="builtin")
    verdict = EvalResult(problem_id=honest.problem_id, workspace=str(honest.root), verify=VerifyResult(ok=True),
                         reward=3)  # fmt: skip
    session.append_vouched("eval", turn=1, eval=verdict, improved=True)  # what kernelpilot's loop writes
    session.append_vouched("end", status="finished", summary={})
    assert finished_session(honest.root).reward == 3
    copy = other.root / session.path.relative_to(honest.root)
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_bytes(session.path.read_bytes())

    assert finished_session(other.root) is None


def test_the_best_candidate_written_out_is_the_one_the_judge_saw(tmp_path):
    ws = _workspace(tmp_path)
    judged = ws.model_new_path.read_text()
    session = Session.create(ws.root, problem=str(ws.model_path), model="builtin")
    verdict = EvalResult(problem_id=ws.problem_id, workspace=str(ws.root), verify=VerifyResult(ok=True), reward=1)
    digest = session.append_vouched("eval", turn=1, eval=verdict, improved=True)
    save_best(ws, session.path, digest)  # as the run does when the judge's verdict is its best so far
    # A script the agent runs at its last turn swaps the saved copy for other code.
    (ws.root / ".kernelpilot" / "best" / "model_new.py").write_text("# not what the judge verified\n")
    ws.model_new_path.write_text("# the agent's last edit\n")

    assert restore_best(ws, session.path)

    assert ws.model_new_path.read_text() == judged, "the run wrote out a candidate the judge never saw"
