"""The trace's switch of collection (harness/tracing.py) keeps torch's warning on every switch out of the sandbox's
log and leaves standard error as it was. The profiler session itself needs a GPU (tests/harness/test_tracing.py);
here a session that writes to file descriptor 2 when switched, as torch's C++ warning does, stands in for it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

PROGRAM = textwrap.dedent(
    """
    import os, sys
    from kernelpilot.harness.tracing import KernelTrace

    class Session:
        def toggle_collection_dynamic(self, on, activities):
            os.write(2, b"WARNING toggling\\n")
            self.on = on

    trace = object.__new__(KernelTrace)
    trace._activities, trace._session = [], Session()
    trace._null = os.open(os.devnull, os.O_WRONLY)
    print("before", file=sys.stderr, flush=True)
    trace._switch(True)
    assert trace._session.on is True
    trace._switch(False)
    assert trace._session.on is False
    print("after", file=sys.stderr, flush=True)
    trace._null = None  # no /dev/null to be had: the switch still happens, its warning shows
    trace._switch(True)
    """
)


def test_the_switch_hides_torchs_warning_and_keeps_stderr():
    run = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, env=os.environ)
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == ["before", "after", "WARNING toggling"]
