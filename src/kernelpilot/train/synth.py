"""Task synthesis: operators crawled from torch.nn, composed into KernelBench-format problems, filtered by running.

The crawl walks `torch.nn`'s module classes and `torch.nn.functional`'s functions and keeps what a small table of
families knows how to build (activations, norms, pooling, linear, conv, softmax family, reductions), dropping
stochastic operators. The sampler and the deterministic composer (compose.py) write chains of them as problems (the
LLM composer, `train/llm_composer.py`, has a model write them); `check_task` (filters.py) runs a problem and says
whether it is fit to train on, in one worker process per device (filter_worker.py); `decontaminate`
(decontaminate.py) drops tasks too close to a benchmark's problems. The kept tasks are written as a dataset by
synth_dataset.py.
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelpilot.errors import KernelpilotError
from kernelpilot.train.compose import (
    LAYOUTS,
    REDUCTIONS,
    SHAPED_MODULES,
    SIZES,
    SOFTMAX_FAMILY,
    Composition,
    compose_tasks,
)
from kernelpilot.train.decontaminate import Dropped, decontaminate
from kernelpilot.train.filter_worker import check_tasks
from kernelpilot.train.filters import FILTERS, STOCHASTIC_MARKERS, Verdict
from kernelpilot.train.tasks import DETERMINISTIC_COMPOSER, Operator, Task

if TYPE_CHECKING:
    from kernelpilot.agent import Model
    from kernelpilot.agent.model import ModelError

SHAPED_FAMILIES = {"Linear": "linear", "Conv2d": "conv", "MaxPool2d": "pooling", "AvgPool2d": "pooling"}
# The drop reason of an LLM-composed problem that fails to load or run: the model's mistake, not a filter's verdict.
LLM_INVALID_PROBLEM = "llm-invalid-problem"


@dataclass
class CrawlReport:
    """What the crawl kept, and what it skipped with the reason."""

    operators: list[Operator]
    skipped: dict[str, str] = field(default_factory=dict)


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


# ------------------------------------------------------------------------------------------------- run


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
