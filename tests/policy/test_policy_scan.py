"""The scan family (policy/scan.py): cumsum and cumprod as one kernel per running statistic, on the CPU (what the
analysis computes, held to Model by the executable spec; launch candidates; what stays refused) and compiled with
nvcc (`cuda_build`). Their GPU verification is in test_policy_gpu.py, with the shared judge."""

from __future__ import annotations

import re

import pytest

from kernelpilot.policy.families import launch_candidates, render_kernel

from kp_testing import nonempty
from policy_testing import (
    SCAN_PROBLEMS,
    analysed,
    check_against_model,
    compile_each_cu,
    needs_nvcc,
    scan_problem,
    write_problem,
)


@pytest.mark.parametrize("name", sorted(SCAN_PROBLEMS))
def test_each_running_statistic_computes_what_the_model_does(tmp_path, name):
    analysis = check_against_model(scan_problem(tmp_path, name))
    assert [group.kind for group in analysis.groups].count("scan") == 1, [g.describe() for g in analysis.groups]


def test_the_ops_before_a_scan_fuse_into_its_loads_and_the_ops_after_read_its_output(tmp_path):
    (masked,) = analysed(scan_problem(tmp_path, "masked_cumsum")).groups
    assert masked.kind == "scan" and masked.ops == ["aten.mul", "aten.cumsum"] and len(masked.tensors) == 2
    assert masked.describe() == "aten.mul, aten.cumsum: one scan kernel over 16 rows of 4096 (float32)"
    scan, epilogue = analysed(scan_problem(tmp_path, "cumsum_then_scale")).groups
    assert (scan.kind, epilogue.kind) == ("scan", "elementwise") and epilogue.tensors == [scan.output]
    # KernelBench's exclusive form: the zeros are not read, the cat reads the scan's output through a window.
    scan, joined = analysed(scan_problem(tmp_path, "exclusive_cumsum")).groups
    assert scan.shape == (8, 1000) and joined.tensors == [scan.output] and joined.accesses[0].bounds == ((0, 8), (1, 1001))


def test_a_scan_over_a_dim_before_the_last_reads_with_strides_and_is_copied_back_in_order(tmp_path):
    # The scan writes in the permuted order; forward returns a contiguous tensor, so a second kernel copies it back.
    scan, copy = analysed(scan_problem(tmp_path, "cumsum_middle_dim")).groups
    assert scan.shape == (4, 20, 300) and scan.accesses[0].strides == (6000, 1, 20)
    assert copy.kind == "elementwise" and copy.tensors == [scan.output] and copy.output.shape == (4, 300, 20)


def test_a_reverse_cumsum_is_one_scan_from_the_rows_end_whose_flips_cancel(tmp_path):
    # KernelBench L1 91: x.flip(1).cumsum(1).flip(1) reads x forward (16-byte vectors) and returns the scan's output.
    analysis = analysed(scan_problem(tmp_path, "reverse_cumsum"))
    (group,) = analysis.groups
    assert group.expr.reverse and group.accesses[0].strides == (4096, 1) and group.ops == ["aten.flip", "aten.cumsum"]
    (returned,) = analysis.outputs
    assert returned.source == group.output and returned.strides == (4096, 1)
    kernel = render_kernel(group, launch_candidates(group)[0]).content
    assert "constexpr bool kReverse = true;" in kernel and "constexpr int kVec = 4;" in kernel
    # Without the flip after it, the scan runs forward over the flipped input (negative strides, scalar loads).
    (forward,) = analysed(scan_problem(tmp_path, "cumsum_of_flipped")).groups
    assert not forward.expr.reverse and forward.accesses[0].strides == (1000, -1)


@pytest.mark.parametrize(("forward", "strides"), [("x.flip(1) * 2 + 1", [(100, -1)]),
                                                  ("x.flip(0, 1) + y", [(-100, -1), (100, 1)])])  # fmt: skip
def test_a_flip_is_a_load_through_negative_strides(tmp_path, forward, strides):
    path = write_problem(tmp_path, "flip", f"def forward(self, x, y):\n    return {forward}",
                         "torch.randn(8, 100), torch.randn(8, 100)")  # fmt: skip
    (group,) = check_against_model(path).groups
    assert group.kind == "elementwise" and [a.strides for a in group.accesses] == strides


def test_launch_candidates_size_the_team_to_the_row(tmp_path):
    (long_rows,) = analysed(scan_problem(tmp_path, "cumsum_rows")).groups
    assert [(c.threads, c.items, c.rows_per_block) for c in launch_candidates(long_rows)] == [
        (512, 4, 1), (256, 4, 1), (128, 4, 2)]  # fmt: skip
    (short_rows,) = analysed(scan_problem(tmp_path, "cumsum_short_rows")).groups
    assert [(c.threads, c.items, c.rows_per_block) for c in launch_candidates(short_rows)] == [(4, 4, 64)]
    kernel = render_kernel(long_rows, launch_candidates(long_rows)[0]).content
    assert "a running sum along each row: 512 threads share a row" in kernel
    assert "constexpr int kVec = 4;" in kernel and "return a + b;" in kernel


def test_the_batch_of_a_scan_is_a_runtime_size_where_it_only_multiplies_rows(tmp_path):
    (rows,) = analysed(scan_problem(tmp_path, "cumsum_rows")).groups
    assert rows.leading_free
    path = write_problem(tmp_path, "one_row", "def forward(self, x):\n    return x.cumsum(0)", "torch.randn(4096)")
    (one_row,) = analysed(path).groups
    assert one_row.kind == "scan" and not one_row.leading_free


@pytest.mark.parametrize(
    ("forward", "blocker"),
    [
        ("x.long().cumsum(-1)", "aten.cumsum (computes a running sum in int64"),
        # Eager accumulates a half-precision scan in its own dtype on a GPU: a float32 accumulation fails to match.
        ("x.bfloat16().cumsum(-1)", "aten.cumsum (computes a running sum in bfloat16, which eager accumulates"),
        ("torch.cummax(x, -1).values", "aten.cummax (no template for this op)"),
    ],
)
def test_running_statistics_the_policy_does_not_generate_say_so(tmp_path, forward, blocker):
    path = write_problem(tmp_path, "refused", f"def forward(self, x):\n    return {forward}", "torch.randn(8, 64)")
    assert blocker in analysed(path).blockers()


@needs_nvcc
def test_scan_kernels_compile_without_spills(tmp_path):
    # Every candidate of the long rows; the first of the product, the strided (scalar) loads, the 4-thread team and
    # the reverse scan.
    candidates = []
    for name, count in (("cumsum_rows", 3), ("cumprod_rows", 1), ("cumsum_middle_dim", 1), ("cumsum_short_rows", 1),
                        ("reverse_cumsum", 1)):  # fmt: skip
        group = analysed(scan_problem(tmp_path, name)).groups[0]
        candidates += [(name, group, config) for config in nonempty(launch_candidates(group)[:count], name)]
    reports = compile_each_cu([render_kernel(group, config).content for _, group, config in candidates], tmp_path)
    for (name, _, config), report in zip(candidates, reports):
        assert set(re.findall(r"(\d+) bytes spill", report)) == {"0"}, (name, config.label, report)
