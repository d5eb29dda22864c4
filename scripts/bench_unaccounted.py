"""How much the judge's wall clock sees beyond what a candidate's process reports, honest and lying (GPU).

    python scripts/bench_unaccounted.py [EXAMPLE ...] [--out FILE]

The candidate's timed window is timed inside its own process, so a candidate can report less than it took; the
judge bounds that with its own clock (timing.py's unaccounted-time check). For each example (default: four of
examples/ from an elementwise pass to a GEMM), this writes the built-in policy's kernels into a workspace and runs
`kernelpilot eval WS --json` on it as written (honest), then with model_new.py made to report its timed window
times 0.9, 0.75, 0.5 and 0.001. Each row: the reported median, the unaccounted time of the candidate's runs and of the
clean process timed between them (the protocol's own cost), and the verdict. The honest rows show what the check
must allow; the lying rows what it lets through. "pipes": the part of the unaccounted time spent outside the two
processes' handling of the run (the wall time less the time each process says the request spent in it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT = ["silu_scale_shift", "softmax_long_rows", "layernorm", "linear_bias_relu"]
FACTORS = [None, 0.9, 0.75, 0.5, 0.001]

# Appended to model_new.py: the sandbox runs as __main__; its timed window's figure is scaled before it is sent.
LIE = """

def _report_scaled(factor):
    import sys
    sandbox = sys.modules.get("__main__")
    if not hasattr(sandbox, "LocalModel") or getattr(sandbox.LocalModel._timed, "scaled", False):
        return
    timed = sandbox.LocalModel._timed

    def scaled(self, inputs, **how):
        ms, actual = timed(self, inputs, **how)
        return ms * factor, actual

    scaled.scaled = True
    sandbox.LocalModel._timed = scaled


_report_scaled({factor})
"""


def policy_workspace(example: Path, folder: Path) -> Path:
    from kernelpilot.policy.analysis import analyze
    from kernelpilot.policy.families import render_all
    from kernelpilot.workspace import EXAMPLE_KERNELS, init_workspace

    ws, _ = init_workspace(example, folder)
    for name in EXAMPLE_KERNELS:
        (ws.root / name).unlink()
    problem = ws.problem()
    for file in render_all(problem, analyze(problem)):
        (ws.root / file.path).write_text(file.content)
    return ws.root


def evaluate(root: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "kernelpilot", "eval", str(root), "--json"], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    try:
        result = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"verdict": f"no JSON (rc {proc.returncode}): {proc.stderr.strip()[-300:]}"}
    bench = result.get("bench") or {}
    candidate = bench.get("candidate") or {}
    eager = bench.get("eager") or {}
    return {
        "reported_ms": candidate.get("median_ms"),
        "unaccounted_ms": candidate.get("unaccounted_ms"),
        "clean_unaccounted_ms": candidate.get("clean_unaccounted_ms"),
        "transport_ms": candidate.get("transport_ms"),
        "clean_transport_ms": candidate.get("clean_transport_ms"),
        "eager_ms": eager.get("median_ms"),
        "reward": result.get("reward"),
        "verdict": result.get("error_kind") or "ok",
        "message": (result.get("message") or "")[:300],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("examples", nargs="*", default=DEFAULT)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/kp-unaccounted"))
    args = parser.parse_args()
    rows = []
    for name in args.examples:
        root = policy_workspace(REPO / "examples" / f"{name}.py", args.dir / name)
        honest = (root / "model_new.py").read_text()
        for factor in FACTORS:
            (root / "model_new.py").write_text(honest if factor is None else honest + LIE.format(factor=factor))
            row = {"example": name, "reports": "as measured" if factor is None else f"x {factor}", **evaluate(root)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    print(f"\n{'example':<20} {'reports':<12} {'reported':>9} {'unacc.':>9} {'clean':>9} {'excess':>9} {'pipes':>9} "
          f"{'clean p.':>9}  verdict")
    for row in rows:
        cells = [row.get(k) for k in ("reported_ms", "unaccounted_ms", "clean_unaccounted_ms")]
        excess = cells[1] - cells[2] if None not in cells[1:] else None
        pipes = [row.get("transport_ms"), row.get("clean_transport_ms")]
        text = [f"{v:9.4f}" if v is not None else f"{'-':>9}" for v in cells + [excess] + pipes]
        print(f"{row['example']:<20} {row['reports']:<12} {' '.join(text)}  {row['verdict']} (reward {row.get('reward')})")


if __name__ == "__main__":
    main()
