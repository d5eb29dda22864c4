"""Every result says whether Landlock confined the judge's sandboxes, and every judging command says so when it did
not: without Landlock a candidate can write anything the user can (the judge's code, the Python installation), so
its verdict and speedup are no evidence against a hostile candidate.

Real sandboxes judge a plain-torch candidate on the CPU, confined by Landlock where this kernel has it, or made
unconfined as on a kernel without it (`confinement_testing.unconfined_judges`: the judge's worker starts them
without the folders they may write). The workspace has no kernels at all, since a build is minutes of g++ or nvcc;
as its protected kp_module.cpp is gone too, the tamper check (in the test's process) is left out. The other
commands' warning is checked with their judging stubbed out: only what they print is under test there.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from confinement_testing import unconfined_judges
from kernelpilot import workspace
from kernelpilot.cli import app
from kernelpilot.errors import UnconfinedJudgeError
from kernelpilot.harness import confine
from kernelpilot.harness.confine import landlock_available
from kernelpilot.harness.judge import Judge
from kernelpilot.results import LANDLOCK, UNCONFINED, UNCONFINED_NOTE, EvalResult, VerifyResult, from_dict, least_confined
from kp_testing import DOUBLE_PROBLEM, scale_problem, write_problem

CONFINEMENTS = [
    pytest.param(LANDLOCK, marks=pytest.mark.skipif(not landlock_available(), reason="this kernel has no Landlock")),
    UNCONFINED,
]
WARNING = f"warning: {UNCONFINED_NOTE}"
PLAIN_CANDIDATE = "from model import Model\n\n\nclass ModelNew(Model):\n    pass\n"


@pytest.fixture
def plain_workspace(tmp_path, monkeypatch) -> Path:
    """A workspace whose candidate is plain torch (the torch-compute guard fails it, in its sandbox), no kernels."""
    ws, _ = workspace.init_workspace(write_problem(tmp_path / "problem", scale_problem(rows=4, features=8)), tmp_path / "ws")
    for source in ws.kernel_sources():
        source.unlink()
    (ws.root / "model_new.py").write_text(PLAIN_CANDIDATE)
    monkeypatch.setattr(workspace, "tampered_files", lambda ws: [])
    return ws.root


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning:")]


@pytest.mark.parametrize("confinement", CONFINEMENTS)
def test_eval_says_whether_the_judges_sandboxes_were_confined_and_warns_once_when_not(plain_workspace, monkeypatch,
                                                                                      confinement):  # fmt: skip
    if confinement == UNCONFINED:
        unconfined_judges(monkeypatch)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")  # what `eval --device cpu` asks for before it judges
    args = ["eval", str(plain_workspace), "--device", "cpu", "--no-bench", "--trials", "1", "--json"]
    outcome = CliRunner().invoke(app, args)

    result = from_dict(EvalResult, json.loads(outcome.stdout))
    assert result.verify is not None and result.error_kind == "guard", result.message  # judged in its sandbox
    assert result.confinement == result.verify.confinement == confinement
    assert warnings(outcome.stderr) == ([WARNING] if confinement == UNCONFINED else []), outcome.stderr


@pytest.mark.skipif(not landlock_available(), reason="this kernel has no Landlock: no judge that must be confined starts")
def test_a_judge_that_must_be_confined_refuses_a_system_without_landlock_and_an_unconfined_sandbox(plain_workspace,
                                                                                                   monkeypatch):  # fmt: skip
    with monkeypatch.context() as without_landlock:
        without_landlock.setattr(confine, "landlock_available", lambda: False)
        with pytest.raises(UnconfinedJudgeError, match="offers no Landlock") as refused:
            Judge("cpu", allow_unconfined=False)  # before a worker starts
        assert "--allow-unconfined" in refused.value.hint
        Judge("cpu").close()  # any other judge starts, and says so in its results

    unconfined_judges(monkeypatch)
    marker = plain_workspace / "the candidate ran"  # unconfined, a candidate may write there
    (plain_workspace / "model_new.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
                                                  + PLAIN_CANDIDATE)  # fmt: skip
    with Judge("cpu", allow_unconfined=False) as judge:
        for step in (judge.verify, judge.bench):
            with pytest.raises(UnconfinedJudgeError, match="reported that Landlock does not confine it") as refused:
                step(plain_workspace)
            assert "--allow-unconfined" in refused.value.hint
        assert not marker.exists(), "the candidate was loaded in the unconfined sandbox before the refusal"
    with Judge("cpu") as judge:  # (the marker is what a loaded candidate leaves)
        judge.verify(plain_workspace, trials=1)
    assert marker.exists()


def test_the_least_confined_step_counts_and_a_result_from_before_has_none():
    assert least_confined(LANDLOCK, None, UNCONFINED) == UNCONFINED
    assert least_confined(LANDLOCK, None) == LANDLOCK and least_confined(None, None) is None and least_confined() is None
    old = {"problem_id": "p", "workspace": "ws", "verify": {"ok": True}, "reward": 1}  # JSON from before
    assert from_dict(EvalResult, old).confinement is None and from_dict(EvalResult, old).verify.confinement is None


# ------------------------------------------------------------------------- the other commands that judge


def _stub_accept(monkeypatch, tmp_path: Path, result: EvalResult) -> list[str]:
    from kernelpilot import acceptance
    from kernelpilot.acceptance import Accepted
    from kernelpilot.harness import judge

    @contextmanager
    def no_judge(device=None):
        yield None

    def accepted(judge, ws, judged=None, *, on_judged=None, **_):
        result.problem_id, result.workspace = ws.problem_id, str(ws.root)
        on_judged(result)
        return Accepted(result, ws.root / "kernelpilot.lock.json")

    monkeypatch.setattr(judge, "Judge", no_judge)
    monkeypatch.setattr(acceptance, "accept_candidate", accepted)
    ws, _ = workspace.init_workspace(write_problem(tmp_path, DOUBLE_PROBLEM, "double.py"), tmp_path / "ws")
    return ["accept", str(ws.root), "--no-commit"]


def _stub_check(monkeypatch, tmp_path: Path, result: EvalResult) -> list[str]:
    from kernelpilot import check

    report = check.CheckReport(outcomes=[check.CheckOutcome("ws", passed=True)], device="cpu",
                               confinement=result.confinement)  # fmt: skip
    monkeypatch.setattr(check, "run_check", lambda *args, **kwargs: report)
    return ["check"]


def _stub_optimize(monkeypatch, tmp_path: Path, result: EvalResult) -> list[str]:
    from kernelpilot import optimize
    from kernelpilot.agent.loop import RunSummary

    @contextmanager
    def checked(*args, **kwargs):
        yield None

    summary = RunSummary("finished", "s1", turns=1, prompt_tokens=0, completion_tokens=0, cost_usd=0.0, best=result)
    ran = optimize.OptimizeResult(tmp_path / "double.py", tmp_path / "ws", "policy", summary,
                                  confinement=result.confinement)  # fmt: skip
    monkeypatch.setattr(optimize, "checked_run", checked)
    monkeypatch.setattr(optimize, "optimize", lambda *args, **kwargs: ran)
    return ["optimize", str(write_problem(tmp_path, DOUBLE_PROBLEM, "double.py"))]


def _stub_suite(monkeypatch, tmp_path: Path, result: EvalResult) -> list[str]:
    from kernelpilot import suite

    outcome = suite.ProblemOutcome("double.py", "finished", correct=True, reward=1, confinement=result.confinement)
    monkeypatch.setattr(suite, "run_suite", lambda *args, **kwargs: suite.summarize([outcome]))
    return ["suite", str(tmp_path)]


@pytest.mark.parametrize("stub", [_stub_accept, _stub_check, _stub_optimize, _stub_suite],
                         ids=["accept", "check", "optimize", "suite"])  # fmt: skip
@pytest.mark.parametrize("confinement", [LANDLOCK, UNCONFINED])
def test_accept_check_optimize_and_suite_warn_once_when_their_judge_was_unconfined(tmp_path, monkeypatch, stub,
                                                                                   confinement):  # fmt: skip
    monkeypatch.chdir(tmp_path)  # no kernelpilot.toml of this checkout's
    result = EvalResult("p", "ws", verify=VerifyResult(ok=True, confinement=confinement), reward=1,
                        confinement=confinement)  # fmt: skip
    outcome = CliRunner().invoke(app, stub(monkeypatch, tmp_path, result))

    assert outcome.exception is None or isinstance(outcome.exception, SystemExit), outcome.exception
    assert warnings(outcome.stderr) == ([WARNING] if confinement == UNCONFINED else []), outcome.output


def test_watch_warns_with_the_first_unconfined_result_only():
    from rich.console import Console

    from kernelpilot.cli.render_watch import TerminalView
    from kernelpilot.watch import WatchEvent

    console = Console(record=True, width=300)
    view = TerminalView(console)
    for confinement in (LANDLOCK, UNCONFINED, UNCONFINED):
        result = EvalResult("p", "ws", verify=VerifyResult(ok=True, confinement=confinement), reward=1,
                            confinement=confinement)  # fmt: skip
        view(WatchEvent("result", result=result))
    assert warnings(console.export_text()) == [WARNING]
