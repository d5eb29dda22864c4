"""TRUSTED side: the comparison of a model's outputs with the reference's, leaf by leaf.

`|actual - expected| <= atol + rtol * |expected|` elementwise, NaN and Inf where the reference has them, and a scale
check where that band is wider than the outputs themselves (an answer that never read its input would pass it).
Where the outputs are themselves rounding noise (a mean of a group norm's output: 0 up to rounding), no answer can
be far below their spread, and noise that reads nothing is as close as an honest answer: `rounding_noise_reason`
then says so, from the reference's own error against a float64 run of it, and the answer stays refused.
Outputs too small or too uniform to have a spread of their own (a mean loss: one number, nearly the same on every
draw) are checked across the trials instead (`AcrossTrials`): there the best constant answer is the mean of the
trials' references, and the answer must be far closer than it, where the reference moves across trials by more
than its dtype and its own rounding can resolve; where it does not, nothing can tell an answer from a constant,
and a warning says so. Integers and booleans must be equal, compared in their own dtype.
Tensors are compared in chunks, so the comparison's temporary memory stays bounded whatever the output's size.
"""

from __future__ import annotations

from collections.abc import Callable
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
# Outputs with fewer finite elements, or a spread no wider than SCALE_CHECK_ULPS units in the last place of their
# typical value, are checked across the trials instead (AcrossTrials), with the same band and ulps; where that check
# cannot tell an answer from a constant one, the verdict carries this warning (a GuardFinding's guard).
SCALE_UNDECIDED = "scale-undecided"
# Across the trials the spread is a few draws' movement of one number (0.3% of a cross-entropy's value, 0.006% of a
# KL's), so an honest answer's rounding sits nearer to it than to an output's own spread: the answer's RMS error
# must stay under this fraction of it. A constant answer's error is the whole spread, or more.
ACROSS_TRIALS_FRACTION = 0.5
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
    sample: TrialSample | None = None  # for the check across trials, where the output's own spread cannot be used


@dataclass
class TrialSample:
    """What the check across trials keeps of one output in one trial: the reference's values (float64, on the CPU;
    all of them for an output under SCALE_CHECK_MIN_ELEMENTS, else the mean of its finite ones), their variance
    about that mean, and the answer's squared error summed over `count` finite elements."""

    values: torch.Tensor
    within_variance: float
    squared_error: float
    count: int
    dtype: torch.dtype


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
        # Squared in float64: float32 squares' rounding alone would give an output of one value a spread of
        # sqrt(eps) times it (0.004 at 12).
        wide_b = finite_b.double()
        self.sum_expected_squared += float(torch.dot(wide_b, wide_b))
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
        elif self.finite and not self.own_spread_usable(expected.dtype):
            comparison.sample = self.trial_sample(expected)
        return comparison

    def spread(self) -> float:
        """The standard deviation of the reference's finite elements."""
        mean = self.sum_expected / self.finite
        return max(self.sum_expected_squared / self.finite - mean * mean, 0.0) ** 0.5

    def typical(self) -> float:
        """The root-mean-square of the reference's finite elements."""
        return (self.sum_expected_squared / self.finite) ** 0.5

    def own_spread_usable(self, dtype: torch.dtype) -> bool:
        """Whether the outputs have a spread of their own to measure an answer against: enough finite elements, and
        a spread wider than SCALE_CHECK_ULPS units in the last place of a typical one (an output filled with one
        value has none, and its float64 sums leave it a rounding error's)."""
        resolution = SCALE_CHECK_ULPS * torch.finfo(dtype).eps * self.typical()
        return self.finite >= SCALE_CHECK_MIN_ELEMENTS and self.spread() > resolution

    def trial_sample(self, expected: torch.Tensor) -> TrialSample:
        """What the check across trials needs of this output (see TrialSample)."""
        if expected.numel() < SCALE_CHECK_MIN_ELEMENTS:
            values, within = expected.detach().reshape(-1).to("cpu", torch.float64), 0.0
        else:
            values, within = torch.tensor([self.sum_expected / self.finite], dtype=torch.float64), self.spread() ** 2
        return TrialSample(values, within, self.squared_error, self.finite, expected.dtype)

    def scale_failure(self, name: str, dtype: torch.dtype, *, atol: float, rtol: float) -> str:
        """Why the outputs are no better than a constant answer, when the tolerance is too wide to tell.

        Where atol + rtol * |typical output| is as wide as the outputs' own spread (every output of a softmax
        over 32k columns is below atol), any constant or noise passes the element test. Then the root-mean-square
        error must also be far below the spread: under a tenth of the outputs' standard deviation (or a few units
        in the last place of their dtype, whichever is larger).
        """
        if not dtype.is_floating_point or not self.finite or not self.own_spread_usable(dtype):
            return ""  # (then AcrossTrials checks it)
        spread, typical = self.spread(), self.typical()
        if atol + rtol * typical < SCALE_CHECK_BAND * spread:
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


class AcrossTrials:
    """The check across trials, for outputs too small or too uniform to have a spread of their own.

    A mean loss is one number, nearly the same on every draw (a cross-entropy of random logits: 12.09 give or take
    0.04), and atol + rtol * 12 is wider than that: a constant answer passes every trial's element test, and an
    output of one number has no spread for the scale check. Across the trials it has one: the best constant answer
    is the mean of the trials' references, and its root-mean-square error over them is their spread about that
    mean. Where the tolerance is as wide as that spread (atol + rtol * |typical| >= SCALE_CHECK_BAND * spread), the
    answer's RMS error over the trials must stay under ACROSS_TRIALS_FRACTION of it, or under the honest error floor:
    SCALE_CHECK_ULPS units in the last place of a typical output, and, when `own_error` is asked (only for an
    answer the first floor alone would refuse), the reference's own RMS error against a float64 run over
    SCALE_CHECK_FRACTION. Where the spread is not above that floor (a bf16 loss: its rounding is wider than its
    spread; a single trial: no spread), no answer can be told from a constant: `check` says so instead of failing.
    """

    def __init__(self, *, atol: float, rtol: float):
        self.atol, self.rtol = atol, rtol
        self.samples: dict[str, list[TrialSample]] = {}
        self.own_spread: set[str] = set()  # outputs the scale check measured in some trial, by their own spread

    def add(self, leaves: list[LeafComparison]) -> None:
        """One trial's comparisons."""
        for leaf in leaves:
            if leaf.sample is None:
                self.own_spread.add(leaf.name)
            else:
                self.samples.setdefault(leaf.name, []).append(leaf.sample)

    def names(self) -> list[str]:
        """The outputs this check is for: those no trial could measure by their own spread."""
        return [name for name in self.samples if name not in self.own_spread]

    def check(self, name: str, own_error: Callable[[], float | None]) -> tuple[str, str]:
        """(why the answers to output `name` are no better than a constant answer, or ""; why nothing can tell, or
        ""). `own_error` gives the reference's RMS error against float64 for the floor (None where unknown)."""
        samples = self.samples.get(name, [])
        if name in self.own_spread or not samples or len({s.values.shape for s in samples}) > 1:
            return "", ""
        values = torch.stack([s.values for s in samples])
        values = values[:, values.isfinite().all(dim=0)]
        if values.numel() == 0:
            return "", ""
        trials, within = len(samples), sum(s.within_variance for s in samples) / len(samples)
        spread = (float((values - values.mean(dim=0)).square().mean()) + within) ** 0.5
        typical = (float(values.square().mean()) + within) ** 0.5
        rms_error = (sum(s.squared_error for s in samples) / max(sum(s.count for s in samples), 1)) ** 0.5
        width = self.atol + self.rtol * typical
        if width < SCALE_CHECK_BAND * spread:
            return "", ""  # the element test tells a constant answer apart
        floor = SCALE_CHECK_ULPS * torch.finfo(samples[0].dtype).eps * typical
        why_floor = f"what {_dtype_name(samples[0].dtype)} resolves at this size ({floor:.3g})"
        if spread > floor and rms_error > max(ACROSS_TRIALS_FRACTION * spread, floor):
            own = own_error()
            if own is not None and own / SCALE_CHECK_FRACTION > floor:
                floor = own / SCALE_CHECK_FRACTION
                why_floor = (f"what the reference's own rounding allows ({own:.3g} against float64, over "
                             f"{SCALE_CHECK_FRACTION:g})")  # fmt: skip
        moves = (
            f"the reference's RMS movement across the {trials} trials is {spread:.3g}" if trials > 1 else
            "one trial shows no movement of the reference across trials"  # fmt: skip
        )
        if spread <= floor:
            return "", (
                f"{name} was not checked against a constant answer: it is too small or uniform for the scale check, "
                f"and {moves}, not above {why_floor}; a constant answer would pass atol + rtol*|typical| = "
                f"{width:.3g} as well"
            )
        allowed = max(ACROSS_TRIALS_FRACTION * spread, floor)
        if rms_error <= allowed:
            return "", ""
        return (
            f"{name}: within atol/rtol only because the tolerance ({width:.3g}) is wider than the reference's "
            f"movement across the {trials} trials (RMS {spread:.3g} about their mean: the error of the best constant "
            f"answer; the output is too small or uniform to have a spread of its own); the root-mean-square error "
            f"{rms_error:.3g} over the trials is not far below it (at most {allowed:.3g}), as no better than a "
            "constant answer"
        ), ""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rounding_noise_reason(leaf: LeafComparison, expected: torch.Tensor, exact: torch.Tensor) -> str:
    """When `leaf` failed the scale check alone and the reference cannot resolve its own outputs (its RMS error
    against `exact`, the float64 reference on the same inputs, is at least SCALE_CHECK_FRACTION of their spread),
    the leaf's message becomes why no answer can be accepted there, which is returned; else ""."""
    if not leaf.scale_only or not leaf.spread or exact.shape != expected.shape:
        return ""
    own_error = rms_difference(expected, exact)
    if own_error < SCALE_CHECK_FRACTION * leaf.spread:
        return ""
    leaf.message = (
        f"{leaf.name}: the reference's outputs are rounding noise (their spread is {leaf.spread:.3g}, and the "
        f"reference's own error against float64 is {own_error:.3g}): at this atol/rtol no answer can be told from "
        "noise that reads nothing, so none is accepted. Give the problem outputs that carry its inputs' values "
        "(e.g. those before a reduction that cancels them)"
    )
    return leaf.message


def rms_difference(expected: torch.Tensor, exact: torch.Tensor) -> float:
    """The root-mean-square difference of two tensors of one shape over the elements finite in both, in float64
    (complex ones as pairs of reals); 0.0 where none is."""
    if expected.is_complex():
        expected, exact = torch.view_as_real(expected.resolve_conj()), torch.view_as_real(exact.resolve_conj())
    squared, finite = 0.0, 0
    flat_expected, flat_exact = expected.reshape(-1), exact.reshape(-1)
    for start in range(0, flat_expected.numel(), COMPARE_CHUNK):
        a = flat_expected[start:start + COMPARE_CHUNK].double()
        b = flat_exact[start:start + COMPARE_CHUNK].to(device=a.device, dtype=torch.float64)
        keep = a.isfinite() & b.isfinite()
        squared += float((a - b)[keep].square().sum())
        finite += int(keep.sum())
    return (squared / finite) ** 0.5 if finite else 0.0


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
