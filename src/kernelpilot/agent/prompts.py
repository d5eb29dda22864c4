"""The system and task prompts: Jinja2 templates from prompts/, filled with the problem and what is known of the GPU.

What is known comes from the harness's on-disk caches only (GPU ceilings, problem cost, eager/compile baselines),
read without touching the GPU: a figure that was never measured is left out, and the first Profile measures it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelpilot.resources import data_dir, template_environment

if TYPE_CHECKING:
    from kernelpilot.config import Settings
    from kernelpilot.problem import Problem
    from kernelpilot.workspace import Workspace


@dataclass
class TaskFacts:
    """Measured figures for the task prompt; None where nothing was measured yet."""

    gpu_name: str | None = None
    bandwidth_gbs: float | None = None
    matmul_tflops: float | None = None
    eager_ms: float | None = None
    compile_ms: float | None = None
    floor_ms: float | None = None
    bound: str | None = None
    bytes: float | None = None
    flops: float | None = None


def render_prompt(name: str, **variables: Any) -> str:
    """Render prompts/<name>.md; a variable the template uses but was not given is an error."""
    return template_environment("prompts").get_template(f"{name}.md").render(**variables)


def task_messages(problem: Problem, ws: Workspace, settings: Settings, facts: TaskFacts) -> list[dict[str, str]]:
    """The conversation a new run starts from: the system prompt (with SKILL.md) and the task."""
    skill = (data_dir("skills") / "SKILL.md").read_text()
    task = render_prompt(
        "task",
        problem_name=problem.name,
        problem_source=Path(ws.model_path).read_text().rstrip(),
        workspace=str(ws.root),
        target_speedup=settings.target_speedup,
        max_turns=settings.max_turns,
        trials=settings.trials,
        atol=settings.atol,
        rtol=settings.rtol,
        **asdict(facts),
    )
    return [{"role": "system", "content": render_prompt("system", skill=skill.strip())}, {"role": "user", "content": task}]


def known_facts(gpu_name: str | None, problem_id: str, cache_dir: Path | None = None) -> TaskFacts:
    """What the caches already know about this problem on this GPU (nothing is measured here). Without Landlock the
    judge neither reads nor writes the cache folder (its sandboxes could write it: harness/cache.py), so neither
    does this."""
    from kernelpilot.harness.cache import load_entry
    from kernelpilot.harness.confine import landlock_available
    from kernelpilot.harness.roofline import CEILINGS_KIND

    if not gpu_name:
        return TaskFacts()
    facts = TaskFacts(gpu_name=gpu_name)
    if not landlock_available():
        return facts
    ceilings = load_entry(CEILINGS_KIND, {"gpu": gpu_name}, cache_dir)
    cost = _cached_cost(problem_id, cache_dir)
    if ceilings is not None:
        facts.bandwidth_gbs = ceilings["bandwidth_gbs"]
    if cost is not None:
        _add_baselines(facts, gpu_name, problem_id, cost.dtype, cache_dir)
    if ceilings is not None and cost is not None:
        _add_floor(facts, ceilings, cost)
    return facts


def baseline_cache_key(problem_id: str, gpu_name: str, dtype: str) -> dict[str, Any]:
    """The key bench.baseline_key makes for a non-graph timing, built from the GPU's name (no CUDA call here)."""
    import torch

    from kernelpilot.harness.bench import TIMING_METHOD
    from kernelpilot.harness.float32 import tf32_allowed

    return {"problem_id": problem_id, "gpu": gpu_name, "torch": torch.__version__, "tf32": tf32_allowed(),
            "dtype": dtype, "graph": False, "method": TIMING_METHOD}


def _cached_cost(problem_id: str, cache_dir: Path | None) -> Any:
    import torch

    from kernelpilot.harness.cache import load_entry
    from kernelpilot.harness.roofline import COST_KIND, ProblemCost

    cached = load_entry(COST_KIND, {"problem_id": problem_id, "torch": torch.__version__}, cache_dir)
    return ProblemCost(**cached) if cached is not None else None


def _add_baselines(facts: TaskFacts, gpu_name: str, problem_id: str, dtype: str, cache_dir: Path | None) -> None:
    from kernelpilot.harness.bench import load_baselines

    baselines = load_baselines(baseline_cache_key(problem_id, gpu_name, dtype), cache_dir)
    if baselines is not None:
        facts.eager_ms = baselines.eager.median_ms
        facts.compile_ms = baselines.compiled.median_ms if baselines.compiled is not None else None


def _add_floor(facts: TaskFacts, ceilings: dict[str, Any], cost: Any) -> None:
    from kernelpilot.harness.roofline import effective_rate, floor_time

    rate = effective_rate(ceilings, cost)
    facts.floor_ms, facts.bound = floor_time(cost.flops, cost.bytes, ceilings["bandwidth_gbs"], rate)
    facts.matmul_tflops, facts.bytes, facts.flops = rate, cost.bytes, cost.flops
