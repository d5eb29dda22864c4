"""UNTRUSTED side of the judge: the process that loads one candidate and runs the calls it is asked for.

Everything here runs next to candidate code (model_new.py, its extension, whatever they import), so nothing here
decides a verdict: this side holds no reference output, compares nothing that counts and keeps no clock whose
reading counts. It maps the inputs and output slots the trusted side lends it (`shared.py`), runs the model, copies
each output into its slot and answers in JSON. What it reports about itself (op counts, kernels, aliasing, its
own event times) is advice that catches honest mistakes; the verdict comes from the trusted side's comparison of
the slots and its own wall clock (`verify.py`, `timing.py`).

A sandbox serves one model for its whole life: a candidate (`mode="candidate"`), or the reference in eager or
compiled form for the baselines (`mode="eager"|"compile"`), in a process where no candidate code ever ran.
`LocalModel` is the model-facing half, also used in-process by CPU tests; `serve` wraps it in the process loop.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# Imported before any candidate code: guards.py takes its snapshot of the watched functions at import.
from kernelpilot.harness import guards  # noqa: I001
from kernelpilot.harness.failures import describe_exception, failure_kind
from kernelpilot.harness.guards import PreviousCall, clone_tree, tensor_leaves
from kernelpilot.harness.shared import dtype_name, open_reference, open_tree
from kernelpilot.harness.tracing import KernelTrace
from kernelpilot.ops import loaded_namespaces

# Captured before any candidate code runs (self-protection for honest reports, not a trust boundary).
_synchronize = torch.cuda.synchronize
_Event = torch.cuda.Event
_perf_counter = time.perf_counter
# The GPU sleeps this long before each timed call, so the call's CPU dispatch overlaps it and is not timed.
DISPATCH_COVER_S = 100e-6
MODES = ("candidate", "eager", "compile")
# A timed run's steps on a GPU, in order (a run's reply gives each one's milliseconds on this process's clock).
RUN_STEPS = ("sync before", "to start", "dispatch", "to end", "copy out")
# Above this many bytes of outputs the self-checks that copy them (unsynced writes, reuse) are skipped.
SELF_CHECK_MAX_BYTES = 1 << 30
_LEFT_MAPPED: list = []  # shared tensors never unmapped: the process exits right after a CUDA error


FORWARD_NAMES = {"candidate": "ModelNew.forward", "eager": "Model.forward", "compile": "Model.forward under torch.compile"}


class LocalModel:
    """One model and the calls the judge makes on it: checked calls, timed runs and a profiled call."""

    def __init__(self, problem: Any, model: torch.nn.Module, device: torch.device, *, workspace: Path | None = None,
                 trace: KernelTrace | None = None, mode: str = "candidate"):  # fmt: skip
        self.problem, self.model, self.device = problem, model, device
        self.forward = FORWARD_NAMES[mode]  # what a failure names: the candidate's forward or the reference's
        self.cuda = device.type == "cuda"
        self.workspace = workspace
        self.trace = trace  # a candidate's on a GPU: every forward runs with a profiler on (tracing.py)
        self.previous: PreviousCall | None = None
        self.timing_slots: list[torch.Tensor] = []
        self.timing_inputs: list | None = None  # the judge's lent inputs (timed_inputs.py), rewritten per run

    # ---------------------------------------------------------------------------- checked calls

    def call(self, inputs: list, slots: list[torch.Tensor], *, seed: int, reference_aliases_inputs: bool) -> dict:
        """Run forward on `inputs` under the self-checks, copy the outputs into `slots`; a JSON-able report."""
        started = _perf_counter()
        if self.cuda:
            poison_free_memory(self.device, [slot.nbytes for slot in slots])
        self.last_poison_s = _perf_counter() - started
        # The candidate's kernels (torch ops of the namespaces loaded here) are no torch compute; what they call is.
        recorder = guards.AtenOpRecorder(own_namespaces=loaded_namespaces())
        try:
            with torch.no_grad(), recorder, self._collecting(True):
                actual = self.model(*inputs)
            read_at_return = clone_tree(actual) if self.cuda else None
            if self.cuda:
                _synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - every failure of the model becomes a report
            return _failed(exc, f"{self.forward} (seed {seed})")
        outputs = tensor_leaves(actual, "out")
        if sum(t.nbytes for _, t in outputs) > SELF_CHECK_MAX_BYTES:  # no copies of multi-GB outputs for advice
            read_at_return, self.previous = None, None
        findings = [
            guards.find_torch_compute(recorder.counts),
            guards.find_output_aliasing(outputs, tensor_leaves(inputs, "inputs"), [],
                                        reference_aliases_inputs=reference_aliases_inputs),  # fmt: skip
            guards.find_module_held_output(outputs, self.model),
            guards.find_monkeypatches(guards.PRISTINE_FUNCTIONS, when="after forward"),
        ]
        guards.restore_functions(guards.PRISTINE_FUNCTIONS)  # for this process's own later calls and reports
        if read_at_return is not None:
            findings.append(guards.find_unsynced_output(tensor_leaves(read_at_return, "out"), outputs))
        if self.previous is not None:
            findings.append(guards.find_reused_output(outputs, self.previous))
        if sum(t.nbytes for _, t in outputs) <= SELF_CHECK_MAX_BYTES:
            self.previous = PreviousCall(
                outputs=[(f"previous {name}", t) for name, t in outputs],
                values=[(f"previous {name}", t.clone()) for name, t in outputs],
                reference_values=[],
            )
        structure = copy_into_slots(actual, slots)
        if self.cuda:
            _synchronize(self.device)
            if sum(t.nbytes for _, t in outputs) > SELF_CHECK_MAX_BYTES:
                del actual, outputs, read_at_return
                torch.cuda.empty_cache()  # the poisoned blocks of multi-GB outputs: the judge needs that memory
        return {"ok": True, "structure": structure, "findings": [_finding(f) for f in findings if f is not None],
                "poison_s": round(self.last_poison_s, 4)}  # fmt: skip

    def profiled_call(self, inputs: list, *, seed: int) -> dict:
        """One more forward under the profiler: the kernels it launched, on which streams, whether torch's."""
        error: list[dict] = []

        def forward() -> None:
            try:
                with torch.no_grad():
                    self.model(*inputs)
            except Exception as exc:  # noqa: BLE001 - the model's failure, not the profiler's
                error.append(_failed(exc, f"{self.forward} under the profiler (seed {seed})"))

        with self._paused():
            profiled = guards.profile_forward(forward, self.device)
        if error:
            return error[0]
        names = [kernel.name for kernel in profiled.kernels]
        # The kernels of the checked calls before this one, collected while they ran.
        traced = self.trace.take_names(read=False) if self.trace is not None else []
        return {"ok": True, "kernels": names, "current_stream": profiled.current_stream,
                "streams": [k.stream for k in profiled.kernels], "synchronized": profiled.synchronized,
                "traced_kernels": traced}  # fmt: skip

    def traced_kernels(self) -> dict:
        """The kernels of the traced calls since the last report (the timed runs the judge asked to trace)."""
        return {"ok": True, "kernels": self.trace.take_names() if self.trace is not None else [],
                "traced": self.trace is not None}  # fmt: skip

    def _collecting(self, wanted: bool) -> Any:
        return self.trace.collecting() if wanted and self.trace is not None else contextlib.nullcontext()

    def _paused(self) -> Any:
        return self.trace.paused() if self.trace is not None else contextlib.nullcontext()

    # ---------------------------------------------------------------------------- timed runs

    def bind(self, slots: list[torch.Tensor], inputs: list | None = None) -> dict:
        """The slots every timed run copies its outputs into and the inputs it reads (the judge rewrites them
        before each run), until the next bind."""
        self.timing_slots, self.timing_inputs, self.previous = slots, inputs, None
        if self.cuda:
            torch.cuda.empty_cache()  # verification's cached blocks, before the timed runs allocate theirs
        return {"ok": True}

    def run(self, seed: int, *, trace: bool = False, inputs: list | None = None) -> dict:
        """One timed call on the bound inputs (the judge drew them from `seed` and flushed the L2), or on
        `inputs` when the judge lent new ones: its time in ms, outputs copied into the bound slots. With none
        bound (a direct request, as tests make), the inputs are drawn here from `seed`.

        On a GPU: the GPU kept busy while the call is dispatched, then an event, the call, a device-wide
        synchronisation (work on every stream counts) and an event. A traced run collects the call's kernels
        (tracing.py): the judge leaves its time out of the figures, since collecting slows each launch.
        """
        if inputs is not None:
            self.timing_inputs = inputs
        if self.timing_inputs is not None:
            inputs = self.timing_inputs
        else:
            try:
                inputs = self.problem.make_inputs(self.device, seed)
            except Exception as exc:  # noqa: BLE001
                return {"ok": False, "error_kind": "reference", "message": f"get_inputs() raised {describe_exception(exc)}"}
        marks = [_perf_counter()]
        try:
            with torch.no_grad():
                ms, actual = self._timed(inputs, trace=trace, marks=marks)
        except Exception as exc:  # noqa: BLE001
            return _failed(exc, f"{self.forward} while timed (seed {seed})")
        structure = copy_into_slots(actual, self.timing_slots)
        if self.cuda:
            _synchronize(self.device)
        marks.append(_perf_counter())
        # Where the run's seconds went on this process's clock (its word, a diagnostic of the protocol's cost).
        steps = [round((b - a) * 1e3, 4) for a, b in itertools.pairwise(marks)]
        reply = {"ok": True, "ms": ms, "structure": structure}
        if len(steps) == len(RUN_STEPS):  # (a CPU run has no steps but the call)
            reply["steps_ms"] = dict(zip(RUN_STEPS, steps))
        return reply

    def _timed(self, inputs: list, *, trace: bool = False, marks: list[float] | None = None) -> tuple[float, Any]:
        mark = marks.append if marks is not None else (lambda _: None)
        if not self.cuda:
            start = _perf_counter()
            actual = self.model(*inputs)
            return (_perf_counter() - start) * 1e3, actual
        _synchronize(self.device)
        mark(_perf_counter())
        torch.cuda._sleep(_dispatch_cover_cycles(self.device))
        start, end = _Event(enable_timing=True), _Event(enable_timing=True)
        with self._collecting(trace):
            start.record()
            mark(_perf_counter())
            actual = self.model(*inputs)
            mark(_perf_counter())
            _synchronize(self.device)
            end.record()
            end.synchronize()
            mark(_perf_counter())
        return start.elapsed_time(end), actual

    def kernels(self, seed: int) -> dict:
        """The kernels of one call on inputs from `seed`, longest first (the bench's breakdown)."""
        from kernelpilot.harness.tracing import profile_kernels
        from kernelpilot.results import to_dict

        inputs = self.problem.make_inputs(self.device, seed)
        with torch.no_grad(), self._paused():
            rows = profile_kernels(self.model, inputs, device=str(self.device))
        return {"ok": True, "kernels": [to_dict(row) for row in rows]}


@functools.cache
def _dispatch_cover_cycles(device: torch.device) -> int:
    """DISPATCH_COVER_S in the GPU's clock cycles (asked once: the properties' clock rate is not a cheap read)."""
    return int(torch.cuda.get_device_properties(device).clock_rate * 1e3 * DISPATCH_COVER_S)


def copy_into_slots(actual: Any, slots: list[torch.Tensor]) -> Any:
    """Describe `actual` as JSON and copy each tensor leaf into the slot of its index when layouts agree."""
    return _describe_into(actual, slots, itertools.count())


def _describe_into(tree: Any, slots: list[torch.Tensor], counter: Iterator[int]) -> Any:
    # A plain recursive function, not a closure over `slots`: a recursive closure is a reference cycle, and the
    # shared slots it held would stay mapped until the garbage collector ran, holding the judge's memory (torch
    # frees a CUDA IPC block on the lender's side only once every process that opened it has let go).
    if isinstance(tree, torch.Tensor):
        index = next(counter)
        slot = slots[index] if index < len(slots) else None
        copied = (
            slot is not None and tree.shape == slot.shape and tree.dtype == slot.dtype and tree.device == slot.device
        )
        if copied:
            slot.copy_(tree)
        return {"t": "tensor", "i": index, "shape": list(tree.shape), "dtype": dtype_name(tree.dtype),
                "device": str(tree.device), "copied": copied}  # fmt: skip
    if isinstance(tree, (tuple, list)):
        return {"t": "tuple" if isinstance(tree, tuple) else "list", "items": [_describe_into(item, slots, counter) for item in tree]}
    if isinstance(tree, dict):
        return {"t": "dict", "items": {str(key): _describe_into(item, slots, counter) for key, item in tree.items()}}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return {"t": "value", "v": tree}
    return {"t": "other", "type": type(tree).__name__}


def poison_free_memory(device: torch.device, output_bytes: list[int]) -> None:
    """Fill the caching allocator's free blocks with 0xFF bytes (NaN in every float type) before a checked call.

    An output the model allocates but does not fully write then shows NaN instead of an earlier result that
    happened to lie in the reused block.
    """
    stream = torch.cuda.current_stream(device).cuda_stream
    free_blocks = [
        block["size"]
        for segment in torch.cuda.memory_snapshot()
        if segment["device"] == device.index and segment["stream"] == stream
        for block in segment["blocks"]
        if block["state"] == "inactive"
    ]
    claimed = []
    try:
        for size in [*free_blocks, *output_bytes]:
            claimed.append(torch.empty(size, dtype=torch.uint8, device=device).fill_(0xFF))
    except torch.cuda.OutOfMemoryError:
        pass  # what was claimed so far is poisoned; the rest stays as it is
    del claimed


def _finding(finding: Any) -> dict:
    return {"guard": finding.guard, "severity": finding.severity, "message": finding.message}


def _failed(exc: BaseException, during: str) -> dict:
    kind, message = failure_kind(exc, during)
    return {"ok": False, "error_kind": kind, "message": message}


# ------------------------------------------------------------------------------------- loading a model


def load_model(mode: str, problem: Any, device: torch.device, *, seed: int, workspace: Path | None, library: str | None):
    """The model this sandbox serves, holding the reference's weights drawn under `seed`.

    Raises `SandboxLoadError` with the verdict's kind ("load", "init") when the candidate cannot be used.
    """
    torch.manual_seed(seed)
    try:
        reference = problem.make_model("cpu")
    except Exception as exc:  # noqa: BLE001
        raise SandboxLoadError("reference", f"the reference Model(*get_init_inputs()) raised {describe_exception(exc)}") from None
    if mode != "candidate":
        model = reference.to(device)
        return torch.compile(model) if mode == "compile" else model
    from kernelpilot.harness.candidate import CandidateError, load_candidate
    from kernelpilot.results import BuildResult
    from kernelpilot.workspace import Workspace

    from kernelpilot.workspace import EXTENSION_NAME

    build = BuildResult(ok=True, workspace=str(workspace), extension_name=EXTENSION_NAME, arch="", library=library) if library else None
    try:
        candidate_cls = load_candidate(Workspace(workspace), build)
    except CandidateError as err:
        raise SandboxLoadError("load", err.message, err.hint) from None
    return adopt(candidate_cls, problem, reference, device)


def adopt(candidate_cls: type, problem: Any, reference: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`candidate_cls(*init_inputs)` holding the reference's parameters and buffers, on `device`."""
    try:
        candidate = candidate_cls(*problem.init_inputs)
    except Exception as exc:  # noqa: BLE001 - the user's constructor failing is a verdict, not a crash
        raise SandboxLoadError("init", f"ModelNew(*get_init_inputs()) raised {describe_exception(exc)}") from None
    if not isinstance(candidate, torch.nn.Module):
        raise SandboxLoadError("init", f"ModelNew is a {type(candidate).__name__}, not a torch.nn.Module")
    try:
        candidate.load_state_dict(reference.state_dict(), strict=True)
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())[:400]
        raise SandboxLoadError("init", f"ModelNew's parameters and buffers do not match Model's state_dict: {detail}") from None
    try:
        return candidate.to(device).train(reference.training)
    except Exception as exc:  # noqa: BLE001
        raise SandboxLoadError(*failure_kind(exc, "moving ModelNew to the device")) from None


class SandboxLoadError(Exception):
    def __init__(self, kind: str, message: str, hint: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.hint = kind, message, hint


# ------------------------------------------------------------------------------------- the process


def serve(args: argparse.Namespace) -> None:
    """Ready (torch imported, CUDA up: a spare waits here), then a "load" request, then one reply per request."""
    from kernelpilot.harness.confine import harden
    from kernelpilot.harness.float32 import pin_float32_math

    pin_float32_math()  # before any model (the reference's or the candidate's) exists in this process
    device = torch.device(args.device)
    if device.type == "cuda":  # before the confinement: the driver's start-up writes outside /dev
        torch.cuda.init()
        device = torch.device("cuda", torch.cuda.current_device())
        _warm_up(device)  # first-use costs (dispatch modes, the profiler, the allocator's snapshot) paid while idle
    confinement = harden()
    with os.fdopen(args.requests_fd, "r", encoding="utf-8") as requests, os.fdopen(args.replies_fd, "w") as replies:
        _write(replies, {"ok": True, "ready": True, "pid": os.getpid(), "confinement": confinement})
        local = None
        for line in requests:
            received = _perf_counter()
            request = json.loads(line)
            if local is None:
                local, reply = _load(request, device)
            else:
                reply = handle(local, request)
                # How long the run took in here, from its request's arrival: this process's word, a diagnostic
                # that splits the judge's unaccounted time into the pipes' share and this process's own.
                reply["in_process_ms"] = round((_perf_counter() - received) * 1e3, 4)
            _write(replies, {"id": request.get("id"), "ok": True, "result": reply, "exiting": reply.get("exiting")})
            if reply.get("exiting"):
                sys.stdout.flush()
                os._exit(3)


def _warm_up(device: torch.device) -> None:
    """What every first checked call of a fresh process would otherwise pay, done before a candidate waits on it."""
    x = torch.ones(1024, device=device)
    with torch.no_grad(), guards.AtenOpRecorder():
        y = x * 2
    clone_tree([y])[0].add_(1)
    poison_free_memory(device, [4096])
    guards.profile_forward(lambda: x.add(1), device)
    _synchronize(device)


def _load(request: dict, device: torch.device) -> tuple[LocalModel | None, dict]:
    """The one "load" request a sandbox takes: the model it serves for the rest of its life."""
    from kernelpilot.problem import load_problem

    args = request.get("args", {})
    if request.get("op") != "load" or args.get("mode") not in MODES:
        return None, {"ok": False, "error_kind": "harness", "message": "a sandbox must be loaded first", "exiting": True}
    try:
        started = _perf_counter()
        problem = load_problem(Path(args["problem"]), validate=False)
        workspace = Path(args["workspace"]) if args.get("workspace") else None
        problem_loaded = _perf_counter()
        # On before the candidate is imported: no code of its own ever runs without a profiler on.
        trace = KernelTrace(device) if args["mode"] == "candidate" and device.type == "cuda" else None
        model = load_model(args["mode"], problem, device, seed=int(args["seed"]), workspace=workspace,
                           library=args.get("library"))  # fmt: skip
    except SandboxLoadError as err:
        return None, {"ok": False, "error_kind": err.kind, "message": err.message, "hint": err.hint, "exiting": True}
    imported = guards.find_monkeypatches(guards.PRISTINE_FUNCTIONS, when="after the candidate was imported")
    # Where the load's seconds went, as this process saw them (diagnostics, not evidence).
    seconds = {"problem": round(problem_loaded - started, 4), "model": round(_perf_counter() - problem_loaded, 4)}
    return LocalModel(problem, model, device, workspace=workspace, trace=trace, mode=args["mode"]), {
        "ok": True, "pid": os.getpid(), "import_findings": [_finding(imported)] if imported else [],
        "seconds": seconds}  # fmt: skip


def handle(local: LocalModel, request: dict) -> dict:
    """One request's reply (a JSON-able dict with "ok"); a failure of the model is a reply, not an exception."""
    op, args = request.get("op"), request.get("args", {})
    try:
        if op == "call":
            started = _perf_counter()
            inputs = open_tree(args["inputs"])
            slots = [open_reference(ref) for ref in args["slots"]]
            opened = _perf_counter()
            reply = local.call(inputs, slots, seed=args["seed"], reference_aliases_inputs=args["reference_aliases_inputs"])
            # Where the call's seconds went, as this process saw them (diagnostics, not evidence).
            reply["seconds"] = {"open shared": round(opened - started, 4), "call": round(_perf_counter() - opened, 4)}
            if reply.get("error_kind") in ("crash", "cuda-error"):
                _LEFT_MAPPED.append((inputs, slots))  # unmapped in a broken context, they would abort the process
            del inputs, slots
        elif op == "profiled_call":
            reply = local.profiled_call(open_tree(args["inputs"]), seed=args["seed"])
        elif op == "bind":
            lent = args.get("inputs")
            reply = local.bind([open_reference(ref) for ref in args["slots"]], open_tree(lent) if lent else None)
        elif op == "run":
            lent = args.get("inputs")
            reply = local.run(args["seed"], trace=bool(args.get("trace")), inputs=open_tree(lent) if lent else None)
        elif op == "traced_kernels":
            reply = local.traced_kernels()
        elif op == "kernels":
            reply = local.kernels(args["seed"])
        else:
            reply = {"ok": False, "error_kind": "harness", "message": f"unknown sandbox request {op!r}"}
    except Exception as exc:  # noqa: BLE001 - whatever happens here is reported, the process goes on if it can
        # Everything in this process is the candidate's to answer for (a tensor subclass it returned raising in a
        # self-check, say): no exception here can turn into a "harness" error with no verdict.
        reply = _failed(exc, f"the candidate's process, handling {op},")
    if reply.get("error_kind") in ("crash", "cuda-error"):
        reply["exiting"] = True  # the CUDA context is unusable
    return reply


def _write(stream: Any, data: dict) -> None:
    stream.write(json.dumps(data, default=str) + "\n")
    stream.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="kernelpilot sandbox (started by the judge, not by hand)")
    parser.add_argument("--device", required=True)
    parser.add_argument("--requests-fd", type=int, required=True)
    parser.add_argument("--replies-fd", type=int, required=True)
    serve(parser.parse_args(argv))


if __name__ == "__main__":
    main()
