"""The caller's side of a child process that speaks JSON lines: the judge's worker, or a sandbox.

`Worker` starts `python -m MODULE` (by default the judge's worker, `kernelpilot.harness.worker`) in a process group
of its own and speaks JSON lines with it over two dedicated pipes; the child's stdout and stderr go to a log file,
so kernels' printf and torch's warnings cannot corrupt a reply. Every request has a timeout: on expiry the whole
group (the child and any ninja/nvcc it started) is killed. A child that dies (abort, segfault, OOM kill) is reported
as a crash with its exit status and the tail of its log. Either way the next request starts a fresh child.

A sandboxed child (`sandboxed=True`) gets `sandbox_environment`: the toolchain's variables only, and private folders.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelpilot import errors
from kernelpilot.errors import KernelpilotError

MAX_REPLY_BYTES = 64 << 20
STARTUP_TIMEOUT_S = 180.0  # importing torch on a cold disk can take a minute
LOG_TAIL_LINES = 25
# The folder a worker process keeps its sandboxes' homes and logs in: made by the caller before the start and
# removed by it after the end, since a worker killed mid-step cannot clean up.
SCRATCH_ENV = "KERNELPILOT_WORKER_SCRATCH"


class WorkerStartError(KernelpilotError):
    """The worker process could not start (torch or kernelpilot not importable in it, ...)."""


@dataclass
class Reply:
    """What came back for one request: the step's result as a plain dict, or why there is none."""

    ok: bool
    result: dict | None = None
    # None | "timeout" | "crash" | "cuda-error" | "oom" | "load" | "runtime" | "user"
    error_kind: str | None = None
    message: str = ""
    hint: str | None = None
    error_class: str | None = None  # for "user": the KernelpilotError subclass the worker raised
    seconds: float = 0.0

    def raise_user_error(self) -> None:
        """Re-raise a user error (missing toolchain, not a workspace, ...) from the worker in the caller."""
        if self.error_kind == "user":
            cls = getattr(errors, self.error_class or "", None)
            if not (isinstance(cls, type) and issubclass(cls, KernelpilotError)):
                cls = KernelpilotError
            raise cls(self.message, self.hint)


# ------------------------------------------------------------------------------------------- caller side


class Worker:
    """A worker subprocess for one device, started on first use and restarted after a timeout or crash."""

    def __init__(
        self,
        device: str = "cuda",
        *,
        log_path: Path | None = None,
        module: str = "kernelpilot.harness.worker",
        module_args: list[str] | None = None,
        sandboxed: bool = False,
    ):
        self.device = device
        self.module, self.module_args, self.sandboxed = module, list(module_args or []), sandboxed
        self.startup_timeout_s = STARTUP_TIMEOUT_S
        self._own_log_dir = None if log_path else tempfile.TemporaryDirectory(prefix="kernelpilot-worker-")
        self.log_path = Path(log_path) if log_path else Path(self._own_log_dir.name) / "worker.log"
        self.info: dict[str, Any] = {}  # the running worker's hello: pid, torch version, GPU name, ...
        self._proc: subprocess.Popen | None = None
        self._requests_fd = -1
        self._replies_fd = -1
        self._buffer = b""
        self._log_offset = 0
        self._next_id = 0
        self._finalizer: weakref.finalize | None = None
        self._scratch: Path | None = None  # the running process's folder for its sandboxes (SCRATCH_ENV)

    # -- public

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running else None

    def start(self) -> dict[str, Any]:
        """Start the worker if it is not running and return its hello (pid, torch version, CUDA, GPU name)."""
        if not self.running:
            self._discard()
            self._spawn()
        if not self.info:
            self._await_hello()
        return self.info

    def launch(self) -> None:
        """Start the process without waiting for its hello (a spare warming up); `start` waits for it."""
        if not self.running:
            self._discard()
            self._spawn()

    def call(self, op: str, args: dict | None = None, *, timeout: float) -> Reply:
        """Run `op` in the worker; a hang past `timeout` seconds or a dead worker comes back as a failed Reply."""
        self.start()
        self._next_id += 1
        request = {"id": self._next_id, "op": op, "args": args or {}}
        started = time.monotonic()
        try:
            self._send(request)
            raw = self._receive(deadline=started + timeout)
        except _WorkerDied:
            return self._crash_reply(op, started)
        except TimeoutError:
            self._kill()
            return Reply(
                ok=False,
                error_kind="timeout",
                message=f"{op} did not finish within {timeout:g} s; the worker was killed and will restart.",
                seconds=time.monotonic() - started,
            )
        except BaseException:
            self._kill()  # interrupted mid-request: the worker's next reply would answer the wrong request
            raise
        reply = dataclasses.replace(_reply_from(raw), seconds=time.monotonic() - started)
        if raw.get("exiting"):
            self._reap()
        return reply

    def close(self, *, grace_s: float = 5.0) -> None:
        """Stop the worker: closing its request pipe lets it exit, and its group is killed if it lingers past
        `grace_s` (0: killed at once, for a process that holds nothing worth an orderly exit)."""
        if self._proc is not None and grace_s > 0:
            _close_fd(self._requests_fd)
            self._requests_fd = -1
            try:
                self._proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self._kill()
        if self._own_log_dir is not None:
            self._own_log_dir.cleanup()
            self._own_log_dir = None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines the current (or last) worker process wrote to its log."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- process lifecycle

    def _spawn(self) -> None:
        requests_read, self._requests_fd = os.pipe()
        self._replies_fd, replies_write = os.pipe()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_offset = log.tell()
            child_env, child_device = _child_environment(self.device)
            if self.sandboxed:  # a home of its own, beside its log
                child_env = sandbox_environment(child_env, self.log_path.with_suffix(".home"),
                                                cuda=child_device != "cpu")  # fmt: skip
            else:
                self._scratch = Path(tempfile.mkdtemp(prefix="kernelpilot-sandboxes-"))
                child_env[SCRATCH_ENV] = str(self._scratch)
            command = [sys.executable, "-m", self.module, "--device", child_device, *self.module_args,
                       "--requests-fd", str(requests_read), "--replies-fd", str(replies_write)]  # fmt: skip
            self._proc = subprocess.Popen(
                command,
                pass_fds=(requests_read, replies_write),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so a kill reaches ninja/nvcc children too
                env=child_env,
            )
        os.close(requests_read)
        os.close(replies_write)
        self._finalizer = weakref.finalize(self, _end, self._proc, self._scratch)

    def _await_hello(self) -> None:
        try:
            self.info = self._receive(deadline=time.monotonic() + self.startup_timeout_s)
        except (_WorkerDied, TimeoutError) as exc:
            tail = self.log_tail()
            status = "did not answer in time" if isinstance(exc, TimeoutError) else self._reap()
            self._kill()
            raise WorkerStartError(
                f"the {self.device} {self.module.rsplit('.', 1)[-1]} process did not start ({status}): "
                f"{tail.splitlines()[-1] if tail else 'no output'}",
                hint=f"Check that `{sys.executable} -c 'import torch, kernelpilot'` works.",
            ) from None

    def _send(self, request: dict) -> None:
        data = (json.dumps(request) + "\n").encode()
        try:
            while data:
                data = data[os.write(self._requests_fd, data) :]
        except (BrokenPipeError, OSError):
            raise _WorkerDied from None

    def _receive(self, deadline: float) -> dict:
        """The next JSON line from the worker; TimeoutError at the deadline, _WorkerDied at end of file."""
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            readable, _, _ = select.select([self._replies_fd], [], [], remaining)
            if not readable:
                continue
            chunk = os.read(self._replies_fd, 1 << 16)
            if not chunk or len(self._buffer) > MAX_REPLY_BYTES:  # a reply that size is no reply (a sandbox's flood)
                raise _WorkerDied
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _crash_reply(self, op: str, started: float) -> Reply:
        status = self._reap()
        tail = self.log_tail()
        message = f"the worker died during {op} ({status}); it will restart."
        if tail:
            message += f"\nlast lines of its log ({self.log_path}):\n{tail}"
        return Reply(ok=False, error_kind="crash", message=message, seconds=time.monotonic() - started)

    def _reap(self) -> str:
        """Wait for a worker that is exiting, kill it if it lingers, and describe how it ended."""
        proc = self._proc
        if proc is None:
            return "not running"
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._kill()
        return describe_exit(proc.returncode)

    def _kill(self) -> None:
        if self._proc is not None:
            _kill_group(self._proc)
            if self._finalizer is not None:
                self._finalizer.detach()
        self._discard()

    def _discard(self) -> None:
        for fd in (self._requests_fd, self._replies_fd):
            _close_fd(fd)
        self._requests_fd = self._replies_fd = -1
        self._buffer = b""
        if self._scratch is not None:  # the process is gone (killed, or found dead)
            shutil.rmtree(self._scratch, ignore_errors=True)
        self._proc = self._scratch = None
        self.info = {}


class _WorkerDied(Exception):
    """The worker's reply pipe closed: the process is gone."""


def _reply_from(raw: dict) -> Reply:
    known = {f.name for f in dataclasses.fields(Reply)}
    return Reply(**{k: v for k, v in raw.items() if k in known})


def _child_environment(device: str) -> tuple[dict[str, str], str]:
    """The worker's environment and device: `cuda:N` becomes `cuda` with only GPU N visible to it."""
    env = dict(os.environ)
    source_root = str(Path(__file__).resolve().parents[2])  # so the child imports this very kernelpilot
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a segfault writes the Python stack to the log
    if not device.startswith("cuda:"):
        return env, device
    index = int(device.split(":", 1)[1])
    visible = env.get("CUDA_VISIBLE_DEVICES")
    env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
    return env, "cuda"


# What a sandbox keeps of the judge's environment: the toolchain and device settings, nothing else (no API keys,
# tokens or credentials of the user's, whatever their names).
_SANDBOX_ENV_NAMES = frozenset({"PATH", "LD_LIBRARY_PATH", "LANG", "TZ", "VIRTUAL_ENV", "PYTHONPATH",
                                "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHONHASHSEED",
                                "KERNELPILOT_ALLOW_TF32"})  # fmt: skip
_SANDBOX_ENV_PREFIXES = ("CUDA", "NVIDIA", "TORCH_CUDA", "PYTORCH_CUDA", "CUBLAS", "CUDNN", "LC_", "OMP_", "MKL_")


# Inductor's setting of how many processes compile a graph's kernels (torch._inductor.config.compile_threads).
COMPILE_THREADS_ENV = "TORCHINDUCTOR_COMPILE_THREADS"


def sandbox_environment(env: dict[str, str], private_dir: Path, *, cuda: bool = True) -> dict[str, str]:
    """A sandbox's environment: toolchain and device settings only, every cache and temp folder its own (under
    `private_dir`), and the folders it may write (its own and the judge's shared-tensor folder). `cuda`: the
    sandbox uses a GPU (torch.compile then compiles in the sandbox's own process)."""
    from kernelpilot.harness.confine import WRITABLE_ENV
    from kernelpilot.harness.shared import SHARED_DIR_ENV

    kept = {k: v for k, v in env.items() if k in _SANDBOX_ENV_NAMES or k.startswith(_SANDBOX_ENV_PREFIXES)}
    private_dir.mkdir(parents=True, exist_ok=True)
    for name, sub in (("HOME", ""), ("TMPDIR", "tmp"), ("XDG_CACHE_HOME", "cache"), ("KERNELPILOT_CACHE_DIR", "kp-cache"),
                      ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):  # fmt: skip
        (private_dir / sub).mkdir(parents=True, exist_ok=True)
        kept[name] = str(private_dir / sub)
    writable = [str(private_dir)] + ([env[SHARED_DIR_ENV]] if env.get(SHARED_DIR_ENV) else [])
    kept[WRITABLE_ENV] = os.pathsep.join(writable)
    # On a GPU, torch.compile compiles in this process, not in a pool of worker processes: a process started after
    # the confinement cannot initialise CUDA (the driver's start-up writes outside the allowed folders), and
    # inductor's workers need the device for some kernels, so their jobs failed with "SubprocException" (seen on an
    # H200: KernelBench L2 6, 8 and 96 lost their torch.compile baseline while plain torch.compile ran them). On the
    # CPU the workers need no device, and compiling C++ kernels in parallel is faster.
    if cuda:
        kept[COMPILE_THREADS_ENV] = "1"
    else:
        kept.update(checked_vector_isa(env))
    return kept


VEC_ISA_OK_ENV = "TORCHINDUCTOR_VEC_ISA_OK"  # inductor: take every vector ISA the CPU's flags name as usable


def checked_vector_isa(env: dict[str, str]) -> dict[str, str]:
    """For a CPU sandbox: VEC_ISA_OK_ENV=1 where this (trusted) process found every vector ISA the CPU's flags name
    usable, as inductor checks them (compiling and loading a test library for each, in this process's inductor
    cache, once per machine), so the sandbox's torch.compile picks the same one without checking again. A sandbox's
    inductor cache is its own and starts empty: each one spent about 12 s of its first CPU compile on that check
    (2 cores). The user's own setting is passed on; anything unexpected leaves the sandbox to check for itself."""
    if env.get(VEC_ISA_OK_ENV) in ("0", "1"):
        return {VEC_ISA_OK_ENV: env[VEC_ISA_OK_ENV]}
    return {VEC_ISA_OK_ENV: "1"} if _every_flagged_isa_builds() else {}


@functools.cache  # once per process
def _every_flagged_isa_builds() -> bool:
    import platform

    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False  # elsewhere inductor's list needs no compile check
    try:
        from torch._inductor import cpu_vec_isa

        flags = cpu_vec_isa.x86_isa_checker()
        flagged = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
        return bool(flagged) and cpu_vec_isa.valid_vec_isa_list() == flagged
    except Exception:  # noqa: BLE001 - inductor's internals moved: the sandbox checks for itself, as before
        return False


def _end(proc: subprocess.Popen, scratch: Path | None) -> None:
    """Kill the process's group and remove the folder it was given."""
    _kill_group(proc)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _close_fd(fd: int) -> None:
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


def describe_exit(returncode: int | None) -> str:
    """`killed by SIGABRT` / `exit code 3`, for a process's return code."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class Deadline:
    """The time left for a step that makes several requests."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self, minimum: float = 1.0) -> float:
        return max(self.end - time.monotonic(), minimum)
