"""The comparison of outputs with the reference's (harness/compare.py), on the CPU: integers compared exactly in
their own dtype, and the check across trials of outputs too small or too uniform for their own spread to show a
constant answer."""

from __future__ import annotations

import pytest
import torch

from kernelpilot.harness.compare import compare_outputs, compare_tensors

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
