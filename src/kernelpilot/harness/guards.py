"""Anti-cheat guards: each names one way a candidate can look correct without doing the work.

Every guard is a small function over plain values (tensors, op counts, kernel names, a module) that returns a
`GuardFinding` or None, so verify.py runs them inside the worker and the tests run them on CPU tensors. This module
runs in the worker process only (it imports torch at the top) and must be imported before any candidate is: it
takes its reference copy of the timing and comparison functions at import time.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import operator
import re
import time
import types
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernelpilot.results import GuardFinding

TORCH_COMPUTE = "torch-compute"
NO_CUSTOM_KERNEL = "no-custom-kernel"
OUTPUT_ALIASES_INPUT = "output-aliases-input"
CACHED_OUTPUT = "cached-output"
INPUT_MUTATED = "input-mutated"
UNSYNCED_STREAM = "unsynced-stream"
MONKEYPATCH = "monkeypatch"
PROTECTED_FILES = "protected-files"
PRECISION_DROP = "precision-drop"

# ------------------------------------------------------------------------------------------ tensors in trees


def tensor_leaves(tree: Any, name: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a nested tuple/list/dict, with a readable path: out, out[1], out['h'][0]."""
    if isinstance(tree, torch.Tensor):
        return [(name, tree)]
    if isinstance(tree, (tuple, list)):
        return [leaf for i, item in enumerate(tree) for leaf in tensor_leaves(item, f"{name}[{i}]")]
    if isinstance(tree, dict):
        return [leaf for key, item in tree.items() for leaf in tensor_leaves(item, f"{name}[{key!r}]")]
    return []


def clone_tree(tree: Any) -> Any:
    """A copy of a nested structure in which every tensor is cloned (same strides) and everything else shared."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, tuple):
        return tuple(clone_tree(item) for item in tree)
    if isinstance(tree, list):
        return [clone_tree(item) for item in tree]
    if isinstance(tree, dict):
        return {key: clone_tree(item) for key, item in tree.items()}
    return tree


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal values, NaN equal to NaN; False when shapes or dtypes differ."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))
    return bool(torch.equal(a, b))


def _memory_span(t: torch.Tensor) -> tuple[torch.device, int, int] | None:
    """(device, first byte, end byte) of the memory behind `t`'s storage; None when it owns no memory."""
    storage = t.untyped_storage()
    if storage.nbytes() == 0 or storage.data_ptr() == 0:
        return None
    start = storage.data_ptr()
    return t.device, start, start + storage.nbytes()


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the memory behind `a` and `b` overlaps: views, and tensors a C++ extension made over one pointer."""
    span_a, span_b = _memory_span(a), _memory_span(b)
    if span_a is None or span_b is None or span_a[0] != span_b[0]:
        return False
    return span_a[1] < span_b[2] and span_b[1] < span_a[2]


def aliased_pairs(
    outputs: list[tuple[str, torch.Tensor]], others: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, str]]:
    """(output name, other name) for every output whose memory overlaps one of `others`."""
    return [(out_name, other_name) for out_name, out in outputs for other_name, other in others if shares_memory(out, other)]


def _pairs_text(pairs: list[tuple[str, str]]) -> str:
    return ", ".join(f"{a} with {b}" for a, b in pairs)


# ------------------------------------------------------------------------------------------ torch-compute

# Aten ops a candidate's forward may run around its kernels: allocation and initialisation (a memset is no
# compute of the result), views and metadata. Everything else is torch computing (part of) the answer. Names
# are overload packets as the dispatcher sees them, after composite ops such as reshape are decomposed.
ALLOWED_ATEN_OPS = frozenset(
    f"aten::{name}"
    for name in (
        # allocation and initialisation
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
        "zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full",
        "fill_", "zero_", "scalar_tensor", "lift_fresh", "resize_", "record_stream",
        # views
        "view", "_unsafe_view", "_reshape_alias", "as_strided", "as_strided_", "alias", "detach",
        "t", "transpose", "permute", "unsqueeze", "squeeze", "expand", "slice", "select", "narrow",
        "split", "split_with_sizes", "unbind", "diagonal", "unfold", "view_as_real", "view_as_complex",
        # metadata
        "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    )
)  # fmt: skip


# The dispatch keys below Python's: a workspace op is run from them, so that the ops its kernel calls are recorded.
_BELOW_PYTHON = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)


class AtenOpRecorder(TorchDispatchMode):
    """Counts every op dispatched while active, including those a C++ extension calls through the dispatcher.

    Calls of the workspace's own ops (torch custom operators in `own_namespaces`) are counted apart in
    `own_calls`, and their kernels run with the recorder active: a dispatch mode is off while it handles a call,
    so without this the aten ops a binding calls (its allocations, or torch compute) would go unseen.
    """

    def __init__(self, own_namespaces: Iterable[str] = ()) -> None:
        super().__init__()
        self.own_namespaces = frozenset(own_namespaces)
        self.counts: Counter[str] = Counter()
        self.own_calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: A002 - torch's signature
        name, kwargs = func.overloadpacket._qualified_op_name, kwargs or {}
        if func.namespace not in self.own_namespaces:
            self.counts[name] += 1
            return func(*args, **kwargs)
        self.own_calls[name] += 1
        tensors = [tensor for _, tensor in tensor_leaves((args, kwargs), "arguments")]
        if not tensors:  # no tensor says which kernel to run: such an op runs as a plain call, unwatched
            return func(*args, **kwargs)
        keys = functools.reduce(operator.or_, (torch._C._dispatch_keys(tensor) for tensor in tensors))
        with self:
            return func.redispatch(keys & _BELOW_PYTHON, *args, **kwargs)


def find_torch_compute(op_counts: Mapping[str, int], allowed: frozenset[str] = ALLOWED_ATEN_OPS) -> GuardFinding | None:
    """Fail when forward ran aten ops other than allocation, views and metadata; name each with its count."""
    computing = {name: count for name, count in op_counts.items() if name not in allowed}
    if not computing:
        return None
    listed = ", ".join(f"{name} x{count}" for name, count in sorted(computing.items(), key=lambda kv: (-kv[1], kv[0])))
    return GuardFinding(
        TORCH_COMPUTE,
        "fail",
        f"ModelNew.forward computed with torch ops ({listed}); only allocation, views and metadata may run "
        "through torch, the work must be done by the workspace's kernels.",
    )


# --------------------------------------------------------------------------- aliasing, mutation, caching


def find_output_aliasing(
    outputs: list[tuple[str, torch.Tensor]],
    inputs: list[tuple[str, torch.Tensor]],
    reference_outputs: list[tuple[str, torch.Tensor]],
    *,
    reference_aliases_inputs: bool,
) -> GuardFinding | None:
    """Fail when an output shares memory with an input (unless the reference's does too) or the reference's output."""
    pairs = aliased_pairs(outputs, reference_outputs)
    if not reference_aliases_inputs:
        pairs = aliased_pairs(outputs, inputs) + pairs
    if not pairs:
        return None
    return GuardFinding(
        OUTPUT_ALIASES_INPUT,
        "fail",
        f"outputs share memory with tensors the candidate did not produce ({_pairs_text(pairs)}); "
        "return freshly allocated outputs.",
    )


def find_mutated_inputs(
    inputs: list[tuple[str, torch.Tensor]], inputs_before: list[tuple[str, torch.Tensor]], *, mutable: set[str]
) -> GuardFinding | None:
    """Fail when an input's values changed during forward, except inputs the reference itself changes (`mutable`)."""
    changed = [
        name
        for (name, after), (_, before) in zip(inputs, inputs_before)
        if name not in mutable and not same_values(after, before)
    ]
    if not changed:
        return None
    return GuardFinding(
        INPUT_MUTATED, "fail", f"forward wrote into its inputs ({', '.join(changed)}); inputs are read-only."
    )


def module_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a module holds between calls: parameters, buffers and tensor attributes (also in containers)."""
    held: list[tuple[str, torch.Tensor]] = []
    for prefix, submodule in module.named_modules():
        owner = f"self.{prefix}" if prefix else "self"
        for attribute, value in vars(submodule).items():
            if attribute in ("_parameters", "_buffers"):
                held += [(f"{owner}.{key}", item) for key, item in value.items() if item is not None]
            elif attribute != "_modules":
                held += tensor_leaves(value, f"{owner}.{attribute}")
    return held


def find_module_held_output(outputs: list[tuple[str, torch.Tensor]], module: torch.nn.Module) -> GuardFinding | None:
    """Fail when an output is (a view of) a tensor the module keeps: the next call would overwrite the result."""
    pairs = aliased_pairs(outputs, module_tensors(module))
    if not pairs:
        return None
    return GuardFinding(
        CACHED_OUTPUT,
        "fail",
        f"outputs are tensors the module keeps between calls ({_pairs_text(pairs)}); a later call overwrites "
        "an earlier result, so allocate each output in forward.",
    )


@dataclass
class PreviousCall:
    """What one trial leaves for the next: its output objects (kept alive) and copies of their values."""

    outputs: list[tuple[str, torch.Tensor]]
    values: list[tuple[str, torch.Tensor]]
    reference_values: list[tuple[str, torch.Tensor]]


def find_reused_output(outputs: list[tuple[str, torch.Tensor]], previous: PreviousCall) -> GuardFinding | None:
    """Fail when a call returns the previous call's memory or changes the previous call's result."""
    pairs = aliased_pairs(outputs, previous.outputs)
    overwritten = [
        name for (name, kept), (_, copy) in zip(previous.outputs, previous.values) if not same_values(kept, copy)
    ]
    if not pairs and not overwritten:
        return None
    details = []
    if pairs:
        details.append(f"this call returned the previous call's memory ({_pairs_text(pairs)})")
    if overwritten:
        details.append(f"the previous call's result changed afterwards ({', '.join(overwritten)})")
    return GuardFinding(CACHED_OUTPUT, "fail", "; ".join(details) + "; outputs must be computed by each call.")


def find_repeated_values(
    outputs: list[tuple[str, torch.Tensor]], reference_values: list[tuple[str, torch.Tensor]], previous: PreviousCall
) -> GuardFinding | None:
    """Fail when an output repeats the previous call's values exactly although the reference's changed."""
    repeated = [
        name
        for (name, out), (_, earlier), (_, ref), (_, earlier_ref) in zip(
            outputs, previous.values, reference_values, previous.reference_values
        )
        if out.numel() > 0 and same_values(out, earlier) and not same_values(ref, earlier_ref)
    ]
    if not repeated:
        return None
    return GuardFinding(
        CACHED_OUTPUT,
        "fail",
        f"new inputs gave exactly the previous call's values ({', '.join(repeated)}) while the reference's changed: "
        "the result was computed before the call.",
    )


# --------------------------------------------------------------------------------------- streams (CUDA)


def find_unsynced_output(
    read_at_return: list[tuple[str, torch.Tensor]], read_after_sync: list[tuple[str, torch.Tensor]]
) -> GuardFinding | None:
    """Fail when outputs read right after forward returned differ from the same outputs after a device sync."""
    changed = [
        name for (name, early), (_, late) in zip(read_at_return, read_after_sync) if not same_values(early, late)
    ]
    if not changed:
        return None
    return GuardFinding(
        UNSYNCED_STREAM,
        "fail",
        f"outputs were still being written after forward returned ({', '.join(changed)}): work left on another "
        "stream must be joined to the current stream (event + wait_stream) before returning.",
    )


@dataclass
class KernelLaunch:
    """One GPU kernel seen by the profiler during a forward: its (demangled) name and its CUDA stream id."""

    name: str
    stream: int


@dataclass
class ProfiledForward:
    """The GPU side of one forward: its kernels, the current stream's id, and whether it synchronised."""

    kernels: list[KernelLaunch] = field(default_factory=list)
    current_stream: int | None = None
    synchronized: bool = False


# Runtime calls after which work on another stream is ordered before what follows on the current one.
_SYNC_CALLS = frozenset({"cudaStreamWaitEvent", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"})
_FORWARD_LABEL = "kernelpilot::candidate_forward"


def profile_forward(forward, device: torch.device) -> ProfiledForward:
    """Run `forward()` once under torch.profiler and return the kernels it launched and on which streams.

    A one-element fill on the current stream runs first, inside the same trace, to learn that stream's id.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    marker = torch.empty(1, device=device)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        marker.fill_(1.0)
        with record_function(_FORWARD_LABEL):
            forward()
        torch.cuda.synchronize(device)
    return read_trace(list(trace.profiler.kineto_results.events()))


def read_trace(events: list[Any]) -> ProfiledForward:
    """Kernels after the marker fill, the marker's stream, and whether a sync call ran inside the forward's range."""
    on_gpu = torch.autograd.DeviceType.CUDA
    gpu_kernels = sorted((e for e in events if e.device_type() == on_gpu and _is_kernel(e)), key=lambda e: e.start_ns())
    profiled = ProfiledForward()
    if gpu_kernels:
        marker, *forward_kernels = gpu_kernels
        profiled.current_stream = marker.device_resource_id()
        profiled.kernels = [KernelLaunch(e.name(), e.device_resource_id()) for e in forward_kernels]
    ranges = [(e.start_ns(), e.end_ns()) for e in events if e.name() == _FORWARD_LABEL and e.device_type() != on_gpu]
    if ranges:
        start, end = ranges[0]
        profiled.synchronized = any(e.name() in _SYNC_CALLS and start <= e.start_ns() <= end for e in events)
    return profiled


def _is_kernel(event: Any) -> bool:
    # The record_function range also appears on the GPU timeline, under its own name.
    return event.name() != _FORWARD_LABEL and not event.name().startswith(("Memcpy", "Memset", "[memory]"))


def find_unsynced_side_stream(profiled: ProfiledForward) -> GuardFinding | None:
    """Fail when forward launched kernels on a stream other than the current one and never synchronised."""
    if profiled.current_stream is None or profiled.synchronized:
        return None
    side = sorted({k.name for k in profiled.kernels if k.stream != profiled.current_stream})
    if not side:
        return None
    return GuardFinding(
        UNSYNCED_STREAM,
        "fail",
        f"forward launched kernels on another stream and did not synchronise before returning ({', '.join(side[:5])}).",
    )


# ------------------------------------------------------------------------------------ custom kernels (CUDA)

# Kernels of torch itself (aten, its bundled attention kernels, Inductor's Triton kernels): computing with them in
# forward is torch computing the answer.
_TORCH_KERNEL_MARKERS = ("at::", "at_cuda_detail", "c10::", "pytorch_flash", "fmha", "triton_")
# Kernels of the libraries a binding may call itself for GEMM and convolution (SKILL.md allows it): not torch
# compute, but not the workspace's own kernel either.
_LIBRARY_KERNEL_MARKERS = ("cublas", "cudnn", "cutlass", "xmma", "gemm", "gemv", "nvjet", "sm80_", "sm90_", "cub::",
                           # cuDNN's legacy convolution kernels, which carry no library prefix (a transposed
                           # convolution's data gradient: convolveNd_dgrad_float_engine, dgrad_engine, and the
                           # setTensor5d/scaleTensor kernels around them)
                           "convolve", "dgrad", "wgrad", "fft2d", "winograd", "settensor", "scaletensor")
# Calls by which workspace code runs a library's GEMM or convolution itself: their kernels are its work.
_LIBRARY_CALLS = re.compile(r"\b(?:cublasLtMatmul|cublas\w*[Gg]emm\w*|cudnnConvolution(?:BiasActivation)?Forward|cudnnConvolutionBackwardData)\s*\(")
# Torch kernels that compute nothing: memory initialisation (torch.zeros / fill_), which forward may use, and the
# sleep (torch.cuda._sleep) a sandbox puts before a timed call to cover its dispatch.
_INITIALISING_KERNEL_MARKERS = ("FillFunctor", "spin_kernel")


def kernel_base_name(demangled: str) -> str:
    """`void kp::relu_kernel<float>(float const*, float*, long)` -> `relu_kernel`."""
    head = demangled.replace("(anonymous namespace)", "anonymous").split("(", 1)[0]  # drop the parameters
    depth, outside_templates = 0, []
    for char in head:  # template arguments may contain spaces and '::', so drop them first
        depth += char == "<"
        if depth == 0:
            outside_templates.append(char)
        depth -= char == ">"
    words = "".join(outside_templates).split()
    return words[-1].rsplit("::", 1)[-1] if words else demangled


def is_torch_kernel(name: str) -> bool:
    """True for kernels of torch itself (aten, its attention kernels, Inductor's Triton kernels)."""
    return any(marker in name for marker in _TORCH_KERNEL_MARKERS)


def is_library_kernel(name: str) -> bool:
    """True for kernels of torch or of cuBLAS, cuDNN and CUTLASS rather than the workspace."""
    lowered = name.lower()
    return is_torch_kernel(name) or any(marker in lowered for marker in _LIBRARY_KERNEL_MARKERS)


def find_no_custom_kernel(kernel_names: list[str], workspace_source: str | None) -> GuardFinding | None:
    """Fail when none of forward's kernels is the candidate's own.

    With the workspace's kernel sources at hand, a kernel counts when its name is defined there, or when it is a
    cuBLAS/cuDNN kernel and the sources call that library themselves (a GEMM whose epilogue does all the work
    launches nothing else); without them, when it is not a torch or library kernel.
    """
    if workspace_source is not None:
        calls_library = _LIBRARY_CALLS.search(workspace_source) is not None
        own = [
            name
            for name in kernel_names
            if _defined_in(kernel_base_name(name), workspace_source)
            or (calls_library and is_library_kernel(name) and not is_torch_kernel(name))
        ]
    else:
        own = [name for name in kernel_names if not is_library_kernel(name)]
    if own:
        return None
    seen = ", ".join(sorted({kernel_base_name(name) for name in kernel_names})[:8]) or "none"
    return GuardFinding(
        NO_CUSTOM_KERNEL,
        "fail",
        f"forward launched no kernel of the workspace (kernels seen: {seen}); the work must run in kernels/*.cu.",
    )


def _defined_in(identifier: str, source: str) -> bool:
    return re.search(rf"\b{re.escape(identifier)}\b", source) is not None


def find_torch_kernels(kernel_names: list[str], *, during: str = "forward") -> GuardFinding | None:
    """Fail when torch's own kernels other than memory initialisation ran during forward.

    The profiler sees kernels however they were launched: from another thread, or with the dispatcher bypassed.
    cuBLAS and cuDNN kernels a binding calls itself are allowed.
    """
    computing = Counter(
        kernel_base_name(name)
        for name in kernel_names
        if is_torch_kernel(name) and not any(marker in name for marker in _INITIALISING_KERNEL_MARKERS)
    )
    if not computing:
        return None
    listed = ", ".join(f"{name} x{count}" for name, count in computing.most_common(8))
    return GuardFinding(TORCH_COMPUTE, "fail", f"{during} ran torch's kernels ({listed}); the work must run in kernels/*.cu.")


# -------------------------------------------------------------------------------------------- monkeypatch

# Functions whose replacement would falsify timing or comparison, as (module, attribute path). Names this torch
# lacks are skipped.
WATCHED_FUNCTIONS = (
    ("time", "perf_counter"), ("time", "time"), ("time", "monotonic"),
    ("torch.cuda", "synchronize"), ("torch._C", "_cuda_synchronize"), ("torch.cuda", "current_stream"),
    ("torch.cuda", "Event"), ("torch.cuda", "Event.record"), ("torch.cuda", "Event.elapsed_time"),
    ("torch.cuda", "Event.synchronize"), ("torch.cuda", "Event.query"), ("torch.cuda", "Stream"),
    ("torch.cuda", "Stream.synchronize"), ("torch.cuda", "Stream.wait_event"),
    ("torch.testing", "assert_close"), ("torch", "allclose"), ("torch", "isclose"), ("torch", "equal"),
)  # fmt: skip


def _owner_and_attribute(module: str, path: str) -> tuple[Any, str]:
    """The object holding the last attribute of `path` (a module or class) and that attribute's name."""
    owner: Any = importlib.import_module(module)
    *parents, attribute = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, attribute


def _current(module: str, path: str) -> Any:
    """What `module.path` is now; for a class attribute, the class's own entry (not a bound method)."""
    try:
        owner, attribute = _owner_and_attribute(module, path)
        if isinstance(owner, type):
            return inspect.getattr_static(owner, attribute)
        return getattr(owner, attribute)
    except Exception:  # noqa: BLE001 - a candidate may replace an owner (torch.cuda.Event) with anything at all
        return None


def snapshot_functions(watched: Iterable[tuple[str, str]] = WATCHED_FUNCTIONS) -> dict[tuple[str, str], Any]:
    """The current object behind each watched name that exists."""
    snapshot = {name: _current(*name) for name in watched}
    return {name: value for name, value in snapshot.items() if value is not None}


def find_monkeypatches(snapshot: Mapping[tuple[str, str], Any], *, when: str) -> GuardFinding | None:
    """Fail when a watched function is not the object in `snapshot`, or not torch's or the standard library's own.

    The second test catches a replacement made before the snapshot was taken (a candidate imported before
    this module); `when` says at which point the check ran.
    """
    replaced = [
        f"{module}.{path}"
        for (module, path), original in snapshot.items()
        if _current(module, path) is not original or not _is_genuine(_current(module, path))
    ]
    if not replaced:
        return None
    return GuardFinding(
        MONKEYPATCH,
        "fail",
        f"the candidate replaced timing or comparison functions ({', '.join(replaced)}), seen {when}; "
        "the originals were put back.",
    )


_TORCH_DIRECTORY = Path(torch.__file__).resolve().parent


def _is_genuine(obj: Any) -> bool:
    """True for C functions of torch or `time`, and for functions and classes whose code lies inside torch."""
    if isinstance(obj, types.BuiltinFunctionType):
        return getattr(obj, "__module__", None) in ("time", "torch", "torch._C")
    code = getattr(obj, "__code__", None)
    try:
        file = code.co_filename if code is not None else inspect.getfile(obj)
    except TypeError:
        return False
    return Path(file).resolve().is_relative_to(_TORCH_DIRECTORY)


def restore_functions(snapshot: Mapping[tuple[str, str], Any]) -> None:
    """Put every recorded object back, so one candidate's patch cannot falsify the next one's evaluation."""
    for (module, path), original in snapshot.items():
        if _current(module, path) is not original:
            owner, attribute = _owner_and_attribute(module, path)
            setattr(owner, attribute, original)


# Taken when the worker imports this module, before any candidate module is imported.
PRISTINE_FUNCTIONS: dict[str, Any] = snapshot_functions()
# verify.py's own clock, immune to a candidate replacing time.perf_counter.
perf_counter = time.perf_counter


# ----------------------------------------------------------------------------------------- protected files


def find_tampered_files(workspace_root: Path) -> GuardFinding | None:
    """Fail when the workspace's protected files (model.py, the registry, setup.py, ...) differ from the manifest."""
    from kernelpilot.errors import WorkspaceError
    from kernelpilot.workspace import open_workspace, tampered_files

    try:
        changed = tampered_files(open_workspace(workspace_root))
    except WorkspaceError as err:
        return GuardFinding(PROTECTED_FILES, "fail", f"the protected files cannot be checked: {err.message}")
    if not changed:
        return None
    return GuardFinding(
        PROTECTED_FILES,
        "fail",
        f"protected workspace files were changed or deleted ({', '.join(changed)}); only kernels/ and "
        "model_new.py may be edited.",
    )


def workspace_kernel_source(workspace_root: Path) -> str | None:
    """The text of the workspace's kernels/*.cu and *.cpp files, to recognise its kernels by name."""
    from kernelpilot.errors import WorkspaceError
    from kernelpilot.workspace import open_workspace

    try:
        sources = open_workspace(workspace_root).kernel_sources()
    except WorkspaceError:
        return None
    return "\n".join(path.read_text(errors="replace") for path in sources)


# ------------------------------------------------------------------------------------------ precision drop

# An fp32 result computed in fp32 is off from an fp64 result by ~1e-7 relative; one rounded through fp16 by
# ~2^-12 and through bf16 by ~2^-9 (median). Half the fp16 level separates the two.
_HALF_PRECISION_MEDIAN_REL_ERROR = 2.0**-13
_ERROR_RATIO = 8.0


def find_precision_drop(
    candidate: torch.Tensor, reference: torch.Tensor, reference_fp64: torch.Tensor
) -> GuardFinding | None:
    """Warn when an fp32 output is much further from fp64 than the fp32 reference and looks half-precision.

    "Looks half-precision": equal to the reference rounded to bf16 or fp16, or a median relative error at
    the level of fp16 rounding or worse.
    """
    exact = reference_fp64.double()
    candidate_error = (candidate.double() - exact).abs().max().item()
    reference_error = (reference.double() - exact).abs().max().item()
    if candidate_error == 0.0 or candidate_error < _ERROR_RATIO * reference_error:
        return None
    rounded_to = _rounded_reference_dtype(candidate, reference)
    median_relative = _median_relative_error(candidate.double(), exact)
    if rounded_to is None and median_relative < _HALF_PRECISION_MEDIAN_REL_ERROR:
        return None
    how = f"equals the reference rounded to {rounded_to}" if rounded_to else "has a half-precision-level error"
    return GuardFinding(
        PRECISION_DROP,
        "warn",
        f"the fp32 output {how}: max error vs an fp64 reference {candidate_error:.3g} "
        f"(the fp32 reference's own: {reference_error:.3g}), median relative error {median_relative:.3g}.",
    )


def _median_relative_error(values: torch.Tensor, exact: torch.Tensor) -> float:
    nonzero = exact != 0
    if not nonzero.any():
        return 0.0
    return ((values - exact)[nonzero].abs() / exact[nonzero].abs()).median().item()


def _rounded_reference_dtype(candidate: torch.Tensor, reference: torch.Tensor) -> str | None:
    for dtype, label in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        if torch.equal(candidate, reference.to(dtype).to(candidate.dtype)):
            return label
    return None
