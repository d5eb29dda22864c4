"""Time `kernelpilot init` of one problem file, first (its check runs in a child) and again in a fresh process (the
check is reused from the cache folder): one fresh cache folder per run, median and range over the runs.

    python scripts/bench_init.py examples/softmax_long_rows.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed_init(problem: Path, workspace: Path, cache_dir: Path) -> float:
    environment = dict(os.environ, KERNELPILOT_CACHE_DIR=str(cache_dir))
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "kernelpilot", "init", str(problem), "--dir", str(workspace)],
        env=environment,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problem", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the seconds as JSON here")
    args = parser.parse_args()
    first, again = [], []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="kp-bench-init-") as folder:
            root = Path(folder)
            first.append(timed_init(args.problem, root / "ws1", root / "cache"))
            again.append(timed_init(args.problem, root / "ws2", root / "cache"))
    for label, seconds in (("first init", first), ("second init", again)):
        print(f"{label}: median {statistics.median(seconds):.2f} s ({min(seconds):.2f}..{max(seconds):.2f} s)")
    print(f"load average: {' '.join(f'{load:.2f}' for load in os.getloadavg())}, {os.cpu_count()} cores")
    if args.out:
        args.out.write_text(json.dumps({"first_s": first, "second_s": again}, indent=1) + "\n")


if __name__ == "__main__":
    main()
