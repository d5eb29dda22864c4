"""Sum up KernelBench runs of `kernelpilot suite`: the latest result of each problem (a script, not a test).

Give the runs' result folders oldest first; a problem's result in a later folder replaces its earlier one. Prints,
per level, how many problems have a result, how many are correct, how many beat both eager and torch.compile by more
than 1.05x, the geometric mean speedups, seconds per problem, and which problems have no result or are slower than
torch.compile.

    python3 scripts/kernelbench_summary.py docs/runs/2026-11-28-h200/kernelbench docs/runs/2026-11-28-h200/kernelbench-6cd6b2d ...
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from kernelpilot.suite import geometric_mean

WIN = 1.05  # "beats" means faster than this factor
SLOWER = 0.97  # below this factor of torch.compile, `optimize` must say torch.compile is faster


def latest_results(folders: list[Path]) -> dict[tuple[int, int], dict]:
    results: dict[tuple[int, int], dict] = {}
    for folder in folders:
        files = sorted(folder.glob("level*__*.json"))
        if not files:
            raise SystemExit(f"{folder} holds no result files (levelN__NAME.json): pass the folders `suite` wrote into.")
        for path in files:
            level, rest = path.stem.split("__", 1)
            results[(int(level.removeprefix("level")), int(rest.split("_", 1)[0]))] = json.loads(path.read_text())
    return results


def summary_rows(results: dict[tuple[int, int], dict], totals: dict[int, int]) -> list[dict]:
    rows = []
    for level, total in sorted(totals.items()):
        mine = {number: r for (lvl, number), r in results.items() if lvl == level}
        correct = {n: r for n, r in mine.items() if r.get("correct")}
        wins = [n for n, r in correct.items()
                if min(r.get("speedup_vs_eager") or 0, r.get("speedup_vs_compile") or 0) > WIN]
        seconds = [r["seconds"] for r in mine.values() if r.get("seconds")]
        rows.append({
            "level": level, "total": total, "with_result": len(mine), "correct": len(correct), "wins": len(wins),
            "geomean_vs_compile": geometric_mean([r.get("speedup_vs_compile") for r in correct.values()]),
            "geomean_vs_eager": geometric_mean([r.get("speedup_vs_eager") for r in correct.values()]),
            "median_s": statistics.median(seconds) if seconds else None, "max_s": max(seconds, default=None),
            "median_sol": statistics.median(sols) if (sols := [r["sol"] for r in correct.values() if r.get("sol")]) else None,
            "with_sol": len(sols),
            "without_result": sorted(set(range(1, total + 1)) - set(mine)),
            "not_correct": sorted(n for n in mine if n not in correct),
            "slower_than_compile": sorted(n for n, r in correct.items()
                                          if r.get("speedup_vs_compile") and r["speedup_vs_compile"] < SLOWER),
        })
    return rows


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", type=Path, nargs="+", help="result folders, oldest first")
    parser.add_argument("--level-size", type=int, nargs="+", default=[100, 100],
                        help="problems in level 1, 2, ... (KernelBench: 100 100 50)")
    args = parser.parse_args(argv)
    rows = summary_rows(latest_results(args.folders), {i + 1: n for i, n in enumerate(args.level_size)})
    print("| level | with a result | correct | > 1.05x vs both | geomean vs compile (vs eager) | median %SOL | seconds (median / max) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        sol = f"{100 * r['median_sol']:.0f}% (of {r['with_sol']})" if r["median_sol"] is not None else "not recorded"
        print(f"| {r['level']} | {r['with_result']} of {r['total']} | {r['correct']} | {r['wins']} | "
              f"{_x(r['geomean_vs_compile'])} ({_x(r['geomean_vs_eager'])}) | {sol} | {r['median_s']:.0f} s / {r['max_s']:.0f} s |")
    total, wins = sum(r["total"] for r in rows), sum(r["wins"] for r in rows)
    print(f"\n{sum(r['with_result'] for r in rows)} of {total} with a result, {sum(r['correct'] for r in rows)} correct, "
          f"{wins} beat both: {100 * wins / total:.1f}% of all {total}")
    for key, label in (("without_result", "no result"), ("not_correct", "not correct"),
                       ("slower_than_compile", f"below {SLOWER}x of torch.compile")):
        print(f"{label}: " + "; ".join(f"L{r['level']} " + ", ".join(map(str, r[key])) for r in rows if r[key]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
