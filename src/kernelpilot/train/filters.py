"""The execution filters of `train synth`: `check_task` runs a problem and says whether it is fit to train on.

Each filter is a reason in FILTERS; the first one a task fails is its verdict. filter_worker.py runs `check_task` in
one worker process per device.
"""

from __future__ import annotations

import ast
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Name fragments that make a model stochastic wherever it calls them, whatever one determinism run happened to show.
STOCHASTIC_MARKERS = ("dropout", "rrelu", "bernoulli", "multinomial", "rand", "normal_", "uniform_", "exponential_")


@dataclass
class Verdict:
    """Whether a task is fit to train on; `reason` names the first filter it failed."""

    kept: bool
    reason: str | None = None  # one of FILTERS, or None when kept
    detail: str = ""
    eager_ms: float | None = None
    compile_ms: float | None = None


FILTERS = (
    "invalid",
    "stochastic-op",
    "degenerate",
    "nondeterministic",
    "compile-mismatch",
    "runtime",
    "timeout",
    "crash",
    "contaminated",
)


def check_task(
    code: str,
    *,
    device: str = "cpu",
    compile_backend: str = "inductor",
    runtime_range_ms: tuple[float, float] = (0.05, 50.0),
    atol: float = 1e-3,
    rtol: float = 1e-3,
) -> Verdict:
    """Run a problem's source on `device`: eager and torch.compile agree, deterministic, not degenerate, timed in range.

    Timing and the runtime range apply on a CUDA device only; on the CPU the times stay None.
    """
    import torch

    from kernelpilot.errors import ProblemError
    from kernelpilot.problem import load_problem

    try:
        stochastic = stochastic_names(code)
    except SyntaxError as err:  # a model's code, not a composed one
        return Verdict(False, "invalid", f"Syntax error at task.py:{err.lineno}: {err.msg}.")
    if stochastic:
        return Verdict(False, "stochastic-op", f"uses {', '.join(stochastic)}")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "task.py"
        path.write_text(code, encoding="utf-8")
        try:
            problem = load_problem(path)
        except ProblemError as err:
            # Without the temporary folder, the same mistake in two tasks reads the same (and counts as one reason).
            return Verdict(False, "invalid", err.message.replace(str(path.resolve()), path.name))
        torch.manual_seed(0)
        model = problem.make_model(device)
        inputs = problem.make_inputs(device, seed=0)
        with torch.no_grad():
            try:
                outputs = [model(*inputs) for _ in range(2)]
            except Exception as err:  # noqa: BLE001 - a problem that fails to run is invalid, whatever the error
                return Verdict(False, "invalid", f"forward raised {type(err).__name__}: {err}")
            degenerate = degenerate_reason(outputs[0])
            if degenerate:
                return Verdict(False, "degenerate", degenerate)
            if not torch.equal(outputs[0], outputs[1]):
                return Verdict(False, "nondeterministic", "two runs on the same inputs differ")
            compiled = torch.compile(model, backend=compile_backend)
            try:
                compiled_out = compiled(*inputs)
            except Exception as err:  # noqa: BLE001 - torch.compile failing on a task drops it like a mismatch
                return Verdict(False, "compile-mismatch", f"torch.compile raised {type(err).__name__}")
            if not torch.allclose(compiled_out, outputs[0], atol=atol, rtol=rtol):
                return Verdict(False, "compile-mismatch", "torch.compile's output differs from eager")
            if not str(device).startswith("cuda"):
                return Verdict(True)
            eager_ms, compile_ms = cuda_median_ms(model, inputs), cuda_median_ms(compiled, inputs)
    low, high = runtime_range_ms
    if not low <= eager_ms <= high:
        return Verdict(False, "runtime", f"eager {eager_ms:.3g} ms is outside [{low}, {high}] ms", eager_ms, compile_ms)
    return Verdict(True, eager_ms=eager_ms, compile_ms=compile_ms)


def stochastic_names(code: str) -> list[str]:
    """The stochastic functions or modules the model's forward pass may use (nn.Dropout, F.rrelu, torch.rand_like...).

    `__init__` and `get_inputs` are left out: random weights and inputs are drawn under a seed by design.
    """
    tree = ast.parse(code)
    model = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model"), None)
    methods = [
        item for item in (model.body if model else []) if isinstance(item, ast.FunctionDef) and item.name != "__init__"
    ]
    found = set()
    for method in methods:
        for node in ast.walk(method):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
            if any(marker in name.lower() for marker in STOCHASTIC_MARKERS):
                found.add(name)
    return sorted(found)


def degenerate_reason(output: Any) -> str | None:
    """Why an output is useless to check a kernel against (NaN/Inf, all zeros, constant), or None."""
    import torch

    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
        return "the output is not a floating-point tensor"
    if not torch.isfinite(output).all():
        return "the output has NaN or Inf"
    if not output.any():
        return "the output is all zeros"
    if output.numel() > 1 and (output == output.flatten()[0]).all():
        return "the output is constant"
    return None


def cuda_median_ms(fn: Callable, inputs: list, runs: int = 20) -> float:
    """The median time of `fn(*inputs)` in ms, by CUDA events, after warm-up."""
    import torch

    for _ in range(3):
        fn(*inputs)
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
