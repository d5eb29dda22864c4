"""Judging many workspaces: the lane scheduler (concurrency, order, failures), the devices each lane gets, and
`kernelpilot eval DIR` over a folder of workspaces through real CPU judges whose builds fail fast."""

from __future__ import annotations

import json
import textwrap
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kernelpilot.cli import app
from kernelpilot.harness.batch import lane_devices, spread
from kernelpilot.workspace import EXAMPLE_KERNELS, init_workspace

PROBLEM = """
import torch
from torch import nn


class Model(nn.Module):
    def forward(self, x):
        return x * 2


def get_inputs():
    return [torch.randn(8)]


def get_init_inputs():
    return []
"""


def test_spread_runs_one_item_per_lane_at_once_and_keeps_the_items_order():
    both_lanes_busy = threading.Barrier(2, timeout=10)  # breaks (and the test fails) if the lanes run one by one
    c_done = threading.Event()
    lanes_seen: dict[str, str] = {}

    def run(lane: str, item: str) -> str:
        lanes_seen[item] = lane
        if item in ("a", "b"):
            both_lanes_busy.wait()
        if item == "a":  # "a" finishes after "b" and "c", which the other lane runs meanwhile
            assert c_done.wait(60), "c never finished"
        return item.upper()

    finished: list[str] = []

    def done(item: str, _: str) -> None:
        finished.append(item)
        if item == "c":
            c_done.set()

    results = spread(["a", "b", "c"], ["lane0", "lane1"], run, on_done=done)

    assert results == ["A", "B", "C"]
    assert {lanes_seen["a"], lanes_seen["b"]} == {"lane0", "lane1"}
    assert finished[-1] == "a"


def test_spread_raises_the_first_failure_and_stops_taking_items():
    started: list[int] = []

    def run(lane: int, item: int) -> int:
        started.append(item)
        if item == 0:
            raise ValueError("item 0 is broken")
        time.sleep(0.2)
        return item

    with pytest.raises(ValueError, match="item 0 is broken"):
        spread(list(range(20)), [0, 1], run)
    assert len(started) < 20


def test_lane_devices_on_cpu_and_on_a_named_gpu():
    assert lane_devices("cpu") == ["cpu"]
    assert lane_devices("cpu", 3) == ["cpu", "cpu", "cpu"]
    assert lane_devices("cuda:1") == ["cuda:1"]


def test_lane_devices_by_default_is_one_per_visible_gpu():
    import torch

    count = torch.cuda.device_count()
    expected = [f"cuda:{index}" for index in range(count)] if count else ["cuda"]
    assert lane_devices(None) == expected


def broken_workspace(root: Path, name: str) -> Path:
    problem = root / "problems" / f"{name}.py"
    problem.parent.mkdir(parents=True, exist_ok=True)
    problem.write_text(textwrap.dedent(PROBLEM))
    ws, _ = init_workspace(problem, root / "runs" / name)
    for example in EXAMPLE_KERNELS:
        (ws.root / example).unlink()
    (ws.root / "kernels" / "broken.cpp").write_text(f"int {name}_broken( {{ return 0; }}\n")  # a syntax error
    return ws.root


@pytest.mark.cuda_build
def test_eval_of_a_folder_judges_every_workspace_in_order_with_two_cpu_workers(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")  # no GPU to ask which arch to build for
    first, second = broken_workspace(tmp_path, "alpha"), broken_workspace(tmp_path, "beta")

    outcome = CliRunner().invoke(app, ["eval", str(tmp_path / "runs"), "--device", "cpu", "--workers", "2", "--json"])

    assert outcome.exit_code == 1, outcome.output
    results = json.loads(outcome.stdout)
    assert [result["workspace"] for result in results] == [str(first), str(second)]
    for result, name in zip(results, ("alpha", "beta")):
        assert (result["error_kind"], result["reward"]) == ("build", -1)
        assert any(f"{name}_broken" in d["message"] or "broken.cpp" in (d["file"] or "")
                   for d in result["build"]["diagnostics"]), result["build"]["log"]


@pytest.mark.cuda_build
def test_eval_of_a_folder_prints_one_row_per_workspace(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    broken_workspace(tmp_path, "alpha")

    outcome = CliRunner().invoke(app, ["eval", str(tmp_path / "runs"), "--device", "cpu", "--no-bench"])

    assert outcome.exit_code == 1
    assert "alpha" in outcome.stdout and "build:" in outcome.stdout and "vs compile" in outcome.stdout


def test_eval_of_a_folder_without_workspaces_is_one_sentence(tmp_path):
    outcome = CliRunner().invoke(app, ["eval", str(tmp_path), "--device", "cpu"])

    assert outcome.exit_code != 0 and "Traceback" not in outcome.output
    assert "is not a workspace and holds none" in outcome.output
