"""The `kernelpilot` command line: the Typer commands (`commands.py`, `train.py`) and how results look in a terminal
(`render_*.py`). The TUI is the other view of the same result objects (`kernelpilot.tui`)."""

from kernelpilot.cli.commands import app, main

__all__ = ["app", "main"]
