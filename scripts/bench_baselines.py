#!/usr/bin/env python3
"""Eager and torch.compile baselines, floor time and % of speed-of-light for every problem in a folder.

Run on a GPU machine (the lead's H100):

    python scripts/bench_baselines.py examples --out logs/bench_baselines.json

Measures the GPU's ceilings once, then each problem's eager and compile timings (runs capped so ~15 problems
finish in a few minutes), prints a table and writes the whole record as JSON. The baselines also go into the
kernelpilot cache (or --cache-dir), so later evaluations on this GPU reuse them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kernelpilot.errors import KernelpilotError
from kernelpilot.harness.bench import baseline_key, measure_baselines, store_baselines
from kernelpilot.harness.sandbox_client import SandboxPool
from kernelpilot.harness.sandbox_client import CleanSandboxes
from kernelpilot.harness.cache import environment_key, store_entry
from kernelpilot.harness.roofline import CEILINGS_KIND, dominant_dtype, measure_ceilings, problem_roofline
from kernelpilot.problem import load_problem
from kernelpilot.results import to_dict


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a folder of KernelBench-format problems (*.py)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--device", default="cuda", help="the CUDA device to measure on (default: cuda)")
    parser.add_argument("--cache-dir", type=Path, help="kernelpilot cache folder (default: the user cache)")
    parser.add_argument("--max-runs", type=int, default=50, help="timed runs per baseline at most (default: 50)")
    parser.add_argument("--max-seconds", type=float, default=3.0, help="timed seconds per baseline at most (default: 3)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    # Logs are read at full width: rich would wrap the table at 80 columns when stdout is a file.
    console = Console(width=None if sys.stdout.isatty() else 140)
    import torch

    if not torch.cuda.is_available():
        console.print("[bold red]error:[/] no CUDA GPU is visible: the baselines are GPU timings.")
        return 2
    problem_files = sorted(path for path in args.folder.glob("*.py") if not path.name.startswith("_"))
    if not problem_files:
        console.print(f"[bold red]error:[/] {args.folder} holds no problem files (*.py).")
        return 2

    started = time.perf_counter()
    ceilings = measure_ceilings(args.device)
    store_entry(CEILINGS_KIND, {"gpu": ceilings["gpu"]}, ceilings, args.cache_dir)
    console.print(_describe_ceilings(ceilings))
    rows = []
    with tempfile.TemporaryDirectory(prefix="kernelpilot-baselines-") as sandboxes:
        pool = SandboxPool(args.device, Path(sandboxes))
        try:
            for path in problem_files:
                console.print(f"[dim]measuring {path.name} ...[/]")
                rows.append(measure_problem(path, args, ceilings, pool))
        finally:
            pool.close()
    record = {
        **environment_key(args.device),
        "ceilings": ceilings,
        "settings": {"max_runs": args.max_runs, "max_seconds": args.max_seconds},
        "seconds": round(time.perf_counter() - started, 1),
        "problems": rows,
    }
    console.print(render_table(rows, record))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        console.print(f"wrote {args.out}")
    return 0 if all(row["error"] is None for row in rows) else 1


def measure_problem(path: Path, args: argparse.Namespace, ceilings: dict, pool: SandboxPool) -> dict:
    """One problem's baselines, roofline and % SOL as a JSON-able row; a failure is recorded, not raised."""
    import torch

    row: dict = {"problem": path.stem, "file": str(path), "error": None}
    started = time.perf_counter()
    try:
        problem = load_problem(path)
        row["problem_id"] = problem.problem_id
        # Timed as the judge times them: in clean sandbox processes, fresh inputs per run.
        clean = CleanSandboxes(pool, path)
        try:
            baselines = measure_baselines(problem, clean, device=args.device, max_runs=args.max_runs,
                                          max_seconds=args.max_seconds)  # fmt: skip
        finally:
            clean.close()
        dtype = dominant_dtype(problem.make_inputs(args.device, 0))
        store_baselines(baseline_key(problem, device=args.device, dtype=dtype), baselines, args.cache_dir)
        roofline = problem_roofline(problem, device=args.device, cache_dir=args.cache_dir, ceilings=ceilings)
        row.update(
            dtype=dtype,
            **to_dict(baselines),
            roofline=to_dict(roofline),
            sol_eager=roofline.floor_ms / baselines.eager.median_ms,
            sol_compile=roofline.floor_ms / baselines.compiled.median_ms if baselines.compiled else None,
        )
    except Exception as err:  # noqa: BLE001 - one broken problem must not end the run
        row["error"] = _one_line(err)
    finally:
        torch.cuda.empty_cache()  # the next problem gets the whole GPU
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def _one_line(err: Exception) -> str:
    if isinstance(err, KernelpilotError):
        return err.message
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _describe_ceilings(ceilings: dict) -> str:
    rates = ", ".join(f"{name} {tflops:.0f}" for name, tflops in ceilings["matmul_tflops"].items())
    return f"{ceilings['gpu']}: copy {ceilings['bandwidth_gbs']:.0f} GB/s (read + write); matmul TFLOP/s: {rates}"


def render_table(rows: list[dict], record: dict) -> Table:
    table = Table(title=f"baselines on {record['gpu']} (torch {record['torch']}, {record['seconds']} s)")
    for header in ("problem", "eager ms (p10-p90)", "compile ms", "floor ms", "bound", "eager %SOL", "compile %SOL"):
        table.add_column(header, justify="left" if header == "problem" else "right")
    for row in rows:
        if row["error"]:
            table.add_row(row["problem"], f"[red]{row['error']}[/]", "", "", "", "", "")
            continue
        eager, compiled, roofline = row["eager"], row["compiled"], row["roofline"]
        table.add_row(
            row["problem"],
            f"{_ms(eager['median_ms'])} ({_ms(eager['p10_ms'])}-{_ms(eager['p90_ms'])})",
            _ms(compiled["median_ms"]) if compiled else "[yellow]failed[/]",
            _ms(roofline["floor_ms"]),
            roofline["bound"],
            _percent(row["sol_eager"]),
            _percent(row["sol_compile"]),
        )
    return table


def _ms(value: float) -> str:
    # Launch-bound problems have floors of microseconds or less: keep their digits.
    return f"{value:.3f}" if value >= 0.01 else f"{value:.2e}"


def _percent(fraction: float | None) -> str:
    return f"{100 * fraction:.0f}%" if fraction is not None else "-"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
