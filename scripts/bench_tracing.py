#!/usr/bin/env python3
"""What the candidate sandbox's kernel trace (harness/tracing.py) costs, on a GPU.

A launch-bound forward (40 small elementwise kernels) is timed the way a sandbox times a run (GPU kept busy while
the call is dispatched, CUDA events around a device-wide sync): with no profiler, with the trace's session on and
collection off (every untraced run), and with collection on (a traced run). Also the CPU cost of switching
collection on and off, and of reading the session (stop, read, start).

    python3 scripts/bench_tracing.py [--runs 50] [--blocks 6] [--out bench_tracing.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kernelpilot.harness.tracing import KernelTrace

LAUNCHES = 40


def forward(x: torch.Tensor) -> torch.Tensor:
    y = x
    for _ in range(LAUNCHES // 2):
        y = torch.relu(y) * 1.0001
    return y


def timed_ms(x: torch.Tensor, runs: int, around=None) -> list[float]:
    samples = []
    for _ in range(runs):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with around() if around is not None else _nothing():
            start.record()
            forward(x)
            torch.cuda.synchronize()
            end.record()
            end.synchronize()
        samples.append(start.elapsed_time(end))
    return samples


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def spread(samples: list[float]) -> dict:
    deciles = statistics.quantiles(samples, n=10, method="inclusive")
    return {"median": statistics.median(samples), "p10": deciles[0], "p90": deciles[-1], "n": len(samples)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="timed runs per block")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1 << 20, device=device)
    for _ in range(5):
        forward(x)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "launches": LAUNCHES}
    # Blocks of runs alternate between no profiler and the trace's session, so drift (clocks, other load) falls
    # on both alike; each block is preceded by a few untimed runs.
    plain, session_on, collecting = [], [], []
    for _ in range(args.blocks):
        timed_ms(x, 5)
        plain += timed_ms(x, args.runs)
        trace = KernelTrace(device)
        timed_ms(x, 5)
        session_on += timed_ms(x, args.runs)
        collecting += timed_ms(x, args.runs, around=trace.collecting)
        trace.close()  # the next block starts with no profiler
    trace = KernelTrace(device)
    report["no profiler (ms)"] = spread(plain)
    report["session on, collection off (ms)"] = spread(session_on)
    report["collection on (ms)"] = spread(collecting)
    toggles = []
    for _ in range(50):
        started = time.perf_counter()
        with trace.collecting():
            pass
        toggles.append((time.perf_counter() - started) * 1e3)
    report["collection on + off, CPU (ms)"] = spread(toggles)
    reads = []
    for _ in range(10):
        started = time.perf_counter()
        names = trace.take_names()
        reads.append((time.perf_counter() - started) * 1e3)
    report["read: stop, read, start (ms)"] = spread(reads)
    report["kernels read at the last read"] = len(names)
    with trace.collecting():
        forward(x)
    report["kernels collected from one forward"] = len(trace.take_names())
    for key, value in report.items():
        shown = f"median {value['median']:.3f}  p10 {value['p10']:.3f}  p90 {value['p90']:.3f}" if isinstance(value, dict) else value
        print(f"{key:36s} {shown}")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
