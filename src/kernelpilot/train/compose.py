"""The seeded sampler and the deterministic composer of `train synth`.

The sampler draws chains of 1-5 compatible operators over one of two layouts (images NCHW, rows B x S x F); the
deterministic composer writes a chain as problem source with its sizes as module constants (the LLM composer,
`train/llm_composer.py`, has a model write it from the same chains).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kernelpilot.problem import problem_id_of
from kernelpilot.train.tasks import Operator, Task

if TYPE_CHECKING:
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
FEATURE_DIM = {"image": 1, "rows": -1}
WIDTH_CHOICES = (32, 64, 128)  # multipliers of the new feature dim a linear/conv introduces, at full size


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


@dataclass
class Composition:
    """What a composer made: its tasks, the replies that gave none (per reason), and the model error that ended it."""

    tasks: list[Task]
    unusable: dict[str, int] = field(default_factory=dict)
    model_error: ModelError | None = None
