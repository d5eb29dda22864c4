"""`python -m kernelpilot` runs the CLI (used on machines where the console script is not installed)."""

from kernelpilot.cli import main

main()
