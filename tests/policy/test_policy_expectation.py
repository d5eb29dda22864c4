"""Softmax-weighted row sums in one pass (policy/expectation.py): entropy, KL and other expectations under a
softmax of the same row are folded into the softmax's own statistic, so a row kernel reads the row once.

The fold must be exact: each variant's analysis is evaluated on the CPU with cpu_spec's `evaluate` (the new
statistic as a torch reduction) against Model, sums that only look alike stay two passes, the generated CUDA is
compiled here for every launch candidate, and the `gpu` tests verify it through the judge.
"""

from __future__ import annotations

import re

import pytest
from kp_testing import EXAMPLES, nonempty
from policy_testing import (
    analysed,
    assert_every_launch_candidate_compiles,
    assert_every_launch_candidate_verifies,
    check_against_model,
    forward_problem,
    needs_nvcc,
    only_group,
)

from kernelpilot.policy.ir import Field, Load, walk
from kernelpilot.policy.codegen import row_layout
from kernelpilot.policy.row import RowProgram
from kernelpilot.policy.families import launch_candidates, render_kernel
from kernelpilot.problem import load_problem

ENTROPY = "torch.logsumexp(x.float(), -1) - (torch.softmax(x.float(), -1) * x.float()).sum(-1)"


def logits(shape: tuple[int, ...], dtype: str = "float32") -> str:
    return f"(torch.randn{shape} * 2).to(torch.{dtype})"


# name -> (forward's arguments, its return expression, get_inputs' tensors)
FOLDED = {
    "entropy_fp32": ("x", ENTROPY, logits((48, 1000))),
    "entropy_fp16_3d": ("x", ENTROPY, logits((2, 24, 777), "float16")),
    # p * log p: log p = x - logsumexp(x) splits into the element x and the per-row constant -logsumexp(x).
    "entropy_of_log_probs": ("x", "-(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)", logits((40, 999))),
    # exp(x - logsumexp(x)): the weight written with logsumexp's own finish.
    "weight_from_logsumexp": (
        "x, y", "(torch.exp(x - torch.logsumexp(x, -1, keepdim=True)) * y).sum(-1)", f"{logits((32, 500))}, {logits((32, 500))}",
    ),
    # A per-row tensor in g: its part is a per-row constant times the sum of the weights.
    "expectation_plus_a_row_value": (
        "x, y, b", "(torch.softmax(x, -1) * (y * 3 + b[:, None])).sum(-1)",
        f"{logits((48, 1000))}, {logits((48, 1000))}, torch.randn(48)",
    ),
    # Only a per-row value weighted: no new statistic, the softmax's own sum of exp stands in for the weights' sum.
    "expectation_of_a_row_value": ("x, b", "(torch.softmax(x, -1) * b[:, None]).sum(-1)", f"{logits((48, 1000))}, torch.randn(48)"),
    # Two expectations under one softmax: two weighted statistics, still one pass.
    "two_expectations": (
        "x, y", "(torch.softmax(x, -1) * x).sum(-1) + 0.5 * (torch.softmax(x, -1) * y).sum(-1)",
        f"{logits((48, 1000))}, {logits((48, 1000))}",
    ),
    # The expectation broadcast back over the row: one statistics pass, then the output re-reads the row (a
    # cluster's shared memory, split unevenly over an odd vocabulary).
    "centred_logits_gpt2_vocab": (
        "x", "x.float() - (torch.softmax(x.float(), -1) * x.float()).sum(-1, keepdim=True)", logits((6, 50257), "bfloat16"),
    ),
    # Masked logits: torch's p * x is 0 * -inf = NaN there, and so is the folded statistic's weighted sum.
    "entropy_of_masked_logits": ("x", ENTROPY.replace("x.float()", "x.float().masked_fill(x > 6, float('-inf'))"),
                                 logits((32, 500))),
    # Categorical's entropy: logsumexp, a softmax of the normalised logits, then the weighted sum: three levels,
    # two once the sum joins the softmax's pass.
    "entropy_categorical": (
        "x", "torch.distributions.Categorical(logits=x.float(), validate_args=False).entropy()", logits((40, 999)),
    ),
}  # fmt: skip
# Sums that look alike but do not have the form: they keep their second pass.
TWO_PASS = {
    # The weight's logsumexp is of another row than its exponent's: exp(x - lse(y)) * g.
    "weight_of_another_rows_logsumexp": (
        "x, y", "(torch.exp(x - torch.logsumexp(y, -1, keepdim=True)) * y).sum(-1)", f"{logits((32, 500))}, {logits((32, 500))}",
    ),
    # g reads the softmax statistic elementwise: log(p) of the softmax's output, not x - logsumexp(x).
    "log_of_the_softmax": ("x", "-(torch.softmax(x, -1) * torch.log(torch.softmax(x, -1))).sum(-1)", logits((32, 500))),
    # A plain max, not an online softmax's: nothing sums exp(x - max).
    "weight_from_a_plain_max": (
        "x, y", "(torch.exp(x - x.amax(-1, keepdim=True)) * y).sum(-1)", f"{logits((32, 500))}, {logits((32, 500))}",
    ),
    # The softmax rounded to bf16 before the product: not exp(x - m) / s any more.
    "softmax_rounded_to_bf16": ("x", "(torch.softmax(x, -1).bfloat16().float() * x).sum(-1)", logits((32, 500))),
}  # fmt: skip
VARIANTS = {**FOLDED, **TWO_PASS}


def variant_problem(folder, name: str):
    return forward_problem(folder, name, *VARIANTS[name])


def levels(group) -> int:
    """How many statistics passes the row program of a group makes."""
    layout = row_layout(group)
    return len(RowProgram(group, layout, {i for i in range(len(layout.strides)) if layout.along_row(i)}).levels)


def row_reads(source: str) -> int:
    """How many times a kernel's passes load access 0 from memory: once per pass that streams it."""
    return len(re.findall(r"load_elements<VEC, false>\(row0 \+", source))


# ------------------------------------------------------------------------------------------ analysis


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_groups_compute_what_the_model_computes(tmp_path, name):
    check_against_model(variant_problem(tmp_path, name), atol=1e-4, equal_nan=name == "entropy_of_masked_logits")


def test_masked_logits_give_nan_entropies_where_torch_does(tmp_path):
    problem = load_problem(variant_problem(tmp_path, "entropy_of_masked_logits"))
    entropies = problem.make_model()(*problem.make_inputs(seed=0))
    assert 0 < entropies.isnan().sum() < len(entropies)  # the variant above compares both kinds of row


@pytest.mark.parametrize("name", sorted(set(FOLDED) - {"entropy_categorical", "expectation_of_a_row_value"}))
def test_softmax_weighted_sums_are_one_pass(tmp_path, name):
    group = analysed(variant_problem(tmp_path, name)).groups[0]
    kinds = [r.kind for r in group.reduces()]
    assert "sum" not in kinds and "online_softmax" not in kinds and "softmax_weighted" in kinds
    assert levels(group) == 1


def test_categoricals_entropy_folds_its_third_level_into_the_second(tmp_path):
    group = only_group(analysed(variant_problem(tmp_path, "entropy_categorical")))
    assert [r.kind for r in group.reduces()] == ["online_softmax", "softmax_weighted"] and levels(group) == 2


def test_a_weighted_row_value_needs_no_new_statistic(tmp_path):
    group = only_group(analysed(variant_problem(tmp_path, "expectation_of_a_row_value")))
    assert [r.kind for r in group.reduces()] == ["online_softmax"] and levels(group) == 1


def test_two_expectations_of_one_softmax_are_two_weighted_statistics_of_one_pass(tmp_path):
    group = only_group(analysed(variant_problem(tmp_path, "two_expectations")))
    assert [r.kind for r in group.reduces()] == ["softmax_weighted", "softmax_weighted"] and levels(group) == 1


@pytest.mark.parametrize("name", sorted(TWO_PASS))
def test_sums_not_of_the_form_keep_their_second_pass(tmp_path, name):
    group = only_group(analysed(variant_problem(tmp_path, name)))
    assert "softmax_weighted" not in [r.kind for r in group.reduces()]
    assert [r.kind for r in group.reduces()][-1] == "sum" and levels(group) == 2


def test_entropy_splits_log_p_into_the_logits_and_minus_their_logsumexp(tmp_path):
    (weighted,) = only_group(analysed(variant_problem(tmp_path, "entropy_of_log_probs"))).reduces()
    # The statistic weighs the logits alone; -logsumexp(x) is applied once per row, to the weights' sum.
    assert weighted.kind == "softmax_weighted" and isinstance(weighted.weighted, Load)
    assert not any(isinstance(node, Field) for node in walk(weighted.weighted))


def test_the_entropy_example_reads_each_row_once_in_every_candidate():
    group = only_group(analysed(EXAMPLES / "logits_entropy_bf16.py"))
    (weighted,) = group.reduces()
    assert weighted.kind == "softmax_weighted" and group.per_row
    candidates = launch_candidates(group)
    assert all(config.shared_blocks == 0 for config in candidates)  # nothing is read twice: nothing to cache
    for config in nonempty(candidates, "launch candidates"):
        source = render_kernel(group, config).content
        assert "// Level 0: online softmax and a softmax-weighted sum" in source and "// Level 1" not in source
        assert row_reads(source) == 1 and "weighted_add<VEC>(st0_max, st0_sum, st0_weighted" in source
        assert "weighted_combine(" in source and "online_add(" not in source


def test_an_expectation_broadcast_over_the_row_is_merged_over_a_cluster(tmp_path):
    group = only_group(analysed(variant_problem(tmp_path, "centred_logits_gpt2_vocab")))
    assert not group.per_row and levels(group) == 1
    clustered = launch_candidates(group)[0]
    assert clustered.shared_blocks == 2  # 50,257 floats do not fit one block, nor split evenly
    source = render_kernel(group, clustered).content
    assert "constexpr int kSpan = 25129;" in source and "cluster.map_shared_rank(" in source
    assert "weighted_combine(st0_max, st0_sum, st0_weighted" in source and row_reads(source) == 1


# ------------------------------------------------------------------------------------------- compiling


@needs_nvcc
@pytest.mark.parametrize(
    "name", ["entropy_fp32", "entropy_fp16_3d", "expectation_plus_a_row_value", "two_expectations", "centred_logits_gpt2_vocab",
             "entropy_categorical"],
)  # fmt: skip
def test_every_launch_candidate_of_the_variants_compiles(tmp_path, name):
    assert_every_launch_candidate_compiles(variant_problem(tmp_path, name), tmp_path)


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_launch_candidate_of_the_variants_passes_verification(tmp_path, judge, name):  # noqa: F811
    assert_every_launch_candidate_verifies(judge, variant_problem(tmp_path, name), tmp_path)
