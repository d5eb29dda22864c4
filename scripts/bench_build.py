#!/usr/bin/env python3
"""Benchmark the incremental build in one warm process: cold, nothing changed, a .cu edited (+ load), a binding touched.

    python scripts/bench_build.py --out bench_build.json [--example examples/silu_scale_shift.py] [--runs 3]

The workspace is scaffolded from an example into a temporary folder. Each case runs --runs times; the table
shows the median and min..max seconds, the JSON holds every run. The .cu case makes a real code change each
run (a host function returning the run number), so every build is a new library that load_extension really
loads and registers, as in an agent's turn; the binding case only touches the file, which is enough to recompile it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kernelpilot.build import build_workspace, load_extension, resolve_arch
from kernelpilot.workspace import Workspace, init_workspace

REPO_ROOT = Path(__file__).resolve().parents[1]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    parser.add_argument("--example", type=Path, default=REPO_ROOT / "examples" / "silu_scale_shift.py")
    parser.add_argument("--runs", type=int, default=3, help="runs per case (default 3)")
    parser.add_argument("--arch", default=None, help="e.g. 9.0 (default: the GPU's, or TORCH_CUDA_ARCH_LIST)")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: CPU count)")
    return parser.parse_args(argv)


def _build(ws: Workspace, args: argparse.Namespace):
    result = build_workspace(ws.root, arch=args.arch, jobs=args.jobs)
    if not result.ok:
        sys.exit(f"bench_build: the build failed: {result.error}\n{result.log[-3000:]}")
    return result


def _timed_build(ws: Workspace, args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    result = _build(ws, args)
    return {"seconds": time.perf_counter() - started, "compiled": result.compiled, "linked": result.linked}


def _cold(ws: Workspace, args: argparse.Namespace) -> dict:
    shutil.rmtree(ws.build_dir, ignore_errors=True)
    return _timed_build(ws, args)


def _edited_cu_and_load(ws: Workspace, args: argparse.Namespace, cu: Path, original: str, run: int) -> dict:
    cu.write_text(f"{original}\nint kp_bench_build_run() {{ return {run}; }}\n")
    started = time.perf_counter()
    result = _build(ws, args)
    built = time.perf_counter()
    load_extension(result)
    loaded = time.perf_counter()
    return {
        "seconds": loaded - started,
        "build_seconds": built - started,
        "load_seconds": loaded - built,
        "compiled": result.compiled,
        "linked": result.linked,
    }


def _touched(ws: Workspace, args: argparse.Namespace, path: Path) -> dict:
    os.utime(path)
    return _timed_build(ws, args)


def _summary(runs: list[dict]) -> dict:
    seconds = [r["seconds"] for r in runs]
    return {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds), "runs": runs}


def measure(ws: Workspace, args: argparse.Namespace) -> dict[str, dict]:
    """Every case, args.runs times each, in this one process."""
    cu = next(p for p in ws.kernel_sources() if p.suffix == ".cu" and not p.name.startswith("kp_"))
    binding = next(p for p in ws.kernel_sources() if p.name.endswith("_binding.cpp"))
    cases: dict[str, list[dict]] = {"cold": [], "nothing changed": [], "one .cu edited + load": [], "binding touched": []}
    for _ in range(args.runs):
        cases["cold"].append(_cold(ws, args))
    for _ in range(args.runs):
        cases["nothing changed"].append(_timed_build(ws, args))
    original = cu.read_text()
    try:
        for run in range(args.runs):
            cases["one .cu edited + load"].append(_edited_cu_and_load(ws, args, cu, original, run))
    finally:
        cu.write_text(original)
    _build(ws, args)  # back to the original .cu, so the binding case recompiles the binding alone
    for _ in range(args.runs):
        cases["binding touched"].append(_touched(ws, args, binding))
    return {name: _summary(runs) for name, runs in cases.items()}


def _environment(args: argparse.Namespace) -> dict:
    import torch

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "arch": resolve_arch(args.arch),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "jobs": args.jobs or os.cpu_count(),
        "example": args.example.name,
        "runs": args.runs,
    }


def _table(cases: dict[str, dict]) -> Table:
    table = Table(title="kernelpilot build times (seconds, one warm process)", title_justify="left")
    table.add_column("case")
    table.add_column("median", justify="right")
    table.add_column("min..max", justify="right")
    table.add_column("recompiled (last run)")
    for name, summary in cases.items():
        last = summary["runs"][-1]
        recompiled = ", ".join(Path(s).name for s in last["compiled"]) or "nothing"
        table.add_row(name, f"{summary['median']:.3f}", f"{summary['min']:.3f}..{summary['max']:.3f}", recompiled)
    return table


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    import torch  # noqa: F401 - imported before any timing: a warm process has paid for it already

    console = Console()
    with tempfile.TemporaryDirectory(prefix="kp-bench-build-") as scratch:
        ws, _ = init_workspace(args.example, Path(scratch) / "workspace")
        cases = measure(ws, args)
    edited = cases["one .cu edited + load"]["runs"]
    binding_recompiled = any(not s.endswith(".cu") for run in edited for s in run["compiled"])
    report = {"environment": _environment(args), "binding_recompiled_on_cu_edit": binding_recompiled, "cases": cases}

    console.print(_table(cases))
    load = statistics.median(r["load_seconds"] for r in edited)
    console.print(f"load_extension of a new build: median {load * 1000:.0f} ms")
    verdict = "[bold red]yes (it must not be)[/]" if binding_recompiled else "[green]no[/]"
    console.print(f"binding or registration (kp_module.cpp) recompiled when only the .cu changed: {verdict}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
