"""TRUSTED side: the comparison of a model's outputs with the reference's, leaf by leaf.

`|actual - expected| <= atol + rtol * |expected|` elementwise, NaN and Inf where the reference has them, and a scale
check where that band is wider than the outputs themselves (an answer that never read its input would pass it).
Where the outputs are themselves rounding noise (a mean of a group norm's output: 0 up to rounding), no answer can
be far below their spread, and noise that reads nothing is as close as an honest answer: `rounding_noise_reason`
then says so, from the reference's own error against a float64 run of it, and the answer stays refused.
Tensors are compared in chunks, so the comparison's temporary memory stays bounded whatever the output's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernelpilot.results import TrialResult

# The scale check (see _ElementErrors.scale_failure): from this many finite elements, when atol + rtol * |typical|
# is at least SCALE_CHECK_BAND times the outputs' spread, the RMS error must stay under SCALE_CHECK_FRACTION of the
# spread or SCALE_CHECK_ULPS units in the last place of a typical output.
SCALE_CHECK_MIN_ELEMENTS = 16
SCALE_CHECK_BAND = 0.25
SCALE_CHECK_FRACTION = 0.1
SCALE_CHECK_ULPS = 8
# Elements compared per step, bounding the comparison's temporary memory (a few times 64 MB).
COMPARE_CHUNK = 1 << 24


@dataclass
class LeafComparison:
    """One output (a tensor or a plain value) compared with the reference's."""

    name: str
    ok: bool
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    worst_index: list[int] | None = None
    worst_ratio: float = 0.0  # error / allowed error at worst_index; inf for NaN, Inf and structure problems
    message: str = ""
    spread: float | None = None  # the reference's standard deviation, when the scale check failed
    scale_only: bool = False  # failed by the scale check alone: every element is within atol/rtol


def compare_outputs(actual: Any, expected: Any, *, atol: float, rtol: float, name: str = "out") -> list[LeafComparison]:
    """Compare two output structures (tensors, tuples, lists, dicts, plain values) leaf by leaf."""
    if isinstance(expected, torch.Tensor):
        return [compare_tensors(name, actual, expected, atol=atol, rtol=rtol)]
    if isinstance(expected, (tuple, list, dict)):
        kind = tuple if isinstance(expected, tuple) else type(expected)
        if not isinstance(actual, kind):
            return [_structure_failure(name, f"is {_describe(actual)}, the reference returns {_describe(expected)}")]
        if len(actual) != len(expected):
            return [_structure_failure(name, f"has {len(actual)} items, the reference's has {len(expected)}")]
        if isinstance(expected, dict):
            if set(actual) != set(expected):
                return [_structure_failure(name, f"has keys {sorted(map(str, actual))}, expected {sorted(map(str, expected))}")]
            pairs = [(f"{name}[{key!r}]", actual[key], expected[key]) for key in expected]
        else:
            pairs = [(f"{name}[{i}]", a, e) for i, (a, e) in enumerate(zip(actual, expected))]
        return [leaf for leaf_name, a, e in pairs for leaf in compare_outputs(a, e, atol=atol, rtol=rtol, name=leaf_name)]
    return [_compare_plain(name, actual, expected, atol=atol, rtol=rtol)]


def compare_tensors(name: str, actual: Any, expected: torch.Tensor, *, atol: float, rtol: float) -> LeafComparison:
    """Shape, dtype, device, then values: NaN/Inf must match the reference's, finite values within tolerance."""
    if not isinstance(actual, torch.Tensor):
        return _structure_failure(name, f"is {_describe(actual)}, the reference returns a tensor")
    for attribute in ("shape", "dtype", "device"):
        got, want = getattr(actual, attribute), getattr(expected, attribute)
        if got != want:
            return _structure_failure(name, f"has {attribute} {_show(got)}, the reference's is {_show(want)}")
    if expected.is_complex():
        actual, expected = torch.view_as_real(actual.resolve_conj()), torch.view_as_real(expected.resolve_conj())
    if not expected.is_floating_point():
        return _compare_exact(name, actual, expected)
    errors = _ElementErrors(expected.shape, atol=atol, rtol=rtol)
    flat_actual, flat_expected = actual.reshape(-1), expected.reshape(-1)
    for start in range(0, flat_expected.numel(), COMPARE_CHUNK):
        stop = start + COMPARE_CHUNK
        errors.add(flat_actual[start:stop], flat_expected[start:stop], start, atol=atol, rtol=rtol)
    return errors.verdict(name, flat_actual, flat_expected)


def _compare_exact(name: str, actual: torch.Tensor, expected: torch.Tensor) -> LeafComparison:
    """Integers and booleans must be equal, compared in their own dtype: through float32 an int64 near 2**50
    equals its neighbours 2**27 away (through float64, those past 2**53). The errors reported are float64
    differences, at least 1 where the values differ."""
    comparison = LeafComparison(name, True, 0.0, 0.0)
    flat_actual, flat_expected = actual.reshape(-1), expected.reshape(-1)
    differing, worst_flat = 0, 0
    for start in range(0, flat_expected.numel(), COMPARE_CHUNK):
        a, b = flat_actual[start : start + COMPARE_CHUNK], flat_expected[start : start + COMPARE_CHUNK]
        unequal = a != b
        count = int(unequal.sum())
        if not count:
            continue
        differing += count
        error = torch.where(unequal, (a.double() - b.double()).abs().clamp_min(1.0), 0.0)
        relative = torch.where(unequal & (b != 0), error / b.double().abs(), 0.0)
        chunk_worst = int(error.argmax())
        if float(error[chunk_worst]) > comparison.max_abs_error:
            comparison.max_abs_error, worst_flat = float(error[chunk_worst]), start + chunk_worst
        comparison.max_rel_error = max(comparison.max_rel_error, float(relative.max()))
    if not differing:
        return comparison
    comparison.ok, comparison.worst_ratio = False, float("inf")
    comparison.worst_index = unravel_index(worst_flat, expected.shape)
    got, want = flat_actual[worst_flat].item(), flat_expected[worst_flat].item()
    comparison.message = (
        f"{name}: {differing} of {expected.numel()} elements differ from the reference's ({expected.dtype} values "
        f"must match exactly); max abs error {comparison.max_abs_error:.6g}; worst at {comparison.worst_index}: "
        f"got {got}, expected {want}"
    )
    return comparison


class _ElementErrors:
    """Running error statistics of one tensor, accumulated chunk by chunk."""

    def __init__(self, shape: torch.Size, *, atol: float = 0.0, rtol: float = 0.0):
        self.shape = shape
        self._atol, self._rtol = atol, rtol
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.worst_ratio = 0.0
        self.worst_flat: int | None = None
        self.outside_tolerance = 0
        self.extra_nan = 0  # NaN where the reference has a number
        self.missing_nan = 0  # a number where the reference has NaN
        self.wrong_inf = 0  # Inf where the reference has a finite value or the other Inf
        self.first_non_finite: int | None = None
        # For the scale check: sums over the finite elements of the squared error, the reference and its square.
        self.finite = 0
        self.squared_error = 0.0
        self.sum_expected = 0.0
        self.sum_expected_squared = 0.0

    def add(self, actual: torch.Tensor, expected: torch.Tensor, offset: int, *, atol: float, rtol: float) -> None:
        compute_dtype = torch.float64 if expected.dtype == torch.float64 else torch.float32
        a, b = actual.to(compute_dtype), expected.to(compute_dtype)
        nan_a, nan_b = a.isnan(), b.isnan()
        wrong_inf = (a.isinf() | b.isinf()) & (a != b) & ~nan_a & ~nan_b
        wrong_non_finite = (nan_a != nan_b) | wrong_inf
        self.extra_nan += int((nan_a & ~nan_b).sum())
        self.missing_nan += int((nan_b & ~nan_a).sum())
        self.wrong_inf += int(wrong_inf.sum())
        if self.first_non_finite is None and bool(wrong_non_finite.any()):
            self.first_non_finite = offset + int(wrong_non_finite.nonzero()[0, 0])

        finite = a.isfinite() & b.isfinite()
        difference = torch.where(finite, (a - b).abs(), 0.0)
        allowed = atol + rtol * torch.where(finite, b.abs(), 0.0)
        self.outside_tolerance += int((difference > allowed).sum())
        ratio = difference / allowed.clamp_min(torch.finfo(compute_dtype).tiny)
        relative = torch.where(finite & (b != 0), difference / b.abs(), 0.0)
        self.finite += int(finite.sum())
        self.squared_error += float(difference.square().sum(dtype=torch.float64))
        finite_b = torch.where(finite, b, 0.0)
        self.sum_expected += float(finite_b.sum(dtype=torch.float64))
        self.sum_expected_squared += float(finite_b.square().sum(dtype=torch.float64))
        self.max_abs = max(self.max_abs, float(difference.max()))
        self.max_rel = max(self.max_rel, float(relative.max()))
        chunk_worst = int(ratio.argmax())
        if self.worst_flat is None or float(ratio[chunk_worst]) > self.worst_ratio:
            self.worst_ratio, self.worst_flat = float(ratio[chunk_worst]), offset + chunk_worst

    def verdict(self, name: str, actual: torch.Tensor, expected: torch.Tensor) -> LeafComparison:
        comparison = LeafComparison(name, True, self.max_abs, self.max_rel, worst_ratio=self.worst_ratio)
        if self.worst_flat is None:  # an empty tensor
            return comparison
        if self.first_non_finite is not None:
            comparison.ok, comparison.worst_ratio = False, float("inf")
            comparison.worst_index = unravel_index(self.first_non_finite, self.shape)
            comparison.message = f"{name} {self._non_finite_text()} (first at {comparison.worst_index})"
            return comparison
        comparison.worst_index = unravel_index(self.worst_flat, self.shape)
        if self.outside_tolerance:
            got, want = actual[self.worst_flat].item(), expected[self.worst_flat].item()
            comparison.ok = False
            comparison.message = (
                f"{name}: {self.outside_tolerance} of {expected.numel()} elements outside tolerance; max abs error "
                f"{self.max_abs:.3g}, max rel error {self.max_rel:.3g}; worst at {comparison.worst_index}: "
                f"got {got:.6g}, expected {want:.6g}"
            )
            return comparison
        scale_failure = self.scale_failure(name, expected.dtype, atol=self._atol, rtol=self._rtol)
        if scale_failure:
            comparison.ok, comparison.worst_ratio, comparison.message = False, float("inf"), scale_failure
            comparison.spread, comparison.scale_only = self.spread(), True
        return comparison

    def spread(self) -> float:
        """The standard deviation of the reference's finite elements."""
        mean = self.sum_expected / self.finite
        return max(self.sum_expected_squared / self.finite - mean * mean, 0.0) ** 0.5

    def scale_failure(self, name: str, dtype: torch.dtype, *, atol: float, rtol: float) -> str:
        """Why the outputs are no better than a constant answer, when the tolerance is too wide to tell.

        Where atol + rtol * |typical output| is as wide as the outputs' own spread (every output of a softmax
        over 32k columns is below atol), any constant or noise passes the element test. Then the root-mean-square
        error must also be far below the spread: under a tenth of the outputs' standard deviation (or a few units
        in the last place of their dtype, whichever is larger).
        """
        if self.finite < SCALE_CHECK_MIN_ELEMENTS or not dtype.is_floating_point:
            return ""
        spread, typical = self.spread(), (self.sum_expected_squared / self.finite) ** 0.5
        if spread == 0.0 or atol + rtol * typical < SCALE_CHECK_BAND * spread:
            return ""
        rms_error = (self.squared_error / self.finite) ** 0.5
        allowed = max(SCALE_CHECK_FRACTION * spread, SCALE_CHECK_ULPS * torch.finfo(dtype).eps * typical)
        if rms_error <= allowed:
            return ""
        return (
            f"{name}: within atol/rtol only because the tolerance is wider than the outputs' scale (their standard "
            f"deviation is {spread:.3g}, atol + rtol*|typical| is {atol + rtol * typical:.3g}); the root-mean-square "
            f"error {rms_error:.3g} is not far below it (at most {allowed:.3g}), as no better than a constant answer"
        )

    def _non_finite_text(self) -> str:
        parts = []
        if self.extra_nan:
            parts.append(f"has NaN at {self.extra_nan} positions where the reference has none")
        if self.missing_nan:
            parts.append(f"has numbers at {self.missing_nan} positions where the reference has NaN")
        if self.wrong_inf:
            parts.append(f"has Inf at {self.wrong_inf} positions where the reference differs")
        return " and ".join(parts)


def unravel_index(flat: int, shape: torch.Size) -> list[int]:
    """The multi-dimensional index of element `flat` of a contiguous tensor of `shape`."""
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return index[::-1]


def _compare_plain(name: str, actual: Any, expected: Any, *, atol: float, rtol: float) -> LeafComparison:
    """Numbers within tolerance, integers (and bools) exactly; anything else (None, strings) must be equal."""
    if isinstance(expected, int) and isinstance(actual, int):  # never through a float, which rounds past 2**53
        error = abs(int(actual) - int(expected))
        relative = error / abs(int(expected)) if expected else 0.0
        message = f"{name} is {actual!r}, the reference's is {expected!r}" if error else ""
        return LeafComparison(name, not error, float(error), relative, worst_ratio=float("inf") if error else 0.0,
                              message=message)  # fmt: skip
    numbers = (bool, int, float)
    if isinstance(expected, numbers) and isinstance(actual, numbers):
        error = abs(float(actual) - float(expected))
        relative = error / abs(float(expected)) if expected else 0.0
        ok = error <= atol + rtol * abs(float(expected))
        message = "" if ok else f"{name} is {actual!r}, the reference's is {expected!r}"
        return LeafComparison(name, ok, error, relative, worst_ratio=0.0 if ok else float("inf"), message=message)
    if type(actual) is type(expected) and actual == expected:
        return LeafComparison(name, True)
    return _structure_failure(name, f"is {actual!r}, the reference's is {expected!r}")


def _structure_failure(name: str, what: str) -> LeafComparison:
    return LeafComparison(name, False, worst_ratio=float("inf"), message=f"{name} {what}")


def _describe(value: Any) -> str:
    kind = type(value).__name__ if not isinstance(value, torch.Tensor) else "tensor"
    return "None" if value is None else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _show(value: Any) -> str:
    return str(tuple(value)) if isinstance(value, torch.Size) else str(value)


def rounding_noise_reason(leaf: LeafComparison, expected: torch.Tensor, exact: torch.Tensor) -> str:
    """When `leaf` failed the scale check alone and the reference cannot resolve its own outputs (its RMS error
    against `exact`, the float64 reference on the same inputs, is at least SCALE_CHECK_FRACTION of their spread),
    the leaf's message becomes why no answer can be accepted there, which is returned; else ""."""
    if not leaf.scale_only or not leaf.spread or exact.shape != expected.shape:
        return ""
    squared, finite = 0.0, 0
    flat_expected, flat_exact = expected.reshape(-1), exact.reshape(-1)
    for start in range(0, flat_expected.numel(), COMPARE_CHUNK):
        a = flat_expected[start:start + COMPARE_CHUNK].double()
        b = flat_exact[start:start + COMPARE_CHUNK].to(device=a.device, dtype=torch.float64)
        keep = a.isfinite() & b.isfinite()
        squared += float((a - b)[keep].square().sum())
        finite += int(keep.sum())
    own_error = (squared / finite) ** 0.5 if finite else 0.0
    if own_error < SCALE_CHECK_FRACTION * leaf.spread:
        return ""
    leaf.message = (
        f"{leaf.name}: the reference's outputs are rounding noise (their spread is {leaf.spread:.3g}, and the "
        f"reference's own error against float64 is {own_error:.3g}): at this atol/rtol no answer can be told from "
        "noise that reads nothing, so none is accepted. Give the problem outputs that carry its inputs' values "
        "(e.g. those before a reduction that cancels them)"
    )
    return leaf.message


def trial_from(seed: int, leaves: list[LeafComparison]) -> TrialResult:
    """A trial's numbers: the largest errors over all outputs, the worst index of the worst output."""
    failing = [leaf for leaf in leaves if not leaf.ok]
    trial = TrialResult(seed=seed, ok=not failing)
    if not leaves:
        return trial
    worst = max(failing or leaves, key=lambda leaf: leaf.worst_ratio)
    abs_errors = [leaf.max_abs_error for leaf in leaves if leaf.max_abs_error is not None]
    rel_errors = [leaf.max_rel_error for leaf in leaves if leaf.max_rel_error is not None]
    trial.max_abs_error = max(abs_errors) if abs_errors else None
    trial.max_rel_error = max(rel_errors) if rel_errors else None
    trial.worst_index, trial.output = worst.worst_index, worst.name
    trial.message = "; ".join(leaf.message for leaf in failing[:3])
    return trial
