"""TRUSTED side: verification at leading-dim variants of the problem's inputs (half and double the batch, half and
double the sequence).

Real layers see several batch sizes and sequence lengths, while get_inputs() names one. A variant's inputs come from the problem's own
get_inputs() draws, so their values mean what the problem's do: "half" keeps the first B // 2 rows of every tensor
input whose dim 0 is the common leading size B (`leading_size`); "double" concatenates two draws (two seeds) along dim 0. Tensors of
another leading size, 0-dim tensors and other values stay as the first draw has them. A variant does not apply where
the tensor inputs disagree on B, where B is too small to halve, or where the reference itself rejects the shapes
(it raises on them, run on this side before any candidate call). The trials are `verify_candidate`'s own, with the
variant's inputs in place of the problem's.

The sequence variants do the same along dim 1: the sequence S is the dim-1 size that the tensor inputs of three or
more dims share (batch, tokens, features); "half-sequence" keeps the first S // 2 steps of every tensor input of two
or more dims whose dim 1 is S (a mask of (batch, tokens) too), "double-sequence" concatenates two draws along dim 1.
Where dim 1 means something else (channels), the reference rejects the shapes and the variant does not apply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kernelpilot.harness.verify import SEED_STRIDE, InputsNotApplicable, verify_candidate
from kernelpilot.results import NOT_APPLICABLE, VariantCheck

VARIANTS = ("half", "double", "half-sequence", "double-sequence")
# Trials per variant: two, so that a result computed before the call is caught by the repeated-values guard.
VARIANT_TRIALS = 2
# The second draw of "double" comes from this far past the trial's seed, away from the other trials' seeds.
SECOND_DRAW_OFFSET = SEED_STRIDE // 2


def leading_size(inputs: Sequence[Any]) -> int:
    """The batch size B: the dim-0 size the tensor inputs of two or more dims share (where all are 1-D, theirs);
    InputsNotApplicable when they disagree or there is none. A 1-D input beside them (a bias, a per-feature scale)
    is no batch: it changes with the variant only where its size happens to be B, and the reference judges that."""
    tensors = [item for item in inputs if isinstance(item, torch.Tensor) and item.dim() >= 1]
    batched = [item for item in tensors if item.dim() >= 2] or tensors
    return _common([item.shape[0] for item in batched], "leading size",
                   "the problem has no tensor input with a leading dimension")  # fmt: skip


def half_inputs(inputs: Sequence[Any]) -> list:
    """The first B // 2 rows of each tensor input whose dim 0 is B; the rest as they are."""
    return _half(inputs, 0)


def double_inputs(first: Sequence[Any], second: Sequence[Any]) -> list:
    """Two draws' tensor inputs of leading size B concatenated along dim 0; the rest as the first draw has them."""
    return _double(first, second, 0)


def sequence_size(inputs: Sequence[Any]) -> int:
    """The sequence length S: the dim-1 size the tensor inputs of three or more dims share; InputsNotApplicable
    when there is none or they disagree."""
    return _common([item.shape[1] for item in inputs if isinstance(item, torch.Tensor) and item.dim() >= 3], "dim 1",
                   "no tensor input has three or more dims (batch, sequence, features)")  # fmt: skip


def _common(sizes: list[int], what: str, none: str) -> int:
    """The one size in `sizes`; InputsNotApplicable (`none`) when there is none, or when they disagree."""
    distinct = sorted(set(sizes))
    if not distinct:
        raise InputsNotApplicable(none)
    if len(distinct) > 1:
        raise InputsNotApplicable(f"the tensor inputs disagree on their {what} ({', '.join(map(str, distinct))})")
    return distinct[0]


def half_sequence_inputs(inputs: Sequence[Any]) -> list:
    """The first S // 2 steps along dim 1 of each tensor input whose dim 1 is S; the rest as they are."""
    return _half(inputs, 1)


def double_sequence_inputs(first: Sequence[Any], second: Sequence[Any]) -> list:
    """Two draws' tensor inputs of sequence length S concatenated along dim 1; the rest as the first draw has them."""
    return _double(first, second, 1)


# dim -> (what its size is called, how the inputs' common size along it is found)
_SIZES: dict[int, tuple[str, Callable[[Sequence[Any]], int]]] = {
    0: ("leading size", leading_size),
    1: ("sequence length", sequence_size),
}


def _half(inputs: Sequence[Any], dim: int) -> list:
    name, size_of = _SIZES[dim]
    size = size_of(inputs)
    if size < 2:
        raise InputsNotApplicable(f"the {name} is {size}, which cannot be halved")
    return [_along(item, dim, size, lambda t: t.narrow(dim, 0, size // 2).clone()) for item in inputs]


def _double(first: Sequence[Any], second: Sequence[Any], dim: int) -> list:
    name, size_of = _SIZES[dim]
    size = size_of(first)
    if size_of(second) != size or len(first) != len(second):
        raise InputsNotApplicable(f"two draws of get_inputs() differ in their {name}s")
    return [_along(a, dim, size, lambda t, b=b: torch.cat([t, b], dim=dim)) for a, b in zip(first, second)]


_MAKERS = {"half": half_inputs, "half-sequence": half_sequence_inputs}
_DOUBLERS = {"double": double_inputs, "double-sequence": double_sequence_inputs}


def variant_maker(problem: Any, variant: str) -> Callable[[torch.device, int], list]:
    """A function (device, seed) -> the variant's inputs, drawn through the problem's `make_inputs`."""
    if variant in _MAKERS:
        return lambda device, seed: _MAKERS[variant](problem.make_inputs(device, seed))
    if variant in _DOUBLERS:
        return lambda device, seed: _DOUBLERS[variant](
            problem.make_inputs(device, seed), problem.make_inputs(device, seed + SECOND_DRAW_OFFSET)
        )
    raise ValueError(f"unknown shape variant {variant!r} (known: {', '.join(VARIANTS)})")


def verify_variants(problem: Any, model: Any, variants: Sequence[str], *, device: str, base_seed: int,
                    atol: float, rtol: float, workspace: Path | None, library: str | None,
                    time_left: Callable[[], float]) -> list[VariantCheck]:  # fmt: skip
    """Verify `model` (holding the weights drawn under `base_seed`) at each variant. After a failure that leaves
    the model's process unusable (a crash, a CUDA error, a hang), the variants left are recorded as not run."""
    checks: list[VariantCheck] = []
    for variant in variants:
        if checks and checks[-1].error_kind in _BREAKS_THE_MODEL:
            checks.append(VariantCheck(variant, "failed", message=f"not run: the {checks[-1].variant} variant "
                                       f"ended in a {checks[-1].error_kind}"))  # fmt: skip
            continue
        checks.append(_verify_one(problem, model, variant, device=device, base_seed=base_seed, atol=atol, rtol=rtol,
                                  workspace=workspace, library=library, timeout=time_left()))  # fmt: skip
    return checks


_BREAKS_THE_MODEL = ("crash", "cuda-error", "timeout", "harness")


def _verify_one(problem: Any, model: Any, variant: str, **verifying: Any) -> VariantCheck:
    if variant not in VARIANTS:  # a name from a lock file written by hand, or by a later kernelpilot
        return VariantCheck(variant, NOT_APPLICABLE, message=f"no such shape variant (known: {', '.join(VARIANTS)})")
    maker = variant_maker(problem, variant)
    result = verify_candidate(problem, model, trials=VARIANT_TRIALS, make_inputs=maker, **verifying)
    if result.error_kind in (NOT_APPLICABLE, "reference"):
        # The reference runs first in every trial: raising there means it does not accept these shapes.
        reason = result.message if result.error_kind == NOT_APPLICABLE else f"the reference rejects them: {result.message}"
        return VariantCheck(variant, NOT_APPLICABLE, message=reason)
    if result.ok:
        return VariantCheck(variant, "verified", inputs=result.input_shapes, message=result.message)
    first_line = (result.message or "failed").strip().splitlines()[0]
    return VariantCheck(variant, "failed", inputs=result.input_shapes, message=first_line,
                        error_kind=result.error_kind)  # fmt: skip


def _along(item: Any, dim: int, size: int, change: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`change(item)` for a tensor whose size along `dim` is `size`; anything else as it is."""
    if isinstance(item, torch.Tensor) and item.dim() > dim and item.shape[dim] == size:
        return change(item)
    return item
