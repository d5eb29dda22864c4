"""The comparison of outputs with the reference's (harness/compare.py), on the CPU: integers compared exactly in
their own dtype, and the check across trials of outputs too small or too uniform for their own spread to show a
constant answer."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from torch import nn

from kernelpilot.harness.compare import SCALE_UNDECIDED, AcrossTrials, compare_outputs, compare_tensors
from kernelpilot.harness.verify import SEED_STRIDE

from verify_testing import verify, write_problem

# ------------------------------------------------------------------------------------------ integers


def test_int64_sums_off_by_one_near_2_to_the_50_fail_though_equal_in_float32():
    expected = torch.full((64,), 2**50, dtype=torch.int64) + torch.arange(64)
    wrong = expected + 1
    assert torch.equal(wrong.float(), expected.float()), "the premise: float32 cannot tell them apart"
    verdict = compare_tensors("out", wrong, expected, atol=1e-2, rtol=1e-2)
    assert not verdict.ok and verdict.max_abs_error == 1.0 and verdict.worst_ratio == float("inf")
    assert "64 of 64 elements differ" in verdict.message and f"got {2**50 + 1}, expected {2**50}" in verdict.message
    assert compare_tensors("out", expected.clone(), expected, atol=1e-2, rtol=1e-2).ok


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
                                   torch.uint32, torch.uint64])  # fmt: skip
def test_every_integer_dtype_must_match_exactly_at_its_largest_values(dtype):
    info = torch.iinfo(dtype)
    expected = torch.tensor([info.max, info.max - 1, info.min, 0], dtype=dtype)
    one_off = torch.tensor([info.max - 1, info.max - 1, info.min, 0], dtype=dtype)
    verdict = compare_tensors("out", one_off, expected, atol=1e-2, rtol=1e-2)
    assert not verdict.ok and "1 of 4 elements differ" in verdict.message and verdict.worst_index == [0]
    assert verdict.max_abs_error >= 1.0, "values that differ report an error of at least 1"
    assert compare_tensors("out", expected.clone(), expected, atol=1e-2, rtol=1e-2).ok


def test_booleans_must_match_exactly():
    expected = torch.tensor([True, False, True])
    verdict = compare_tensors("out", torch.tensor([True, True, True]), expected, atol=1.0, rtol=1.0)
    assert not verdict.ok and verdict.worst_index == [1] and "1 of 3 elements differ" in verdict.message


def test_plain_integers_match_exactly_past_float64s_integers():
    (off,) = compare_outputs(2**60 + 1, 2**60, atol=1e-2, rtol=1e-2)
    assert not off.ok and off.max_abs_error == 1.0
    (same,) = compare_outputs(2**60 + 1, 2**60 + 1, atol=1e-2, rtol=1e-2)
    (near_float,) = compare_outputs(3.001, 3.0, atol=1e-2, rtol=1e-2)
    assert same.ok and near_float.ok


# ------------------------------------------------------------------------------------------ across trials

# Five trials' mean cross-entropy of random logits: one number, about 12.09, moving by about 0.037 between draws,
# while atol + rtol * 12 = 0.13.
LOSSES = [12.1143, 12.0561, 12.0935, 12.0412, 12.1226]
TOLERANCE = {"atol": 1e-2, "rtol": 1e-2}


def across(answers, references, *, own_error=None, **tolerance):
    """AcrossTrials' (failure, cannot-tell) for `answers` to `references`, one pair per trial, each of which must
    pass the element test (the premise of every case here). `own_error` None: asking for it (the reference's own
    error against float64, which only an answer the dtype's floor would refuse needs) fails the test."""
    tolerance = tolerance or TOLERANCE
    check = AcrossTrials(**tolerance)
    for answer, reference in zip(answers, references, strict=True):
        leaves = compare_outputs(answer, reference, **tolerance)
        assert all(leaf.ok for leaf in leaves), [leaf.message for leaf in leaves]
        check.add(leaves)
    assert check.names() == ["out"]

    def not_asked():
        raise AssertionError("the reference's own error was asked for, though the answer is decided without it")

    return check.check("out", own_error or not_asked)


def scalars(values, dtype=torch.float32):
    return [torch.tensor(value, dtype=dtype) for value in values]


def test_a_constant_loss_within_atol_rtol_of_every_trial_fails_across_the_trials():
    references = scalars(LOSSES)
    best_constant = sum(LOSSES) / len(LOSSES)  # the trials' own mean: the closest any constant can be
    constant_ish = [best_constant + 1e-4 * i for i in range(len(LOSSES))]  # changes, so no repeated-values guard
    for answers in (scalars([best_constant] * len(LOSSES)), scalars(constant_ish)):
        failure, cannot_tell = across(answers, references, own_error=lambda: 3e-7)  # float32's own, as measured
        assert "no better than a constant answer" in failure and "across the 5 trials" in failure, failure
        assert cannot_tell == ""


def test_an_honest_loss_with_a_gpus_rounding_passes_without_asking_for_the_references_own_error():
    references = scalars(LOSSES)
    generator = torch.Generator().manual_seed(0)
    noise = 1e-6 * torch.randn(len(LOSSES), generator=generator, dtype=torch.float64)  # GPU vs CPU reductions
    honest = scalars([loss * (1 + float(delta)) for loss, delta in zip(LOSSES, noise)])
    assert across(honest, references) == ("", "")


def test_a_bf16_loss_whose_rounding_is_wider_than_its_spread_cannot_be_told_from_a_constant_and_warns():
    references = scalars(LOSSES, torch.bfloat16)  # bf16's spacing at 12 is 0.0625: wider than the spread
    one_ulp_off = [torch.nextafter(r.float(), torch.tensor(100.0)).bfloat16() + 0.0625 * (i % 2) for i, r in
                   enumerate(references)]  # fmt: skip
    constant = scalars([12.09] * len(LOSSES), torch.bfloat16)
    for answers in (references, one_ulp_off, constant):
        failure, cannot_tell = across(answers, references)
        assert failure == "" and "not checked against a constant answer" in cannot_tell, cannot_tell
        assert "bfloat16 resolves" in cannot_tell


def test_a_single_trial_cannot_tell_and_says_so():
    failure, cannot_tell = across(scalars(LOSSES[:1]), scalars(LOSSES[:1]))
    assert failure == "" and "one trial shows no movement" in cannot_tell


def test_where_the_tolerance_resolves_the_spread_the_element_test_decides_alone():
    tight = {"atol": 1e-4, "rtol": 1e-4}  # 0.0013, far below the spread: a constant fails the element test
    assert not compare_outputs(torch.tensor(12.09), scalars(LOSSES)[0], **tight)[0].ok
    off = scalars([loss + 1e-3 for loss in LOSSES])  # within the tight tolerance, not under a tenth of the spread
    assert across(off, scalars(LOSSES), **tight) == ("", "")


def test_the_references_own_rounding_raises_the_floor_only_for_an_answer_the_dtype_floor_would_refuse():
    # Values near 1 moving by about 5e-6 between trials: above float32's 8 ulps (9.5e-7), so a constant fails.
    references = scalars([1 + 5e-6 * k for k in (-2, -1, 0, 1, 2)])
    off = scalars([float(r) + 5e-6 for r in references])  # above half the spread (RMS 7.1e-6) and the ulps
    failure, _ = across(off, references, own_error=lambda: 1e-8)  # a reference far more exact than the answer
    assert "no better than a constant" in failure
    failure, cannot_tell = across(off, references, own_error=lambda: 1e-6)  # its own rounding is the spread's size
    assert failure == "" and "the reference's own rounding allows" in cannot_tell
    failure, _ = across(off, references, own_error=lambda: None)  # no float64 run: the dtype's floor decides
    assert "no better than a constant" in failure


def test_an_output_of_one_value_repeated_is_checked_across_trials_not_by_its_rounding_spread():
    references = [torch.full((64,), loss) for loss in LOSSES]  # a loss broadcast: no spread of its own
    assert compare_tensors("out", references[0] + 1e-5, references[0], **TOLERANCE).ok, "not refused by its rounding"
    failure, _ = across([torch.full((64,), 12.09)] * len(LOSSES), references, own_error=lambda: 3e-7)
    assert "no better than a constant" in failure
    assert across([r * (1 + 1e-6) for r in references], references) == ("", "")


def test_a_small_vector_with_matching_nans_is_checked_on_its_finite_elements():
    references = [torch.tensor([loss, float("nan"), 2 * loss]) for loss in LOSSES]
    constant = [torch.tensor([12.09, float("nan"), 24.18])] * len(LOSSES)
    failure, _ = across(constant, references, own_error=lambda: 3e-7)
    assert "no better than a constant" in failure
    assert across([r.clone() for r in references], references) == ("", "")


# ------------------------------------------------------------------------------------------ in verification

# A mean cross-entropy small enough for the CPU whose spread across draws (about 0.03) is below atol + rtol * 10.
CROSS_ENTROPY = """
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Model(nn.Module):
        def forward(self, logits, targets):
            return F.cross_entropy(logits, targets)

    def get_inputs():
        return [(torch.randn(16384, 64) * 4.0).to(DTYPE), torch.randint(0, 64, (16384,))]

    def get_init_inputs():
        return []
"""


def _floats(t: torch.Tensor) -> np.ndarray:
    """A contiguous float32 or bf16 tensor's elements as float32, read from its memory (no torch op runs)."""
    if t.dtype == torch.float32:
        return np.ctypeslib.as_array((ctypes.c_float * t.numel()).from_address(t.data_ptr())).copy()
    bits = np.ctypeslib.as_array((ctypes.c_uint16 * t.numel()).from_address(t.data_ptr()))
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _write_scalar(out: torch.Tensor, value: float) -> torch.Tensor:
    if out.dtype == torch.float32:
        ctypes.c_float.from_address(out.data_ptr()).value = value
    else:  # bf16: float32's top half, rounded to nearest even
        bits = int(np.array([value], dtype=np.float32).view(np.uint32)[0])
        ctypes.c_uint16.from_address(out.data_ptr()).value = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return out


class HonestCrossEntropy(nn.Module):
    """The loss computed from the logits' memory in float64, as a kernel would."""

    def forward(self, logits, targets):
        x = _floats(logits).astype(np.float64).reshape(logits.shape)
        labels = np.ctypeslib.as_array((ctypes.c_int64 * targets.numel()).from_address(targets.data_ptr()))
        top = x.max(axis=1)
        loss = np.log(np.exp(x - top[:, None]).sum(axis=1)) + top - x[np.arange(len(labels)), labels]
        return _write_scalar(torch.empty((), dtype=logits.dtype), float(loss.mean()))


class ConstantCrossEntropy(nn.Module):
    """9.96 plus a trace of one logit: within atol + rtol * 10 of every draw's loss."""

    def forward(self, logits, targets):
        return _write_scalar(torch.empty((), dtype=logits.dtype), 9.96 + 1e-4 * float(_floats(logits)[0]))


def cross_entropy_problem(tmp_path, dtype: str):
    return write_problem(tmp_path, CROSS_ENTROPY.replace("DTYPE", dtype), name=f"ce_{dtype.split('.')[-1]}")


def test_in_verification_a_constant_loss_fails_and_an_honest_one_passes_without_warnings(tmp_path):
    problem = cross_entropy_problem(tmp_path, "torch.float32")
    losses = [float(problem.make_model("cpu")(*problem.make_inputs("cpu", k * SEED_STRIDE))) for k in range(3)]
    assert all(abs(loss - 9.96) <= 1e-2 + 1e-2 * loss for loss in losses), losses  # the cheat's premise
    cheat = verify(problem, ConstantCrossEntropy, trials=3)
    assert not cheat.ok and cheat.error_kind == "mismatch", cheat.message
    assert "no better than a constant" in cheat.message, cheat.message
    assert [trial.ok for trial in cheat.trials] == [True, True, False], "decided after the last trial"
    honest = verify(problem, HonestCrossEntropy, trials=3)
    assert honest.ok and not honest.guards, (honest.message, honest.guards)


def test_in_verification_an_honest_bf16_loss_passes_with_a_warning_that_nothing_could_tell(tmp_path):
    problem = cross_entropy_problem(tmp_path, "torch.bfloat16")
    result = verify(problem, HonestCrossEntropy, trials=3)
    assert result.ok, result.message
    assert [(f.guard, f.severity) for f in result.guards] == [(SCALE_UNDECIDED, "warn")], result.guards
    assert f"warnings: {SCALE_UNDECIDED}" in result.message and "bfloat16 resolves" in result.guards[0].message
