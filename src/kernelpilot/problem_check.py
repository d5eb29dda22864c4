"""Load and check a problem file in a child process with a time and a memory limit.

A problem file is Python that kernelpilot has to run (its top level, get_init_inputs(), Model(...), get_inputs()).
Run in the caller's process, a file that loops forever hangs kernelpilot, one that calls os._exit() ends it
silently, a crash takes it down, and a huge input can exhaust the machine. Here the file runs in a child process in
its own process group, with an address-space limit; the parent waits with a timeout and kills the group when it
expires. The child reports back JSON lines on a pipe (the stage it is in, then the problem's size or a ProblemError's
message and hint), never a pickle, so a stage that never reports is still known: the last one it started.

The child reports all the parent needs (the problem's id, its Model's signatures as source text, its size), so the
parent never runs the file itself. A check that passed is kept, in this process and in kernelpilot's cache folder,
under the file's content, the limits, the device and the checking code, and reused: most `init` calls start no child.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import kernelpilot
from kernelpilot.errors import KernelpilotError, ProblemError, ProblemMemoryError
from kernelpilot.harness.cache import load_entry, store_entry
from kernelpilot.problem import (
    EXIT_HINT,
    MEMORY_HINT,
    TRACEBACK_HINT,
    check_source,
    during,
    exit_error,
    load_problem,
    problem_id_of,
    shown_path,
    validated_on_meta,
)
from kernelpilot.problem_signatures import ModelSignatures, model_signatures
from kernelpilot.problem_size import (
    ProblemSize,
    format_bytes,
    host_memory_available,
    host_memory_total,
    measure,
    require_fits,
)

ENV_TIMEOUT = "KERNELPILOT_PROBLEM_TIMEOUT"
ENV_MEMORY = "KERNELPILOT_PROBLEM_MEMORY"
DEFAULT_TIMEOUT_S = 120.0
# The child's own start-up (Python, torch) is not the file's time, and on a busy machine it can take a while.
STARTUP_ALLOWANCE_S = 60.0
# Stages of the child beyond those of problem.py: before the file runs, and the output-size estimate after it.
STARTUP = "kernelpilot's start-up, before the file ran"
FORWARD = "Model.forward() on meta tensors"

_CHILD_COMMAND = "from kernelpilot.problem_check import child_main; child_main()"
_REPORT_LIMIT = 1 << 20  # bytes of JSON read from the child; a size and a message need a few hundred
_OUTPUT_TAIL = 4096  # bytes of the file's own printing kept, for the last line in a hint
# After the child ends, how long its pipes may take to drain: a process the file started outside the child's process
# group may hold them open forever, and what the child itself wrote is in the pipe already.
_DRAIN_S = 2.0
_UNIT_FACTORS = {
    "": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40
}
_CRASH_SIGNALS = {"SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE"}

CACHE_KIND = "problem-check"
# The code a check's report comes from, beside this file; with torch's version file, a part of the cache key, so a
# report made by another kernelpilot or torch (or before an edit to these files) is made again.
_CHECKING_CODE = ("problem.py", "problem_check.py", "problem_size.py", "problem_signatures.py", "host_budget.py")
# The variables that choose which GPU "cuda" is.
_GPU_SELECTION = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
# Reports of the checks that passed in this process, by their cache key.
_passed_checks: dict[str, dict[str, Any]] = {}


@dataclass(frozen=True)
class ProblemLimits:
    """How long the file's code may run while it is loaded (kernelpilot's start-up in the child not counted), and
    how many bytes the child may allocate beyond that start-up."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_bytes: int | None = None  # None: default_memory_bytes()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ProblemLimits:
        """The defaults, with KERNELPILOT_PROBLEM_TIMEOUT (seconds) and KERNELPILOT_PROBLEM_MEMORY (bytes, or with
        a unit: 512MiB, 8GiB, 4G) where they are set."""
        env = os.environ if env is None else env
        timeout = env.get(ENV_TIMEOUT)
        memory = env.get(ENV_MEMORY)
        return cls(
            timeout_s=_parse_seconds(timeout) if timeout else DEFAULT_TIMEOUT_S,
            memory_bytes=parse_bytes(memory, ENV_MEMORY) if memory else None,
        )

    def memory(self) -> int:
        return self.memory_bytes if self.memory_bytes is not None else default_memory_bytes()


@dataclass
class ProblemCheck:
    """What the child found: the file's content id, its Model's signatures as ModelNew writes them, the problem's
    size, and the memory of the GPU it will be judged on when one is seen."""

    path: Path
    problem_id: str
    signatures: ModelSignatures
    size: ProblemSize
    gpu_memory_bytes: int | None
    gpu_name: str | None

    @property
    def name(self) -> str:
        return self.path.stem


def default_memory_bytes() -> int:
    """Half the machine's RAM, or what is available now when that is less."""
    return min(host_memory_total() // 2, host_memory_available())


def check_problem(path: str | Path, *, device: str | None = None, limits: ProblemLimits | None = None) -> ProblemCheck:
    """Load and validate the problem file in a child process under `limits` (default: ProblemLimits.from_env()),
    then check that its inputs, outputs and parameters fit `device` (None: the judge's default GPU, "cpu": the host).

    Every way it can fail is a ProblemError naming the file and the stage: a timeout, an exit, a signal, the memory
    limit, and everything `load_problem` reports. A check that passed is reused for the same file content, limits
    and device (`check_key`) without starting the child; one that failed is made again, so an edited file is too.
    """
    limits = limits or ProblemLimits.from_env()
    file, source = check_source(path)  # a missing file or a syntax error needs no child
    key = check_key(problem_id_of(source), device, limits)
    report = _recall(key)
    if report is None:
        report = _run_child(file, device, limits)
        if report["problem_id"] != key["problem_id"]:
            raise ProblemError(
                f"{shown_path(file)} changed while it was being checked.",
                hint="Run the command again once the file is saved.",
            )
    check = ProblemCheck(
        path=file,
        problem_id=report["problem_id"],
        signatures=ModelSignatures(**report["signatures"]),
        size=ProblemSize(**report["size"]),
        gpu_memory_bytes=report["gpu_memory_bytes"],
        gpu_name=report["gpu_name"],
    )
    # Measured again every time: the host's free memory, which a CPU judge needs, changes.
    require_fits(
        check.size, shown_path(file), device=device, gpu_memory_bytes=check.gpu_memory_bytes, gpu_name=check.gpu_name
    )
    _remember(key, report)
    return check


def check_key(problem_id: str, device: str | None, limits: ProblemLimits) -> dict[str, Any]:
    """What a check's report depends on: the file's content, the limits as set (the default memory limit as the
    default: the bytes it stands for follow the free memory), the device, and the checking code."""
    return {
        "problem_id": problem_id,
        "timeout_s": limits.timeout_s,
        "memory_bytes": limits.memory_bytes,
        "device": target_device(device),
        "code": _checking_code_digest(),
    }


def target_device(device: str | None) -> str | dict[str, Any]:
    """The device a check is for: "cpu", or the GPU device named, the GPUs the driver lists and the variables that
    choose among them.

    Not the GPU's own name and memory, which the child reports: asking CUDA here would cost this process importing
    torch and starting CUDA, seconds that reusing a check saves. Where the driver lists no GPUs (no NVIDIA driver,
    or a container that hides /proc/driver), a GPU swapped under unchanged variables keeps the earlier report; its
    fit is then checked only by the judge, when the problem runs.
    """
    if device == "cpu":
        return "cpu"
    return {
        "device": device or "cuda",
        "gpus": _driver_gpus(),
        "selection": {name: os.environ[name] for name in _GPU_SELECTION if name in os.environ},
    }


def _driver_gpus() -> list[str]:
    """'<bus>: <model>, <UUID>' for each GPU the NVIDIA driver lists, read from its files (no CUDA started)."""
    try:
        folders = sorted(_NVIDIA_GPUS.iterdir())
    except OSError:
        return []
    listed = []
    for folder in folders:
        try:
            lines = (folder / "information").read_text().splitlines()
        except OSError:
            continue
        facts = [line.split(":", 1)[1].strip() for line in lines if line.startswith(("Model:", "GPU UUID:"))]
        listed.append(f"{folder.name}: {', '.join(facts)}")
    return listed


@functools.cache
def _checking_code_digest() -> str:
    """A hash of the checking code (_CHECKING_CODE) and of torch's version file."""
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in _CHECKING_CODE:
        digest.update((here / name).read_bytes())
    torch_spec = importlib.util.find_spec("torch")  # its version file, without importing torch
    if torch_spec is not None and torch_spec.origin is not None:
        digest.update(Path(torch_spec.origin).with_name("version.py").read_bytes())
    return digest.hexdigest()[:16]


def _recall(key: dict[str, Any]) -> dict[str, Any] | None:
    """The report of a check that passed under `key`: in this process, else in the cache folder."""
    canonical = json.dumps(key, sort_keys=True)
    if canonical in _passed_checks:
        return _passed_checks[canonical]
    stored = load_entry(CACHE_KIND, key)
    if stored is not None:
        _passed_checks[canonical] = stored
    return stored


def _remember(key: dict[str, Any], report: dict[str, Any]) -> None:
    """Keep the report of a check that passed, in this process and in the cache folder where it can be written."""
    canonical = json.dumps(key, sort_keys=True)
    if _passed_checks.get(canonical) == report:
        return
    _passed_checks[canonical] = report
    try:
        store_entry(CACHE_KIND, key, report)
    except OSError:  # a read-only or full cache folder: the next process checks the file again, nothing worse
        pass


def parse_bytes(text: str, setting: str) -> int:
    """'8GiB', '512 MiB', '4G', '1000000': a byte count; ProblemError naming `setting` when it is not one."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text, re.IGNORECASE)
    if match is None:
        raise ProblemError(
            f"{setting}={text!r} is not a number of bytes.", hint=f"Write it as bytes or with a unit: {setting}=8GiB."
        )
    return int(float(match.group(1)) * _UNIT_FACTORS[(match.group(2) or "").lower()])


def _parse_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ProblemError(
            f"{ENV_TIMEOUT}={text!r} is not a positive number of seconds.", hint=f"Write it as e.g. {ENV_TIMEOUT}=300."
        )
    return seconds


# ------------------------------------------------------------------------------------------- parent


def _run_child(file: Path, device: str | None, limits: ProblemLimits) -> dict[str, Any]:
    """Run the child on `file`; its result, or the ProblemError saying how it ended without one."""
    memory = limits.memory()
    request = json.dumps({"path": str(file), "device": device, "memory_bytes": memory})
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD_COMMAND],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, so whatever the file starts is killed with it
        env=_child_env(),
    )
    reports = _Reports()
    output: deque[int] = deque(maxlen=_OUTPUT_TAIL)
    readers = [_reader(child.stdout, reports.add, _REPORT_LIMIT), _reader(child.stderr, output.extend, None)]
    try:
        try:
            child.stdin.write(request.encode())
            child.stdin.close()
        except BrokenPipeError:  # the child died before reading the request; its exit status says how
            pass
        timed_out = not _wait(child, reports, limits.timeout_s)
    finally:
        _kill_group(child.pid)
        child.wait()
        for reader in readers:
            reader.join(_DRAIN_S)
    messages = list(reports.messages)
    stage = next((m["stage"] for m in reversed(messages) if "stage" in m), STARTUP)
    if timed_out and stage == STARTUP:
        raise ProblemError(
            f"The process loading {shown_path(file)} did not start within {STARTUP_ALLOWANCE_S:g} s "
            "(before any of the file's code ran).",
            hint="The machine may be overloaded; `python -c 'import torch'` shows how long torch takes to import.",
        )
    if timed_out:
        raise ProblemError(
            f"Loading {shown_path(file)} timed out after {limits.timeout_s:g} s {during(stage)}.",
            hint=f"Make the file's code finish (a loop that never ends?), or allow more time: {ENV_TIMEOUT}=SECONDS.",
        )
    for message in messages:
        if "result" in message:
            return message["result"]
        if "error" in message:
            raise _reported_error(message["error"], memory)
    raise _ending_error(file, child.returncode, stage, memory, bytes(output))


def _reported_error(error: dict[str, Any], memory: int) -> ProblemError:
    if error.get("kind") == "memory":
        return ProblemMemoryError(
            f"{error['message'].rstrip('.')}; loading a problem may use {format_bytes(memory)}.",
            hint=f"{MEMORY_HINT} Or raise the limit with {ENV_MEMORY}=BYTES (e.g. 32GiB).",
        )
    return ProblemError(error["message"], hint=error.get("hint"))


def _ending_error(file: Path, returncode: int, stage: str, memory: int, output: bytes) -> ProblemError:
    """The error for a child that ended without a report: an exit status, or the signal that killed it."""
    if returncode >= 0:
        err = exit_error(file, returncode, stage)
        return ProblemError(err.message, hint=_with_last_output(EXIT_HINT, output))
    name = _signal_name(-returncode)
    if name in _CRASH_SIGNALS:
        hint = f"The file's code (or a library it calls) crashed; run `python {shown_path(file)}` to see where."
    else:
        hint = (
            f"Something outside kernelpilot stopped it; the kernel's out-of-memory killer sends SIGKILL, and "
            f"loading a problem may use {format_bytes(memory)} ({ENV_MEMORY} sets it)."
        )
    return ProblemError(
        f"{shown_path(file)} was killed by {name} {during(stage)}.", hint=_with_last_output(hint, output)
    )


def _with_last_output(hint: str, output: bytes) -> str:
    lines = [line.strip() for line in output.decode("utf-8", "replace").splitlines() if line.strip()]
    return f"{hint} Its last output: {lines[-1][:200]}" if lines else hint


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _wait(child: subprocess.Popen, reports: _Reports, timeout_s: float) -> bool:
    """Wait for the child to end; False when the file's code ran past `timeout_s` (or the start-up past its own)."""
    spawned = time.monotonic()
    while True:
        try:
            child.wait(timeout=0.05)
            return True
        except subprocess.TimeoutExpired:
            started = reports.file_started_at
            if started is None:
                if time.monotonic() - spawned > STARTUP_ALLOWANCE_S:
                    return False
            elif time.monotonic() - started > timeout_s:
                return False


class _Reports:
    """The child's JSON lines as they arrive, and when the first stage of the file's own code began."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.file_started_at: float | None = None
        self._partial = b""

    def add(self, chunk: bytes) -> None:
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if not isinstance(message, dict):
                continue
            self.messages.append(message)
            if self.file_started_at is None and message.get("stage") not in (None, STARTUP):
                self.file_started_at = time.monotonic()


def _reader(stream: IO[bytes], sink: Callable[[bytes], Any], limit: int | None) -> threading.Thread:
    """A thread reading `stream` to its end into `sink` (at most `limit` bytes; the rest is read and dropped)."""

    def read() -> None:
        taken = 0
        while chunk := stream.read1(65536):
            if limit is None or taken < limit:
                sink(chunk[: None if limit is None else limit - taken])
                taken += len(chunk)
        stream.close()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _child_env() -> dict[str, str]:
    """This environment, with kernelpilot importable in the child however this process found it."""
    env = dict(os.environ)
    package_parent = str(Path(kernelpilot.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    return env


# -------------------------------------------------------------------------------------------- child


def child_main() -> None:
    """The child: read the request from stdin, report JSON lines on the original stdout, exit without cleanup."""
    request = json.loads(sys.stdin.read())
    report = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # what the file prints goes with its errors, never into the report
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # a file reading stdin gets end-of-file, not a hang

    def send(**message: Any) -> None:
        report.write(json.dumps(message) + "\n")
        report.flush()

    try:
        send(result=_check_in_child(request, lambda stage: send(stage=stage)))
    except ProblemMemoryError as err:
        send(error={"kind": "memory", "message": err.message, "hint": err.hint})
    except KernelpilotError as err:
        send(error={"kind": "problem", "message": err.message, "hint": err.hint})
    except BaseException as err:  # noqa: BLE001 - anything else still ends in one sentence, not a traceback
        shown = shown_path(Path(request["path"]))
        send(error={
            "kind": "internal",
            "message": f"Loading {shown} failed with {type(err).__name__}: {str(err).strip()[:160]}.",
            "hint": TRACEBACK_HINT.format(file=shown),
        })
    # os._exit: atexit handlers and threads the file left behind must not delay or change the ending.
    os._exit(0)


def _check_in_child(request: dict[str, Any], on_stage: Callable[[str], None]) -> dict[str, Any]:
    on_stage(STARTUP)
    import torch

    # The first operator with a Python meta kernel imports torch's decompositions (seconds on a busy machine):
    # done here, that time is not counted against the file, and it is mapped before the memory limit is set.
    torch.empty(1, device="meta").add(1)

    gpu_memory_bytes, gpu_name = _gpu_memory(request["device"])
    memory = request["memory_bytes"]
    _limit_address_space(memory)
    problem = load_problem(request["path"], validate=False, on_stage=on_stage, host_memory_bytes=memory)
    model, inputs = validated_on_meta(problem, on_stage=on_stage, host_memory_bytes=memory)
    on_stage(FORWARD)
    size = measure(model, inputs)
    return {
        "problem_id": problem.problem_id,
        "signatures": asdict(model_signatures(problem)),
        "size": asdict(size),
        "gpu_memory_bytes": gpu_memory_bytes,
        "gpu_name": gpu_name,
    }


def _gpu_memory(device: str | None) -> tuple[int | None, str | None]:
    """The memory and name of the GPU the judge would use; (None, None) for the CPU or when no GPU is visible.

    Asked before the memory limit is set: starting CUDA reserves a great deal of address space.
    """
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return None, None
    try:
        index = torch.device(device or "cuda").index
        properties = torch.cuda.get_device_properties(index if index is not None else 0)
    except (RuntimeError, AssertionError, ValueError):  # a bad device name or index: the judge reports it when it runs
        return None, None
    return properties.total_memory, properties.name


def _limit_address_space(memory_bytes: int) -> None:
    """Let the process map `memory_bytes` more than it has mapped now (torch and its libraries)."""
    mapped = _mapped_bytes()
    if mapped == 0:  # no /proc (not Linux): the limit could not be set relative to what is mapped
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped + memory_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _mapped_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0
