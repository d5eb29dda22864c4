"""How many bytes a problem needs (its inputs, outputs and parameters, measured on meta tensors) and whether that
fits the device the judge will use; the host's memory in the same units."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kernelpilot.errors import ProblemError

if TYPE_CHECKING:
    import torch

# During a correctness trial the judge holds three copies of the inputs (the trial's, an untouched copy for the
# mutation guard, the reference's own) and three of the outputs (the reference's, the candidate's, the candidate's
# read the moment forward returned), and two models with the same parameters (harness/verify.py).
DATA_COPIES = 3
MODEL_COPIES = 2
# The most memory one GPU has today (NVIDIA B300, AMD MI355X: 288 GB): with no GPU visible, a problem needing
# more can run nowhere, while one needing less may still fit the GPU it is later judged on.
LARGEST_GPU_BYTES = 288 * 10**9

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


@dataclass
class ProblemSize:
    """Bytes of the tensors a problem passes in, gets out (None when forward cannot run on meta) and holds."""

    input_bytes: int
    output_bytes: int | None
    parameter_bytes: int

    @property
    def device_bytes(self) -> int:
        """What the judge keeps on the device during a trial (outputs counted as 0 when unknown)."""
        data = self.input_bytes + (self.output_bytes or 0)
        return DATA_COPIES * data + MODEL_COPIES * self.parameter_bytes

    def breakdown(self) -> str:
        """'3 x (4.0 TiB of inputs + 4.0 TiB of outputs) + 2 x 0 B of parameters', for a sentence."""
        outputs = "outputs not known" if self.output_bytes is None else f"{format_bytes(self.output_bytes)} of outputs"
        return (
            f"{DATA_COPIES} x ({format_bytes(self.input_bytes)} of inputs + {outputs}) "
            f"+ {MODEL_COPIES} x {format_bytes(self.parameter_bytes)} of parameters"
        )


def measure(model: torch.nn.Module, inputs: list) -> ProblemSize:
    """The size of a problem from its model and inputs (meta or real tensors); forward runs on meta tensors only,
    so a model on another device is moved to meta (the caller's model is used up)."""
    parameters = [*model.parameters(), *model.buffers()]
    return ProblemSize(
        input_bytes=tensor_bytes(inputs),
        output_bytes=_meta_output_bytes(model, inputs),
        parameter_bytes=sum(tensor.nbytes for tensor in parameters),
    )


def tensor_bytes(tree: Any) -> int:
    """The bytes of every tensor in a nested list/tuple/dict (views counted at their own size)."""
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.nbytes
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(item) for item in tree)
    if isinstance(tree, dict):
        return sum(tensor_bytes(item) for item in tree.values())
    return 0


def require_fits(
    size: ProblemSize,
    shown_file: str,
    *,
    device: str | None,
    gpu_memory_bytes: int | None,
    gpu_name: str | None = None,
) -> None:
    """ProblemError, with the numbers, when the problem cannot fit where it will be judged.

    `device` "cpu" checks the host's available memory; a GPU device (or None, the judge's default) checks
    `gpu_memory_bytes` when a GPU was found, else the largest memory any GPU has.
    """
    needed = size.device_bytes
    at_least = "at least " if size.output_bytes is None else ""
    if device == "cpu":
        available = host_memory_available()
        if needed > available:
            raise ProblemError(
                f"{shown_file} needs {at_least}{format_bytes(needed)} on the host to be judged on the CPU "
                f"({size.breakdown()}), more than the {format_bytes(available)} of memory available.",
                hint=_SMALLER_HINT,
            )
        return
    if gpu_memory_bytes is not None:
        if needed > gpu_memory_bytes:
            which = f"the {gpu_name}" if gpu_name else "the GPU"
            raise ProblemError(
                f"{shown_file} needs {at_least}{format_bytes(needed)} of GPU memory to be judged "
                f"({size.breakdown()}), more than the {format_bytes(gpu_memory_bytes)} of {which}.",
                hint=_SMALLER_HINT,
            )
        return
    if needed > LARGEST_GPU_BYTES:
        raise ProblemError(
            f"{shown_file} needs {at_least}{format_bytes(needed)} of GPU memory to be judged ({size.breakdown()}), "
            f"more than any GPU has ({format_bytes(LARGEST_GPU_BYTES)} at most).",
            hint=_SMALLER_HINT,
        )


_SMALLER_HINT = (
    "Make the tensors get_inputs() returns (or Model's parameters) smaller; the judge keeps "
    f"{DATA_COPIES} copies of the inputs and of the outputs at once."
)


def host_memory_total() -> int:
    """The machine's RAM in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_memory_available() -> int:
    """The RAM that can be allocated now without swapping (MemAvailable), or the total where that is unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return host_memory_total()


def format_bytes(count: float) -> str:
    """'4.0 TiB', '512 B': a byte count in binary units with one decimal."""
    unit = 0
    while abs(count) >= 1024 and unit < len(_UNITS) - 1:
        count /= 1024
        unit += 1
    return f"{int(count)} B" if unit == 0 else f"{count:.1f} {_UNITS[unit]}"


def _meta_output_bytes(model: torch.nn.Module, inputs: list) -> int | None:
    """The bytes forward returns, run on meta copies of the model and inputs; None when it cannot run there."""
    import torch

    def to_meta(item: Any) -> Any:
        return item.to("meta") if isinstance(item, torch.Tensor) else item

    try:
        model.to("meta")  # in place: a model on the CPU came from the fallback for code meta tensors cannot run
        with torch.no_grad(), torch.device("meta"):
            return tensor_bytes(model(*[to_meta(item) for item in inputs]))
    except Exception:  # noqa: BLE001 - data-dependent code cannot run on meta tensors; the outputs stay unknown
        return None

