"""The synthesised task dataset: the kept tasks of a synthesis run (train/synth.py) as JSONL (and parquet when pyarrow
is installed), its run report and a dataset card, and reading its tasks back (rollouts, RL, verl's data).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from kernelpilot.errors import KernelpilotError
from kernelpilot.train.synth import SynthReport
from kernelpilot.train.tasks import Task

DATASET_FILE = "tasks.jsonl"
CARD_TEMPLATE = """\
# kernelpilot synthesised kernel tasks

KernelBench-format problems (`class Model`, `get_inputs()`, `get_init_inputs()`) composed by `kernelpilot train synth`
from {operator_count} seed operators crawled from torch.nn and torch.nn.functional (torch {torch_version}), 1-5
operators each, filtered by running them on `{devices}`.

- composer: {composer}{stopped_note}
- composed: {composed}; kept: {kept} (seed {seed}, sizes "{scale}")
- dropped per filter: {dropped}
- decontaminated against: {benchmark}

Fields: `task_id`, `code` (the problem source), `ops` (operator names in order; for an LLM-composed task, the
sampled operators the model was asked to fuse), `layout` (image NCHW or rows B x S x F), `shapes` (the module
constants; for an LLM-composed task, the sizes it was given), `eager_ms` and `compile_ms` (median CUDA-event times;
null when filtered on a CPU), `composer` ("deterministic" or "llm:<model>").

Load it with `datasets.load_dataset("json", data_files="{data_file}")`{parquet_note}.
"""


def write_dataset(report: SynthReport, out_dir: Path, *, settings: dict[str, Any]) -> list[Path]:
    """Write the kept tasks as JSONL (and parquet when pyarrow is installed), the run report and a dataset card."""
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [dataclasses.asdict(task) for task in report.kept]
    jsonl = out_dir / DATASET_FILE
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    written = [jsonl]
    parquet = _write_parquet(rows, out_dir / "tasks.parquet")
    if parquet is not None:
        written.append(parquet)
    summary = {key: value for key, value in dataclasses.asdict(report).items() if key != "kept"}
    summary["model_error"] = report.model_error.message if report.model_error is not None else None
    (out_dir / "report.json").write_text(json.dumps({**summary, "settings": settings}, indent=2), encoding="utf-8")
    card = CARD_TEMPLATE.format(
        operator_count=settings.get("operator_count", "?"),
        torch_version=torch.__version__,
        devices=settings.get("devices"),
        composer=report.composer,
        stopped_note=f" (stopped early: {report.model_error.message})" if report.model_error is not None else "",
        composed=report.composed,
        kept=len(report.kept),
        seed=settings.get("seed"),
        scale=settings.get("scale"),
        dropped=", ".join(f"{k} {v}" for k, v in report.dropped_by_filter.items()),
        benchmark=settings.get("benchmark_dir") or "nothing",
        data_file=DATASET_FILE,
        parquet_note=" or from tasks.parquet" if parquet is not None else "",
    )
    (out_dir / "README.md").write_text(card, encoding="utf-8")
    return [*written, out_dir / "report.json", out_dir / "README.md"]


def _write_parquet(rows: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return None  # JSONL alone is a complete dataset; parquet is a convenience
    # shapes differ in keys per layout: stored as JSON text so every row has one schema.
    table = pa.Table.from_pylist([{**row, "shapes": json.dumps(row["shapes"])} for row in rows])
    pq.write_table(table, path)
    return path


def read_tasks(path: Path) -> list[Task]:
    """The tasks of a dataset written by `write_dataset` (its folder or its JSONL file)."""
    path = Path(path)
    jsonl = path / DATASET_FILE if path.is_dir() else path
    if not jsonl.is_file():
        raise KernelpilotError(
            f"No task dataset at {jsonl}.", hint="Make one with `kernelpilot train synth --out DIR`."
        )
    return [Task(**json.loads(line)) for line in jsonl.read_text(encoding="utf-8").splitlines() if line.strip()]
