"""User-facing errors: one clear sentence and a hint, turned into a non-zero exit by the CLI."""

from __future__ import annotations


class KernelpilotError(Exception):
    """An error the user can cause and fix. `str(err)` is one sentence; `hint` says what to do."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


class ProblemError(KernelpilotError):
    """The problem file cannot be used (missing, not Python, no Model, ...)."""


class WorkspaceError(KernelpilotError):
    """The workspace is missing, malformed, or a protected file was changed."""


class BuildError(KernelpilotError):
    """The toolchain is missing or misconfigured (not a compile error in the user's code)."""


class NoGPUError(KernelpilotError):
    """A GPU is needed and none is visible."""


class ProblemMemoryError(ProblemError):
    """Running the problem file ran out of memory (the loader's memory limit, or the machine's)."""


class UnconfinedJudgeError(KernelpilotError):
    """A judge that must be confined (training's) found that Landlock does not confine its sandboxes."""

    HINT = ("Train where Landlock confines the sandboxes (Linux 5.13 or newer, not blocked by a container's seccomp "
            "profile), or pass --allow-unconfined to train on rewards a hostile candidate could forge.")  # fmt: skip

    def __init__(self, message: str, hint: str | None = HINT):
        super().__init__(message, hint)
