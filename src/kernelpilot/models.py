"""Which model a run uses: the litellm model the settings name, else the built-in policy.

This sits above both `agent` and `policy`: the policy is a `Model` built on the agent's types, so the agent
package never imports it, and the choice between the two is made here. The policy is imported only when it is
chosen, so a run with a named model never pays its import time.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from kernelpilot.agent.model import LiteLLMModel, ModelError

if TYPE_CHECKING:
    from kernelpilot.agent import JudgeResult, Model

_NO_MODEL_HINT = (
    "Pass --model (e.g. --model openai/gpt-4o, or --model openai/<name> --api-base http://localhost:8000/v1 for a "
    "local server), or set KERNELPILOT_MODEL and KERNELPILOT_API_BASE, with the key in OPENAI_API_KEY."
)


def resolve_model(
    model: str | None,
    api_base: str | None,
    api_key: str | None,
    *,
    problem_path: Path | None = None,
    judge_results: Mapping[str, JudgeResult] | None = None,
    workspace: Path | None = None,
) -> Model:
    """The model the settings name, else the built-in policy, else ModelError saying how to configure one.

    The built-in policy is given the problem (`problem_path`), the workspace it writes in, and the judge tools' typed
    results by call id (`judge_results`, which the loop fills as the run goes); a language model reads only the
    conversation.
    """
    if model:
        return LiteLLMModel(model, api_base=api_base, api_key=api_key)
    if api_base:
        raise ModelError(
            f"--api-base {api_base} was given without --model.",
            hint=f"Name the served model: --model openai/<name> (GET {api_base.rstrip('/')}/models lists them).",
        )
    try:
        from kernelpilot.policy import BuiltinPolicy
    except ImportError as err:
        if err.name != "kernelpilot.policy":
            raise  # the policy exists but is broken: show the real failure
        raise ModelError(
            "No model is configured and the built-in policy is not installed.", hint=_NO_MODEL_HINT
        ) from None
    if problem_path is None:
        raise ModelError("No model is configured, and the built-in policy needs the problem to work on.",
                         hint=_NO_MODEL_HINT)  # fmt: skip
    return BuiltinPolicy(problem_path, judge_results if judge_results is not None else {}, workspace=workspace)
