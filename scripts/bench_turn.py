#!/usr/bin/env python3
"""Per-turn cost of judging a .cu-only change with a warm worker: rebuild + load + verify + bench.

Run on a GPU machine:  python scripts/bench_turn.py --out turn.json [--runs 5] [--rows 8192 --cols 8192]

It scaffolds a workspace for y = x * 2 + 1, answers it with the workspace's example kernel (scale_shift), and
times `Judge.evaluate` once cold (worker start, cold build, baselines and torch.compile measured into an empty
cache) and then `--runs` times after editing the .cu each time (a different blocks-per-SM constant, so every
turn really recompiles, relinks and loads a new library in the same worker). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kernelpilot.harness.judge import Judge
from kernelpilot.results import EvalResult, to_dict
from kernelpilot.workspace import init_workspace

PROBLEM = '''"""y = x * 2 + 1 over a large fp32 matrix: the example kernel's problem."""
import torch
from torch import nn

ROWS, COLS = {rows}, {cols}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x * 2.0 + 1.0


def get_inputs():
    return [torch.randn(ROWS, COLS)]


def get_init_inputs():
    return []
'''

CANDIDATE = '''from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return kp_ops.scale_shift(x, 2.0, 1.0)
'''

KNOB = re.compile(r"constexpr int kBlocksPerSm = \d+;")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Where to write the JSON report.")
    parser.add_argument("--runs", type=int, default=5, help="Warm turns to time (at least 3).")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=8192)
    args = parser.parse_args()
    console = Console()

    with tempfile.TemporaryDirectory(prefix="kp-bench-turn-") as tmp:
        report = measure_turns(Path(tmp), rows=args.rows, cols=args.cols, runs=max(args.runs, 3), console=console)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_report(console, report)
    console.print(f"wrote {args.out}")
    return 0 if report["all_correct"] else 1


def measure_turns(tmp: Path, *, rows: int, cols: int, runs: int, console: Console) -> dict:
    problem = tmp / "scale_shift_problem.py"
    problem.write_text(PROBLEM.format(rows=rows, cols=cols))
    ws, _ = init_workspace(problem, tmp / "ws")
    ws.model_new_path.write_text(CANDIDATE)
    kernel = ws.kernels_dir / "example_scale_shift.cu"

    started = time.perf_counter()
    judge = Judge(cache_dir=tmp / "cache")
    try:
        startup_s = time.perf_counter() - started
        console.print(f"worker started in {startup_s:.1f} s on {judge.gpu_name}; cold evaluation...")
        cold = timed_evaluation(judge, ws.root)
        warm = []
        for turn in range(runs):
            kernel.write_text(KNOB.sub(f"constexpr int kBlocksPerSm = {5 + turn};", kernel.read_text()))
            warm.append(timed_evaluation(judge, ws.root))
            console.print(f"turn {turn + 1}: {warm[-1]['total_s']:.2f} s")
        gpu = judge.gpu_name
    finally:
        judge.close()

    totals = [turn["total_s"] for turn in warm]
    return {
        "gpu": gpu,
        "problem": {"rows": rows, "cols": cols, "dtype": "float32"},
        "worker_startup_s": startup_s,
        "cold": cold,
        "warm": warm,
        "warm_total_s": {"median": statistics.median(totals), "min": min(totals), "max": max(totals)},
        # A .cu-only turn must recompile no C++: neither a binding nor kp_module.cpp, the ops' registration.
        "cpp_recompiled_in_a_warm_turn": any(any(name.endswith(".cpp") for name in turn["compiled"]) for turn in warm),
        "all_correct": all(turn["reward"] >= 1 for turn in [cold, *warm]),
    }


def timed_evaluation(judge: Judge, root: Path) -> dict:
    """One `evaluate`, its wall time and the parts the results time themselves."""
    started = time.perf_counter()
    result: EvalResult = judge.evaluate(root)
    total_s = time.perf_counter() - started
    build_s = result.build.seconds if result.build else 0.0
    verify_s = result.verify.seconds if result.verify else 0.0
    return {
        "total_s": total_s,
        "build_s": build_s,
        "verify_s": verify_s,
        "load_bench_and_ipc_s": total_s - build_s - verify_s,
        "compiled": result.build.compiled if result.build else [],
        "reward": result.reward,
        "candidate_ms": result.bench.candidate.median_ms if result.bench and result.bench.candidate else None,
        "bench_phases_s": result.bench.phases if result.bench else {},
        "verify_phases_s": result.verify.phases if result.verify else {},
        "error": f"{result.error_kind}: {result.message}" if result.error_kind else None,
        "result": to_dict(result),
    }


def print_report(console: Console, report: dict) -> None:
    table = Table(title=f"per-turn cost on {report['gpu']} (seconds)", title_justify="left")
    for column in ("", "total", "build", "verify", "load+bench+ipc", "reward"):
        table.add_column(column, justify="right" if column else "left")
    table.add_column("recompiled", overflow="fold")
    rows = [("cold", report["cold"])] + [(f"turn {i + 1}", turn) for i, turn in enumerate(report["warm"])]
    for label, turn in rows:
        table.add_row(
            label,
            f"{turn['total_s']:.2f}",
            f"{turn['build_s']:.2f}",
            f"{turn['verify_s']:.2f}",
            f"{turn['load_bench_and_ipc_s']:.2f}",
            str(turn["reward"]),
            ", ".join(Path(name).name for name in turn["compiled"]) or "-",
        )
    console.print(table)
    warm = report["warm_total_s"]
    console.print(
        f"worker start {report['worker_startup_s']:.1f} s; warm turn median {warm['median']:.2f} s "
        f"(min {warm['min']:.2f}, max {warm['max']:.2f}); binding or registration recompiled in a "
        f"warm turn: {report['cpp_recompiled_in_a_warm_turn']}"
    )
    last = report["warm"][-1]
    for name in ("bench_phases_s", "verify_phases_s"):
        parts = ", ".join(f"{step} {seconds:.3f}" for step, seconds in last[name].items())
        console.print(f"last warm turn, {name[:-2].replace('_', ' ')} (s): {parts or '-'}", highlight=False)
    for label, turn in rows:
        if turn["error"]:
            console.print(f"[red]{label}: {turn['error']}[/]", highlight=False)


if __name__ == "__main__":
    sys.exit(main())
