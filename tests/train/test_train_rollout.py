"""`train rollout`: the agent over dataset tasks against an OpenAI-compatible endpoint, transcripts for RFT, resume."""

from pathlib import Path

from openai_server import MODEL_ID, ScriptedOpenAIServer

from kernelpilot.config import Settings
from kernelpilot.train.rft import build_sft_dataset, find_transcripts
from kernelpilot.train.rollout import ROLLOUTS_FILE, run_rollouts
from kernelpilot.train.synth import SynthReport
from kernelpilot.train.synth_dataset import write_dataset
from kernelpilot.train.tasks import Task

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_rollouts_run_every_task_record_transcripts_and_resume(tmp_path):
    tasks = [Task(name, (EXAMPLES / f"{name}.py").read_text(), [], "rows", {}) for name in ("rmsnorm", "row_mean")]
    write_dataset(SynthReport(2, tasks, {}, [], {}, 0.0), tmp_path / "tasks", settings={})
    settings = Settings(model=f"openai/{MODEL_ID}", api_key="test", max_turns=3, trials=1)
    with ScriptedOpenAIServer() as server:
        for _ in tasks:
            server.reply_tool_calls([("TodoWrite", {"todos": [{"content": "write a kernel", "status": "pending"}]})])
            server.reply_tool_calls([("Finish", {"summary": "I made it 10x faster."})])
        settings.api_base = server.base_url
        rollouts = run_rollouts(tmp_path / "tasks", tmp_path / "out", settings, devices=["cpu", "cpu"])
    assert [r.task_id for r in rollouts] == ["rmsnorm", "row_mean"]
    assert all(r.status == "finished" and r.reward == -1 and Path(r.session).is_file() for r in rollouts)
    assert len((tmp_path / "out" / ROLLOUTS_FILE).read_text().splitlines()) == 2

    again = run_rollouts(tmp_path / "tasks", tmp_path / "out", settings, devices=["cpu"])  # no server: nothing reruns
    assert [(r.task_id, r.skipped, r.session) for r in again] == [(r.task_id, True, r.session) for r in rollouts]

    # The model claimed success, the judge never verified anything: RFT keeps neither.
    report = build_sft_dataset(find_transcripts(tmp_path / "out"), tmp_path / "sft.jsonl")
    assert (report.read, report.kept, report.dropped_by_filter["no-positive-outcome"]) == (2, 0, 2)
