"""TRUSTED side's handle on a sandbox process: start it for one model, send it requests, read its JSON replies.

The sandbox (`sandbox.py`) runs in a process of its own group, with an environment stripped to the toolchain's
settings and private cache and temp folders, and dies with the judge's worker. Requests carry only JSON (shared
tensors go by reference, see `shared.py`); replies are parsed as JSON and nothing else. A sandbox serves one model
and is closed after it: the next candidate gets a fresh process, so nothing one candidate changed can judge the
next. `InProcessModel` runs the same request handling inside this process, for CPU tests only.
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
from pathlib import Path
from typing import Any, Protocol

from kernelpilot.harness.failures import classify
from kernelpilot.harness.process import Worker, WorkerStartError

_counter = itertools.count(1)


class ModelProcess(Protocol):
    """What the trusted side asks of a model under test: `request(op, args, timeout) -> reply dict`."""

    hello: dict

    def request(self, op: str, args: dict, *, timeout: float) -> dict: ...

    def close(self) -> None: ...


class Sandbox:
    """A sandbox process: started blank (torch imported, CUDA up), then loaded with the one model it serves."""

    def __init__(self, device: str, *, log_dir: Path):
        log_path = Path(log_dir) / f"sandbox-{next(_counter)}.log"
        self._worker = Worker(device, log_path=log_path, module="kernelpilot.harness.sandbox", sandboxed=True)
        self.hello: dict = {"ok": False, "error_kind": "harness", "message": "the sandbox was not loaded"}
        self.mode = ""
        self._started: dict | None = None

    def launch(self) -> None:
        """Start the blank process without waiting for it."""
        self._worker.launch()

    def start(self) -> dict:
        """Start the blank process (the expensive part: a spare is started ahead of need)."""
        if self._started is None:
            try:
                self._started = dict(self._worker.start())
            except WorkerStartError as err:
                self._started = {"ok": False, "error_kind": "crash", "message": err.message}
        return self._started

    def load(self, mode: str, problem_path: Path, *, seed: int, timeout: float, workspace: Path | None = None,
             library: str | None = None) -> dict:  # fmt: skip
        """Load the model this sandbox serves; its reply (ok, or the verdict's kind and message) is `hello`."""
        self.mode = mode
        started = self.start()
        if not started.get("ok"):
            self.hello = {**started, "message": f"the sandbox did not start: {started.get('message', '')}"}
            return self.hello
        # In the judge's log, so a process the GPU's tools list (memory, faults) can be told apart.
        print(f"sandbox pid {self.pid}: {mode} of {problem_path}", file=sys.stderr, flush=True)
        args = {"mode": mode, "problem": str(problem_path), "seed": seed,
                "workspace": str(workspace) if workspace else None, "library": library}  # fmt: skip
        reply = self._request("load", args, timeout=timeout, what="loading the candidate")
        self.hello = reply
        if not reply.get("ok"):
            self.close()
        return reply

    @property
    def pid(self) -> int | None:
        return self._worker.pid

    def request(self, op: str, args: dict, *, timeout: float) -> dict:
        if not self.hello.get("ok"):
            return dict(self.hello)
        return self._request(op, args, timeout=timeout, what=op)

    def _request(self, op: str, args: dict, *, timeout: float, what: str) -> dict:
        reply = self._worker.call(op, args, timeout=timeout)
        if reply.ok and isinstance(reply.result, dict):
            return reply.result
        kind = reply.error_kind or "crash"
        if kind == "timeout":
            message = f"{what} did not finish within {timeout:g} s; the candidate's process was killed"
        elif kind == "crash":
            message = reply.message.replace("the worker died", "the candidate's process died").replace("; it will restart.", ".")
            cuda_lines = [line for line in self._worker.log_tail(400).splitlines() if classify(message=line) == "cuda-error"]
            if cuda_lines:  # torch aborted on the CUDA error that broke the context
                kind, message = "cuda-error", f"{what} broke the candidate's CUDA context: {cuda_lines[0].strip()[:300]}"
        else:
            message = reply.message
        return {"ok": False, "error_kind": kind, "message": message}

    def close(self) -> None:
        # Killed at once: a sandbox holds nothing to save (its answers are already on the judge's side), and an
        # orderly exit of an interpreter with torch and CUDA loaded took about a second of every turn.
        self._worker.close(grace_s=0)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SandboxPool:
    """Hands out fresh sandboxes, keeping spares started ahead so a turn does not wait for torch's import.

    A GPU judge keeps two (`spares`): a search's turns come every 2-3 s once nothing is compiled in them, and one
    spare, started as the last one was taken, was still importing torch at the next turn (1-2 s of each turn's
    Profile on an H200). On the CPU device no spare is kept: the spare's start (torch's import, seconds of CPU)
    would run on the cores the candidate is being verified and timed on, and disturb its timing.

    `confined` stays True while every sandbox handed out said, before any candidate code ran in it, that Landlock
    confines its writes (and the kernel has Landlock at all): what the judge's cache trusts (`worker.py`).
    """

    GPU_SPARES = 2

    def __init__(self, device: str, log_dir: Path, *, spares: int | None = None):
        from kernelpilot.harness.confine import landlock_available

        self.device, self.log_dir = device, log_dir
        self.spares = (0 if device == "cpu" else self.GPU_SPARES) if spares is None else spares
        self._spares: list[Sandbox] = []  # oldest first: the one most likely ready
        self._handed_out: list[Sandbox] = []
        self.confined = landlock_available()
        # Held while a process is started and recorded, and by whoever lists them (the worker's orphan killer), as
        # a thread may take one (`CleanSandboxes.warm`).
        self.lock = threading.RLock()

    def prelaunch(self) -> None:
        """Start the spares now, without waiting for them, where they are not starting yet: the first verification
        then finds one ready (torch's import and CUDA's start, about 3 s on an H200, overlap the build instead)."""
        self._launch_spares()

    def take(self) -> Sandbox:
        """A started sandbox (the oldest spare, if there is one), and a spare launched in its place."""
        sandbox = self._handed(self._spare_or_new())
        self.started(sandbox)
        self._launch_spares()
        return sandbox

    def reserve(self) -> Sandbox:
        """A sandbox launched now, by the calling thread, and not waited for: another thread may then `started` and
        load it. A sandbox dies with the thread that launched it (it arms PR_SET_PDEATHSIG, which fires when that
        thread ends), so a short-lived thread must launch none: the worker's main thread reserves them for it."""
        sandbox = self._handed(self._spare_or_new())
        self._launch_spares()
        return sandbox

    def started(self, sandbox: Sandbox) -> dict:
        """Wait for the sandbox's hello (it comes before anything is loaded: sandbox.serve) and note its confinement."""
        hello = sandbox.start()
        if hello.get("ok") and hello.get("confinement") != "landlock":  # anything else is unconfined
            with self.lock:
                self.confined = False
        return hello

    def _spare_or_new(self) -> Sandbox:
        with self.lock:
            if self._spares:
                return self._spares.pop(0)
            sandbox = Sandbox(self.device, log_dir=self.log_dir)
            sandbox.launch()
            return sandbox

    def _handed(self, sandbox: Sandbox) -> Sandbox:
        with self.lock:
            self._handed_out = [s for s in self._handed_out if s.pid is not None] + [sandbox]
        return sandbox

    def _launch_spares(self) -> None:
        with self.lock:
            while len(self._spares) < self.spares:
                self._spares.append(Sandbox(self.device, log_dir=self.log_dir))
                self._spares[-1].launch()

    def pids(self) -> list[int | None]:
        """The processes of the sandboxes this pool started that are still running (the spares' included)."""
        with self.lock:
            return [s.pid for s in [*self._handed_out, *self._spares]]

    def close(self) -> None:
        with self.lock:
            for spare in self._spares:
                spare.close()
            self._spares = []


class InProcessModel:
    """The sandbox's request handling run in this process, JSON round trips included: for CPU tests only.

    There is no boundary here; the trusted logic under test is the same as with a `Sandbox`.
    """

    def __init__(self, local: Any, hello: dict | None = None):
        self.local = local
        self.hello = hello or {"ok": True, "pid": None, "import_findings": []}

    @classmethod
    def from_class(cls, problem: Any, candidate_cls: type, *, device: str, seed: int, workspace: Path | None = None):
        """`candidate_cls` with the reference's weights drawn under `seed`, served in this process."""
        import torch

        from kernelpilot.harness import guards
        from kernelpilot.harness.sandbox import LocalModel, SandboxLoadError, adopt

        dev = torch.device(device)
        torch.manual_seed(seed)
        reference = problem.make_model("cpu")
        try:
            model = adopt(candidate_cls, problem, reference, dev)
        except SandboxLoadError as err:
            return cls(None, {"ok": False, "error_kind": err.kind, "message": err.message})
        patched = guards.find_monkeypatches(guards.PRISTINE_FUNCTIONS, when="after the candidate was imported")
        guards.restore_functions(guards.PRISTINE_FUNCTIONS)
        findings = [{"guard": patched.guard, "severity": patched.severity, "message": patched.message}] if patched else []
        return cls(LocalModel(problem, model, dev, workspace=workspace), {"ok": True, "pid": None, "import_findings": findings})

    def request(self, op: str, args: dict, *, timeout: float) -> dict:
        from kernelpilot.harness.sandbox import handle

        reply = handle(self.local, {"op": op, "args": json.loads(json.dumps(args))})
        return json.loads(json.dumps(reply, default=str))

    def close(self) -> None:
        pass


class InProcessClean:
    """The reference's eager and compiled forms served in this process: for CPU tests only (see InProcessModel)."""

    def __init__(self, problem: Any, device: str):
        self.problem, self.device = problem, device
        self._models: dict[str, InProcessModel] = {}

    def eager(self) -> InProcessModel:
        return self._get("eager")

    def compiled(self) -> InProcessModel:
        return self._get("compile")

    def release_compiled(self) -> None:
        self._models.pop("compile", None)

    def _get(self, mode: str) -> InProcessModel:
        import torch

        from kernelpilot.harness.sandbox import LocalModel, load_model

        if mode not in self._models:
            dev = torch.device(self.device)
            model = load_model(mode, self.problem, dev, seed=0, workspace=None, library=None)
            self._models[mode] = InProcessModel(LocalModel(self.problem, model, dev, mode=mode))
        return self._models[mode]


class CleanSandboxes:
    """The reference in eager and compiled form, each in a process where no candidate code ever ran.

    `warm` readies them ahead, in a thread, while the candidate builds (their processes launched by the caller's
    thread, which outlives the warm-up); every other method waits for that thread first, so nothing a bench times
    overlaps the warm-up's own work on the device.
    """

    def __init__(self, pool: Any, problem_path: Path):
        self.pool, self.problem_path = pool, problem_path
        self._models: dict[str, Any] = {}
        self._reserved: dict[str, Any] = {}  # launched for the warm-up thread to load (`warm`)
        self._lock = threading.Lock()
        self._warming: threading.Thread | None = None
        self._closed = False
        self.warm_note = ""  # why the warm-up stopped short, if it did (the worker's log says so)

    def warm(self, work: Any, modes: tuple[str, ...] = ("eager", "compile")) -> None:
        """Launch a process for each of `modes` now, then run `work(self)` in a thread, at most once
        (`bench.warm_clean_models`: load them, compile); a form it does not load is closed when released."""
        if self._warming is not None or self._closed:
            return
        with self._lock:
            self._reserved = {mode: self.pool.reserve() for mode in modes if mode not in self._models}

        def run() -> None:
            try:
                work(self)
            except Exception as err:  # noqa: BLE001 - a warm-up that fails leaves the bench to do it, as before
                self.warm_note = f"{type(err).__name__}: {err}"
                print(f"kernelpilot worker: warming the clean sandboxes of {self.problem_path} stopped: "
                      f"{self.warm_note}", file=sys.stderr, flush=True)  # fmt: skip

        self._warming = threading.Thread(target=run, name="kernelpilot-warm-clean", daemon=True)
        self._warming.start()

    def eager(self) -> Any:
        self.wait_for_warm_up()
        return self._get("eager")

    def compiled(self) -> Any:
        self.wait_for_warm_up()
        return self._get("compile")

    def release_compiled(self) -> None:
        """Close the compiled form's process (its baselines are cached; a later measurement starts another)."""
        self.wait_for_warm_up()
        with self._lock:
            models = [self._models.pop("compile", None), self._reserved.pop("compile", None)]
        for model in models:
            if model is not None:
                model.close()

    def wait_for_warm_up(self, timeout: float | None = None) -> None:
        """Return once the warm-up thread has ended (at once from that thread, or where none runs)."""
        warming = self._warming
        if warming is not None and warming is not threading.current_thread():
            warming.join(timeout)

    def _get(self, mode: str) -> Any:
        with self._lock:
            model = self._models.get(mode)
            if model is None or not model.hello.get("ok") or model.pid is None:
                if self._closed:
                    raise RuntimeError("the clean sandboxes were closed")
                model = self._reserved.pop(mode, None)
                if model is not None:
                    self.pool.started(model)
                elif threading.current_thread() is self._warming:
                    raise RuntimeError(f"no {mode} process was launched for the warm-up")  # (see SandboxPool.reserve)
                else:
                    model = self.pool.take()
                model.load(mode, self.problem_path, seed=0, timeout=600.0)
                self._models[mode] = model
            return model

    def close(self) -> None:
        self._closed = True  # a warm-up thread loads no process after this
        with self._lock:
            models, self._models = [*self._models.values(), *self._reserved.values()], {}
            self._reserved = {}
        for model in models:
            model.close()  # (a warm-up call waiting on one of them returns at once)
        self.wait_for_warm_up(timeout=60.0)
        with self._lock:
            models, self._models = list(self._models.values()), {}
        for model in models:
            model.close()
