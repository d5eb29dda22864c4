"""One classifier of failures while judging, and the one list of the error kinds a verdict can carry.

Used on both sides of the trust boundary: the sandbox names what the model raised, the trusted side names what
its own processes hit. A kind says whose fault it is and what happens next (see ERROR_KINDS).
"""

from __future__ import annotations

import re

# Every error_kind a BuildResult / VerifyResult / BenchResult / EvalResult / Reply can carry.
ERROR_KINDS: dict[str, str] = {
    "build": "the extension did not compile or link",
    "tampered": "protected workspace files were changed",
    "load": "the extension or model_new.py cannot be imported, or ModelNew is missing",
    "init": "ModelNew cannot be constructed or does not hold Model's parameters",
    "reference": "the problem itself (Model, get_inputs) failed",
    "mismatch": "an output differs from the reference's (in a checked call or a sampled timed call)",
    "guard": "an anti-cheat guard failed",
    "runtime": "the candidate raised",
    "oom": "the device ran out of memory",
    "cuda-error": "a CUDA error (illegal address, launch failure, ...) broke the process's CUDA context",
    "crash": "a process died (segfault, abort, killed)",
    "timeout": "a step did not finish in time; its process was killed",
    "harness": "kernelpilot's own checking code failed: a bug to report, no verdict on the candidate",
    "user": "a problem with the user's set-up (no toolchain, not a workspace, ...)",
}

# Lower case; any of these in an error's text means the CUDA context is unusable afterwards.
_CUDA_CONTEXT_ERRORS = (
    "cuda error", "illegal memory access", "illegaladdress", "illegal address", "misaligned address",
    "misalignedaddress", "unspecified launch failure", "launchfailure", "device-side assert", "illegal instruction",
    "illegalinstruction", "hardware stack error", "cudaerror", "cublas_status", "cudnn_status",
)  # fmt: skip
_SOURCE_LOCATION = re.compile(r"[\w./\\-]+\.(?:cu|cuh|cpp|cc|h|hpp):\d+")


def classify(exc: BaseException | None = None, message: str = "") -> str:
    """"oom", "cuda-error" or "runtime" for an exception (or only its message)."""
    text = (message or (str(exc) if exc is not None else "")).lower()
    name = type(exc).__name__ if exc is not None else ""
    if isinstance(exc, MemoryError) or name == "OutOfMemoryError" or "out of memory" in text:
        return "oom"
    if name == "AcceleratorError" or any(marker in text for marker in _CUDA_CONTEXT_ERRORS):
        return "cuda-error"
    return "runtime"


def is_device_failure(exc: BaseException) -> bool:
    """Out of memory or a CUDA error: the device's state, not a property of the problem or of a check."""
    return classify(exc) != "runtime"


def failure_kind(exc: BaseException, during: str) -> tuple[str, str]:
    """(kind, one-line message) for an exception raised while the model ran."""
    return classify(exc), f"{during} raised {describe_exception(exc)}"


def describe_exception(exc: BaseException) -> str:
    """`Type: first line`, plus the first kernel source location the message names when the first line has none.

    A first line that only introduces what follows ("An exception occurred in a subprocess:", as torch.compile's
    compile workers report) gets the message's last line too: the error that traceback ends in."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    first = lines[0][:300] if lines else ""
    if first.endswith(":") and len(lines) > 1:
        first += f" ... {lines[-1][:300]}"
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    location = _SOURCE_LOCATION.search(str(exc))
    if location and location.group(0) not in first:
        text += f" (at {location.group(0)})"
    return text
