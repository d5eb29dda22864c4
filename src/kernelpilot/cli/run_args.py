"""The arguments `optimize` and `tui` share, declared once: the fields of `RunArgs` are both the commands' parameters
(`run_command` puts them first, in this order, before a command's own) and the values the command receives.

Typer reads a command's parameters from its signature, so `run_command` gives the function it registers a signature
built from these fields and packs the values Typer passes back into one `RunArgs`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

# The folder a command makes is --dir everywhere; the older spelling --workspace still works, hidden from help.
DirOpt = Annotated[Optional[Path], typer.Option("--dir", help="Workspace folder (default: ./kp-<problem name>).")]
WorkspaceAliasOpt = Annotated[Optional[Path], typer.Option("--workspace", hidden=True)]
ProblemArg = Annotated[Path, typer.Argument(help="A KernelBench-format file: Model, get_inputs(), get_init_inputs().")]
ModelOpt = Annotated[Optional[str], typer.Option("--model", help="litellm model, e.g. openai/gpt-5 (default: KERNELPILOT_MODEL, else the built-in policy).")]
ApiBaseOpt = Annotated[Optional[str], typer.Option("--api-base", help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1.")]
ApiKeyOpt = Annotated[Optional[str], typer.Option("--api-key", help="API key (default: KERNELPILOT_API_KEY or the provider's usual variable).")]
MaxTurnsOpt = Annotated[Optional[int], typer.Option("--max-turns", help="Most model turns (default 40, at most 200).")]
TargetOpt = Annotated[Optional[float], typer.Option("--target", help="Speedup vs torch.compile that counts as done (default 1.05).")]
OutputOpt = Annotated[Optional[Path], typer.Option("--output", help="Where the best model_new.py goes (default: beside PROBLEM); its kernels/ go beside it.")]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue the workspace's newest session (or the one --session names).")]
SessionOpt = Annotated[Optional[str], typer.Option("--session", help="Session id to resume (implies --resume).")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cuda, cuda:N or cpu (cpu only exercises the harness).")]


@dataclass
class RunArgs:
    """What `optimize` and `tui` were asked to run: the problem, the model, the budgets and where things go."""

    problem: ProblemArg
    model: ModelOpt = None
    api_base: ApiBaseOpt = None
    api_key: ApiKeyOpt = None
    max_turns: MaxTurnsOpt = None
    target: TargetOpt = None
    dir: DirOpt = None
    workspace: WorkspaceAliasOpt = None
    output: OutputOpt = None
    resume: ResumeOpt = False
    session: SessionOpt = None
    device: DeviceOpt = None


def _shared_parameters() -> list[inspect.Parameter]:
    """RunArgs' fields as the parameters of a function, with their Typer annotations and defaults."""
    hints = typing.get_type_hints(RunArgs, include_extras=True)  # Annotated kept: it holds the Typer option
    return [
        inspect.Parameter(field.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hints[field.name],
                          default=inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default)
        for field in dataclasses.fields(RunArgs)
    ]  # fmt: skip


def run_command(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command(args: RunArgs, **own)` as a function Typer can register: RunArgs' parameters, then the command's
    own (those after `args`); the values of the shared ones reach `command` packed into `args`."""
    shared = _shared_parameters()
    own_signature = inspect.signature(command, eval_str=True)
    own = list(own_signature.parameters.values())[1:]

    @functools.wraps(command)
    def registered(**values: Any) -> Any:
        args = RunArgs(**{parameter.name: values.pop(parameter.name) for parameter in shared})
        return command(args, **values)

    parameters = shared + own
    registered.__signature__ = own_signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    registered.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
    return registered
