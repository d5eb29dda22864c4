"""Speed-of-light floor of a problem: its FLOPs and fewest bytes against the GPU's measured ceilings.

FLOPs are what `torch.utils.flop_counter` counts (matmuls, convolutions, attention: the work tensor cores do);
elementwise and reduction work is bounded by memory and enters through bytes. The fewest bytes a kernel can move
are its inputs, outputs and parameters/buffers, each once. The ceilings are measured on the GPU, not taken
from a data sheet: a large device-to-device copy and 8192^3 matmuls, once per GPU model, cached on disk.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelpilot.harness.cache import MemoryCache, device_name, load_entry, store_entry
from kernelpilot.harness.clock import time_callable
from kernelpilot.results import Roofline

if TYPE_CHECKING:
    from kernelpilot.problem import Problem

COST_KIND = "cost"
CEILINGS_KIND = "ceilings"
# When the meta run fails (an op with no meta kernel, data-dependent shapes), count on the real device, but
# only for problems whose inputs and parameters are this small: the count is a full forward pass.
REAL_RUN_MAX_BYTES = 1 << 30
COPY_BYTES = 1 << 30
MATMUL_SIZE = 8192
# The rates kept per GPU; `matmul_rate` picks the one a problem's dtype runs at.
MATMUL_DTYPES = ("bfloat16", "float16", "tf32", "float32")


@dataclass
class ProblemCost:
    """What one forward pass of the reference must do, whatever kernel does it."""

    flops: float
    bytes: float
    dtype: str  # the inputs' dominant floating dtype, e.g. "float32"; "" when they have none
    counted_on: str  # "meta", or the device the fallback run used
    conv_flops: float = 0.0  # the part of `flops` done by convolutions (cuDNN has its own tf32 switch)


def floor_time(flops: float, bytes: float, bandwidth_gbs: float, tflops: float) -> tuple[float, str]:
    """The speed-of-light time in ms and what bounds it ("memory" or "compute")."""
    if bandwidth_gbs <= 0 or tflops <= 0:
        raise ValueError(f"ceilings must be positive, got {bandwidth_gbs} GB/s and {tflops} TFLOP/s")
    memory_ms = bytes / (bandwidth_gbs * 1e9) * 1e3
    compute_ms = flops / (tflops * 1e12) * 1e3
    if compute_ms > memory_ms:
        return compute_ms, "compute"
    return memory_ms, "memory"


# ------------------------------------------------------------------------------------- problem cost


def tensors_in(values: Any) -> list:
    """The distinct tensors in a (nested) structure of inputs or outputs."""
    import torch
    from torch.utils._pytree import tree_leaves

    seen: dict[int, torch.Tensor] = {}
    for leaf in tree_leaves(values):
        if isinstance(leaf, torch.Tensor):
            seen.setdefault(id(leaf), leaf)
    return list(seen.values())


def nbytes_of(values: Any) -> int:
    """Bytes held by the distinct tensors in `values` (meta tensors count by shape, like real ones)."""
    return sum(t.numel() * t.element_size() for t in tensors_in(values))


def dominant_dtype(values: Any) -> str:
    """The floating dtype holding the most bytes among the tensors in `values` ("" when there is none)."""
    bytes_per_dtype: dict[str, int] = {}
    for tensor in tensors_in(values):
        if tensor.is_floating_point():
            name = str(tensor.dtype).removeprefix("torch.")
            bytes_per_dtype[name] = bytes_per_dtype.get(name, 0) + tensor.numel() * tensor.element_size()
    return max(bytes_per_dtype, key=bytes_per_dtype.get, default="")


def count_cost(problem: Problem, *, device: str) -> ProblemCost:
    """Count FLOPs and bytes of one reference forward: on meta tensors, else on `device` if the problem is small."""
    try:
        return _count_on(problem, "meta")
    except Exception as meta_error:  # noqa: BLE001 - any op may lack a meta kernel; the fallback decides
        held = _held_bytes_on_meta(problem)
        if held is None or held > REAL_RUN_MAX_BYTES:
            raise RuntimeError(
                f"the cost of {problem.name} cannot be counted on meta tensors ({type(meta_error).__name__}) "
                f"and the problem is too large to count on {device}"
            ) from meta_error
        return _count_on(problem, device)


def _count_on(problem: Problem, device: str) -> ProblemCost:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model, inputs = _instantiate(problem, device)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        outputs = model(*inputs)
    state = list(model.parameters()) + list(model.buffers())
    moved = nbytes_of(inputs) + nbytes_of(outputs) + nbytes_of(state)
    per_op = counter.get_flop_counts().get("Global", {})
    return ProblemCost(
        flops=float(counter.get_total_flops()),
        bytes=float(moved),
        dtype=dominant_dtype(inputs) or dominant_dtype(state),
        counted_on=device,
        conv_flops=float(sum(count for op, count in per_op.items() if "convolution" in str(op))),
    )


def _instantiate(problem: Problem, device: str) -> tuple[Any, list]:
    """Model and inputs born on `device` (inputs of several GB must never be made on the host first)."""
    import torch

    # Not problem.make_model: it builds on the host and moves, which allocates and initialises real weights.
    with torch.device(device):
        model = problem.model_cls(*problem.init_inputs).eval()
    return model.to(device), problem.make_inputs(device=device, seed=0)


def _held_bytes_on_meta(problem: Problem) -> int | None:
    """Bytes of the inputs and parameters, from a meta instantiation; None when even that fails."""
    try:
        model, inputs = _instantiate(problem, "meta")
    except Exception:  # noqa: BLE001 - unknown size: the caller must not risk a real run
        return None
    return nbytes_of(inputs) + nbytes_of(list(model.parameters()) + list(model.buffers()))


# ------------------------------------------------------------------------------------- GPU ceilings


def measure_ceilings(device: str) -> dict[str, Any]:
    """Measure the GPU's copy bandwidth (GB/s, read + write) and dense matmul rates (TFLOP/s per dtype)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"ceilings can only be measured on a CUDA device, not {device!r}")
    try:
        with torch.cuda.device(dev):
            return {
                "gpu": device_name(device),
                "bandwidth_gbs": _copy_bandwidth_gbs(dev),
                "matmul_tflops": {name: _matmul_tflops(dev, name) for name in MATMUL_DTYPES},
            }
    finally:
        torch.cuda.empty_cache()  # the probes' gigabytes go back to the caller's process, not the cache


def _copy_bandwidth_gbs(device) -> float:
    import torch

    # Leave room for whatever else the worker holds; the copy must still dwarf the L2 to measure DRAM.
    free_bytes, _ = torch.cuda.mem_get_info(device)
    size = min(COPY_BYTES, free_bytes // 4)
    source = torch.empty(size, dtype=torch.uint8, device=device).random_()
    target = torch.empty_like(source)
    timing = _time(lambda: target.copy_(source), device)
    return 2 * size / (timing.median_ms * 1e-3) / 1e9


def _matmul_tflops(device, name: str) -> float:
    import torch

    dtype = torch.float32 if name in ("tf32", "float32") else getattr(torch, name)
    a, b = (torch.randn(MATMUL_SIZE, MATMUL_SIZE, dtype=dtype, device=device) for _ in range(2))
    out = torch.empty_like(a)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
    try:
        timing = _time(lambda: torch.matmul(a, b, out=out), device)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return 2 * MATMUL_SIZE**3 / (timing.median_ms * 1e-3) / 1e12


def _time(call, device):
    # The operands dwarf the L2, so a flush would only add noise.
    return time_callable(call, [[]], device=str(device), min_runs=10, max_runs=30, max_seconds=3.0, flush_l2=False)


def gpu_ceilings(device: str, cache_dir: Path | MemoryCache | None = None) -> dict[str, Any]:
    """The ceilings of the GPU at `device`: from the cache, else measured once and stored."""
    key = {"gpu": device_name(device)}
    cached = load_entry(CEILINGS_KIND, key, cache_dir)
    if cached is not None:
        return cached
    ceilings = measure_ceilings(device)
    store_entry(CEILINGS_KIND, key, ceilings, cache_dir)
    return ceilings


def matmul_rate(ceilings: dict[str, Any], dtype: str, *, tf32: bool | None = None) -> float:
    """The matmul TFLOP/s a problem of `dtype` can reach; fp32 runs at the tf32 rate only when tf32 is allowed."""
    rates = ceilings["matmul_tflops"]
    if dtype in ("bfloat16", "float16"):
        return rates[dtype]
    if tf32 is None:
        import torch

        tf32 = torch.backends.cuda.matmul.allow_tf32
    if dtype == "float32" and tf32:
        return rates["tf32"]
    # float64 and integer problems have no tensor-core rate of their own here; fp32 is the nearest ceiling.
    return rates["float32"]


def effective_rate(ceilings: dict[str, Any], cost: ProblemCost) -> float:
    """The TFLOP/s of the problem's whole compute: matmuls at torch's matmul precision, convolutions at cuDNN's.

    For fp32 the two switches differ by default (cuDNN allows tf32, cuBLAS does not), and the rates by 7x.
    """
    import torch

    matmul_flops = cost.flops - cost.conv_flops
    matmul = matmul_rate(ceilings, cost.dtype, tf32=torch.backends.cuda.matmul.allow_tf32)
    conv = matmul_rate(ceilings, cost.dtype, tf32=torch.backends.cudnn.allow_tf32)
    if cost.flops <= 0:
        return matmul
    return cost.flops / (matmul_flops / matmul + cost.conv_flops / conv)


# ----------------------------------------------------------------------------------------- roofline


def problem_cost(problem: Problem, *, device: str, cache_dir: Path | MemoryCache | None = None) -> ProblemCost:
    """`count_cost`, cached per problem and torch version (flop formulas change with torch)."""
    import torch

    key = {"problem_id": problem.problem_id, "torch": torch.__version__}
    cached = load_entry(COST_KIND, key, cache_dir)
    if cached is not None:
        return ProblemCost(**cached)
    cost = count_cost(problem, device=device)
    store_entry(COST_KIND, key, asdict(cost), cache_dir)
    return cost


def problem_roofline(
    problem: Problem,
    *,
    device: str,
    cache_dir: Path | MemoryCache | None = None,
    ceilings: dict[str, Any] | None = None,
) -> Roofline:
    """The problem's speed-of-light floor on the GPU at `device` (or against `ceilings` given explicitly)."""
    import torch

    if ceilings is None:
        if torch.device(device).type != "cuda":
            raise ValueError(f"no measured ceilings exist for {device!r}: pass ceilings= explicitly")
        ceilings = gpu_ceilings(device, cache_dir)
    cost = problem_cost(problem, device=device, cache_dir=cache_dir)
    rate = effective_rate(ceilings, cost)
    floor_ms, bound = floor_time(cost.flops, cost.bytes, ceilings["bandwidth_gbs"], rate)
    return Roofline(
        flops=cost.flops,
        bytes=cost.bytes,
        floor_ms=floor_ms,
        bound=bound,
        bandwidth_gbs=ceilings["bandwidth_gbs"],
        matmul_tflops=rate,
    )
