"""The lock file against an agent that rewrites it. `accept` writes kernelpilot.lock.json into the workspace: the
hashes of the candidate's files it verified, and its figures. `kernelpilot.load` and `swap` build and load only a
candidate whose files match the lock, and `check` compares with its figures. But the lock lives in the workspace,
which a program the agent runs may write (a later optimize run of the same workspace, say): new code and a lock
rewritten to name its hashes would be loaded into the user's model as the verified candidate."""

from __future__ import annotations

import hashlib
import json

import pytest

from kernelpilot.errors import KernelpilotError
from kernelpilot.lockfile import Environment, Lock, Timings, Verification, lock_path, write_lock
from kernelpilot.workspace import init_workspace
from kp_testing import scale_problem, write_problem


def _accepted(tmp_path):
    """A workspace whose candidate `accept` locked (the lock as accept writes it, from its own process)."""
    ws, _ = init_workspace(write_problem(tmp_path, scale_problem(rows=8, features=16)), tmp_path / "ws")
    from kernelpilot.lockfile import file_hashes

    lock = Lock(problem_id=ws.problem_id, environment=Environment(gpu="cpu", torch="2", cuda=None),
                verification=Verification(atol=1e-2, rtol=1e-2), timings=Timings(bench_seed=1), reward=1,
                files=file_hashes(ws))  # fmt: skip
    write_lock(ws, lock)
    return ws


def test_a_lock_rewritten_to_name_new_code_is_not_an_accepted_candidate(tmp_path):
    from kernelpilot.deploy import _require_accepted

    ws = _accepted(tmp_path)
    _require_accepted(ws)  # the accepted candidate, as it was locked
    # The agent's script: other code, and the lock's hashes rewritten to name it.
    ws.model_new_path.write_text(ws.model_new_path.read_text() + "\n# never verified\n")
    path = lock_path(ws)
    data = json.loads(path.read_text())
    data["files"]["model_new.py"] = hashlib.sha256(ws.model_new_path.read_bytes()).hexdigest()
    path.write_text(json.dumps(data, indent=2) + "\n")

    with pytest.raises(KernelpilotError, match="lock file"):
        _require_accepted(ws)


def test_an_older_lock_that_accept_wrote_still_names_an_accepted_candidate(tmp_path):
    """The honest control: going back to an earlier accepted version (git checkout of the workspace) loads."""
    from kernelpilot.deploy import _require_accepted
    from kernelpilot.lockfile import file_hashes, read_lock

    ws = _accepted(tmp_path)
    first_lock, first_candidate = lock_path(ws).read_text(), ws.model_new_path.read_text()
    ws.model_new_path.write_text(first_candidate + "\n# the next accepted version\n")
    write_lock(ws, read_lock(lock_path(ws)).__class__(**{**read_lock(lock_path(ws)).__dict__, "files": file_hashes(ws)}))
    _require_accepted(ws)

    lock_path(ws).write_text(first_lock)
    ws.model_new_path.write_text(first_candidate)

    _require_accepted(ws)
