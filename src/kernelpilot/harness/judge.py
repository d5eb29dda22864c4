"""The judge every caller uses: build -> load -> verify -> bench -> reward of a workspace's candidate, in a worker.

The agent, the CLI, `check` and the trainer all go through `Judge`; none of them runs GPU code itself. Each step
runs in the judge's worker process with its own timeout, and whatever goes wrong there (a compile error, a hang,
a crash, a wrong answer) comes back as a result with an error kind and a message, never as an exception. Only
errors the user must fix outside the candidate (not a workspace, no GPU, no toolchain) are raised.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelpilot.errors import KernelpilotError, NoGPUError, UnconfinedJudgeError, WorkspaceError
from kernelpilot.harness.process import Reply, Worker
from kernelpilot.results import UNCONFINED, BenchResult, BuildResult, EvalResult, VerifyResult, from_dict, least_confined

# A candidate that dies, raises, answers wrong or hides work while being timed fails although it passed the trials.
_BENCH_FAILURES_THAT_FAIL_THE_CANDIDATE = ("crash", "cuda-error", "runtime", "mismatch", "guard")
DEVICES = r"cpu|cuda(:\d+)?"  # what a judge runs on: the CPU, the current GPU, or the N-th visible one


@dataclass
class Timeouts:
    """Seconds each step may take before its worker is killed."""

    build: float = 600.0
    verify: float = 300.0
    bench: float = 600.0


class Judge:
    """Evaluates candidates on one device through a long-lived worker; use as a context manager or call close().

    Threads may share one judge (the TUI's watcher and its accept key): its worker runs one step at a time.
    `confinement` is the least confined its sandboxes have been (None before any sandbox ran): every result says
    its own, and the callers warn when it is UNCONFINED. With `allow_unconfined=False` (training's judges) the
    judge refuses to start where the kernel has no Landlock, and raises UnconfinedJudgeError, instead of
    returning the result, once a step reports a sandbox that Landlock did not confine.
    """

    def __init__(
        self,
        device: str | None = None,
        *,
        timeouts: Timeouts | None = None,
        cache_dir: Path | None = None,
        arch: str | None = None,
        jobs: int | None = None,
        log_path: Path | None = None,
        allow_unconfined: bool = True,
        worker: Worker | None = None,
    ):
        self.device = _checked_device(device or "cuda")
        if not allow_unconfined:
            require_landlock()  # before a worker starts
        self.allow_unconfined = allow_unconfined
        self.confinement: str | None = None
        self.timeouts = timeouts or Timeouts()
        self.cache_dir = cache_dir
        self.arch = arch
        self.jobs = jobs
        self.worker = worker or Worker(self.device, log_path=log_path)  # (`launch_worker`'s, started ahead)
        self._steps = threading.Lock()  # one request at a time on the worker's pipes
        self._noting = threading.Lock()  # one update of `confinement` at a time
        if self.device != "cpu":
            self._require_gpu()

    def _require_gpu(self) -> None:
        if not self.worker.start().get("cuda_available"):
            self.worker.close()
            raise NoGPUError(
                "no CUDA GPU is visible, and verifying and timing kernels needs one.",
                hint="Run it on a machine with an NVIDIA GPU and a CUDA build of torch "
                "(check `nvidia-smi` and CUDA_VISIBLE_DEVICES).",
            )

    @property
    def gpu_name(self) -> str | None:
        return self.worker.start().get("gpu_name")

    # -- the steps

    def prepare(self, ws_root: Path | str) -> None:
        """Tell the worker a run on this workspace starts: on a GPU it starts the first sandbox and warms the
        reference's clean sandboxes (torch.compile's compile included) while the candidate is written and built,
        and the first bench waits for that instead of doing it. A failure here costs nothing but that head start."""
        args = {"workspace": str(_open(ws_root).root), "cache_dir": _str_or_none(self.cache_dir)}
        with self._steps:
            self.worker.call("prepare", args, timeout=self.timeouts.build)

    def build(self, ws_root: Path | str, ahead: Sequence[Mapping[str, str]] = ()) -> BuildResult:
        """Build the workspace's extension incrementally, in the worker, and the `ahead` versions of its kernel files
        ({path: content} each) side by side with it, so that writing one of them later compiles nothing
        (`build_ahead.py`; the result's `ahead` counts them)."""
        ws = _open(ws_root)
        args = {"workspace": str(ws.root), "arch": self.arch, "jobs": self.jobs, "cache_dir": _str_or_none(self.cache_dir)}
        if ahead:
            args["ahead"] = [dict(version) for version in ahead]
        reply = self._call("build", args, self.timeouts.build)
        if reply.ok:
            return from_dict(BuildResult, reply.result)
        from kernelpilot.workspace import EXTENSION_NAME

        return BuildResult(
            ok=False, workspace=str(ws.root), extension_name=EXTENSION_NAME, arch=self.arch or "", error=reply.message
        )

    def verify(
        self,
        ws_root: Path | str,
        build: BuildResult | None = None,
        *,
        trials: int = 5,
        atol: float = 1e-2,
        rtol: float = 1e-2,
        base_seed: int | None = None,
        variants: Sequence[str] = (),
        slower_than_ms: float | None = None,
    ) -> VerifyResult:
        """Load the candidate (with `build`'s extension) in a fresh sandbox and run the trials and guards.

        `base_seed` None draws an unpredictable one (the result records it, so a run can be reproduced).
        `variants` ("half", "double": `harness/variants.py`) are verified after the trials pass, each recorded in
        the result's `variants` whatever its outcome: the verdict is the trials'.
        `slower_than_ms` (a time to beat) stops a candidate whose warm calls are far slower, as error kind SLOWER.
        """
        ws = _open(ws_root)
        # The variants' trials take about as long as the problem's own: the step gets twice the time.
        timeout = self.timeouts.verify * (2 if variants else 1)
        args = self._candidate_args(ws.root, build) | {"trials": trials, "atol": atol, "rtol": rtol,
                                                       "base_seed": base_seed, "variants": list(variants),
                                                       "slower_than_ms": slower_than_ms,
                                                       "timeout": _inner(timeout)}  # fmt: skip
        reply = self._call("verify", args, timeout)
        if reply.ok:
            return self._served(from_dict(VerifyResult, reply.result))
        return VerifyResult(ok=False, atol=atol, rtol=rtol, error_kind=reply.error_kind, message=reply.message)

    def bench(
        self,
        ws_root: Path | str,
        build: BuildResult | None = None,
        *,
        min_runs: int = 20,
        atol: float = 1e-2,
        rtol: float = 1e-2,
    ) -> BenchResult:
        """Time the candidate in a fresh sandbox against eager and torch.compile (signed, confirmed baselines);
        timed calls are checked against the reference with `atol`/`rtol`."""
        ws = _open(ws_root)
        args = self._candidate_args(ws.root, build) | {"min_runs": min_runs, "cache_dir": _str_or_none(self.cache_dir),
                                                       "atol": atol, "rtol": rtol,
                                                       "timeout": _inner(self.timeouts.bench)}  # fmt: skip
        reply = self._call("bench", args, self.timeouts.bench)
        if reply.ok:
            return self._served(from_dict(BenchResult, reply.result))
        return BenchResult(ok=False, error_kind=reply.error_kind, message=reply.message)

    def evaluate(
        self, ws_root: Path | str, *, trials: int = 5, atol: float = 1e-2, rtol: float = 1e-2, bench: bool = True,
        variants: Sequence[str] = (), slower_than_ms: float | None = None,
    ) -> EvalResult:
        """Build, verify (and verify at the shape `variants`) and, when it is correct and `bench`, time the
        candidate; the reward sums it up (the variants do not count in it), `confinement` the steps' sandboxes.
        `slower_than_ms`: a time to beat; a candidate far slower is stopped early (error kind SLOWER), untimed."""
        result = self._evaluate(ws_root, trials=trials, atol=atol, rtol=rtol, bench=bench, variants=variants,
                                slower_than_ms=slower_than_ms)
        steps = [step.confinement for step in (result.verify, result.bench) if step is not None]
        result.confinement = least_confined(*steps)
        return result

    def _evaluate(
        self, ws_root: Path | str, *, trials: int, atol: float, rtol: float, bench: bool, variants: Sequence[str],
        slower_than_ms: float | None = None,
    ) -> EvalResult:
        from kernelpilot.harness.reward import milestone_reward
        from kernelpilot.workspace import tampered_files

        ws = _open(ws_root)
        result = EvalResult(problem_id=ws.problem_id, workspace=str(ws.root))
        tampered = tampered_files(ws)
        if tampered:
            return _failed(result, "tampered", f"protected workspace files were changed or deleted: {', '.join(tampered)}.")
        try:
            has_sources = bool(ws.kernel_sources())
        except WorkspaceError as err:  # a kernel file name no build can carry: the candidate's, like a compile error
            return _failed(result, "build", f"{err.message} Hint: {err.hint}.")
        if has_sources:
            result.build = self.build(ws.root)
            if not result.build.ok:
                return _failed(result, "build", result.build.error or "the build failed.")
        result.verify = self.verify(ws.root, result.build, trials=trials, atol=atol, rtol=rtol, variants=variants,
                                    slower_than_ms=slower_than_ms)
        if not result.verify.ok:
            return _failed(result, result.verify.error_kind or "mismatch", result.verify.message)
        if bench:
            result.bench = self.bench(ws.root, result.build, atol=atol, rtol=rtol)
            if not result.bench.ok:
                kind = result.bench.error_kind or "runtime"
                if kind in _BENCH_FAILURES_THAT_FAIL_THE_CANDIDATE:
                    return _failed(result, kind, f"correct in the trials, but failed while timed: {result.bench.message}")
                result.error_kind, result.message = kind, f"correct, but not timed: {result.bench.message}"
        timed = result.bench if result.bench is not None and result.bench.ok else None
        result.reward = milestone_reward(
            built=True,
            correct=True,
            speedup_vs_eager=timed.speedup_vs_eager if timed else None,
            speedup_vs_compile=timed.speedup_vs_compile if timed else None,
        )
        return result

    # -- lifecycle

    def close(self) -> None:
        """Stop the worker."""
        self.worker.close()

    def __enter__(self) -> Judge:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _candidate_args(self, root: Path, build: BuildResult | None) -> dict[str, Any]:
        """What every candidate step sends: the workspace, its build, and whether its sandbox must be confined (the
        worker then refuses an unconfined one before the candidate loads, with UnconfinedJudgeError)."""
        from kernelpilot.results import to_dict

        return {"workspace": str(root), "build": to_dict(build) if build is not None else None,
                "confined": not self.allow_unconfined}  # fmt: skip

    def _served(self, result: VerifyResult | BenchResult) -> VerifyResult | BenchResult:
        """Note how the step's sandboxes were confined; refuse an unconfined one unless that is allowed (the
        worker has refused it already, before the candidate loaded: this is the result's own word)."""
        with self._noting:
            self.confinement = least_confined(self.confinement, result.confinement)
        if result.confinement == UNCONFINED and not self.allow_unconfined:
            raise UnconfinedJudgeError("A sandbox of the judge reported that Landlock does not confine it, so a "
                                       "candidate could change what the judge runs and its rewards are not evidence.")
        return result

    def _call(self, op: str, args: dict[str, Any], timeout: float) -> Reply:
        with self._steps:
            reply = self.worker.call(op, args, timeout=timeout)
        reply.raise_user_error()
        return reply


def launch_worker(device: str | None) -> Worker | None:
    """A judge's worker process started now, without waiting for it, for `Judge(device, worker=...)` to take over:
    its torch import and CUDA start then overlap the checks before a run. None for a device the judge refuses."""
    device = device or "cuda"  # (Judge's default)
    if not re.fullmatch(DEVICES, device):
        return None
    worker = Worker(device)
    worker.launch()
    return worker


def require_landlock() -> None:
    """UnconfinedJudgeError when this kernel offers no Landlock, so that no sandbox of a judge can be confined:
    what a judge that must be confined checks before it starts, and training before it spends any time."""
    from kernelpilot.harness import confine

    if not confine.landlock_available():
        raise UnconfinedJudgeError("This system offers no Landlock, so the judge's sandboxes cannot be confined and a "
                                   "candidate could change what the judge runs.")  # fmt: skip


def evaluate_path(
    target: Path,
    candidate: Path | None = None,
    *,
    device: str | None = None,
    trials: int = 5,
    atol: float = 1e-2,
    rtol: float = 1e-2,
    bench: bool = True,
    variants: Sequence[str] = (),
) -> EvalResult:
    """`kernelpilot eval`: judge a workspace folder, or a candidate file against a problem file (`accept`: with
    the shape `variants`)."""
    if candidate is None and target.is_file():
        raise KernelpilotError(
            f"{target} is a problem file, so the candidate to judge is missing.",
            hint=f"Pass it: kernelpilot eval {target} --candidate model_new.py",
        )
    if candidate is not None and not target.is_file():
        raise KernelpilotError(
            f"--candidate needs a problem file to judge against, and {target} is not a file.",
            hint="Pass the problem file first: kernelpilot eval model.py --candidate model_new.py",
        )
    if candidate is not None:
        candidate_files(candidate)  # a link among them is refused before any process starts
    with Judge(device) as judge:
        if candidate is None:
            return judge.evaluate(target, trials=trials, atol=atol, rtol=rtol, bench=bench, variants=variants)
        with candidate_workspace(target, candidate) as ws_root:
            return judge.evaluate(ws_root, trials=trials, atol=atol, rtol=rtol, bench=bench, variants=variants)


@contextmanager
def candidate_workspace(problem_path: Path, candidate_path: Path) -> Iterator[Path]:
    """A temporary workspace for `problem_path` holding `candidate_path` as model_new.py and the kernels/ beside it."""
    from kernelpilot.workspace import EXAMPLE_KERNELS, PROTECTED_FILES, init_workspace

    kernels = candidate_files(candidate_path)
    with tempfile.TemporaryDirectory(prefix="kernelpilot-eval-") as tmp:
        ws, _ = init_workspace(problem_path, Path(tmp) / f"kp-{problem_path.stem}")
        for example in EXAMPLE_KERNELS:  # the candidate's own kernels replace the scaffold's example
            (ws.root / example).unlink(missing_ok=True)
        shutil.copyfile(candidate_path, ws.model_new_path)
        for relative in kernels:
            if relative.as_posix() not in PROTECTED_FILES:
                (ws.root / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(candidate_path.parent / relative, ws.root / relative)
        yield ws.root


def candidate_files(candidate_path: Path) -> list[Path]:
    """The files of the kernels/ folder beside a candidate file, relative to its folder; refused where one of them
    (or the folder) is a link, as in a workspace's kernels/: a candidate is judged on its own files, and a link's
    target is some other file, which may change once judged and does not travel with the candidate's folder."""
    if not candidate_path.is_file():
        raise KernelpilotError(f"Candidate file {candidate_path} does not exist.", hint="Check the path to model_new.py.")
    folder = candidate_path.parent
    kernels = folder / "kernels"
    links = [kernels] if kernels.is_symlink() else []
    if kernels.is_dir() and not links:
        links = sorted(path for path in kernels.rglob("*") if path.is_symlink())
    if links:
        shown = ", ".join(path.relative_to(folder).as_posix() for path in links)
        raise KernelpilotError(
            f"{shown} {'is a link' if len(links) == 1 else 'are links'}, and kernelpilot copies a candidate's files "
            "but never follows a link out of its folder.",
            hint="Copy the file itself into kernels/ (cp -L) and judge it again.",
        )
    if not kernels.is_dir():
        return []
    return sorted(path.relative_to(folder) for path in kernels.rglob("*") if path.is_file())


def _open(ws_root: Path | str) -> Any:
    from kernelpilot.workspace import open_workspace

    return open_workspace(Path(ws_root).resolve())


def _inner(timeout: float) -> float:
    """The time the worker gives a step's sandbox: less than the step's own, so the sandbox is the one killed."""
    return max(timeout - min(10.0, 0.1 * timeout), 1.0)


def _str_or_none(path: Path | None) -> str | None:
    return str(path) if path is not None else None


def _failed(result: EvalResult, error_kind: str, message: str) -> EvalResult:
    result.error_kind, result.message, result.reward = error_kind, message, -1
    return result


def _checked_device(device: str) -> str:
    if re.fullmatch(DEVICES, device):
        return device
    raise KernelpilotError(f"Unknown device {device!r}.", hint="Use cuda, cuda:N (the N-th visible GPU) or cpu.")
