"""TRUSTED side: the check across trials, element by element, for outputs whose spread is structure.

The scale check (compare.py) refuses an answer that is no closer than a constant to an output with a spread of its
own. But an output's spread may be structure that does not depend on the input: `weight + 1e-3 * x` spreads as
the weight does, while each element moves by about 1e-3 from one draw to the next, less than atol + rtol * |out|.
Answering with the weight passes every trial's element test and the scale check. Across the trials it shows: the
best answer that ignores the input is each element's mean over the trials, whose error is the elements' movement
about those means.

So for each floating output of SCALE_CHECK_MIN_ELEMENTS or more, this side picks ELEMENT_SAMPLE positions at random
(once per verification, after the calls: the model never learns them) and keeps the reference's values and the
answer's errors there, trial by trial. After the last trial, where the tolerance is as wide as that movement
(atol + rtol * |typical| >= SCALE_CHECK_BAND * movement), the answer's RMS error must stay under
ACROSS_TRIALS_FRACTION of it, or under the honest floor: SCALE_CHECK_ULPS units in the last place of a typical
output, or the reference's own RMS error against a float64 run over SCALE_CHECK_FRACTION. Where the movement is not
above that floor (a bf16 output moving by less than its rounding), nothing can tell, and nothing is said: the
output has a spread of its own, which the scale check used.

`ChecksAcrossTrials` runs this check and compare.AcrossTrials (outputs with no spread of their own) over a series
of calls: verification's trials, and the checked timed runs (a model honest while verified and answering with a
constant while timed is no better than a constant there either).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from kernelpilot.harness.compare import (
    ACROSS_TRIALS_FRACTION,
    SCALE_CHECK_BAND,
    SCALE_CHECK_FRACTION,
    SCALE_CHECK_MIN_ELEMENTS,
    SCALE_CHECK_ULPS,
    AcrossTrials,
    LeafComparison,
)
from kernelpilot.harness.guards import tensor_leaves

ELEMENT_SAMPLE = 4096


class ElementsAcrossTrials:
    """Sampled elements of each output, trial by trial, and the verdict on them after the last trial."""

    def __init__(self, *, atol: float, rtol: float):
        self.atol, self.rtol = atol, rtol
        self._draw = random.SystemRandom()
        self.positions: dict[str, tuple[torch.Size, torch.Tensor]] = {}
        self.values: dict[str, list[torch.Tensor]] = {}  # the reference's, float64 on the CPU
        self.errors: dict[str, list[torch.Tensor]] = {}  # the answer's minus the reference's
        self.dtypes: dict[str, torch.dtype] = {}

    def add(self, name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        """One trial's output `name`, already found within tolerance element by element."""
        if not expected.is_floating_point() or expected.numel() < SCALE_CHECK_MIN_ELEMENTS:
            return
        if actual.shape != expected.shape:
            return
        shape, flat = self.positions.get(name, (None, None))
        if shape != expected.shape:  # the first trial (or a shape that changed: this output starts over)
            generator = torch.Generator().manual_seed(self._draw.getrandbits(63))
            count = min(ELEMENT_SAMPLE, expected.numel())
            flat = torch.randint(expected.numel(), (count,), generator=generator)
            self.positions[name] = (expected.shape, flat)
            self.values[name], self.errors[name] = [], []
        index = tuple(part.to(expected.device) for part in torch.unravel_index(flat, expected.shape))
        want = expected[index].to("cpu", torch.float64)
        got = actual[index].to("cpu", torch.float64)
        self.values[name].append(want)
        self.errors[name].append(got - want)
        self.dtypes[name] = expected.dtype

    def names(self) -> list[str]:
        return list(self.values)

    def check(self, name: str, own_error: Callable[[], float | None]) -> str:
        """Why the answers to output `name` are no better than ignoring the input, or ""."""
        values, errors = self.values.get(name, []), self.errors.get(name, [])
        if len(values) < 2:
            return ""
        values, errors = torch.stack(values), torch.stack(errors)
        finite = values.isfinite().all(dim=0) & errors.isfinite().all(dim=0)
        values, errors = values[:, finite], errors[:, finite]
        if values.numel() == 0:
            return ""
        movement = float((values - values.mean(dim=0)).square().mean()) ** 0.5
        typical = float(values.square().mean()) ** 0.5
        width = self.atol + self.rtol * typical
        if width < SCALE_CHECK_BAND * movement:
            return ""  # the element test tells an answer that ignores the input apart
        floor = SCALE_CHECK_ULPS * torch.finfo(self.dtypes[name]).eps * typical
        rms_error = float(errors.square().mean()) ** 0.5
        if movement <= floor or rms_error <= max(ACROSS_TRIALS_FRACTION * movement, floor):
            return ""
        own = own_error()
        if own is not None:
            floor = max(floor, own / SCALE_CHECK_FRACTION)
        allowed = max(ACROSS_TRIALS_FRACTION * movement, floor)
        if movement <= floor or rms_error <= allowed:
            return ""
        trials, sampled = values.shape
        return (
            f"{name}: within atol/rtol only because the tolerance ({width:.3g}) is wider than how far its elements move "
            f"across the {trials} trials (RMS {movement:.3g} about each element's mean, at {sampled} elements picked at "
            f"random: the error of an answer that ignores the input there); the root-mean-square error {rms_error:.3g} "
            f"is not far below it (at most {allowed:.3g}), as no better than that"
        )


class ChecksAcrossTrials:
    """Both checks across a series of calls: compare.AcrossTrials for the outputs with no spread of their own,
    ElementsAcrossTrials for the others."""

    def __init__(self, *, atol: float, rtol: float):
        self.small = AcrossTrials(atol=atol, rtol=rtol)
        self.elements = ElementsAcrossTrials(atol=atol, rtol=rtol)

    def add(self, leaves: list[LeafComparison], actual: Any, expected: Any) -> None:
        """One call's comparisons, its answer and the reference's outputs."""
        self.small.add(leaves)
        passed = {leaf.name for leaf in leaves if leaf.ok and leaf.sample is None}
        if not passed:
            return
        answers = dict(tensor_leaves(actual, "out"))
        for name, reference in tensor_leaves(expected, "out"):
            if name in passed and isinstance(answers.get(name), torch.Tensor):
                self.elements.add(name, answers[name], reference)

    def apply(self, leaves: list[LeafComparison], own_error: Callable[[str], float | None]) -> list[str]:
        """After the last call: fail the leaves whose answers were no better than a constant or than ignoring the
        input; the sentences for the outputs where nothing can tell. `own_error(name)`: the reference's RMS error
        against float64 for output `name` (None where unknown), asked only where an answer would be refused."""
        small, undecided = set(self.small.names()), []
        for leaf in leaves:
            if leaf.name in small:
                failure, cannot_tell = self.small.check(leaf.name, lambda name=leaf.name: own_error(name))
                undecided += [cannot_tell] if cannot_tell else []
            else:
                failure = self.elements.check(leaf.name, lambda name=leaf.name: own_error(name))
            if failure:
                leaf.ok, leaf.worst_ratio, leaf.message = False, float("inf"), failure
        return undecided
