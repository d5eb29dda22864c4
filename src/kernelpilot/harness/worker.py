"""The only process where GPU code runs: a long-lived worker subprocess, requests in, results out.

`Worker` (the caller's side) starts `python -m kernelpilot.harness.worker` in a process group of its own and speaks
JSON lines with it over two dedicated pipes; the worker's stdout and stderr go to a log file, so kernels' printf
and torch's warnings cannot corrupt a reply. Every request has a timeout: on expiry the whole group (the worker and
any ninja/nvcc it started) is killed. A worker that dies (abort, segfault, OOM kill) is reported as a crash with its
exit status and the tail of its log. Either way the next request starts a fresh worker.

The worker's side (`serve`) imports torch once and keeps it, caches problems by (path, problem id) and loaded
candidates by (workspace, library, model_new.py content), and runs one step per request: ping, build, load,
verify, bench. A CUDA error leaves the CUDA context unusable, so after replying to one the worker exits and the
next request gets a fresh one; an out-of-memory error only empties the allocator's cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import hashlib
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kernelpilot import errors
from kernelpilot.errors import KernelpilotError

MAX_REPLY_BYTES = 64 << 20
STARTUP_TIMEOUT_S = 180.0  # importing torch on a cold disk can take a minute
LOG_TAIL_LINES = 25


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

    def close(self) -> None:
        """Stop the worker (closing its request pipe lets it exit; the group is killed if it lingers)."""
        if self._proc is not None:
            _close_fd(self._requests_fd)
            self._requests_fd = -1
            try:
                self._proc.wait(timeout=5)
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
                child_env = sandbox_environment(child_env, self.log_path.with_suffix(".home"))
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
        self._finalizer = weakref.finalize(self, _kill_group, self._proc)

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
        self._proc = None
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
                                "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHONHASHSEED"})  # fmt: skip
_SANDBOX_ENV_PREFIXES = ("CUDA", "NVIDIA", "TORCH_CUDA", "PYTORCH_CUDA", "CUBLAS", "CUDNN", "LC_", "OMP_", "MKL_")


def sandbox_environment(env: dict[str, str], private_dir: Path) -> dict[str, str]:
    """A sandbox's environment: toolchain and device settings only, every cache and temp folder its own (under
    `private_dir`), and the folders it may write (its own and the judge's shared-tensor folder)."""
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
    return kept


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


def classify_error(message: str, exc: BaseException | None = None) -> str:
    """"oom", "cuda-error" or "runtime" for an exception (or its message): `failures.classify`."""
    from kernelpilot.harness.failures import classify

    return classify(exc, message)


# ------------------------------------------------------------------------------------------- worker side


class WorkerState:
    """What a worker keeps between requests: its device, loaded problems, and sandboxes.

    The worker is the judge's trusted side: it never imports candidate code. A candidate is loaded in a fresh
    sandbox process, kept for the steps of one evaluation of the same sources (verify, then bench) and closed
    when another candidate comes. The reference's eager and compiled forms have clean sandboxes of their own.
    """

    MAX_CLEAN = 2  # problems whose clean reference sandboxes stay warm

    def __init__(self, device: str):
        from kernelpilot.harness.sandbox_client import SandboxPool
        from kernelpilot.harness.shared import SHARED_DIR_ENV

        self.device = device
        self.problems: dict[tuple[str, str], Any] = {}
        self.log_dir = Path(tempfile.mkdtemp(prefix="kernelpilot-sandboxes-"))
        shared = self.log_dir / "shared"
        shared.mkdir()
        os.environ[SHARED_DIR_ENV] = str(shared)  # SharedArena's files (CPU) go here, the one folder sandboxes share
        self.pool = SandboxPool(device, self.log_dir)
        self.clean: OrderedDict[tuple[str, str], CleanSandboxes] = OrderedDict()
        self._candidate: tuple[tuple, Any] | None = None

    def problem(self, path: Path) -> Any:
        from kernelpilot.problem import load_problem, problem_id_of

        key = (str(path.resolve()), problem_id_of(path.read_text(encoding="utf-8")))
        if key not in self.problems:
            self.problems[key] = load_problem(path)
        return self.problems[key]

    def clean_models(self, problem_path: Path, problem: Any) -> CleanSandboxes:
        key = (str(problem_path.resolve()), problem.problem_id)
        if key not in self.clean:
            self.clean[key] = CleanSandboxes(self.pool, problem_path)
            while len(self.clean) > self.MAX_CLEAN:
                self.clean.popitem(last=False)[1].close()
        self.clean.move_to_end(key)
        return self.clean[key]

    def sandbox(self, ws: Any, build: Any, *, seed: int | None, timeout: float) -> Any:
        """The candidate's sandbox: the one verify left when the sources are the same (and `seed` is None or
        its own), else a fresh one loaded with the candidate's weights drawn under `seed`."""
        from kernelpilot.harness.verify import random_seed

        library = build.library if build is not None and build.ok else None
        sources = hashlib.sha256(Path(ws.model_new_path).read_bytes()).hexdigest()
        key = (str(ws.root), library, sources)
        if self._candidate is not None:
            (old_key, old_seed), sandbox = self._candidate
            if old_key == key and seed in (None, old_seed) and sandbox.pid is not None:
                return sandbox
            sandbox.close()
            self._candidate = None
        seed = random_seed() if seed is None else seed
        sandbox = self.pool.take()
        sandbox.load("candidate", Path(ws.model_path), seed=seed, timeout=timeout, workspace=Path(ws.root),
                     library=library)  # fmt: skip
        sandbox.seed = seed
        self._candidate = ((key, seed), sandbox)
        return sandbox

    def kill_orphans(self) -> list[int]:
        """Kill the processes a candidate left behind (daemons that left its sandbox's group)."""
        from kernelpilot.harness.orphans import kill_orphans

        return kill_orphans({pid for pid in self.pool.pids() if pid is not None})

    def done_with_candidate(self) -> None:
        if self._candidate is not None:
            self._candidate[1].close()
            self._candidate = None

    def close(self) -> None:
        self.done_with_candidate()
        for clean in self.clean.values():
            clean.close()
        self.pool.close()
        shutil.rmtree(self.log_dir, ignore_errors=True)


class CleanSandboxes:
    """The reference in eager and compiled form, each in a process where no candidate code ever ran."""

    def __init__(self, pool: Any, problem_path: Path):
        self.pool, self.problem_path = pool, problem_path
        self._models: dict[str, Any] = {}

    def eager(self) -> Any:
        return self._get("eager")

    def compiled(self) -> Any:
        return self._get("compile")

    def _get(self, mode: str) -> Any:
        model = self._models.get(mode)
        if model is None or not model.hello.get("ok") or model.pid is None:
            model = self.pool.take()
            model.load(mode, self.problem_path, seed=0, timeout=600.0)
            self._models[mode] = model
        return model

    def close(self) -> None:
        for model in self._models.values():
            model.close()
        self._models.clear()


def _workspace_and_build(args: dict) -> tuple[Any, Any]:
    from kernelpilot.results import BuildResult, from_dict
    from kernelpilot.workspace import Workspace

    build = from_dict(BuildResult, args["build"]) if args.get("build") else None
    return Workspace(Path(args["workspace"])), build


def op_ping(state: WorkerState, args: dict) -> dict:
    """Who this worker is: pid, torch, CUDA, GPU name."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "pid": os.getpid(),
        "device": state.device,
        "torch": torch.__version__,
        "cuda_available": cuda,
        "device_count": torch.cuda.device_count() if cuda else 0,
        "gpu_name": torch.cuda.get_device_name() if cuda and state.device.startswith("cuda") else None,
    }


def op_build(state: WorkerState, args: dict) -> dict:
    """Build the workspace's extension (ninja runs in this process group, so a timeout kills it too)."""
    from kernelpilot.build import build_workspace
    from kernelpilot.results import to_dict

    return to_dict(build_workspace(Path(args["workspace"]), arch=args.get("arch"), jobs=args.get("jobs")))


def op_load(state: WorkerState, args: dict) -> dict:
    """Load the candidate in a sandbox and say whether it loaded (a cheap check that model_new.py imports)."""
    from kernelpilot.harness.candidate import CandidateError

    ws, build = _workspace_and_build(args)
    hello = dict(state.sandbox(ws, build, seed=None, timeout=args.get("timeout", 120.0)).hello)
    if not hello.get("ok"):
        state.done_with_candidate()
        error = CandidateError(hello.get("message") or "the candidate could not be loaded", hello.get("hint"))
        error.kind = hello.get("error_kind") or "load"
        raise error
    return {"pid": hello.get("pid"), "worker_pid": os.getpid(), "sandboxed": True}


def op_verify(state: WorkerState, args: dict) -> dict:
    """Correctness trials and guards of the workspace's candidate (in its sandbox) against its model.py."""
    from kernelpilot.harness.sandbox_client import Deadline
    from kernelpilot.harness.verify import random_seed, verify_candidate
    from kernelpilot.results import to_dict

    ws, build = _workspace_and_build(args)
    problem = state.problem(ws.model_path)
    seed = args["base_seed"] if args.get("base_seed") is not None else random_seed()
    deadline = Deadline(args.get("timeout", 600.0))
    _release_cached_memory()  # an earlier step's cached blocks: the sandbox's outputs need the device's memory
    sandbox = state.sandbox(ws, build, seed=seed, timeout=deadline.left())
    result = verify_candidate(problem, sandbox, device=state.device, trials=args.get("trials", 5), base_seed=seed,
                              atol=args.get("atol", 1e-2), rtol=args.get("rtol", 1e-2), workspace=ws.root,
                              library=build.library if build is not None and build.ok else None,
                              timeout=deadline.left())  # fmt: skip
    if not result.ok:
        state.done_with_candidate()
    return to_dict(result)


def op_bench(state: WorkerState, args: dict) -> dict:
    """Times of the candidate (in its sandbox), eager and torch.compile, speedups and % of speed-of-light."""
    from kernelpilot.harness.bench import bench_candidate
    from kernelpilot.harness.sandbox_client import Deadline
    from kernelpilot.results import BenchResult, to_dict

    ws, build = _workspace_and_build(args)
    problem = state.problem(ws.model_path)
    deadline = Deadline(args.get("timeout", 600.0))
    _release_cached_memory()  # what verification left cached: the sandboxes' outputs need the device's memory
    try:
        sandbox = state.sandbox(ws, build, seed=None, timeout=deadline.left())
        if not sandbox.hello.get("ok"):
            hello = sandbox.hello
            return to_dict(BenchResult(ok=False, error_kind=hello.get("error_kind") or "load", message=hello.get("message", "")))
        result = bench_candidate(
            problem,
            sandbox,
            state.clean_models(Path(ws.model_path), problem),
            device=state.device,
            seed=sandbox.seed,
            cache_dir=Path(args["cache_dir"]) if args.get("cache_dir") else None,
            min_runs=args.get("min_runs", 20),
            atol=args.get("atol", 1e-2),
            rtol=args.get("rtol", 1e-2),
            timeout=deadline.left(),
        )
    finally:
        state.done_with_candidate()  # a candidate's sandbox lives for one evaluation
    return to_dict(result)


OPS: dict[str, Callable[[WorkerState, dict], dict]] = {
    "ping": op_ping,
    "build": op_build,
    "load": op_load,
    "verify": op_verify,
    "bench": op_bench,
}


def handle(state: WorkerState, request: dict) -> dict:
    """Run one request and build its reply; `exiting` is set when the CUDA context can no longer be trusted."""
    from kernelpilot.harness.candidate import CandidateError

    op = OPS.get(request.get("op", ""))
    if op is None:
        return {"ok": False, "error_kind": "runtime", "message": f"unknown request {request.get('op')!r}"}
    try:
        reply = {"ok": True, "result": op(state, request.get("args", {}))}
    except CandidateError as err:
        # The candidate's own failure, in its sandbox: whatever its kind, this process is unharmed.
        reply = {"ok": False, "error_kind": getattr(err, "kind", "load"), "message": err.message, "hint": err.hint,
                 "in_sandbox": True}  # fmt: skip
    except KernelpilotError as err:
        reply = {"ok": False, "error_kind": "user", "message": err.message, "hint": err.hint,
                 "error_class": type(err).__name__}  # fmt: skip
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - whatever the candidate raises becomes a reply
        message = _describe_exception(exc)
        reply = {"ok": False, "error_kind": classify_error(message, exc), "message": message}
    _refine_result_error_kind(reply)
    if request.get("op") != "build":  # (a build's own processes have ended with it)
        state.kill_orphans()
    return _after_errors(state, reply)


def _refine_result_error_kind(reply: dict) -> None:
    """Name OOM and CUDA errors in a step's own result, which may call them "runtime" or "crash"."""
    result = reply.get("result")
    if isinstance(result, dict) and result.get("error_kind") in ("runtime", "crash"):
        refined = classify_error(result.get("message") or "")
        if refined != "runtime":
            result["error_kind"] = refined


def _after_errors(state: WorkerState, reply: dict) -> dict:
    """Free memory after an OOM; after a CUDA error, or a context that fails a sync, mark the worker as exiting."""
    result = reply.get("result") or {}
    # A step's result may name the candidate's CUDA error: that broke the candidate's sandbox, not this process.
    kinds = set() if reply.get("in_sandbox") else {reply.get("error_kind")}
    if "oom" in kinds:
        _release_cached_memory()
    if kinds & {"cuda-error", "crash"}:
        reply["exiting"] = True
        return reply
    sync_error = _cuda_sync_error(state.device)
    if sync_error is None:
        return reply
    # The step returned, but a kernel it launched broke the context (e.g. an out-of-bounds write seen only now).
    earlier = f" (the step itself reported: {result['message']})" if result.get("message") else ""
    return {"ok": False, "error_kind": "cuda-error", "message": sync_error + earlier, "exiting": True}


def _cuda_sync_error(device: str) -> str | None:
    """The error a device-wide sync raises, or None when the CUDA context is healthy (always None on CPU)."""
    if not device.startswith("cuda"):
        return None
    import torch

    try:
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - any failure here means the context is poisoned
        return _describe_exception(exc)
    return None


def _release_cached_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _describe_exception(exc: BaseException) -> str:
    """`Type: message (at model_new.py:12 in forward)`: the innermost frame outside torch and kernelpilot."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0][:500]}" if lines else type(exc).__name__
    if "CUDA" in text and len(lines) > 1:
        text += " " + " ".join(line.strip() for line in lines[1:4])
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_frame(f.filename)]
    if frames:
        frame = frames[-1]
        text += f" (at {Path(frame.filename).name}:{frame.lineno} in {frame.name})"
    return text


def _is_user_frame(filename: str) -> bool:
    """A frame in the candidate's code: not in kernelpilot, the standard library or installed packages."""
    import sysconfig

    library_dirs = {Path(__file__).resolve().parents[1]}
    library_dirs |= {Path(sysconfig.get_paths()[key]).resolve() for key in ("stdlib", "purelib", "platlib")}
    path = Path(filename).resolve()
    return not any(path.is_relative_to(d) for d in library_dirs)


def serve(device: str, requests_fd: int, replies_fd: int) -> None:
    """The worker's loop: hello, then one reply per request line until the request pipe closes."""
    import torch  # noqa: F401 - imported once here, so no request pays for it

    from kernelpilot.harness.orphans import become_subreaper

    _not_dumpable()
    become_subreaper()
    state = WorkerState(device)
    try:
        with os.fdopen(requests_fd, "r", encoding="utf-8") as requests, os.fdopen(replies_fd, "w", encoding="utf-8") as replies:
            _write_line(replies, op_ping(state, {}))
            for line in requests:
                request = json.loads(line)
                reply = handle(state, request)
                reply["id"] = request.get("id")
                _write_line(replies, reply)
                if reply.get("exiting"):
                    # The CUDA context is unusable and its teardown may hang: leave without it.
                    state.close()
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(3)
    finally:
        state.close()


def _not_dumpable() -> None:
    """No other process of this user may read this one's memory (ptrace, /proc/PID/mem): the sandboxes run as
    the same user, and this process holds the reference outputs and the signing key."""
    if os.environ.get("KERNELPILOT_DUMPABLE"):
        return
    try:
        import ctypes

        pr_set_dumpable = 4
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_dumpable, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _write_line(stream: Any, data: dict) -> None:
    stream.write(json.dumps(data, default=str) + "\n")
    stream.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="kernelpilot GPU worker (started by kernelpilot, not by hand)")
    parser.add_argument("--device", required=True)
    parser.add_argument("--requests-fd", type=int, required=True)
    parser.add_argument("--replies-fd", type=int, required=True)
    args = parser.parse_args(argv)
    serve(args.device, args.requests_fd, args.replies_fd)


if __name__ == "__main__":
    main()
