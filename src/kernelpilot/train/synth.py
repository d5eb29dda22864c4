"""Task synthesis: operators crawled from torch.nn, composed into KernelBench-format problems, filtered by running.

The crawl walks `torch.nn`'s module classes and `torch.nn.functional`'s functions and keeps what a small table of
families knows how to build (activations, norms, pooling, linear, conv, softmax family, reductions), dropping
stochastic operators. The sampler draws chains of 1-5 compatible operators over one of two layouts (images NCHW,
rows B x S x F); the deterministic composer writes a chain as problem source with its sizes as module constants (the
LLM composer, `train/llm_composer.py`, has a model write it). `check_task` runs a problem and says whether it is fit
to train on; `decontaminate` (decontaminate.py) drops tasks too close to a benchmark's problems. The kept tasks are
written as a dataset by synth_dataset.py.
"""

from __future__ import annotations

import ast
import inspect
import random
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelpilot.errors import KernelpilotError
from kernelpilot.problem import problem_id_of
from kernelpilot.train.decontaminate import Dropped, decontaminate

if TYPE_CHECKING:
    from kernelpilot.agent import Model
    from kernelpilot.agent.model import ModelError

LAYOUTS = ("image", "rows")
# Per layout, the input's dims as module constant names, in order.
INPUT_DIMS = {"image": ("BATCH", "CHANNELS", "HEIGHT", "WIDTH"), "rows": ("BATCH", "SEQUENCE", "FEATURES")}
# Per layout, the input dims (module constant name, size). "full" is sized for an H100, "small" for CPU checks.
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "full": {
        "image": {"BATCH": 16, "CHANNELS": 64, "HEIGHT": 128, "WIDTH": 128},
        "rows": {"BATCH": 32, "SEQUENCE": 512, "FEATURES": 1024},
    },
    "small": {
        "image": {"BATCH": 2, "CHANNELS": 8, "HEIGHT": 16, "WIDTH": 16},
        "rows": {"BATCH": 2, "SEQUENCE": 8, "FEATURES": 32},
    },
}
# Operators that need init arguments: class name -> (layout, constructor template over the feature dim `{c}` and
# the new dim `{out}`, whether it introduces a new feature dim). Everything else must construct with no arguments.
SHAPED_MODULES: dict[str, tuple[str, str, bool]] = {
    "Linear": ("rows", "nn.Linear({c}, {out})", True),
    "LayerNorm": ("rows", "nn.LayerNorm({c})", False),
    "RMSNorm": ("rows", "nn.RMSNorm({c})", False),
    "Conv2d": ("image", "nn.Conv2d({c}, {out}, 3, padding=1)", True),
    "BatchNorm2d": ("image", "nn.BatchNorm2d({c})", False),
    "InstanceNorm2d": ("image", "nn.InstanceNorm2d({c}, affine=True)", False),
    "GroupNorm": ("image", "nn.GroupNorm(4, {c})", False),
    "MaxPool2d": ("image", "nn.MaxPool2d(2)", False),
    "AvgPool2d": ("image", "nn.AvgPool2d(2)", False),
}
SHAPED_FAMILIES = {"Linear": "linear", "Conv2d": "conv", "MaxPool2d": "pooling", "AvgPool2d": "pooling"}
POOLING_HALVES = {"MaxPool2d", "AvgPool2d"}
# The softmax family takes a dim; the functional crawl gives it the feature/channel dim.
SOFTMAX_FAMILY = {"Softmax", "LogSoftmax", "Softmin", "softmax", "log_softmax", "softmin"}
# Reductions end a chain (the output loses its feature dim): torch function -> call template.
REDUCTIONS = {
    "sum": "torch.sum(x, dim={dim})",
    "mean": "torch.mean(x, dim={dim})",
    "amax": "torch.amax(x, dim={dim})",
    "logsumexp": "torch.logsumexp(x, dim={dim})",
    "norm": "torch.linalg.vector_norm(x, dim={dim})",
}
# Name fragments that make a model stochastic wherever it calls them, whatever one determinism run happened to show.
STOCHASTIC_MARKERS = ("dropout", "rrelu", "bernoulli", "multinomial", "rand", "normal_", "uniform_", "exponential_")
FEATURE_DIM = {"image": 1, "rows": -1}
WIDTH_CHOICES = (32, 64, 128)  # multipliers of the new feature dim a linear/conv introduces, at full size
DETERMINISTIC_COMPOSER = "deterministic"
# The drop reason of an LLM-composed problem that fails to load or run: the model's mistake, not a filter's verdict.
LLM_INVALID_PROBLEM = "llm-invalid-problem"


@dataclass(frozen=True)
class Operator:
    """A seed operator: its name as the problem spells it, its family, and the layouts it runs on."""

    name: str  # "nn.GELU", "F.silu", "torch.sum"
    family: str  # activation, softmax, norm, pooling, linear, conv, reduction
    layouts: tuple[str, ...]


@dataclass
class CrawlReport:
    """What the crawl kept, and what it skipped with the reason."""

    operators: list[Operator]
    skipped: dict[str, str] = field(default_factory=dict)


@dataclass
class Task:
    """A synthesised problem: its source and what the dataset records about it."""

    task_id: str
    code: str
    ops: list[str]
    layout: str
    shapes: dict[str, int]
    eager_ms: float | None = None
    compile_ms: float | None = None
    composer: str = DETERMINISTIC_COMPOSER  # or "llm:<model>"


# ------------------------------------------------------------------------------------------------ crawl


def crawl_operators() -> CrawlReport:
    """The seed operators of this torch: nn modules and nn.functional functions we can shape, minus stochastic ones."""
    import torch.nn.functional as F
    from torch import nn

    report = CrawlReport(operators=[])
    with warnings.catch_warnings():  # probing deprecated functions (F.upsample...) warns; they are skipped anyway
        warnings.simplefilter("ignore")
        _crawl_into(report, nn, F)
    report.operators += [Operator(f"torch.{name}", "reduction", LAYOUTS) for name in REDUCTIONS]
    return report


def _crawl_into(report: CrawlReport, nn: Any, F: Any) -> None:
    for name, cls in sorted(inspect.getmembers(nn, inspect.isclass)):
        if issubclass(cls, nn.Module) and cls.__module__.startswith("torch.nn.modules."):
            _classify_module(name, cls, report)
    for name, fn in sorted(inspect.getmembers(F, inspect.isfunction)):
        if not name.startswith("_"):
            _classify_function(name, fn, report)


def _classify_module(name: str, cls: type, report: CrawlReport) -> None:
    if any(marker in name.lower() for marker in STOCHASTIC_MARKERS):
        report.skipped[f"nn.{name}"] = "stochastic (random in training mode)"
        return
    if name in SHAPED_MODULES:
        family = SHAPED_FAMILIES.get(name, "norm")
        report.operators.append(Operator(f"nn.{name}", family, (SHAPED_MODULES[name][0],)))
        return
    family = cls.__module__.rsplit(".", 1)[-1]
    if family != "activation":
        report.skipped[f"nn.{name}"] = f"no shape rule for the {family} family"
        return
    args = {"dim": 1} if name in SOFTMAX_FAMILY else {}
    reason = _unfit_elementwise(lambda x: cls(**args)(x)) if _constructs(cls, args) else "needs init arguments"
    if reason:
        report.skipped[f"nn.{name}"] = reason
    else:
        report.operators.append(Operator(f"nn.{name}", "softmax" if name in SOFTMAX_FAMILY else "activation", LAYOUTS))


def _classify_function(name: str, fn: Callable, report: CrawlReport) -> None:
    if any(marker in name for marker in STOCHASTIC_MARKERS):
        report.skipped[f"F.{name}"] = "stochastic (random in training mode)"
        return
    if name in SOFTMAX_FAMILY:
        report.operators.append(Operator(f"F.{name}", "softmax", LAYOUTS))
        return
    try:
        required = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return
    if len(required) != 1:
        return  # not a one-tensor function: losses, convs, attention... (the module crawl covers the shaped ones)
    reason = _unfit_elementwise(fn)
    if reason:
        report.skipped[f"F.{name}"] = reason
    else:
        report.operators.append(Operator(f"F.{name}", "norm" if "norm" in name else "activation", LAYOUTS))


def _constructs(cls: type, args: dict[str, Any]) -> bool:
    try:
        cls(**args)
    except Exception:  # noqa: BLE001 - any failure means "cannot be built without arguments"
        return False
    return True


def _unfit_elementwise(apply: Callable) -> str | None:
    """Why `apply` is not a deterministic shape-preserving op on a float tensor, or None when it is."""
    import torch

    x = torch.randn(4, 8, 6, 6)
    try:
        first = [apply(x) for _ in range(2)]
    except Exception as err:  # noqa: BLE001 - an op that fails on a plain float tensor is not a seed
        return f"fails on a float tensor ({type(err).__name__})"
    if not all(isinstance(out, torch.Tensor) and out.shape == x.shape for out in first):
        return "does not keep its input's shape"
    if not torch.equal(first[0], first[1]):
        return "stochastic (two calls differ)"
    return None


# ---------------------------------------------------------------------------------------------- compose


@dataclass(frozen=True)
class ChainStep:
    """One operator of a chain: its name, how a problem spells it, and the shape of its output."""

    operator: str  # "nn.Conv2d"
    usage: str  # "nn.Conv2d(channels, out_channels_0, 3, padding=1)", "F.softmax(x, dim=-1)"
    shape: str  # "(BATCH, OUT_CHANNELS_0, HEIGHT // 2, WIDTH // 2)"


@dataclass
class Chain:
    """A sampled chain of operators, and the composer's state: forward lines, init lines and parameters, dims."""

    layout: str
    feature: str  # the module constant naming the current feature/channel dim
    constants: dict[str, int]
    init_lines: list[str] = field(default_factory=list)
    forward_lines: list[str] = field(default_factory=list)
    init_params: list[str] = field(default_factory=list)
    steps: list[ChainStep] = field(default_factory=list)
    ended: bool = False
    pooled: int = 0  # pooling layers so far, each halving height and width

    @property
    def ops(self) -> list[str]:
        return [step.operator for step in self.steps]


def compose_tasks(
    operators: Iterable[Operator], count: int, *, seed: int = 0, scale: str = "full", max_ops: int = 5
) -> list[Task]:
    """`count` distinct problems of 1-`max_ops` operators each, the same for the same seed and operators."""
    return [task_of(chain) for chain in sample_chains(operators, count, seed=seed, scale=scale, max_ops=max_ops)]


def sample_chains(
    operators: Iterable[Operator], count: int, *, seed: int = 0, scale: str = "full", max_ops: int = 5
) -> list[Chain]:
    """`count` chains of distinct operator sequences, the same for the same seed and operators."""
    operators = sorted(operators, key=lambda op: op.name)
    rng = random.Random(seed)
    chains: dict[tuple[str, ...], Chain] = {}
    attempts = 0
    while len(chains) < count and attempts < count * 50:
        attempts += 1
        chain = sample_chain(operators, rng, scale=scale, max_ops=max_ops)
        chains.setdefault((chain.layout, *chain.ops), chain)
    return list(chains.values())


def sample_chain(operators: list[Operator], rng: random.Random, *, scale: str = "full", max_ops: int = 5) -> Chain:
    """One chain: a layout, then 1-`max_ops` operators that fit it, drawn from `rng`."""
    layout = rng.choice(LAYOUTS)
    feature = "CHANNELS" if layout == "image" else "FEATURES"
    chain = Chain(layout, feature, dict(SIZES[scale][layout]))
    for _ in range(rng.randint(1, max_ops)):
        fitting = [op for op in operators if layout in op.layouts and _fits(op, chain)]
        _append(chain, rng.choice(fitting), rng, scale)
        if chain.ended:
            break
    return chain


def task_of(chain: Chain) -> Task:
    """The deterministic composer's task for a chain: its operators applied in order."""
    code = render_problem(chain)
    return Task(problem_id_of(code), code, chain.ops, chain.layout, chain.constants)


def _fits(op: Operator, chain: Chain) -> bool:
    short = op.name.split(".", 1)[1]
    if op.family == "reduction":
        return bool(chain.ops)  # a lone reduction is too trivial to be worth a task
    if short in POOLING_HALVES:
        return chain.constants["HEIGHT"] >> (chain.pooled + 1) >= 2  # keep the image at least 2x2
    if short == "GroupNorm":
        return chain.constants[chain.feature] % 4 == 0
    return True


def _append(chain: Chain, op: Operator, rng: random.Random, scale: str) -> None:
    prefix, short = op.name.split(".", 1)
    index = len(chain.steps)
    dim = FEATURE_DIM[chain.layout]
    if op.family == "reduction":
        usage = REDUCTIONS[short].format(dim=dim)
        chain.forward_lines.append(f"x = {usage}")
        chain.ended = True
    elif prefix == "F":
        extra = f", dim={dim}" if op.family == "softmax" else ""
        usage = f"F.{short}(x{extra})"
        chain.forward_lines.append(f"x = {usage}")
    else:
        usage = _constructor(chain, short, index, rng, scale)
        chain.init_lines.append(f"self.op{index} = {usage}")
        chain.forward_lines.append(f"x = self.op{index}(x)")
    chain.pooled += short in POOLING_HALVES
    chain.steps.append(ChainStep(op.name, usage, _shape(chain)))


def _shape(chain: Chain) -> str:
    """The chain's current output shape in module constants: the feature dim renamed, pooled dims divided."""
    dims = list(INPUT_DIMS[chain.layout])
    dims[FEATURE_DIM[chain.layout]] = chain.feature
    if chain.pooled:  # only images pool: their last two dims are height and width
        dims[-2:] = [f"{dim} // {2**chain.pooled}" for dim in dims[-2:]]
    if chain.ended:  # a reduction over the feature dim removes it
        del dims[FEATURE_DIM[chain.layout]]
    return f"({', '.join(dims)})"


def _constructor(chain: Chain, short: str, index: int, rng: random.Random, scale: str) -> str:
    if short not in SHAPED_MODULES:
        return f"nn.{short}(dim={FEATURE_DIM[chain.layout]})" if short in SOFTMAX_FAMILY else f"nn.{short}()"
    _, template, new_dim = SHAPED_MODULES[short]
    feature_param = _init_param(chain, chain.feature)
    if not new_dim:
        return template.format(c=feature_param)
    out = f"OUT_{'CHANNELS' if chain.layout == 'image' else 'FEATURES'}_{index}"
    chain.constants[out] = rng.choice(WIDTH_CHOICES) * (8 if scale == "full" else 1) // 4
    text = template.format(c=feature_param, out=_init_param(chain, out))
    chain.feature = out
    return text


def _init_param(chain: Chain, constant: str) -> str:
    if constant not in chain.init_params:
        chain.init_params.append(constant)
    return constant.lower()


def render_problem(chain: Chain) -> str:
    """The KernelBench-format source of a composed chain: constants, Model, get_inputs, get_init_inputs."""
    dims = INPUT_DIMS[chain.layout]
    params = "".join(f", {name.lower()}: int" for name in chain.init_params)
    init_body = ["super().__init__()", *chain.init_lines]
    lines = [
        f'"""Synthesised by kernelpilot train synth: {" -> ".join(chain.ops)}."""',
        "",
        "import torch",
        "import torch.nn as nn",
        "import torch.nn.functional as F",
        "",
        *(f"{name} = {value}" for name, value in chain.constants.items()),
        "",
        "",
        "class Model(nn.Module):",
        f"    def __init__(self{params}):",
        *(f"        {line}" for line in init_body),
        "",
        "    def forward(self, x: torch.Tensor) -> torch.Tensor:",
        *(f"        {line}" for line in chain.forward_lines),
        "        return x",
        "",
        "",
        "def get_inputs():",
        f"    return [torch.randn({', '.join(dims)})]",
        "",
        "",
        "def get_init_inputs():",
        f"    return [{', '.join(chain.init_params)}]",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- filters


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


# ------------------------------------------------------------------------------------------------- run


@dataclass
class Composition:
    """What a composer made: its tasks, the replies that gave none (per reason), and the model error that ended it."""

    tasks: list[Task]
    unusable: dict[str, int] = field(default_factory=dict)
    model_error: ModelError | None = None


@dataclass
class SynthReport:
    """A synthesis run: tasks composed, kept, and how many each filter (or the LLM composer's reading) dropped."""

    composed: int  # candidates: composed tasks, or the LLM composer's replies
    kept: list[Task]
    dropped_by_filter: dict[str, int]
    contaminated: list[Dropped]
    skipped_operators: dict[str, str]
    seconds: float
    composer: str = DETERMINISTIC_COMPOSER
    model_error: ModelError | None = None  # ended an LLM composer's run early: callers raise it after writing


def require_filter_devices(devices: Sequence[str]) -> None:
    """One sentence, before anything is composed, for a --devices entry that is not a device or a GPU not visible."""
    import re

    unknown = [device for device in devices if not re.fullmatch(r"cpu|cuda(:\d+)?", device)]
    if unknown:
        raise KernelpilotError(f"Unknown device {unknown[0]!r} in --devices.", hint="Use cpu, cuda or cuda:N, comma-separated.")
    if any(device.startswith("cuda") for device in devices):
        import torch

        if not torch.cuda.is_available():  # the filter workers are spawned, so asking here costs them nothing
            raise KernelpilotError(
                "--devices names a GPU, and no CUDA GPU is visible.",
                hint="Filter on the CPU with --devices cpu --scale small, or run it on a GPU machine.",
            )


def synthesize(
    count: int,
    *,
    seed: int = 0,
    scale: str = "full",
    devices: Sequence[str] = ("cuda",),
    compile_backend: str = "inductor",
    benchmark_dir: Path | None = None,
    runtime_range_ms: tuple[float, float] = (0.05, 50.0),
    similarity: float = 0.9,
    timeout_s: float = 300.0,
    on_task: Callable[[Task, Verdict], None] | None = None,
    model: Model | None = None,
) -> SynthReport:
    """Crawl, compose `count` candidates, filter them in one worker process per device, decontaminate.

    `timeout_s` bounds one task's filters (torch.compile's first call included). With a `model`, the LLM composer
    writes the candidates; a model error stops it, and the tasks composed so far are still filtered and reported.
    """
    from kernelpilot.train.filter_worker import check_tasks

    if scale not in SIZES:
        raise KernelpilotError(f"Unknown --scale {scale}.", hint=f"Use one of: {', '.join(SIZES)}.")
    require_filter_devices(devices)
    started = time.monotonic()
    crawl = crawl_operators()
    composition = _compose(crawl.operators, count, seed=seed, scale=scale, model=model)
    composed = composition.tasks
    options = {"compile_backend": compile_backend, "runtime_range_ms": runtime_range_ms}
    verdicts = check_tasks(
        [task.code for task in composed],
        devices,
        options,
        timeout_s,
        on_verdict=(lambda i, v: on_task(composed[i], v)) if on_task is not None else None,
    )
    dropped = {**dict.fromkeys(FILTERS, 0), **composition.unusable}
    passed = []
    for task, verdict in zip(composed, verdicts):
        task.eager_ms, task.compile_ms = verdict.eager_ms, verdict.compile_ms
        if verdict.kept:
            passed.append(task)
        else:
            reason = _drop_reason(task, verdict)
            dropped[reason] = dropped.get(reason, 0) + 1
    contaminated: list[Dropped] = []
    if benchmark_dir is not None:
        passed, contaminated = decontaminate(passed, benchmark_dir, similarity=similarity)
        dropped["contaminated"] = len(contaminated)
    return SynthReport(
        len(composed) + sum(composition.unusable.values()),
        passed,
        dropped,
        contaminated,
        crawl.skipped,
        time.monotonic() - started,
        composer=f"llm:{model.name}" if model is not None else DETERMINISTIC_COMPOSER,
        model_error=composition.model_error,
    )


def _compose(operators: list[Operator], count: int, *, seed: int, scale: str, model: Model | None) -> Composition:
    if model is None:
        return Composition(compose_tasks(operators, count, seed=seed, scale=scale))
    from kernelpilot.train.llm_composer import compose_with_model

    return compose_with_model(model, operators, count, seed=seed, scale=scale)


def _drop_reason(task: Task, verdict: Verdict) -> str:
    """The filter that dropped a task; for a model's problem that fails to load or run, what the model got wrong."""
    if verdict.reason == "invalid" and task.composer != DETERMINISTIC_COMPOSER:
        first_line = verdict.detail.strip().splitlines()[0] if verdict.detail.strip() else "no detail"
        return f"{LLM_INVALID_PROBLEM}: {first_line}"
    return verdict.reason
