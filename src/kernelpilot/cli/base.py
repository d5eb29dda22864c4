"""What every command shares: the two consoles, a KernelpilotError as `error:` / `hint:` lines and a non-zero exit,
the warning that a judge's sandboxes were not confined, JSON output, and a Typer app whose help reads as a person would write it (no `<bool>` after a flag, no `{problem}`).
"""

from __future__ import annotations

import functools
import json
import re
import sys

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from kernelpilot.errors import KernelpilotError

console = Console()
err_console = Console(stderr=True)


def report_error(err: KernelpilotError) -> None:
    """Print a user error as one line plus its hint."""
    # escape: messages quote user code and exceptions ("[x, y]", shapes) that rich would read as markup;
    # soft_wrap: rich would otherwise break a long message at the terminal width into several lines.
    err_console.print(f"[bold red]error:[/] {escape(err.message)}", highlight=False, soft_wrap=True)
    if err.hint:
        err_console.print(f"[dim]hint:[/] {escape(err.hint)}", highlight=False, soft_wrap=True)


def warn_if_unconfined(console: Console, *confinements: str | None) -> None:
    """One `warning:` line when any of these judgements came from sandboxes that Landlock did not confine."""
    from kernelpilot.results import UNCONFINED, UNCONFINED_NOTE, least_confined

    if least_confined(*confinements) == UNCONFINED:
        console.print(f"[bold yellow]warning:[/] {escape(UNCONFINED_NOTE)}", highlight=False, soft_wrap=True)


def print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def one_of(value, alias, name: str, alias_name: str):
    """The value of an option that has an old spelling kept as a hidden alias; both at once is an error."""
    if value is not None and alias is not None and value != alias:
        raise KernelpilotError(f"{name} and {alias_name} name the same folder; pass only one.", hint=f"Use {name}.")
    return value if value is not None else alias


class _ReadableParams:
    """Help without a type after a flag ("--resume <bool>") and with "<path>..." for a list argument."""

    def get_params(self, ctx: typer.Context) -> list:
        params = super().get_params(ctx)  # type: ignore[misc]  # the help option is made here, not in __init__
        for param in params:
            if isinstance(param, TyperOption) and param.is_flag:
                param.metavar = ""  # a flag takes no value, so there is no type to show
            elif isinstance(param, TyperArgument) and param.nargs != 1:
                param.display_type_rich = functools.partial(_list_type, param)  # not "<list[Path]>"
        return params


class _Command(_ReadableParams, TyperCommand):
    """A command whose usage line names its arguments as PROBLEM / [WORKSPACE] (typer writes `{problem}`)."""

    def collect_usage_pieces(self, ctx: typer.Context) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = (param.metavar or param.name or "").upper() + ("..." if param.nargs != 1 else "")
                pieces.append(name if param.required else f"[{name}]")
        return pieces


class _Group(_ReadableParams, TyperGroup):
    """A group of commands with the same readable options."""


def _list_type(param: TyperArgument, ctx: typer.Context) -> str:
    shown = param.display_type(ctx)
    listed = re.fullmatch(r"<list\[(\w+)\]>", shown)
    return f"<{listed.group(1).lower()}>..." if listed else shown


class App(typer.Typer):
    """A Typer app whose commands turn a KernelpilotError into `error:` / `hint:` lines and a non-zero exit."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("cls", _Group)
        super().__init__(*args, **kwargs)

    def command(self, *args, **kwargs):  # type: ignore[override]
        kwargs.setdefault("cls", _Command)
        register = super().command(*args, **kwargs)

        def decorator(fn):
            @functools.wraps(fn)
            def wrapped(*a, **kw):
                try:
                    return fn(*a, **kw)
                except KernelpilotError as err:
                    report_error(err)
                    raise typer.Exit(err.exit_code) from None

            register(wrapped)
            return fn

        return decorator
