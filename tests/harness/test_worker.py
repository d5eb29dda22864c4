"""The GPU worker subprocess (run on device "cpu") and candidate loading: hangs, crashes, fresh loads, no leaks."""

from __future__ import annotations

import os
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from kernelpilot.harness.candidate import CandidateError, load_candidate, make_candidate_model
from kernelpilot.harness.confine import landlock_available  # noqa: F401 - named in a skipif condition
from kernelpilot.harness.failures import classify
from kernelpilot.harness.process import Worker, describe_exit
from kernelpilot.workspace import Workspace

TINY_PROBLEM = """
import torch
from torch import nn

TAG = "{tag}"


class Model(nn.Module):
    def __init__(self, features: int = 8):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return x * self.scale


def get_inputs():
    return [torch.randn(4, 8)]


def get_init_inputs():
    return [8]
"""

HONEST_CANDIDATE = """
from model import Model, TAG


class ModelNew(Model):
    tag = TAG
"""


def write_workspace(root: Path, model_new: str, tag: str = "a") -> Workspace:
    """A folder with a tiny problem as model.py and `model_new` as model_new.py."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.py").write_text(TINY_PROBLEM.format(tag=tag))
    (root / "model_new.py").write_text(textwrap.dedent(model_new))
    return Workspace(root)


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def worker():
    with Worker("cpu") as cpu_worker:
        yield cpu_worker


# ------------------------------------------------------------------------------------------ the worker


def test_worker_says_who_it_is(worker):
    info = worker.start()
    assert info["device"] == "cpu"
    assert info["pid"] == worker.pid != os.getpid()
    assert info["torch"]


def test_a_hanging_candidate_is_killed_in_its_sandbox_and_the_worker_stays(worker, tmp_path):
    # The candidate notes when it starts to hang (/dev stays writable): the call's own time also holds the start of
    # a fresh sandbox (importing torch), seconds on a busy machine, and the kill is timed from the hang instead.
    hang_started = Path(f"/dev/shm/kernelpilot-test-hang-{os.getpid()}-{tmp_path.name}")
    hanging = f"import time\nopen({str(hang_started)!r}, 'w').write(repr(time.time()))\ntime.sleep(600)\n"
    ws = write_workspace(tmp_path / "ws", hanging)
    worker_pid = worker.start()["pid"]

    try:
        reply = worker.call("load", {"workspace": str(ws.root), "timeout": 2}, timeout=60)
        noted = hang_started.read_text() if hang_started.exists() else ""  # none: killed before its hang began
        hung_for = time.time() - float(noted) if noted else 0.0
    finally:
        hang_started.unlink(missing_ok=True)

    assert (reply.ok, reply.error_kind) == (False, "timeout")
    assert "within 2 s" in reply.message and "the candidate's process was killed" in reply.message
    assert reply.seconds >= 2
    assert hung_for < 12, "killed 2 s after the request at the latest, which came before the hang began"
    assert worker.pid == worker_pid, "the candidate's hang is its sandbox's, not the worker's"
    ws.model_new_path.write_text(HONEST_CANDIDATE)
    reply = worker.call("load", {"workspace": str(ws.root)}, timeout=60)
    assert reply.ok, reply.message
    assert reply.result["pid"] not in (worker_pid, None)


def test_an_abort_is_a_crash_with_the_signal_and_the_log_tail_and_the_worker_recovers(worker, tmp_path):
    aborting = """
    import os, sys
    print("candidate about to abort", file=sys.stderr, flush=True)
    os.abort()
    """
    ws = write_workspace(tmp_path / "ws", aborting)
    worker_pid = worker.start()["pid"]

    reply = worker.call("load", {"workspace": str(ws.root)}, timeout=60)

    assert (reply.ok, reply.error_kind) == (False, "crash")
    assert "SIGABRT" in reply.message
    assert "candidate about to abort" in reply.message
    assert worker.pid == worker_pid, "the abort killed the candidate's sandbox, not the worker"
    ws.model_new_path.write_text(HONEST_CANDIDATE)
    assert worker.call("load", {"workspace": str(ws.root)}, timeout=60).ok


def test_a_segfault_is_a_crash(worker, tmp_path):
    ws = write_workspace(tmp_path / "ws", "import ctypes\nctypes.string_at(0)\n")
    reply = worker.call("load", {"workspace": str(ws.root)}, timeout=60)
    assert (reply.ok, reply.error_kind) == (False, "crash")
    assert "SIGSEGV" in reply.message


def test_printing_to_stdout_does_not_corrupt_replies(worker, tmp_path):
    noisy = 'print("{\\"not\\": \\"a reply\\"}")\nprint("x" * 100000)\n' + HONEST_CANDIDATE
    ws = write_workspace(tmp_path / "ws", noisy)
    reply = worker.call("load", {"workspace": str(ws.root)}, timeout=60)
    assert reply.ok, reply.message
    assert reply.result["sandboxed"] is True and reply.result["pid"] != worker.pid


def test_two_versions_of_model_new_load_in_the_same_worker(worker, tmp_path):
    ws = write_workspace(tmp_path / "ws", HONEST_CANDIDATE + "VERSION = 1\n")
    first = worker.call("load", {"workspace": str(ws.root)}, timeout=60)
    again = worker.call("load", {"workspace": str(ws.root)}, timeout=60)
    ws.model_new_path.write_text(HONEST_CANDIDATE + "VERSION = 2\n")
    second = worker.call("load", {"workspace": str(ws.root)}, timeout=60)

    assert first.ok and again.ok and second.ok
    assert first.result["worker_pid"] == second.result["worker_pid"], "a new version must not restart the worker"
    assert again.result["pid"] == first.result["pid"], "an unchanged candidate keeps its sandbox"
    assert second.result["pid"] != first.result["pid"], "a changed model_new.py gets a fresh sandbox"


def test_a_load_error_names_the_exception(worker, tmp_path):
    ws = write_workspace(tmp_path / "ws", "import no_such_module_for_kernelpilot\n")
    reply = worker.call("load", {"workspace": str(ws.root)}, timeout=60)
    assert (reply.ok, reply.error_kind) == (False, "load")
    assert reply.message == "model_new.py raised ModuleNotFoundError: No module named 'no_such_module_for_kernelpilot'"


def test_a_candidate_raising_in_forward_is_a_runtime_error_and_the_worker_stays(worker, tmp_path):
    raising = HONEST_CANDIDATE + """
    def forward(self, x):
        raise ValueError("boom in forward")
"""
    ws = write_workspace(tmp_path / "ws", raising)
    pid = worker.start()["pid"]
    reply = worker.call("verify", {"workspace": str(ws.root), "trials": 2}, timeout=120)
    assert reply.ok, reply.message
    assert reply.result["ok"] is False
    assert reply.result["error_kind"] == "runtime"
    assert "ValueError: boom in forward" in reply.result["message"]
    assert worker.pid == pid


FLOAT32_PROBLEM = """
import torch
from torch import nn


def tf32_switches():
    on = [torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
          torch.get_float32_matmul_precision() != "highest"]
    return float(sum(2**i for i, switch in enumerate(on) if switch))


class Model(nn.Module):
    def forward(self, x):
        return x + tf32_switches()  # the switches of the process computing it


def get_inputs():
    return [torch.randn(4, 8)]


def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("candidate, computed_in", [
    ("from model import Model\n\nclass ModelNew(Model):\n    pass\n", "the candidate's sandbox and the worker agree"),
    ("from torch import nn\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x.clone()\n",
     "the reference: no TF32 switch on in the worker"),
])  # fmt: skip
def test_float32_problems_are_computed_with_every_tf32_switch_off(worker, tmp_path, candidate, computed_in):
    """torch turns TF32 on for float32 cuDNN convolutions by default; the judge's processes turn it off."""
    ws = write_workspace(tmp_path / "ws", candidate)
    (ws.root / "model.py").write_text(FLOAT32_PROBLEM)
    reply = worker.call("verify", {"workspace": str(ws.root), "trials": 1}, timeout=120)
    assert reply.ok, reply.message
    trials = reply.result["trials"]
    assert trials and all(trial["max_abs_error"] == 0.0 for trial in trials), (computed_in, trials)


def test_tf32_is_allowed_only_when_the_user_asks():
    from kernelpilot.harness.float32 import tf32_allowed

    assert not tf32_allowed({}) and not tf32_allowed({"KERNELPILOT_ALLOW_TF32": "0"})
    assert tf32_allowed({"KERNELPILOT_ALLOW_TF32": "1"}) and tf32_allowed({"KERNELPILOT_ALLOW_TF32": "yes"})


def test_an_unknown_request_is_an_error_reply_not_a_crash(worker):
    pid = worker.start()["pid"]
    reply = worker.call("no-such-op", {}, timeout=10)
    assert (reply.ok, reply.error_kind) == (False, "runtime")
    assert worker.pid == pid


def test_close_stops_the_worker(tmp_path):
    worker = Worker("cpu", log_path=tmp_path / "worker.log")
    pid = worker.start()["pid"]
    worker.close()
    assert not worker.running
    assert not is_alive(pid)
    assert (tmp_path / "worker.log").exists(), "a log the caller named is kept"


def test_a_killed_worker_leaves_no_sandbox_folder_behind(tmp_path, monkeypatch):
    """A worker killed at once (a step past its time, or close with no grace) cannot clean up after itself: the
    folder its sandboxes write in is the caller's to remove."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)
    worker = Worker("cpu", log_path=tmp_path / "worker.log")
    worker.start()
    assert [p.name for p in scratch.iterdir() if p.name.startswith("kernelpilot-sandboxes-")], "the worker's folder"
    worker.close(grace_s=0)
    assert not worker.running
    assert [p.name for p in scratch.iterdir()] == []


@pytest.mark.slow
def test_a_sandbox_is_killed_at_close_while_a_worker_exits_in_order(tmp_path):
    import signal

    from kernelpilot.harness.sandbox_client import Sandbox

    # An orderly exit of a process with torch loaded took about a second of every turn (bench_turn's "sandbox:
    # close"); a sandbox holds nothing to save, so it is killed.
    sandbox = Sandbox("cpu", log_dir=tmp_path)
    assert sandbox.start()["ok"]
    process = sandbox._worker._proc
    sandbox.close()
    assert process.returncode == -signal.SIGKILL and sandbox.pid is None

    worker = Worker("cpu", log_path=tmp_path / "worker.log")
    worker.start()
    process = worker._proc
    worker.close()
    assert process.returncode == 0, "the judge's worker ends in order (its own sandboxes and logs)"


def test_error_kinds_and_exit_descriptions():
    assert classify(None, "RuntimeError: CUDA out of memory. Tried to allocate 80.00 GiB") == "oom"
    assert classify(None, "RuntimeError: CUDA error: an illegal memory access was encountered") == "cuda-error"
    assert classify(None, "RuntimeError: CUDA error: device-side assert triggered") == "cuda-error"
    assert classify(None, "ValueError: shapes do not match") == "runtime"
    assert describe_exit(-6) == "killed by SIGABRT"
    assert describe_exit(3) == "exit code 3"


# ------------------------------------------------------------------------------------ candidate loading


def test_candidate_sees_its_own_model_and_leaves_nothing_behind(tmp_path):
    ws_a = write_workspace(tmp_path / "a", HONEST_CANDIDATE, tag="a")
    ws_b = write_workspace(tmp_path / "b", HONEST_CANDIDATE, tag="b")
    unrelated = types.ModuleType("model")
    sys.modules["model"] = unrelated
    path_before = list(sys.path)
    try:
        cls_a = load_candidate(ws_a, None)
        cls_b = load_candidate(ws_b, None)
    finally:
        restored = sys.modules.pop("model")

    assert (cls_a.tag, cls_b.tag) == ("a", "b"), "each candidate imports its own workspace's model.py"
    assert cls_a.__module__ != cls_b.__module__
    assert restored is unrelated, "a module the workspace shadowed is put back"
    assert sys.path == path_before
    assert "model_new" not in sys.modules


def test_candidate_load_errors_are_one_sentence(tmp_path):
    with pytest.raises(CandidateError, match=r"^model_new.py raised ZeroDivisionError: division by zero$"):
        load_candidate(write_workspace(tmp_path / "raises", "1 / 0\n"), None)
    with pytest.raises(CandidateError, match="defines no class ModelNew"):
        load_candidate(write_workspace(tmp_path / "empty", "x = 1\n"), None)
    unbuilt = write_workspace(tmp_path / "unbuilt", HONEST_CANDIDATE)
    (unbuilt.kernels_dir).mkdir()
    (unbuilt.kernels_dir / "k.cu").write_text("")
    with pytest.raises(CandidateError, match="has kernel sources but no build"):
        load_candidate(unbuilt, None)


def test_candidate_model_gets_the_reference_weights(tmp_path):
    from kernelpilot.problem import load_problem

    ws = write_workspace(tmp_path / "ws", HONEST_CANDIDATE)
    problem = load_problem(ws.model_path)
    model = make_candidate_model(problem, load_candidate(ws, None), "cpu")
    assert not model.training
    assert model.scale.shape == (8,)

    extra_parameter = HONEST_CANDIDATE + """
    def __init__(self, features=8):
        super().__init__(features)
        self.extra = __import__("torch").nn.Linear(2, 2)
"""
    with pytest.raises(CandidateError, match=r"parameters do not match Model's.*extra"):
        make_candidate_model(problem, load_candidate(write_workspace(tmp_path / "extra", extra_parameter), None), "cpu")


# ------------------------------------------------------------------------------------------ the trust boundary

DAEMON_CANDIDATE = """
import os, time
if os.fork() == 0:
    os.setsid()
    daemon = os.fork()
    if daemon == 0:  # the grandchild: a daemon out of the sandbox's process group
        time.sleep(600)
        os._exit(0)
    with open("{pid_file}", "w") as out:  # by its parent, before the candidate's import goes on (os.wait below)
        out.write(str(daemon))
    os._exit(0)
os.wait()
from model import Model


class ModelNew(Model):
    pass
"""


def test_a_daemon_the_candidate_forks_does_not_outlive_the_step(worker, tmp_path):
    pid_file = Path(f"/dev/shm/kernelpilot-test-daemon-{os.getpid()}-{tmp_path.name}.pid")  # /dev stays writable
    ws = write_workspace(tmp_path / "ws", DAEMON_CANDIDATE.format(pid_file=pid_file))
    try:
        reply = worker.call("load", {"workspace": str(ws.root)}, timeout=60)
        assert reply.ok, reply.message
        daemon = int(pid_file.read_text())  # written before the load went on, however late the daemon runs
    finally:
        pid_file.unlink(missing_ok=True)
    assert not is_alive(daemon), "a process the candidate started outlived the step that loaded it"


@pytest.mark.skipif("not landlock_available()", reason="this kernel has no Landlock: sandboxes run unconfined here")
def test_a_candidate_cannot_write_outside_its_sandbox(worker, tmp_path):
    target = tmp_path / "written-by-the-candidate.pth"
    writer = f"open({str(target)!r}, 'w').write('import evil')\n" + HONEST_CANDIDATE
    ws = write_workspace(tmp_path / "ws", writer)
    reply = worker.call("load", {"workspace": str(ws.root)}, timeout=60)
    assert (reply.ok, reply.error_kind) == (False, "load")
    assert "PermissionError" in reply.message
    assert not target.exists()


def test_the_sandbox_environment_keeps_the_toolchain_and_drops_credentials(tmp_path):
    from kernelpilot.harness.process import sandbox_environment

    env = {"PATH": "/usr/bin", "CUDA_HOME": "/usr/local/cuda", "OPENAI_API_KEY": "sk-secret", "GITHUB_TOKEN": "t",
           "HOME": "/root", "KERNELPILOT_CACHE_DIR": "/root/.cache/kernelpilot", "AWS_SECRET_ACCESS_KEY": "a"}
    sandboxed = sandbox_environment(env, tmp_path)
    assert sandboxed["PATH"] == "/usr/bin" and sandboxed["CUDA_HOME"] == "/usr/local/cuda"
    assert not {"OPENAI_API_KEY", "GITHUB_TOKEN", "AWS_SECRET_ACCESS_KEY"} & set(sandboxed)
    for name in ("HOME", "KERNELPILOT_CACHE_DIR", "TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert Path(sandboxed[name]).is_relative_to(tmp_path), name
    # On a GPU torch.compile compiles in the sandbox itself: worker processes started under the confinement cannot
    # use CUDA. On the CPU inductor keeps its own choice.
    assert sandboxed["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    assert "TORCHINDUCTOR_COMPILE_THREADS" not in sandbox_environment(env, tmp_path, cuda=False)


def test_a_cpu_sandbox_takes_the_vector_isa_the_judge_checked(tmp_path):
    """Inductor checks each vector ISA by compiling a test library in its cache, and a sandbox's cache starts empty:
    the judge checks once and tells CPU sandboxes the answer, which is the answer they would have found."""
    import platform

    from torch._inductor import cpu_vec_isa

    from kernelpilot.harness.process import VEC_ISA_OK_ENV, sandbox_environment

    env = {"PATH": "/usr/bin"}
    flagged = [isa for isa in cpu_vec_isa.supported_vec_isa_list
               if all(flag in cpu_vec_isa.x86_isa_checker() for flag in str(isa).split())]  # fmt: skip
    every_one_builds = platform.machine() == "x86_64" and bool(flagged) and cpu_vec_isa.valid_vec_isa_list() == flagged
    assert sandbox_environment(env, tmp_path, cuda=False).get(VEC_ISA_OK_ENV) == ("1" if every_one_builds else None)
    assert VEC_ISA_OK_ENV not in sandbox_environment(env, tmp_path), "a GPU sandbox is left to inductor as before"
    assert sandbox_environment({**env, VEC_ISA_OK_ENV: "0"}, tmp_path, cuda=False)[VEC_ISA_OK_ENV] == "0"


def test_verify_reports_where_the_candidates_load_went(worker, tmp_path):
    """The turn's cost breakdown: the wait for a spare sandbox and the candidate's load, with the sandbox's own
    split of the load (the problem file, the model), in the verification's phases."""
    ws = write_workspace(tmp_path / "ws", HONEST_CANDIDATE)
    reply = worker.call("verify", {"workspace": str(ws.root), "trials": 1}, timeout=120)
    assert reply.ok, reply.message  # (the verdict itself does not matter here: the candidate uses torch ops)
    phases = reply.result["phases"]
    for name in ("sandbox: spare ready", "sandbox: load candidate", "sandbox: load problem", "sandbox: load model"):
        assert phases[name] >= 0, name
    assert phases["sandbox: load model"] <= phases["sandbox: load candidate"]


SLOW_RAW_CANDIDATE = """
import ctypes
import time

import torch
from model import Model


def floats(t):
    return (ctypes.c_float * t.numel()).from_address(t.data_ptr())


class ModelNew(Model):
    def forward(self, x):  # x * scale through the tensors' memory (no torch compute), 150 ms a call
        time.sleep(0.15)
        out, scale = torch.empty_like(x), self.scale.detach()
        xs, ss, os_ = floats(x), floats(scale), floats(out)
        for i in range(x.numel()):
            os_[i] = xs[i] * ss[i % scale.numel()]
        return out
"""


def test_verify_with_a_time_to_beat_stops_a_far_slower_candidate_after_two_trials(worker, tmp_path):
    ws = write_workspace(tmp_path / "ws", SLOW_RAW_CANDIDATE)
    stopped = worker.call("verify", {"workspace": str(ws.root), "trials": 5, "slower_than_ms": 1.0}, timeout=120)
    assert stopped.ok, stopped.message
    # (This folder is no real workspace, so the protected-files guard fails too, and a guard outranks "slower".)
    assert [trial["ok"] for trial in stopped.result["trials"]] == [True, True]
    assert "stopped after 2 trials: a call took" in stopped.result["message"]
    unbounded = worker.call("verify", {"workspace": str(ws.root), "trials": 3}, timeout=120)
    assert [trial["ok"] for trial in unbounded.result["trials"]] == [True, True, True]
