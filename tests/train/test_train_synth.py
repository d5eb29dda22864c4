"""Task synthesis on CPU tensors: the operator crawl, composition, the execution filters, decontamination, the dataset.

torch.compile runs with backend="aot_eager" here (dynamo tracing and AOT autograd, no inductor codegen): inductor's
C++ compile on this 2-core machine costs seconds per task, and real runs on the GPU use inductor.
"""

import json
import shutil
from pathlib import Path

import pytest

from kernelpilot.problem import load_problem
from kernelpilot.train.compose import compose_tasks
from kernelpilot.train.decontaminate import decontaminate, op_sequence
from kernelpilot.train.filters import check_task
from kernelpilot.train.synth import crawl_operators, synthesize
from kernelpilot.train.synth_dataset import read_tasks, write_dataset
from kernelpilot.train.tasks import Task

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BACKEND = "aot_eager"


@pytest.fixture(scope="module")
def crawl():
    return crawl_operators()


def _problem(forward: str, helpers: str = "") -> str:
    return f"""import torch
import torch.nn as nn
import torch.nn.functional as F
{helpers}

class Model(nn.Module):
    def forward(self, x):
        {forward}


def get_inputs():
    return [torch.randn(4, 16)]


def get_init_inputs():
    return []
"""


def test_crawl_keeps_every_family_and_no_stochastic_operator(crawl):
    names = [op.name for op in crawl.operators]
    assert len(names) >= 40
    assert {op.family for op in crawl.operators} >= {
        "activation",
        "softmax",
        "norm",
        "pooling",
        "linear",
        "conv",
        "reduction",
    }
    assert {"nn.GELU", "F.silu", "nn.LayerNorm", "nn.Conv2d", "nn.MaxPool2d", "F.softmax", "torch.sum"} <= set(names)
    assert not [name for name in names if "dropout" in name.lower() or "rrelu" in name.lower()]
    assert "stochastic" in crawl.skipped["nn.RReLU"]
    assert "stochastic" in crawl.skipped["nn.Dropout"]


def test_composition_is_deterministic_and_loadable(crawl, tmp_path):
    tasks = compose_tasks(crawl.operators, 12, seed=3, scale="small")
    assert [task.code for task in tasks] == [
        task.code for task in compose_tasks(crawl.operators, 12, seed=3, scale="small")
    ]
    assert len({task.task_id for task in tasks}) == 12
    for task in tasks:
        assert 1 <= len(task.ops) <= 5
        path = tmp_path / f"{task.task_id}.py"
        path.write_text(task.code)
        problem = load_problem(path)  # validates Model, get_inputs and get_init_inputs on meta tensors
        assert problem.make_model()(*problem.make_inputs(seed=0)).isfinite().all()


def test_composed_tasks_pass_the_filters(crawl):
    tasks = compose_tasks(crawl.operators, 6, seed=5, scale="small")
    verdicts = [check_task(task.code, compile_backend=BACKEND) for task in tasks]
    assert all(verdict.kept for verdict in verdicts), verdicts
    assert all(verdict.eager_ms is None for verdict in verdicts)  # no timing without a GPU


@pytest.mark.parametrize(
    ("forward", "reason"),
    [
        ("return x * 0", "all zeros"),
        ("return torch.ones_like(x) * 3", "constant"),
        ("return torch.log(x - 100)", "NaN or Inf"),
    ],
)
def test_degenerate_outputs_are_dropped(forward, reason):
    verdict = check_task(_problem(forward), compile_backend=BACKEND)
    assert (verdict.kept, verdict.reason) == (False, "degenerate")
    assert reason in verdict.detail


def test_a_hidden_random_op_is_caught_as_nondeterministic():
    # The noise comes from a helper outside Model, which the static stochastic-op scan does not read.
    helper = "\ndef jitter(x):\n    return x + torch.randn_like(x)\n"
    verdict = check_task(_problem("return jitter(x)", helper), compile_backend=BACKEND)
    assert (verdict.kept, verdict.reason) == (False, "nondeterministic")


def test_stochastic_ops_in_forward_are_dropped_before_running():
    verdict = check_task(_problem("return F.dropout(x, 0.5, training=True)"), compile_backend=BACKEND)
    assert (verdict.kept, verdict.reason) == (False, "stochastic-op")
    assert "dropout" in verdict.detail


def test_a_broken_problem_is_invalid():
    verdict = check_task(_problem("return x @ x"), compile_backend=BACKEND)  # 4x16 @ 4x16 cannot multiply
    assert (verdict.kept, verdict.reason) == (False, "invalid")


def test_code_that_is_not_a_problem_is_invalid_and_the_reason_names_no_temporary_folder():
    not_python = check_task("class Model(nn.Module:\n", compile_backend=BACKEND)
    assert not_python.reason == "invalid" and not_python.detail.startswith("Syntax error at task.py:1: ")
    no_model = check_task(_problem("return x").replace("class Model", "class Net"), compile_backend=BACKEND)
    assert (no_model.reason, no_model.detail) == ("invalid", "task.py has no class named Model.")


def test_decontamination_drops_a_copy_of_a_benchmark_problem(crawl, tmp_path):
    benchmark = tmp_path / "bench"
    benchmark.mkdir()
    shutil.copy(EXAMPLES / "layernorm.py", benchmark)
    shutil.copy(EXAMPLES / "conv2d_relu_bias.py", benchmark)
    renamed = (EXAMPLES / "conv2d_relu_bias.py").read_text().replace("self.conv", "self.c0").replace("BATCH", "B")
    copies = [
        Task("copy", (EXAMPLES / "layernorm.py").read_text(), [], "rows", {}),
        Task("renamed", renamed, [], "image", {}),
    ]
    fresh = compose_tasks(crawl.operators, 5, seed=11, scale="small")
    kept, dropped = decontaminate(copies + fresh, benchmark)
    assert {d.task_id for d in dropped} == {"copy", "renamed"}
    assert all(d.why == "same operator sequence" for d in dropped)
    assert [task.task_id for task in kept] == [task.task_id for task in fresh]


def test_op_sequence_reads_every_spelling_alike():
    assert op_sequence((EXAMPLES / "conv2d_relu_bias.py").read_text()) == ["conv2d", "relu", "add"]
    assert op_sequence(_problem("return F.relu(torch.sum(x, dim=1))")) == ["sum", "relu"]


def test_dataset_round_trip(tmp_path):
    report = synthesize(4, seed=2, scale="small", devices=["cpu"], compile_backend=BACKEND, benchmark_dir=EXAMPLES)
    assert len(report.kept) + sum(report.dropped_by_filter.values()) == report.composed
    written = write_dataset(report, tmp_path, settings={"seed": 2, "scale": "small", "devices": "cpu"})
    assert (tmp_path / "README.md") in written
    assert [task.code for task in read_tasks(tmp_path)] == [task.code for task in report.kept]
    row = json.loads((tmp_path / "tasks.jsonl").read_text().splitlines()[0])
    assert set(row) >= {"code", "ops", "shapes", "eager_ms", "compile_ms"}
    assert row["composer"] == "deterministic"


def test_dataset_loads_with_datasets(tmp_path):
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (pip install 'kernelpilot[train]')")
    report = synthesize(3, seed=4, scale="small", devices=["cpu"], compile_backend=BACKEND)
    write_dataset(report, tmp_path, settings={})
    loaded = datasets.load_dataset("json", data_files=str(tmp_path / "tasks.jsonl"), split="train")
    assert loaded["code"] == [task.code for task in report.kept]
    if (tmp_path / "tasks.parquet").exists():
        assert datasets.load_dataset("parquet", data_files=str(tmp_path / "tasks.parquet"), split="train")["ops"] == [
            task.ops for task in report.kept
        ]
