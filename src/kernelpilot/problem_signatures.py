"""Model's constructor and forward signatures as source text, the way model_new.py's ModelNew repeats them.

Worked out where the problem file is loaded (the checking child), and sent back as plain strings, so the process
that writes model_new.py never has to run the file to learn them.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kernelpilot.problem import Problem


@dataclass(frozen=True)
class ModelSignatures:
    """ModelNew's `(self, ...)` for __init__ and forward, the argument list passing the constructor's parameters
    on to Model, and whether some default has no literal spelling and is read from Model when model_new.py runs."""

    init_signature: str
    init_call: str
    forward_signature: str
    uses_model_defaults: bool


def model_signatures(problem: Problem) -> ModelSignatures:
    """The signatures of the problem's Model as ModelNew writes them."""
    init_parameters = list(problem.init_signature().parameters.values())
    forward_parameters = list(problem.forward_signature().parameters.values())
    init_signature, init_fallbacks = _signature_source("__init__", init_parameters)
    forward_signature, forward_fallbacks = _signature_source("forward", forward_parameters)
    return ModelSignatures(
        init_signature=init_signature,
        init_call=_call_source(init_parameters),
        forward_signature=forward_signature,
        uses_model_defaults=bool(init_fallbacks or forward_fallbacks),
    )


class _SourceText:
    """A default value that prints as the given source text (inspect.Signature prints defaults by repr)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature_source(method: str, parameters: list[inspect.Parameter]) -> tuple[str, list[str]]:
    """`(self, ...)` for a method with these parameters, and the names whose defaults are not literals.

    Annotations are dropped (they may name types model_new.py does not import). A default with a literal
    spelling is written as that literal; any other default is read from Model's own signature at import
    time, so it stays the very same object.
    """
    kind = inspect.Parameter
    positional_only = bool(parameters) and parameters[0].kind is kind.POSITIONAL_ONLY
    self_kind = kind.POSITIONAL_ONLY if positional_only else kind.POSITIONAL_OR_KEYWORD
    written, fallbacks = [kind("self", self_kind)], []
    for parameter in parameters:
        parameter = parameter.replace(annotation=kind.empty)
        if parameter.default is not kind.empty:
            literal = _literal_source(parameter.default)
            if literal is None:
                literal = f"_model_default({method!r}, {parameter.name!r})"
                fallbacks.append(parameter.name)
            parameter = parameter.replace(default=_SourceText(literal))
        written.append(parameter)
    return str(inspect.Signature(written)), fallbacks


def _literal_source(value: object) -> str | None:
    """`repr(value)` when it is a Python literal that evaluates back to an equal value of the same type."""
    text = repr(value)
    try:
        parsed = ast.literal_eval(text)
        return text if type(parsed) is type(value) and parsed == value else None
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _call_source(parameters: list[inspect.Parameter]) -> str:
    """The argument list that passes every parameter on to Model's constructor unchanged."""
    kind = inspect.Parameter
    arguments = []
    for parameter in parameters:
        if parameter.kind is kind.VAR_POSITIONAL:
            arguments.append(f"*{parameter.name}")
        elif parameter.kind is kind.VAR_KEYWORD:
            arguments.append(f"**{parameter.name}")
        elif parameter.kind is kind.KEYWORD_ONLY:
            arguments.append(f"{parameter.name}={parameter.name}")
        else:
            arguments.append(parameter.name)
    return ", ".join(arguments)
