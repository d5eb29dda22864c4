"""The task types of synthesis: a seed operator (the crawl's output, the sampler's input) and a synthesised task."""

from __future__ import annotations

from dataclasses import dataclass

DETERMINISTIC_COMPOSER = "deterministic"


@dataclass(frozen=True)
class Operator:
    """A seed operator: its name as the problem spells it, its family, and the layouts it runs on."""

    name: str  # "nn.GELU", "F.silu", "torch.sum"
    family: str  # activation, softmax, norm, pooling, linear, conv, reduction
    layouts: tuple[str, ...]


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
