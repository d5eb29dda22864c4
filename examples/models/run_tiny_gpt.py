"""kernelpilot in a model, end to end, on a GPU: capture two layers of TinyGPT, optimize them with the built-in
policy, accept them, swap them back into the model, and measure the whole model's forward.

    python examples/models/run_tiny_gpt.py [--out DIR] [--json PATH]

1. capture: the first block's MLP RMSNorm and its SwiGLU MLP are written as problems (`kernelpilot.capture`);
   the policy's analysis (on the CPU, meta tensors) must support both;
2. optimize + accept: `kernelpilot optimize PROBLEM --dir WS` (no model: the built-in policy), then
   `kernelpilot accept WS --no-commit` (the judge verifies and times it again and writes the lock file);
3. swap: every RMSNorm of the model (two per block and the final one) and every block's MLP are replaced by the
   accepted ModelNew (`kernelpilot.swap`), sharing the model's own weights;
4. measure: the forward of the original model in eager and under torch.compile, and of the swapped model in eager
   and under torch.compile, and each output against the original eager one. The kernels are torch custom ops with
   meta implementations, so torch.compile traces through them; any graph break is still counted and its reason
   recorded, and where compiling fails outright, the row is reported as skipped with the reason;
5. other shapes: the swapped model (eager) at half the batch, half the sequence and twice both, each output against
   the original model's at that shape (the kernels take the batch and the sequence at run time where the policy
   proved that right; a kernel fixed to the captured shape raises, and the row says so).

It writes DIR/results.json (or --json) and prints a table. About 5 minutes on an H100, most of it the two
optimize runs and torch.compile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import kernelpilot
from kernelpilot.lockfile import lock_path, read_lock
from kernelpilot.policy.analysis import analyze
from kernelpilot.problem import load_problem
from kernelpilot.workspace import open_workspace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_gpt import GPTConfig, RMSNorm, TinyGPT  # noqa: E402 - the user model beside this script

BATCH, SEQUENCE = 8, 1024
# The swapped layers' kernels round differently from eager's; over four bf16 blocks that stays well inside these.
ATOL = RTOL = 5e-2
# One layer's verification: its kernels compute in float32 and round once, the reference rounds every bfloat16 step,
# so they differ by up to a few units in the last place (2 ulp is 1.6%: over the default 1e-2, measured on an H100).
TOLERANCE = 2e-2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--out", type=Path, default=Path("tiny_gpt_run"), help="folder for problems and workspaces")
    parser.add_argument("--json", type=Path, default=None, help="results file (default: OUT/results.json)")
    parser.add_argument("--max-turns", type=int, default=40, help="turns of each optimize run")
    parser.add_argument("--runs", type=int, default=50, help="timed forward calls of each variant")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help="atol and rtol of optimize's and accept's verification (bfloat16 layers)")  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA GPU is visible; this example optimizes and times kernels on one.", file=sys.stderr)
        return 1
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": BATCH,
                     "sequence": SEQUENCE, "config": vars(GPTConfig()) | {"dtype": "bfloat16"}}  # fmt: skip

    model, x = make_model()
    shapes = [(BATCH // 2, SEQUENCE), (BATCH, SEQUENCE // 2), (BATCH * 2, SEQUENCE * 2)]
    others = [torch.randn(batch, sequence, GPTConfig().dim, dtype=x.dtype, device=x.device) for batch, sequence in shapes]
    with torch.inference_mode():
        reference = model(x)
        other_references = [model(other) for other in others]
    problems = capture_layers(model, x, out)
    results["layers"] = {name: analysis_of(path) for name, path in problems.items()}
    unsupported = [name for name, layer in results["layers"].items() if not layer["supported"]]
    if unsupported:
        print(f"error: the built-in policy does not support {', '.join(unsupported)}: "
              f"{'; '.join(results['layers'][n]['blockers'] for n in unsupported)}", file=sys.stderr)  # fmt: skip
        return 1
    for name, path in problems.items():
        results["layers"][name] |= optimize_and_accept(path, out / f"kp-{name}", args.max_turns, args.tolerance)

    results["model"] = {
        "eager": measure(model, x, args.runs),
        "compile": measure(compiled(model), x, args.runs, reference),
    }
    other_eager = [measure(model, other, args.runs) for other in others]
    swapped = swap_layers(model, out)
    results["swapped_modules"] = swapped
    results["model"]["swapped_eager"] = measure(model, x, args.runs, reference)
    results["model"]["swapped_compile"] = measure(compiled(model), x, args.runs, reference)
    results["other_shapes"] = [
        {"batch": other.shape[0], "sequence": other.shape[1], "eager": eager,
         "swapped_eager": measure(model, other, args.runs, expected)}
        for other, expected, eager in zip(others, other_references, other_eager)
    ]  # fmt: skip
    target = args.json or out / "results.json"
    target.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"\nwrote {target}")
    every_shape = [results["model"]["swapped_eager"], *(row["swapped_eager"] for row in results["other_shapes"])]
    return 0 if all(timing.get("correct") for timing in every_shape) else 1


def make_model() -> tuple[TinyGPT, torch.Tensor]:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = TinyGPT(GPTConfig()).to(torch.bfloat16).eval()
        for module in model.modules():
            if isinstance(module, RMSNorm):  # ones would hide a norm that ignored its weight
                torch.nn.init.uniform_(module.weight, 0.5, 1.5)
        x = torch.randn(BATCH, SEQUENCE, GPTConfig().dim, dtype=torch.bfloat16)
    return model, x


def capture_layers(model: TinyGPT, x: torch.Tensor, out: Path) -> dict[str, Path]:
    problems = {"rmsnorm": out / "problems" / "rmsnorm.py", "mlp": out / "problems" / "mlp.py"}
    block = model.blocks[0]
    with torch.inference_mode(), kernelpilot.capture(block.mlp_norm, problems["rmsnorm"]), \
            kernelpilot.capture(block.mlp, problems["mlp"]):  # fmt: skip
        model(x)
    return problems


def analysis_of(problem: Path) -> dict:
    """What the built-in policy makes of the problem, analysed on the CPU (meta tensors), before any GPU work."""
    analysis = analyze(load_problem(problem))
    return {
        "problem": str(problem),
        "supported": analysis.supported,
        "blockers": "" if analysis.supported else analysis.blockers(),
        "kernels": [group.describe() for group in analysis.generated_groups],
    }


def optimize_and_accept(problem: Path, workspace: Path, max_turns: int, tolerance: float) -> dict:
    """`kernelpilot optimize` with the built-in policy, then `kernelpilot accept --no-commit`; the lock's figures."""
    started = time.perf_counter()
    kernelpilot_cli("optimize", problem, "--dir", workspace, "--output", workspace / "model_new.py",
                    "--max-turns", str(max_turns), env={"KERNELPILOT_ATOL": str(tolerance),
                                                        "KERNELPILOT_RTOL": str(tolerance)})  # fmt: skip
    optimized_s = time.perf_counter() - started
    kernelpilot_cli("accept", workspace, "--no-commit", "--atol", tolerance, "--rtol", tolerance)
    lock = read_lock(lock_path(open_workspace(workspace)))
    timings = lock.timings
    return {
        "workspace": str(workspace),
        "optimize_s": round(optimized_s, 1),
        "accept_s": round(time.perf_counter() - started - optimized_s, 1),
        "candidate_ms": timings.candidate.median_ms if timings.candidate else None,
        "eager_ms": timings.eager.median_ms if timings.eager else None,
        "compile_ms": timings.compile.median_ms if timings.compile else None,
        "speedup_vs_eager": timings.speedup_vs_eager,
        "speedup_vs_compile": timings.speedup_vs_compile,
    }


def kernelpilot_cli(*args: object, env: dict[str, str] | None = None) -> None:
    command = [sys.executable, "-m", "kernelpilot", *map(str, args)]
    print("$", " ".join(command[2:]), flush=True)
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})
    print(done.stdout[-2000:], done.stderr[-2000:], sep="", flush=True)
    if done.returncode != 0:
        raise SystemExit(f"`{' '.join(command[2:])}` failed with exit code {done.returncode}")


def swap_layers(model: TinyGPT, out: Path) -> list[str]:
    """Every RMSNorm and every MLP of the model replaced by the accepted workspace of its kind."""
    targets = [name for name, module in model.named_modules() if isinstance(module, RMSNorm)]
    targets += [f"blocks.{index}.mlp" for index in range(len(model.blocks))]
    for target in targets:
        kernelpilot.swap(model, target, out / ("kp-mlp" if target.endswith(".mlp") else "kp-rmsnorm"))
    return targets


def compiled(model: torch.nn.Module):
    torch._dynamo.reset()  # the swapped model is traced afresh, not guarded against the original's graphs
    return torch.compile(model)


def measure(forward, x: torch.Tensor, runs: int, reference: torch.Tensor | None = None) -> dict:
    """The median time of `runs` forward calls (after the first, which compiles, and a few warm-up calls), and
    the output's largest difference from `reference`; a forward that fails is reported as skipped."""
    breaks_before = _graph_breaks()
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            output = forward(x)
            torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - e.g. torch.compile tracing through the extension's functions
        return {"skipped": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"}
    first_call_s = time.perf_counter() - started
    times = []
    with torch.inference_mode():
        for _ in range(5):
            forward(x)
        for _ in range(runs):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            forward(x)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
    result = {"median_ms": statistics.median(times), "min_ms": min(times), "first_call_s": round(first_call_s, 2)}
    if reference is not None:
        result["max_abs_diff"] = (output.float() - reference.float()).abs().max().item()
        result["correct"] = bool(torch.allclose(output.float(), reference.float(), atol=ATOL, rtol=RTOL))
    if _graph_breaks() > breaks_before:
        # torch.compile runs what it cannot trace (a pybind kernel call) in eager, between compiled graphs.
        result["graph_breaks"] = _graph_breaks() - breaks_before
        result["graph_break_reasons"] = sorted({reason.splitlines()[0][:160]
                                                for reason in torch._dynamo.utils.counters["graph_break"]})  # fmt: skip
    return result


def _graph_breaks() -> int:
    """Graph breaks torch.compile has counted in this process."""
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def print_table(results: dict) -> None:
    print(f"\nTinyGPT {results['config']['layers']} blocks, dim {results['config']['dim']}, "
          f"{BATCH}x{SEQUENCE} tokens, bf16, {results['gpu']}")  # fmt: skip
    print(f"{'layer':<10} {'candidate ms':>12} {'eager ms':>9} {'compile ms':>10} {'vs eager':>9} {'vs compile':>10}")
    for name, layer in results["layers"].items():
        print(f"{name:<10} {_ms(layer['candidate_ms']):>12} {_ms(layer['eager_ms']):>9} {_ms(layer['compile_ms']):>10} "
              f"{_x(layer['speedup_vs_eager']):>9} {_x(layer['speedup_vs_compile']):>10}")  # fmt: skip
    model = results["model"]
    eager_ms = model["eager"]["median_ms"]
    print(f"\n{'whole model':<16} {'median ms':>9} {'vs eager':>9} {'max |diff|':>11} {'correct':>8}")
    for name, timing in model.items():
        if "skipped" in timing:
            print(f"{name:<16} skipped: {timing['skipped']}")
            continue
        diff = f"{timing['max_abs_diff']:.3g}" if "max_abs_diff" in timing else "-"
        print(f"{name:<16} {timing['median_ms']:>9.3f} {eager_ms / timing['median_ms']:>8.2f}x {diff:>11} "
              f"{str(timing.get('correct', '-')):>8}")  # fmt: skip

    print(f"\n{'other shapes':<16} {'eager ms':>9} {'swapped ms':>10} {'vs eager':>9} {'max |diff|':>11} {'correct':>8}")
    for row in results["other_shapes"]:
        timing, label = row["swapped_eager"], f"{row['batch']}x{row['sequence']}"
        if "skipped" in timing:
            print(f"{label:<16} skipped: {timing['skipped']}")
            continue
        eager_ms = row["eager"]["median_ms"]
        print(f"{label:<16} {eager_ms:>9.3f} {timing['median_ms']:>10.3f} {eager_ms / timing['median_ms']:>8.2f}x "
              f"{timing['max_abs_diff']:>11.3g} {str(timing['correct']):>8}")  # fmt: skip


def _ms(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def _x(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


if __name__ == "__main__":
    sys.exit(main())
