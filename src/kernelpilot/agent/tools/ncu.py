"""Ncu: Nsight Compute over one forward call of the candidate, loaded the way the harness loads it, its CSV report
parsed into one record per kernel launch and rendered with the limit each launch hits."""

from __future__ import annotations

import csv
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelpilot.agent import ToolContext
from kernelpilot.agent.shell_guard import SCRATCH_DIR
from kernelpilot.agent.tool_results import NcuLaunch, NcuReport
from kernelpilot.agent.tools.judge import build_candidate
from kernelpilot.agent.tools.schema import CheckedTool, object_schema
from kernelpilot.agent.tools.shell import ProcessRun, confined, run_process
from kernelpilot.results import BuildResult, to_dict
from kernelpilot.workspace_files import own_folder

if TYPE_CHECKING:
    from kernelpilot.workspace import Workspace

NCU_TIMEOUT_S = 300
NCU_OUTPUT_TAIL_LINES = 30  # of ncu's own output, kept to say why it profiled nothing

NCU_METRICS = {
    "gpu__time_duration.sum": "duration",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "launch__registers_per_thread": "registers",
    "launch__block_size": "block_size",
    "launch__grid_size": "grid_size",
}
_MICROSECONDS_PER_UNIT = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
                          "second": 1e6, "s": 1e6}  # fmt: skip

# Runs in the profiled process: confines itself as a judge's sandbox does (CUDA first, then no new privileges and
# writes only to its private folders), loads the candidate the way the harness does, then profiles one forward call
# (after a warm-up call, so lazy initialisation stays out) between cudaProfilerStart and cudaProfilerStop.
# On a CPU device it only loads and calls, which lets tests check the loading without a GPU.
NCU_DRIVER = """
import json, sys
from pathlib import Path
import torch
from kernelpilot.harness.candidate import load_candidate, make_candidate_model
from kernelpilot.harness.confine import harden
from kernelpilot.harness.float32 import pin_float32_math
from kernelpilot.results import BuildResult, from_dict
from kernelpilot.workspace import open_workspace

pin_float32_math()  # the math the judge times the candidate with
workspace = open_workspace(sys.argv[1])
built = json.loads(Path(sys.argv[2]).read_text())
build = from_dict(BuildResult, built) if built is not None else None  # null: a workspace with no kernels
device = torch.device(sys.argv[3])
problem = workspace.problem()
if device.type == "cuda":
    torch.cuda.init()
print("confinement:", harden(), flush=True)
model = make_candidate_model(problem, load_candidate(workspace, build), device)
inputs = problem.make_inputs(device, seed=0)
on_gpu = device.type == "cuda"
with torch.no_grad():
    model(*inputs)
    if on_gpu:
        torch.cuda.synchronize(device)
        torch.cuda.profiler.start()
    model(*inputs)
    if on_gpu:
        torch.cuda.synchronize(device)
        torch.cuda.profiler.stop()
"""


class NcuTool(CheckedTool):
    name = "Ncu"
    description = (
        "Profile the candidate's kernels with Nsight Compute (ncu) over one forward call: per launch its duration, "
        "DRAM and SM throughput (% of peak), achieved occupancy, registers per thread and launch shape, and which "
        "limit it hits. `kernel` (a regex) restricts it to matching kernel names. Slow (kernels are replayed); use "
        "it to learn why a kernel is slow. Where ncu or a GPU is missing it says so."
    )
    parameters = object_schema({"kernel": {"type": "string", "minLength": 1, "description": "regex of kernel names"}})

    def execute(self, args: dict[str, Any], ctx: ToolContext) -> NcuReport:
        unavailable = ncu_unavailable_reason(ctx)
        if unavailable:
            return NcuReport(available=False, reason=unavailable)
        kernel = args.get("kernel")
        build = build_candidate(ctx, self.name)
        if not build.ok:
            return NcuReport(build=build, kernel=kernel)
        run, report = run_ncu(ctx.workspace, build, ctx.judge.device, kernel)
        tail = "\n".join(run.output.strip().splitlines()[-NCU_OUTPUT_TAIL_LINES:])
        return NcuReport(kernel=kernel, exit_code=run.returncode, timed_out=run.timed_out, timeout_s=NCU_TIMEOUT_S,
                         launches=parse_ncu_csv(report + "\n" + run.output), output_tail=tail)  # fmt: skip


def ncu_unavailable_reason(ctx: ToolContext) -> str | None:
    """One sentence saying why ncu cannot run here, or None when it can."""
    instead = "use Profile for times and the kernel breakdown."
    if shutil.which("ncu") is None:
        return f"ncu (Nsight Compute) is not installed on this machine, so Ncu is unavailable; {instead}"
    if ctx.judge is None or ctx.judge.device == "cpu":
        return f"This run has no GPU, so ncu cannot profile kernels here; {instead}"
    return None


def run_ncu(ws: Workspace, build: BuildResult, device: str, kernel: str | None) -> tuple[ProcessRun, str]:
    """Run the driver under ncu; return the run and ncu's CSV report."""
    scratch = own_folder(ws.root / SCRATCH_DIR, ws.root)  # a link there is removed, not written through
    with tempfile.TemporaryDirectory(dir=scratch, prefix="ncu-") as folder:
        build_json, report = Path(folder) / "build.json", Path(folder) / "report.csv"
        build_json.write_text(json.dumps(to_dict(build)))
        command = ["ncu", "--csv", "--log-file", str(report), "--print-units", "base", "--profile-from-start", "off",
                   "--metrics", ",".join(NCU_METRICS)]  # fmt: skip
        if kernel:
            command += ["--kernel-name", f"regex:{kernel}"]
        command += [sys.executable, "-c", NCU_DRIVER, str(ws.root), str(build_json), device]
        # The profiled process confines its own writes (`harden`); the wrapper kills whatever it leaves running.
        run = run_process(confined(command, writable=[]), cwd=ws.root, env=driver_environment(Path(folder) / "sandbox"),
                          timeout=NCU_TIMEOUT_S)  # fmt: skip
        return run, report.read_text(errors="replace") if report.is_file() else ""


def driver_environment(private_dir: Path) -> dict[str, str]:
    """A judge sandbox's environment (the toolchain's variables only, its own HOME, caches and temp folder under
    `private_dir`, the only folder it may write), with this very kernelpilot importable. ncu runs with it too."""
    import kernelpilot

    from kernelpilot.harness.process import sandbox_environment

    source_root = str(Path(kernelpilot.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH")) if p))
    return sandbox_environment(env, private_dir)


def parse_ncu_csv(text: str) -> list[NcuLaunch]:
    """ncu's `--csv` rows (one per launch and metric) as one record per launch: id, kernel and its metrics."""
    rows = csv.DictReader(line for line in text.splitlines() if line.startswith('"'))
    launches: dict[str, dict[str, Any]] = {}
    for row in rows:
        metric = NCU_METRICS.get(row.get("Metric Name") or "")
        if metric is None or row.get("ID") in (None, "ID"):
            continue
        launch = launches.setdefault(row["ID"], {"id": int(row["ID"]), "kernel": row.get("Kernel Name", "?")})
        value = _ncu_number(row.get("Metric Value", ""))
        if metric == "duration" and value is not None:
            metric, value = "duration_us", value * _MICROSECONDS_PER_UNIT.get(row.get("Metric Unit", ""), 1e-3)
        launch[metric] = value
    return [NcuLaunch(**launch) for launch in sorted(launches.values(), key=lambda launch: launch["id"])]


def _ncu_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))  # ncu groups thousands with commas
    except ValueError:
        return None
