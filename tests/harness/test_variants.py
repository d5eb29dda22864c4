"""Verification at leading-dim variants of the problem's inputs: how half and double are made from the problem's
own draws, when a variant does not apply, and the trusted verifier's trials at each variant against candidates
served in this process (shape-generic, shape-specialised, and ones the reference's shapes do not allow)."""

from __future__ import annotations

import ctypes
import textwrap

import pytest
import torch
from torch import nn

from kernelpilot.harness.sandbox_client import InProcessModel
from kernelpilot.harness.variants import (
    SECOND_DRAW_OFFSET,
    VARIANT_TRIALS,
    VARIANTS,
    double_inputs,
    half_inputs,
    variant_maker,
    verify_variants,
)
from kernelpilot.harness.verify import InputsNotApplicable, verify_candidate
from kernelpilot.problem import load_problem
from kernelpilot.results import NOT_APPLICABLE

# y = relu(x) + bias per column: x's batch is dim 0, the bias is shared by every row.
PROBLEM = """
    import torch
    from torch import nn

    class Model(nn.Module):
        def forward(self, x, bias):
            return torch.relu(x) + bias

    def get_inputs():
        return [torch.randn(ROWS, 6), torch.randn(6)]

    def get_init_inputs():
        return []
"""


def load(tmp_path, source: str):
    path = tmp_path / "problem.py"
    path.write_text(textwrap.dedent(source))
    return load_problem(path)


def floats(t: torch.Tensor):
    return (ctypes.c_float * t.numel()).from_address(t.data_ptr())


def relu_plus_bias(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The problem's answer for any number of rows, computed outside torch (no torch compute for the guards)."""
    out = torch.empty_like(x)
    xs, bs, ys, columns = floats(x), floats(bias), floats(out), bias.numel()
    ys[:] = [max(v, 0.0) + bs[i % columns] for i, v in enumerate(xs)]
    return out


class AnyBatch(nn.Module):
    def forward(self, x, bias):
        return relu_plus_bias(x, bias)


class OnlyEightRows(nn.Module):
    """As a kernel specialised to the problem's shapes: it refuses any other batch size."""

    def forward(self, x, bias):
        if x.shape[0] != 8:
            raise RuntimeError(f"compiled for 8 rows, got {x.shape[0]}")
        return relu_plus_bias(x, bias)


BATCH_VARIANTS = ("half", "double")


def run_variants(problem, candidate_cls, variants=BATCH_VARIANTS, seed=5):
    model = InProcessModel.from_class(problem, candidate_cls, device="cpu", seed=seed)
    return verify_variants(problem, model, variants, device="cpu", base_seed=seed, atol=1e-5, rtol=1e-5,
                           workspace=None, library=None, time_left=lambda: 60.0)  # fmt: skip


# ------------------------------------------------------------------------------------ making the inputs


def test_half_keeps_the_first_rows_and_double_concatenates_two_draws_of_the_problem(tmp_path):
    problem = load(tmp_path, PROBLEM.replace("ROWS", "8"))
    first, second = problem.make_inputs("cpu", 11), problem.make_inputs("cpu", 11 + SECOND_DRAW_OFFSET)

    half = variant_maker(problem, "half")(torch.device("cpu"), 11)
    double = variant_maker(problem, "double")(torch.device("cpu"), 11)

    assert [tuple(t.shape) for t in half] == [(4, 6), (6,)] and [tuple(t.shape) for t in double] == [(16, 6), (6,)]
    assert torch.equal(half[0], first[0][:4]) and torch.equal(half[1], first[1])
    assert torch.equal(double[0], torch.cat([first[0], second[0]])) and torch.equal(double[1], first[1])
    assert not torch.equal(first[0], second[0]), "the two halves of double are two draws"


def test_a_1d_input_changes_only_where_its_size_is_the_batch_and_values_and_0_dim_tensors_stay():
    x, bias, scale = torch.randn(8, 6), torch.randn(6), torch.tensor(2.0)
    half = half_inputs([x, bias, scale, 3])
    assert [tuple(t.shape) for t in half[:3]] == [(4, 6), (6,), ()] and half[3] == 3
    assert tuple(half_inputs([x, torch.randn(8)])[1].shape) == (4,), "a per-row input of size B is halved too"


@pytest.mark.parametrize(
    ("inputs", "reason"),
    [
        ([torch.randn(8, 4), torch.randn(6, 4, 2)], "the tensor inputs disagree on their leading size (6, 8)"),
        ([torch.randn(8), torch.randn(6)], "the tensor inputs disagree on their leading size (6, 8)"),
        ([torch.randn(1, 4)], "the leading size is 1, which cannot be halved"),
        ([torch.tensor(1.0), 3], "the problem has no tensor input with a leading dimension"),
    ],
)
def test_half_does_not_apply_without_one_leading_size_of_two_or_more(inputs, reason):
    with pytest.raises(InputsNotApplicable) as caught:
        half_inputs(inputs)
    assert str(caught.value) == reason


def test_double_of_one_row_applies_but_not_of_inputs_that_disagree():
    assert double_inputs([torch.randn(1, 4)], [torch.randn(1, 4)])[0].shape == (2, 4)
    with pytest.raises(InputsNotApplicable, match="disagree on their leading size"):
        double_inputs([torch.randn(2, 4), torch.randn(3, 4)], [torch.randn(2, 4), torch.randn(3, 4)])


# ------------------------------------------------------------------------------------------- verifying


def test_a_shape_generic_candidate_verifies_at_half_and_double(tmp_path):
    problem = load(tmp_path, PROBLEM.replace("ROWS", "8"))

    checks = run_variants(problem, AnyBatch)

    assert [(c.variant, c.status) for c in checks] == [("half", "verified"), ("double", "verified")], checks
    assert [c.inputs for c in checks] == [[[4, 6], [6]], [[16, 6], [6]]]
    assert all(c.message.startswith(f"{VARIANT_TRIALS} trials passed") for c in checks)


def test_a_shape_specialised_candidate_fails_both_variants_with_its_own_error(tmp_path):
    problem = load(tmp_path, PROBLEM.replace("ROWS", "8"))

    checks = run_variants(problem, OnlyEightRows)

    assert [(c.variant, c.status, c.error_kind) for c in checks] == [("half", "failed", "runtime"),
                                                                     ("double", "failed", "runtime")]  # fmt: skip
    assert "compiled for 8 rows, got 4" in checks[0].message and "got 16" in checks[1].message
    assert checks[1].inputs == [[16, 6], [6]] and "\n" not in checks[0].message


def test_a_wrong_answer_at_another_batch_size_is_a_mismatch(tmp_path):
    problem = load(tmp_path, PROBLEM.replace("ROWS", "8"))

    class WrongPastRowEight(nn.Module):
        def forward(self, x, bias):
            out = relu_plus_bias(x, bias)
            floats(out)[-1] += 1.0 if x.shape[0] > 8 else 0.0
            return out

    half, double = run_variants(problem, WrongPastRowEight)
    assert half.status == "verified"
    assert (double.status, double.error_kind) == ("failed", "mismatch") and "trial 1" in double.message


def test_variants_the_problem_cannot_make_or_the_reference_rejects_are_not_applicable(tmp_path):
    one_row = load(tmp_path, PROBLEM.replace("ROWS", "1"))
    half, double = run_variants(one_row, AnyBatch)
    assert (half.status, half.message, half.inputs) == (NOT_APPLICABLE, "the leading size is 1, which cannot be halved", None)
    assert double.status == "verified" and double.inputs == [[2, 6], [6]]

    fixed = load(tmp_path, PROBLEM.replace("ROWS", "8").replace("torch.relu(x)", "torch.relu(x.view(8, 6))"))
    called = []

    class Recording(AnyBatch):
        def forward(self, x, bias):
            called.append(x.shape[0])
            return super().forward(x, bias)

    half, double = run_variants(fixed, Recording)
    assert [c.status for c in (half, double)] == [NOT_APPLICABLE, NOT_APPLICABLE]
    assert half.message.startswith("the reference rejects them: the reference Model raised RuntimeError")
    assert called == [], "the candidate is never called at shapes the reference rejects"


def test_an_unknown_variant_is_not_applicable_and_the_known_ones_still_run(tmp_path):
    problem = load(tmp_path, PROBLEM.replace("ROWS", "8"))
    triple, half = run_variants(problem, AnyBatch, variants=["triple", "half"])
    assert (triple.status, triple.message) == (
        NOT_APPLICABLE, "no such shape variant (known: half, double, half-sequence, double-sequence)")
    assert half.status == "verified"


def test_after_a_crash_the_variants_left_are_not_run(tmp_path):
    problem = load(tmp_path, PROBLEM.replace("ROWS", "8"))

    class Crashed:
        """A model whose process died at the first call, as a sandbox client reports it."""

        hello = {"ok": True, "import_findings": []}
        calls = 0

        def request(self, op, args, *, timeout):
            Crashed.calls += 1
            return {"ok": False, "error_kind": "crash", "message": "the sandbox died (signal 11)"}

    half, double = verify_variants(problem, Crashed(), BATCH_VARIANTS, device="cpu", base_seed=0, atol=1e-5, rtol=1e-5,
                                   workspace=None, library=None, time_left=lambda: 60.0)  # fmt: skip

    assert (half.status, half.error_kind, half.message) == ("failed", "crash", "the sandbox died (signal 11)")
    assert (double.status, double.message) == ("failed", "not run: the half variant ended in a crash")
    assert Crashed.calls == 1


# y = relu(x) * mask: x is (batch, tokens, features), the mask (batch, tokens), the scale per feature.
SEQUENCE_PROBLEM = """
    import torch
    from torch import nn

    class Model(nn.Module):
        def forward(self, x, mask, scale):
            return torch.relu(x) * mask.unsqueeze(-1) * scale

    def get_inputs():
        return [torch.randn(2, TOKENS, 4), torch.rand(2, TOKENS), torch.rand(4)]

    def get_init_inputs():
        return []
"""


class AnySequence(nn.Module):
    def forward(self, x, mask, scale):
        out = torch.empty_like(x)
        xs, ms, ss, ys = floats(x), floats(mask), floats(scale), floats(out)
        features = scale.numel()
        ys[:] = [max(v, 0.0) * ms[i // features] * ss[i % features] for i, v in enumerate(xs)]
        return out


def test_half_and_double_sequence_change_dim_1_of_every_input_that_has_it(tmp_path):
    problem = load(tmp_path, SEQUENCE_PROBLEM.replace("TOKENS", "6"))
    first = problem.make_inputs("cpu", 11)
    second = problem.make_inputs("cpu", 11 + SECOND_DRAW_OFFSET)
    half = variant_maker(problem, "half-sequence")(torch.device("cpu"), 11)
    double = variant_maker(problem, "double-sequence")(torch.device("cpu"), 11)
    assert [tuple(t.shape) for t in half] == [(2, 3, 4), (2, 3), (4,)]
    assert [tuple(t.shape) for t in double] == [(2, 12, 4), (2, 12), (4,)]
    assert torch.equal(half[0], first[0][:, :3]) and torch.equal(half[1], first[1][:, :3]) and half[0].is_contiguous()
    assert torch.equal(double[0], torch.cat([first[0], second[0]], dim=1)) and torch.equal(double[2], first[2])
    with pytest.raises(InputsNotApplicable, match="no tensor input has three or more dims"):
        variant_maker(load(tmp_path, PROBLEM.replace("ROWS", "8")), "half-sequence")(torch.device("cpu"), 0)


def test_a_sequence_generic_candidate_verifies_at_every_variant(tmp_path):
    problem = load(tmp_path, SEQUENCE_PROBLEM.replace("TOKENS", "6"))
    checks = run_variants(problem, AnySequence, variants=VARIANTS)
    assert [(c.variant, c.status) for c in checks] == [(v, "verified") for v in VARIANTS], checks
    assert [c.inputs[0] for c in checks] == [[1, 6, 4], [4, 6, 4], [2, 3, 4], [2, 12, 4]]


def test_a_candidate_fixed_in_its_sequence_fails_the_sequence_variants(tmp_path):
    problem = load(tmp_path, SEQUENCE_PROBLEM.replace("TOKENS", "6"))

    class OnlySixTokens(AnySequence):
        def forward(self, x, mask, scale):
            if x.shape[1] != 6:
                raise RuntimeError(f"compiled for 6 tokens, got {x.shape[1]}")
            return super().forward(x, mask, scale)

    checks = run_variants(problem, OnlySixTokens, variants=VARIANTS)
    assert [c.status for c in checks] == ["verified", "verified", "failed", "failed"], checks
    assert "compiled for 6 tokens, got 3" in checks[2].message


def test_the_problems_own_verification_records_its_input_shapes(tmp_path):
    problem = load(tmp_path, PROBLEM.replace("ROWS", "8"))
    model = InProcessModel.from_class(problem, AnyBatch, device="cpu", seed=0)
    result = verify_candidate(problem, model, device="cpu", base_seed=0, trials=1)
    assert result.ok, result.message
    assert result.input_shapes == [[8, 6], [6]] and result.variants == []
