"""The LLM composer of `train synth`: a model writes each problem around operators sampled from the crawl.

The operators and sizes come from the deterministic composer's sampler (same seed, same chains); the model gets them,
with the shape each one outputs, through prompts/synth_compose.md, one query per task and no tools, and answers with
the problem in a fenced code block. This module only asks and reads: the code goes through the same execution
filters and decontamination as composed tasks (`synth.synthesize`). A reply with no code block is counted, never
fatal; a model error (server down, key refused) ends composition and keeps what was composed before it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from kernelpilot.agent import Model, RecoverableError
from kernelpilot.agent.model import LiteLLMModel, ModelError
from kernelpilot.agent.prompts import render_prompt
from kernelpilot.errors import KernelpilotError
from kernelpilot.problem import problem_id_of
from kernelpilot.train.compose import FEATURE_DIM, INPUT_DIMS, Chain, Composition, sample_chains
from kernelpilot.train.tasks import DETERMINISTIC_COMPOSER, Operator, Task

LLM_COMPOSER = "llm"
COMPOSERS = (DETERMINISTIC_COMPOSER, LLM_COMPOSER)
PROMPT_TEMPLATE = "synth_compose"
# Drop reasons of replies that give no task: no code block; the same source as an earlier reply (one row is enough).
LLM_UNPARSEABLE = "llm-unparseable"
LLM_DUPLICATE = "llm-duplicate"
_CODE_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def composer_model(composer: str, model: str | None, api_base: str | None, api_key: str | None) -> Model | None:
    """The model the named composer writes with (None for the deterministic one); one sentence when flags misfit."""
    if composer not in COMPOSERS:
        raise KernelpilotError(
            f"Unknown composer '{composer}'.", hint=f"Use --composer {' or --composer '.join(COMPOSERS)}."
        )
    if composer == DETERMINISTIC_COMPOSER:
        if model or api_base:
            raise KernelpilotError(
                "--model and --api-base are used only by the llm composer.",
                hint="Add --composer llm, or leave them out for the deterministic composer.",
            )
        return None
    if not model:
        raise ModelError(
            "The llm composer needs a model.",
            hint="Pass --model (or set `model` in train.toml's [synth] table), e.g. --model openai/<name> "
            "--api-base http://localhost:8000/v1 for a local vLLM server.",
        )
    # No tools are sent: native mode keeps the text-action instructions (for tool calls) out of the prompt.
    return LiteLLMModel(model, api_base=api_base, api_key=api_key, native_tools=True)


def compose_with_model(
    model: Model, operators: Iterable[Operator], count: int, *, seed: int = 0, scale: str = "full", max_ops: int = 5
) -> Composition:
    """Ask `model` for one problem per sampled chain; the problems it wrote, and what it wrote that was none."""
    composition = Composition(tasks=[])
    seen: set[str] = set()
    for chain in sample_chains(operators, count, seed=seed, scale=scale, max_ops=max_ops):
        try:
            reply = model.query(compose_messages(chain), [])
        except ModelError as err:
            composition.model_error = err
            break
        except RecoverableError:  # a reply that could not be read at all (e.g. malformed tool calls)
            _count(composition, LLM_UNPARSEABLE)
            continue
        code = problem_in(reply.content)
        if code is None:
            _count(composition, LLM_UNPARSEABLE)
        elif problem_id_of(code) in seen:
            _count(composition, LLM_DUPLICATE)
        else:
            seen.add(problem_id_of(code))
            composition.tasks.append(_task(code, chain, model.name))
    return composition


def compose_messages(chain: Chain) -> list[dict[str, Any]]:
    """The one-message conversation asking for a problem that fuses the chain's operators at its sizes."""
    prompt = render_prompt(
        PROMPT_TEMPLATE,
        layout=chain.layout,
        input_shape=f"({', '.join(INPUT_DIMS[chain.layout])})",
        feature_dim=FEATURE_DIM[chain.layout],
        constants=chain.constants,
        steps=chain.steps,
    )
    return [{"role": "user", "content": prompt}]


def problem_in(reply: str) -> str | None:
    """The problem source in a reply: the fenced block defining `class Model`, else the only fenced block; or None."""
    blocks = [block.strip() + "\n" for block in _CODE_BLOCK.findall(reply) if block.strip()]
    defining_model = [block for block in blocks if re.search(r"^class Model\b", block, re.MULTILINE)]
    if defining_model:
        return defining_model[0]
    return blocks[0] if len(blocks) == 1 else None


def _task(code: str, chain: Chain, model_name: str) -> Task:
    return Task(problem_id_of(code), code, chain.ops, chain.layout, dict(chain.constants), composer=f"llm:{model_name}")


def _count(composition: Composition, reason: str) -> None:
    composition.unusable[reason] = composition.unusable.get(reason, 0) + 1
