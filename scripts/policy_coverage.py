"""How much of KernelBench the built-in policy generates kernels for, analysed on the CPU (a script, not a test).

Each problem runs in a forked child with a time limit, doing what the policy does before it writes anything:
load the file, `analyze` it on meta tensors, and, when it is supported, take every group's launch candidates and
render every file (`render_all`). A problem counts as supported only when all of that succeeds, so the policy
would write kernels for every op and torch computes nothing. Per level it prints the supported count, the blocker
histogram (each distinct reason the analysis gives, counted once per problem, numbers written as N so that
shapes do not split a reason) and the time per problem (median and max: loading, analysis, launch candidates and
rendering, as the child measures it; the wall clock where it timed out). With --check-mb, supported problems small
enough are also run on the CPU against the policy's executable spec of their groups (cpu_spec.py).

    python3 scripts/policy_coverage.py /path/to/KernelBench --levels 1 2 3 --json coverage.json
    python3 scripts/policy_coverage.py /path/to/KernelBench --levels 3 --only 35_LSTM --timeout 300
    python3 scripts/policy_coverage.py /path/to/KernelBench --levels 2 --check-mb 1500 --timeout 600
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import re
import statistics
import sys
import time
import traceback
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path


def problems(root: Path, level: int, only: list[str]) -> list[Path]:
    """The problem files of one level, in KernelBench's order (by their leading number)."""
    folder = root / f"level{level}"
    if not folder.is_dir():
        raise SystemExit(f"{folder} is not a folder: pass KernelBench's root (the folder holding level1, level2...).")
    found = [path for path in folder.glob("*.py") if not path.name.startswith("_")]
    if only:
        found = [path for path in found if any(name in path.stem for name in only)]
    return sorted(found, key=lambda path: (int(m.group()) if (m := re.match(r"\d+", path.stem)) else 10**9, path.stem))


def analyse(path: Path, check_bytes: int = 0) -> dict:
    """What the policy decides for one problem: supported, or the reasons it is not; `seconds` is the time that
    takes (load, analysis, every launch candidate, every rendered file). With `check_bytes`, a supported problem
    whose tensors fit is also checked on the CPU (`cpu_check`)."""
    from kernelpilot.policy.analysis import analyze
    from kernelpilot.policy.families import launch_candidates, render_all
    from kernelpilot.problem import load_problem

    started = time.perf_counter()
    problem = load_problem(path)
    analysis = analyze(problem)
    if not analysis.supported:
        reasons = [str(item) for item in analysis.unsupported]
        reasons += [f"{', '.join(g.ops)} (a matrix op: needs cuBLAS/cuDNN)" for g in analysis.groups if not g.generated]
        return {"supported": False, "reasons": list(dict.fromkeys(reasons)), "seconds": time.perf_counter() - started}
    for group in analysis.generated_groups:
        launch_candidates(group)
    files = render_all(problem, analysis)
    row = {"supported": True, "reasons": [], "groups": len(analysis.generated_groups), "files": len(files),
           "seconds": time.perf_counter() - started}  # fmt: skip
    if check_bytes:
        row["check"] = cpu_check(problem, analysis, check_bytes)
    return row


def cpu_check(problem, analysis, limit_bytes: int) -> str:
    """Model run on the CPU against the analysis' groups run by the policy's executable spec (cpu_spec.py, in
    float64), on the problem's own inputs, when the inputs, parameters and group outputs take at most
    `limit_bytes`: "ok", "WRONG" (some output differs by more than 1e-3 + 1e-3 * |expected|) or "skipped"."""
    import torch

    from kernelpilot.policy.cpu_spec import evaluate

    with torch.device("meta"):
        model, inputs = problem.make_model(), problem.make_inputs()
    tensors = [t for t in [*inputs, *model.state_dict().values()] if isinstance(t, torch.Tensor)]
    needed = sum(t.numel() * t.element_size() for t in tensors)
    needed += sum(math.prod(group.output.shape) * 8 for group in analysis.groups)  # the spec's float64 outputs
    if needed > limit_bytes:
        return f"skipped ({needed / 2**20:.0f} MB)"
    model, inputs = problem.make_model("cpu"), problem.make_inputs("cpu", seed=0)
    memory = {("input", name): value for name, value in zip(problem.forward_signature().parameters, inputs)}
    memory.update({("parameter", name): t.detach() for name, t in model.state_dict().items()})
    with torch.no_grad():
        expected = model(*inputs)
        actual = evaluate(analysis, memory)
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    worst = 0.0
    for got, want in zip(actual, expected):
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"WRONG (an output is {got.dtype} {tuple(got.shape)}, Model's {want.dtype} {tuple(want.shape)})"
        error = (got.double() - want.double()).abs() / (1e-3 + 1e-3 * want.double().abs())
        worst = max(worst, float(error.max())) if error.numel() else worst
    verdict = "ok" if len(actual) == len(expected) and worst <= 1 else "WRONG"
    return f"{verdict} (largest error {worst:.2g} of the tolerance)"


def _child(path: Path, check_bytes: int, sink: Connection) -> None:
    try:
        row = analyse(path, check_bytes)
    except BaseException as err:  # noqa: BLE001 - any failure is a finding about this problem, reported as a reason
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        where = traceback.extract_tb(err.__traceback__)[-1]
        row = {"supported": False, "reasons": [f"error ({type(err).__name__}: {first[:200]} at "
                                                f"{Path(where.filename).name}:{where.lineno})"]}  # fmt: skip
    sink.send(row)
    sink.close()


def run_one(path: Path, timeout_s: float, check_bytes: int = 0) -> dict:
    """Analyse `path` in a forked child; a child that has not answered in `timeout_s` is killed."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    started = time.perf_counter()
    child = context.Process(target=_child, args=(path, check_bytes, sender), daemon=True)
    child.start()
    sender.close()
    row = None
    if receiver.poll(timeout_s):
        try:
            row = receiver.recv()
        except EOFError:
            row = None
    elapsed = time.perf_counter() - started
    child.join(1.0)
    if child.is_alive():
        child.kill()
        child.join()
    if row is None:
        reason = f"analysis exceeded {timeout_s:g} s" if elapsed >= timeout_s else f"child died (exit {child.exitcode})"
        row = {"supported": False, "reasons": [reason], "seconds": elapsed}
    return {"problem": path.stem, **row, "seconds": round(row.get("seconds", elapsed), 3)}


def reason_key(reason: str) -> str:
    """A reason with its numbers written as N (not digits inside names: avg_pool2d), so the same blocker on
    different shapes counts once."""
    return re.sub(r"(?<![\w.])\d+(\.\d+)?", "N", reason)


def summary(level: int, rows: list[dict], top: int) -> dict:
    times = [row["seconds"] for row in rows]
    histogram = Counter(key for row in rows for key in dict.fromkeys(reason_key(r) for r in row["reasons"]))
    return {
        "level": level,
        "problems": len(rows),
        "supported": sum(row["supported"] for row in rows),
        "median_s": round(statistics.median(times), 3) if times else 0.0,
        "max_s": max(times, default=0.0),
        "slowest": max(rows, key=lambda row: row["seconds"])["problem"] if rows else None,
        "blockers": histogram.most_common(top),
        "checks": dict(Counter(row["check"].split()[0] for row in rows if "check" in row)),
    }


def print_summary(info: dict) -> None:
    print(f"\nlevel {info['level']}: {info['supported']}/{info['problems']} supported; time per problem: median "
          f"{info['median_s']:.2f} s, max {info['max_s']:.2f} s ({info['slowest']})")  # fmt: skip
    if info["checks"]:
        print("  CPU checks: " + ", ".join(f"{count} {verdict}" for verdict, count in sorted(info["checks"].items())))
    for reason, count in info["blockers"]:
        print(f"  {count:3d}  {reason}")


WARM_UP_PROBLEM = """
import torch


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.linear(x)).sum(-1)


def get_inputs():
    return [torch.randn(4, 8)]


def get_init_inputs():
    return []
"""


def warm_up() -> None:
    """Analyse a small problem here, so that each forked child starts with torch's tracing machinery imported
    (several seconds the first time in a process: torch._dynamo) and its time is the problem's own."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "warm_up.py"
        path.write_text(WARM_UP_PROBLEM)
        analyse(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="KernelBench's root: the folder holding level1, level2, level3")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--only", nargs="*", default=[], help="problems whose file name contains one of these")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per problem (default 60)")
    parser.add_argument("--top", type=int, default=25, help="blockers listed per level (default 25)")
    parser.add_argument("--json", type=Path, help="write every row and the summaries as JSON")
    parser.add_argument("--quiet", action="store_true", help="no line per problem")
    parser.add_argument("--check-mb", type=float, default=0.0,
                        help="also check each supported problem whose tensors take at most this many MB on the CPU: "
                             "Model against the groups run by the policy's executable spec")  # fmt: skip
    args = parser.parse_args()

    warm_up()

    report = {"timeout_s": args.timeout, "levels": []}
    for level in args.levels:
        rows = []
        for path in problems(args.root, level, args.only):
            row = run_one(path, args.timeout, int(args.check_mb * 2**20))
            rows.append(row)
            if not args.quiet:
                verdict = "supported" if row["supported"] else "; ".join(row["reasons"])[:160]
                verdict += f"; CPU check: {row['check']}" if "check" in row else ""
                print(f"L{level} {row['problem']:<60} {row['seconds']:7.2f} s  {verdict}", flush=True)
        info = summary(level, rows, args.top)
        report["levels"].append({**info, "rows": rows})
        print_summary(info)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
