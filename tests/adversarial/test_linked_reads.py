"""Links the trusted side would read through (issue #14).

Writes through links planted in a workspace are covered by test_planted_links.py. These are the reads: a file the
trusted side copies or hashes on the candidate's behalf, planted as a link to some other file, which is then judged
as the candidate's own though it is not part of it and may change once judged. (Reads are not a secret's boundary:
the sandbox and the agent's Bash are confined in what they write, not in what they read.) Against kernelpilot as it
was (a46f2cd) both passed: `eval --candidate` copied a linked kernel file's target (here a token) into the
workspace it built and judged, and a protected file replaced by a link to an identical copy was not tampered.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kernelpilot.workspace import init_workspace, tampered_files
from kp_testing import scale_mul_candidate, scale_problem, write_problem

SRC = Path(__file__).resolve().parents[2] / "src"
TOKEN = "kp-secret-token-0c1d"


def test_eval_refuses_a_candidates_kernel_file_that_is_a_link(tmp_path):
    problem = write_problem(tmp_path, scale_problem(rows=8, features=16))
    secret = tmp_path / "home" / ".netrc"
    secret.parent.mkdir()
    secret.write_text(f"// {TOKEN}\n")
    candidate = tmp_path / "submission" / "model_new.py"
    (candidate.parent / "kernels").mkdir(parents=True)
    candidate.write_text(scale_mul_candidate(16))
    (candidate.parent / "kernels" / "leak.cu").symlink_to(secret)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    environment = dict(os.environ, TMPDIR=str(scratch), TORCH_CUDA_ARCH_LIST="9.0",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))  # fmt: skip
    completed = subprocess.run(
        [sys.executable, "-m", "kernelpilot", "eval", str(problem), "--candidate", str(candidate), "--device", "cpu"],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    shown = completed.stdout + completed.stderr
    assert completed.returncode != 0, shown
    assert "kernels/leak.cu is a link" in shown, shown
    assert "Traceback" not in shown, shown
    leaked = [path for path in scratch.rglob("*") if path.is_file() and TOKEN in path.read_text(errors="replace")]
    assert leaked == [], f"the linked file was copied to {leaked}"


def test_a_protected_file_replaced_by_a_link_to_an_identical_copy_is_tampered(tmp_path):
    ws, _ = init_workspace(write_problem(tmp_path, scale_problem(rows=8, features=16)), tmp_path / "ws")
    copy = tmp_path / "elsewhere" / "model.py"
    copy.parent.mkdir()
    copy.write_bytes((ws.root / "model.py").read_bytes())
    (ws.root / "model.py").unlink()
    (ws.root / "model.py").symlink_to(copy)
    assert "model.py" in tampered_files(ws)
