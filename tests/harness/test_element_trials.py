"""The check across trials at sampled elements (element_trials.py): outputs whose spread is structure, where an
answer that ignores the input passes every trial's element test and the scale check."""

from __future__ import annotations

import torch

from kernelpilot.harness.element_trials import ELEMENT_SAMPLE, ElementsAcrossTrials

TOLERANCE = {"atol": 1e-2, "rtol": 1e-2}
WEIGHT = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))


def draws(trials: int, scale: float = 1e-3, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """The reference's outputs, weight + scale * x, over `trials` draws of x."""
    generator = torch.Generator().manual_seed(1)
    return [(WEIGHT + scale * torch.randn(64, 1024, generator=generator)).to(dtype) for _ in range(trials)]


def verdict(answers: list[torch.Tensor], references: list[torch.Tensor], own_error=lambda: None) -> str:
    check = ElementsAcrossTrials(**TOLERANCE)
    for answer, reference in zip(answers, references):
        check.add("out", answer, reference)
    return check.check("out", own_error)


def test_an_answer_that_ignores_the_input_fails_across_the_trials():
    references = draws(5)
    failure = verdict([WEIGHT.clone() for _ in references], references)
    assert "no better than that" in failure and "across the 5 trials" in failure
    assert f"at {ELEMENT_SAMPLE} elements picked at random" in failure


def test_an_honest_answer_with_a_gpus_rounding_passes():
    references = draws(5)
    noisy = [reference + 1e-6 * torch.randn_like(reference) for reference in references]
    assert verdict(noisy, references) == ""


def test_where_the_elements_move_more_than_the_tolerance_the_element_test_decides_alone():
    references = draws(5, scale=1.0)
    asked = []
    assert verdict([WEIGHT.clone() for _ in references], references, lambda: asked.append(1)) == ""
    assert asked == []  # no float64 run for an output the element test resolves


def test_a_bf16_output_moving_less_than_its_rounding_says_nothing():
    references = draws(5, dtype=torch.bfloat16)
    assert verdict([WEIGHT.to(torch.bfloat16) for _ in references], references) == ""


def test_one_trial_cannot_tell():
    references = draws(1)
    assert verdict([WEIGHT.clone()], references) == ""


def test_the_references_own_rounding_raises_the_floor():
    references = draws(5)
    off = [reference + 7e-4 * torch.randn_like(reference) for reference in references]  # 0.7 of the movement
    assert "no better than that" in verdict(off, references)
    assert verdict(off, references, own_error=lambda: 1e-3) == ""  # floor 1e-2: the reference's own error / 0.1


def test_the_sampled_positions_are_drawn_anew_for_each_verification():
    first, second = ElementsAcrossTrials(**TOLERANCE), ElementsAcrossTrials(**TOLERANCE)
    for check in (first, second):
        check.add("out", WEIGHT, WEIGHT)
    assert not torch.equal(first.positions["out"][1], second.positions["out"][1])
