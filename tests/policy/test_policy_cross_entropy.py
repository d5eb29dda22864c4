"""Cross-entropy in the built-in policy: log_softmax + nll_loss as one row kernel gathering each row's target.

The partition is checked with cpu_spec's CPU `evaluate` against F.cross_entropy on small inputs (ignored rows,
class weights, every reduction); the generated CUDA is compiled here and verified through the judge on a GPU.
"""

from __future__ import annotations

import pytest
from kp_testing import EXAMPLES, nonempty
from policy_testing import (
    analysed,
    assert_generated_kernels_verify,
    built_workspace,
    check_against_model,
    compile_each_cu,
    needs_nvcc,
    only_group,
    write_problem,
)

from kernelpilot.policy.ir import Gather
from kernelpilot.policy.families import launch_candidates, render_kernel

# 64 rows of 50 classes; about a fifth of the targets are the ignored index.
TARGETS = "torch.where(torch.rand(64) < 0.2, {ignore}, torch.randint(0, 50, (64,)))"
LOGITS = "torch.randn(64, 50) * 3"
WEIGHT = "self.register_buffer('weight', torch.rand(50) + 0.5)"

CROSS_ENTROPY = {
    "mean": ("F.cross_entropy(x, t)", -100, ""),
    "sum": ("F.cross_entropy(x, t, reduction='sum')", -100, ""),
    "none": ("F.cross_entropy(x, t, reduction='none')", -100, ""),
    "ignore_index_7": ("F.cross_entropy(x, t, ignore_index=7)", 7, ""),
    "weighted_mean": ("F.cross_entropy(x, t, weight=self.weight)", -100, WEIGHT),
    "weighted_sum": (
        "F.cross_entropy(x, t, weight=self.weight, reduction='sum')",
        -100,
        WEIGHT,
    ),
    "weighted_none": (
        "F.cross_entropy(x, t, weight=self.weight, reduction='none')",
        -100,
        WEIGHT,
    ),
    "nll_of_log_probs": ("F.nll_loss(x, t)", -100, ""),
    "loss_times_two": ("F.cross_entropy(x, t, reduction='none') * 2 + 1", -100, ""),
}


def cross_entropy_problem(folder, name: str):
    call, ignore, init = CROSS_ENTROPY[name]
    inputs = f"{LOGITS}, {TARGETS.format(ignore=ignore)}"
    return write_problem(
        folder, name, f"def forward(self, x, t):\n    return {call}", inputs, init
    )


@pytest.mark.parametrize("name", sorted(CROSS_ENTROPY))
def test_groups_compute_what_cross_entropy_computes(tmp_path, name):
    check_against_model(cross_entropy_problem(tmp_path, name))


def test_cross_entropy_example_reads_the_logits_in_one_row_kernel_then_averages_in_one_row():
    analysis = analysed(EXAMPLES / "cross_entropy.py")
    assert analysis.supported, analysis.blockers()
    losses, mean = analysis.groups
    assert (
        losses.kind == "row"
        and losses.per_row
        and (losses.rows, losses.row_length) == (16384, 32000)
    )
    assert [r.kind for r in losses.reduces()] == ["online_softmax"]
    assert isinstance(losses.expr, Gather) and losses.expr.ignore == -100
    assert [t.name for t in losses.tensors] == [
        "logits",
        "targets",
    ]  # logits are read by one access: once
    assert len([a for a in losses.accesses if a.strides[-1] != 0]) == 1
    assert (mean.rows, mean.row_length, mean.output.shape) == (1, 16384, ())
    assert [t.name for t in mean.tensors] == [
        losses.name,
        "targets",
    ]  # the count of targets not ignored


def test_a_weighted_mean_sums_the_target_weights_in_a_gather_only_row_kernel(tmp_path):
    analysis = analysed(cross_entropy_problem(tmp_path, "weighted_mean"))
    losses, weights, mean = analysis.groups
    assert isinstance(weights.expr, Gather) and not weights.reduces()
    assert (
        launch_candidates(weights)[0].threads == 32
    )  # no statistics: no reason for a block per row
    assert {t.name for t in mean.tensors} == {losses.name, weights.name}


def test_the_gather_reads_the_target_as_an_integer_and_zeroes_ignored_rows(tmp_path):
    group = analysed(cross_entropy_problem(tmp_path, "ignore_index_7")).groups[0]
    source = render_kernel(group, launch_candidates(group)[0]).content
    assert "const int64_t r1 = in1[row_offset1(safe_row)];" in source
    assert "gather_column(r1)" in source and "r1 == 7 ? 0.0f :" in source


@pytest.mark.parametrize(
    ("call", "op"),
    [
        # The log-softmax over dim 1 is generated (a row kernel of the permuted input); the spatial loss is not.
        ("F.cross_entropy(x.view(4, 50, 16), t.view(4, 16))", "aten.nll_loss2d_forward"),
    ],
)
def test_unsupported_cross_entropy_forms_name_the_op(tmp_path, call, op):
    forward = f"def forward(self, x, t):\n    return {call}"
    path = write_problem(
        tmp_path, "unsupported", forward, f"{LOGITS}, {TARGETS.format(ignore=-100)}"
    )
    analysis = analysed(path)
    assert not analysis.supported and op in analysis.blockers()


@needs_nvcc
@pytest.mark.parametrize(
    "name", ["weighted_mean", "nll_of_log_probs", "loss_times_two"]
)
def test_cross_entropy_variants_compile(tmp_path, name):
    compile_each_cu([render_kernel(group, config).content
                     for group in nonempty(analysed(cross_entropy_problem(tmp_path, name)).generated_groups, "groups")
                     for config in nonempty(launch_candidates(group), "launch candidates")], tmp_path)  # fmt: skip


@pytest.mark.cuda_build
def test_cross_entropy_workspace_builds(tmp_path):
    built_workspace(cross_entropy_problem(tmp_path, "weighted_mean"), tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["weighted_mean", "sum", "none", "nll_of_log_probs"])
def test_cross_entropy_variants_pass_verification(tmp_path, judge, name):  # noqa: F811
    assert_generated_kernels_verify(judge, cross_entropy_problem(tmp_path, name), tmp_path)


def test_reduction_none_is_one_kernel_writing_a_loss_per_row(tmp_path):
    group = only_group(analysed(cross_entropy_problem(tmp_path, "none")))
    assert group.per_row and group.output.shape == (64,)
