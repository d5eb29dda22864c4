"""Sandboxes as on a kernel without Landlock, for tests that need an unconfined judge on any machine.

The judge's side starts its sandboxes without the folders they may write (the sandbox environment without
`confine.WRITABLE_ENV`), so `confine.harden` returns "none" in the child, as it does where Landlock is missing, and
the sandbox says so in its first reply. Nothing a candidate can set chooses this: a sandbox's environment is fixed
before it starts, and kernelpilot reads no variable for it.

`unconfine_sandboxes` does this for the sandboxes this process starts (a worker's state run in the test's process);
`unconfined_judges` for the workers of the Judges made from then on, which run `unconfined_worker.py` (beside this
file): the judge's worker, doing the same before it serves.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent
UNCONFINED_WORKER = "unconfined_worker"  # tests/unconfined_worker.py, run as `python -m unconfined_worker`


def unconfine_sandboxes(set_attribute=setattr) -> None:
    """Sandboxes this process starts from now on run unconfined; `set_attribute` is a test's monkeypatch.setattr
    (undone after the test), or setattr in a process of the test's own."""
    from kernelpilot.harness import process
    from kernelpilot.harness.confine import WRITABLE_ENV

    made = process.sandbox_environment

    def without_writable_folders(env: dict[str, str], private_dir: Path, **settings) -> dict[str, str]:
        return {name: value for name, value in made(env, private_dir, **settings).items() if name != WRITABLE_ENV}

    set_attribute(process, "sandbox_environment", without_writable_folders)


def unconfined_judges(monkeypatch) -> None:
    """Judges made from now on in this test start a worker whose sandboxes run unconfined."""
    from kernelpilot.harness import judge

    monkeypatch.setattr(judge, "Worker", functools.partial(judge.Worker, module=UNCONFINED_WORKER))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
