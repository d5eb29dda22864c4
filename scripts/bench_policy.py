"""Benchmark the built-in policy's generated kernels on every problem of a folder (a script, not a test).

For each problem: analyse it; if every op can be generated, scaffold a workspace, write the policy's kernels
with their first launch configuration, build all workspaces in parallel, then judge each one (verify + time
against eager and torch.compile) in one warm worker. A problem whose first answer mismatches gets the policy's
fallback, the rounding-faithful kernels (`analyze(faithful=True)`), judged in its place and marked
row["fallback"] = "faithful", when they differ. With --search, every further launch configuration is then
tried the way the policy's own search does (one group at a time, the others at their best so far; each try
built, verified and timed) and the fastest correct one is reported, as `kernelpilot optimize` would keep it.
Prints one table and writes JSON. --markdown turns such JSON files (one run split over several calls) into
BENCHMARKS.md's table and the three counts the issue's goals are about, with no GPU.

    python3 scripts/bench_policy.py examples --search --out bench_policy.json
    python3 scripts/bench_policy.py --markdown part1.json part2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kernelpilot.build import build_workspace
from kernelpilot.harness.judge import Judge
from kernelpilot.harness.reward import DEFAULT_THRESHOLD
from kernelpilot.policy.analysis import analyze
from kernelpilot.policy.families import launch_candidates, render_all, render_kernel
from kernelpilot.policy.policy import kernel_shares
from kernelpilot.policy.search import LaunchSearch
from kernelpilot.problem import load_problem
from kernelpilot.results import EvalResult, from_dict, to_dict
from kernelpilot.workspace import EXAMPLE_KERNELS, init_workspace


def prepare(problem_path: Path, root: Path) -> dict:
    """Analyse one problem and, when supported, write its generated workspace."""
    problem = load_problem(problem_path)
    analysis = analyze(problem)
    row = {"problem": problem_path.stem, "supported": analysis.supported, "note": ""}
    if not analysis.supported:
        row["note"] = analysis.blockers()
        return row
    ws, _ = init_workspace(problem_path, root / problem_path.stem)
    for name in EXAMPLE_KERNELS:  # as the policy leaves its workspace: without the scaffold's example
        (ws.root / name).unlink(missing_ok=True)
    for file in render_all(ws.problem(), analysis):
        (ws.root / file.path).write_text(file.content)
    row["workspace"] = str(ws.root)
    return row


def judge_row(judge: Judge, row: dict, trials: int = 5) -> None:
    result = judge.evaluate(row["workspace"], trials=trials)
    bench = result.bench
    row.update(correct=bool(result.verify and result.verify.ok), reward=result.reward, message=result.message,
               error_kind=result.error_kind)
    if bench and bench.candidate:
        row.update(
            eager_ms=bench.eager.median_ms if bench.eager else None,
            compile_ms=bench.compiled.median_ms if bench.compiled else None,
            ours_ms=bench.candidate.median_ms,
            ours_p10_ms=bench.candidate.p10_ms,
            ours_p90_ms=bench.candidate.p90_ms,
            vs_eager=bench.speedup_vs_eager,
            vs_compile=bench.speedup_vs_compile,
            sol=bench.sol_candidate,
            bound=bench.roofline.bound if bench.roofline else None,
        )
    row["result"] = to_dict(result)


def judge_problem(judge: Judge, row: dict, problem_path: Path, search: bool) -> None:
    """What `optimize` would keep: the first answer; after a mismatch, the policy's fallback; with `search`, the
    fastest correct launch configuration of whichever verified."""
    judge_row(judge, row)
    if row.get("error_kind") == "mismatch":  # not a crash or a guard finding: maybe rounding
        faithful_row(judge, row, problem_path)
    if search and row.get("correct"):
        search_row(judge, row, problem_path)


def faithful_row(judge: Judge, row: dict, problem_path: Path) -> None:
    """As the policy does after a mismatch: write the rounding-faithful kernels, when they differ, and judge them in
    place of the first answer, whose message is kept in row["first_message"]."""
    problem = load_problem(problem_path)
    faithful = analyze(problem, faithful=True)
    if faithful == analyze(problem):
        return
    # The faithful analysis only splits groups off, so its files overwrite every kernel of the first answer.
    for file in render_all(problem, faithful):
        (Path(row["workspace"]) / file.path).write_text(file.content)
    row.update(fallback="faithful", first_message=row.get("message"))
    judge_row(judge, row)


def search_row(judge: Judge, row: dict, problem_path: Path) -> None:
    """Try the other launch configurations with the policy's own search; keep the fastest correct one in `row`."""
    analysis = analyze(load_problem(problem_path), faithful=row.get("fallback") == "faithful")
    groups = analysis.generated_groups
    candidates = {group.name: launch_candidates(group) for group in groups}
    shares = kernel_shares(from_dict(EvalResult, row["result"]), groups) if row.get("result") else {}
    search = LaunchSearch({name: len(configs) for name, configs in candidates.items()}, row.get("ours_ms"), row.get("sol"),
                          shares)  # fmt: skip
    row["tries"] = [{"choice": dict(search.best), "ms": row.get("ours_ms")}]
    while (next_try := search.next_try()) is not None:
        choice = search.choice(*next_try)
        write_kernels(row, groups, candidates, choice)
        trial = dict(row)
        judge_row(judge, trial, trials=2)
        ms = trial.get("ours_ms") if trial.get("correct") else None
        row["tries"].append({"choice": choice, "ms": ms, "error_kind": trial.get("error_kind")})
        if search.record(ms, trial.get("sol") if ms is not None else None):
            row.update({key: value for key, value in trial.items() if key != "tries"})
    write_kernels(row, groups, candidates, search.best)
    row["configs"] = {name: candidates[name][index].label for name, index in search.best.items()}


def write_kernels(row: dict, groups: list, candidates: dict, choice: dict[str, int]) -> None:
    for group in groups:
        kernel = render_kernel(group, candidates[group.name][choice[group.name]])
        (Path(row["workspace"]) / kernel.path).write_text(kernel.content)


def render(rows: list[dict], gpu: str, searched: bool) -> Table:
    how = "fastest launch config of the policy's search" if searched else "first launch config, no search"
    table = Table(title=f"built-in policy on {gpu} ({how})")
    for name in ("problem", "supported", "correct", "eager ms", "compile ms", "ours ms", "vs eager", "vs compile", "% SOL"):
        table.add_column(name, justify="left" if name == "problem" else "right")

    for row in rows:
        table.add_row(
            row["problem"],
            "yes" if row["supported"] else "no",
            {True: "yes", False: "NO"}.get(row.get("correct"), "-"),
            fmt(row.get("eager_ms"), "{:.3f}"),
            fmt(row.get("compile_ms"), "{:.3f}"),
            fmt(row.get("ours_ms"), "{:.3f}"),
            fmt(row.get("vs_eager"), "{:.2f}x"),
            fmt(row.get("vs_compile"), "{:.2f}x"),
            fmt(row["sol"] * 100 if row.get("sol") else None, "{:.0f}%"),
        )
    return table


def fmt(value, pattern: str) -> str:
    """A number through `pattern`, or "-" for a missing value."""
    return pattern.format(value) if isinstance(value, (int, float)) else "-"


MARKDOWN_HEADER = ("problem", "supported", "correct", "eager ms", "compile ms", "ours ms (p10–p90)", "vs eager",
                   "vs compile", "% SOL", "kept launch config")
WIN = DEFAULT_THRESHOLD  # the bar, the reward's "faster": at least 1.05x torch.compile


def markdown(rows: list[dict]) -> str:
    """BENCHMARKS.md's table of `rows` (sorted by problem), then the counts: correct, >= 1.05x vs torch.compile,
    and the median % SOL of the memory-bound problems."""

    def ms(value) -> str:
        return fmt(value, "{:.3f}")

    def ratio(value) -> str:
        return fmt(value, "{:.2f}x")

    def kept(row: dict) -> str:
        if not row["supported"]:
            return row.get("note") or "-"
        if row.get("correct") is False:
            return (row.get("message") or "").splitlines()[0] if row.get("message") else "-"
        configs = row.get("configs") or {}
        named = len(configs) > 1  # several groups: say which is which
        text = "; ".join(f"{name}: {label}" if named else label for name, label in configs.items())
        return f"{text} (faithful fallback)" if row.get("fallback") else text or "-"

    lines = ["| " + " | ".join(MARKDOWN_HEADER) + " |", "|" + " --- |" * len(MARKDOWN_HEADER)]
    for row in sorted(rows, key=lambda row: row["problem"]):
        timed = row.get("correct") and isinstance(row.get("ours_ms"), (int, float))
        ours = f"{ms(row['ours_ms'])} ({ms(row.get('ours_p10_ms'))}–{ms(row.get('ours_p90_ms'))})" if timed else "-"
        sol = f"{row['sol'] * 100:.0f}%" if timed and isinstance(row.get("sol"), (int, float)) else "-"
        cells = [row["problem"], "yes" if row["supported"] else "no",
                 {True: "yes", False: "**no**"}.get(row.get("correct"), "-"),
                 ms(row.get("eager_ms")) if timed else "-", ms(row.get("compile_ms")) if timed else "-", ours,
                 ratio(row.get("vs_eager")) if timed else "-", ratio(row.get("vs_compile")) if timed else "-", sol,
                 kept(row)]  # fmt: skip
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    supported = [row for row in rows if row["supported"]]
    correct = [row for row in supported if row.get("correct")]
    wins = [row for row in correct if (row.get("vs_compile") or 0) >= WIN]
    memory = [row["sol"] for row in correct if row.get("bound") == "memory" and row.get("sol")]
    lines += ["", f"- correct: {len(correct)} of {len(supported)} supported ({len(rows)} problems)",
              f"- >= {WIN}x vs torch.compile: {len(wins)} of {len(supported)}",
              "- median % SOL of the memory-bound: "
              + (f"{statistics.median(memory) * 100:.0f}% over {len(memory)}" if memory else "-")]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, nargs="?", help="the problems (not with --markdown)")
    parser.add_argument("--markdown", type=Path, nargs="+", metavar="JSON",
                        help="print BENCHMARKS.md's table of these earlier outputs and stop (no GPU)")
    parser.add_argument("--out", type=Path, default=Path("bench_policy.json"))
    parser.add_argument("--search", action="store_true", help="time every launch configuration, keep the fastest")
    parser.add_argument("--only", default="", help="comma-separated problem names (default: every .py in FOLDER)")
    args = parser.parse_args()
    if args.markdown:
        missing = [str(path) for path in args.markdown if not path.is_file()]
        if missing:
            parser.error(f"no such file: {', '.join(missing)} (give the JSON files that --out wrote)")
        print(markdown([row for path in args.markdown for row in json.loads(path.read_text())["rows"]]))
        return
    if args.folder is None:
        parser.error("give the folder of problems, e.g. examples (or --markdown JSON... for a table)")
    names = {name.strip() for name in args.only.split(",") if name.strip()}
    start = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="kp-bench-policy-"))
    rows = [prepare(path, root) for path in sorted(args.folder.glob("*.py")) if not names or path.stem in names]
    supported = [row for row in rows if row["supported"]]
    jobs = max(1, (os.cpu_count() or 2) // max(1, len(supported)))
    with ThreadPoolExecutor(max_workers=len(supported) or 1) as pool:
        builds = list(pool.map(lambda row: build_workspace(Path(row["workspace"]), jobs=jobs), supported))
    for row, build in zip(supported, builds):
        row["built"] = build.ok
        if not build.ok:
            row["note"] = build.error or "build failed"
    with Judge() as judge:
        for row in supported:
            if row["built"]:
                judge_problem(judge, row, args.folder / f"{row['problem']}.py", args.search)
            # Written after every problem, so a run cut short by a time limit keeps what it measured.
            args.out.write_text(json.dumps({"gpu": judge.gpu_name, "rows": rows}, indent=2, default=str))
        gpu = judge.gpu_name or "GPU"
    console = Console(width=140)
    console.print(render(rows, gpu, args.search))
    for row in rows:
        if row.get("note") or (row.get("correct") is False):
            console.print(f"{row['problem']}: {row.get('note') or row.get('message')}", highlight=False)
        if row.get("fallback"):
            console.print(f"{row['problem']}: the first answer failed ({row['first_message']}); judged the "
                          f"{row['fallback']} fallback instead", highlight=False)  # fmt: skip
    console.print(f"{len(rows)} problems in {time.perf_counter() - start:.1f} s")
    args.out.write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
