"""RL log-prob patterns in the built-in policy: per-token log-probabilities of sampled tokens (log_softmax then a
gather along the vocabulary) and per-token entropy (softmax statistics, then a sum that depends on them), plus a
plain log_softmax and row max/min.

Each is one row kernel reading the logits from memory once: the gathered log-probability needs only the row's
softmax statistics and one element, and the entropy's softmax-weighted sum is accumulated in the softmax's own
pass (expectation.py; test_policy_expectation.py has its variants). The partition is checked with cpu_spec's CPU `evaluate` against Model, the
generated CUDA is compiled here and verified through the judge on a GPU.
"""

from __future__ import annotations

import re

import pytest
from kp_testing import EXAMPLES, nonempty
from policy_testing import (
    analysed,
    assert_every_launch_candidate_compiles,
    assert_every_launch_candidate_verifies,
    built_workspace,
    check_against_model,
    forward_problem,
    needs_nvcc,
    only_group,
    write_problem,
)

from kernelpilot.policy.ir import Field, Gather, Stack, walk
from kernelpilot.policy.codegen import render_model_new
from kernelpilot.policy.families import launch_candidates, render_kernel
from kernelpilot.problem import load_problem

SELECTIVE_LOG_SOFTMAX = "torch.log_softmax(x.float(), dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)"
ENTROPY = "torch.logsumexp(x.float(), -1) - (torch.softmax(x.float(), -1) * x.float()).sum(-1)"


def logits(shape: tuple[int, ...], dtype: str = "float32") -> str:
    return f"(torch.randn{shape} * 2).to(torch.{dtype})"


def token_ids(shape: tuple[int, ...]) -> str:
    return f"torch.randint(0, {shape[-1]}, {shape[:-1]})"


# name -> (forward's arguments, its return expression, get_inputs' tensors)
VARIANTS = {
    "logprobs_fp32": ("x, t", SELECTIVE_LOG_SOFTMAX, f"{logits((48, 1000))}, {token_ids((48, 1000))}"),
    "logprobs_fp16": ("x, t", SELECTIVE_LOG_SOFTMAX, f"{logits((48, 1000), 'float16')}, {token_ids((48, 1000))}"),
    "logprobs_bf16_gpt2_vocab": (
        "x, t", SELECTIVE_LOG_SOFTMAX, f"{logits((6, 50257), 'bfloat16')}, {token_ids((6, 50257))}",
    ),
    "logprobs_3d": ("x, t", SELECTIVE_LOG_SOFTMAX, f"{logits((2, 24, 777))}, {token_ids((2, 24, 777))}"),
    "logprobs_of_raw_logits": (
        "x, t", "x.gather(-1, t[..., None]).squeeze(-1)", f"{logits((40, 333))}, {token_ids((40, 333))}",
    ),
    # PPO's ratio exp(logp - old_logp): the squeezed log-probability stays one value per row of the same kernel.
    "logprobs_ratio": (
        "x, t, old",
        f"torch.exp({SELECTIVE_LOG_SOFTMAX} - old)",
        f"{logits((32, 1000))}, {token_ids((32, 1000))}, torch.randn(32) - 7",
    ),
    "logprobs_keepdim": ("x, t", "torch.log_softmax(x, -1).gather(-1, t)", f"{logits((32, 500))}, {token_ids((32, 1, 500))}"),
    "entropy_fp32": ("x", ENTROPY, logits((48, 1000))),
    "entropy_bf16_gpt2_vocab": ("x", ENTROPY, logits((6, 50257), "bfloat16")),
    "entropy_of_log_probs_3d_fp16": (
        "x", "-(torch.softmax(x.float(), -1) * torch.log_softmax(x.float(), -1)).sum(-1)", logits((2, 24, 777), "float16"),
    ),
    # Three levels: logsumexp, a softmax of the normalised logits (which reads it), then the weighted sum.
    "entropy_categorical": (
        "x", "torch.distributions.Categorical(logits=x.float(), validate_args=False).entropy()", logits((40, 999)),
    ),
    # An RL trainer's two per-token values from one softmax, returned together: one kernel writing both.
    "logprobs_and_entropy": ("x, t", f"{SELECTIVE_LOG_SOFTMAX}, {ENTROPY}", f"{logits((48, 1000))}, {token_ids((48, 1000))}"),
    "logprobs_and_entropy_tempered_3d_bf16": (
        "x, t",
        "torch.log_softmax(x.float() / 0.7, -1).gather(-1, t[..., None]).squeeze(-1), "
        "-(torch.softmax(x.float() / 0.7, -1) * torch.log_softmax(x.float() / 0.7, -1)).sum(-1)",
        f"{logits((2, 24, 777), 'bfloat16')}, {token_ids((2, 24, 777))}",
    ),
    "log_softmax": ("x", "torch.log_softmax(x, -1)", logits((64, 3000))),
    "amax": ("x", "x.amax(-1)", logits((64, 3000))),
    "max_values": ("x", "x.max(-1).values", logits((64, 3000))),
    "max_keepdim": ("x", "torch.max(x, dim=-1, keepdim=True)[0] * 2", logits((64, 3000))),
    "min_values_3d": ("x", "x.min(dim=-1).values", logits((4, 16, 300))),
    "max_of_two_tensors": ("x, y", "torch.max(x, y)", f"{logits((64, 300))}, {logits((64, 300))}"),
}  # fmt: skip


def variant_problem(folder, name: str):
    return forward_problem(folder, name, *VARIANTS[name])


def rendered(group, config) -> str:
    return render_kernel(group, config).content


def row_reads(source: str) -> int:
    """How many times a kernel's passes load the logits (access 0) from memory: once per pass that streams them."""
    return len(re.findall(r"load_elements<VEC, false>\(row0 \+", source))


# ------------------------------------------------------------------------------------------ analysis


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_groups_compute_what_the_model_computes(tmp_path, name):
    check_against_model(variant_problem(tmp_path, name), atol=1e-4)


def test_token_logprobs_example_is_one_row_kernel_gathering_the_sampled_token():
    group = only_group(analysed(EXAMPLES / "token_logprobs_bf16.py"))
    assert group.kind == "row" and group.per_row and (group.rows, group.row_length) == (8192, 128256)
    assert (group.output.shape, group.output.dtype) == ((8192,), "float32")
    gathers = [node for node in walk(group.expr) if isinstance(node, Gather)]
    assert len(gathers) == 1 and gathers[0].ignore is None  # gather has no ignored index, unlike nll_loss
    assert [r.kind for r in group.reduces()] == ["online_softmax"]
    assert [t.name for t in group.tensors] == ["logits", "token_ids"]
    assert len([a for a in group.accesses if a.strides[-1] != 0]) == 1  # the logits are one access


def test_token_logprobs_stream_the_row_once_and_read_the_sampled_column_after_the_statistics():
    group = only_group(analysed(EXAMPLES / "token_logprobs_bf16.py"))
    candidates = launch_candidates(group)
    # One level and an output that needs only the statistics: nothing is read twice, so nothing is cached.
    assert all(config.shared_blocks == 0 for config in candidates)
    for config in nonempty(candidates, "launch candidates"):
        source = rendered(group, config)
        assert "// Level 0: online softmax" in source and "// Level 1" not in source
        assert "the row is streamed once" in source and row_reads(source) == 1
        assert "gather_column(r1)" in source and "r1 == " not in source  # no ignored index to zero


def test_entropy_example_is_one_row_pass_accumulating_the_softmax_and_the_weighted_sum():
    group = only_group(analysed(EXAMPLES / "logits_entropy_bf16.py"))
    assert group.kind == "row" and group.per_row and (group.rows, group.row_length) == (8192, 128256)
    # sum(softmax(z) * z) joins the softmax's pass: one statistic holds the max, the sum of exp and the weighted sum.
    (weighted,) = group.reduces()
    assert weighted.kind == "softmax_weighted" and not any(isinstance(node, Field) for node in walk(weighted.weighted))
    candidates = launch_candidates(group)
    assert all(config.shared_blocks == 0 for config in candidates)  # nothing is read twice: no cluster cache
    for config in nonempty(candidates, "launch candidates"):
        source = rendered(group, config)
        assert "// Level 0: online softmax and a softmax-weighted sum" in source and "// Level 1" not in source
        assert "the row is streamed once" in source and row_reads(source) == 1


def test_policy_logprobs_and_entropy_example_is_one_row_kernel_writing_both_values():
    analysis = analysed(EXAMPLES / "policy_logprobs_entropy_bf16.py")
    group = only_group(analysis)
    assert group.kind == "row" and group.per_row and (group.rows, group.row_length) == (4096, 128256)
    assert isinstance(group.expr, Stack) and group.output.shape == (2, 4096)
    # The two values share the softmax statistics, and the entropy's weighted sum joins their pass.
    (statistic,) = group.reduces()
    assert statistic.kind == "softmax_weighted"
    assert len([node for node in walk(group.expr) if isinstance(node, Gather)]) == 1
    assert [t.name for t in group.tensors] == ["logits", "token_ids"]
    # forward returns the two rows of the stacked output, contiguous views of it.
    assert [(leaf.source, leaf.shape, leaf.offset) for leaf in analysis.outputs] == [
        (group.output, (4096,), 0), (group.output, (4096,), 4096),
    ]  # fmt: skip
    model_new = render_model_new(load_problem(EXAMPLES / "policy_logprobs_entropy_bf16.py"), analysis).content
    assert "return (out_g0.view(-1)[0:4096].view(4096,), out_g0.view(-1)[4096:8192].view(4096,))" in model_new


def test_logprobs_and_entropy_read_the_row_once_in_every_candidate():
    # Merged first (the log-prob and the entropy share one online softmax), then the entropy's sum folds into
    # that softmax's pass; folded first, the two kernels would no longer share a statistic and would not merge.
    group = only_group(analysed(EXAMPLES / "policy_logprobs_entropy_bf16.py"))
    for config in nonempty(launch_candidates(group), "launch candidates"):
        source = rendered(group, config)
        assert config.shared_blocks == 0 and row_reads(source) == 1
        assert "out[row] = " in source and "out[1 * kRows + row] = " in source



def test_log_softmax_of_long_fp32_rows_is_read_once_from_registers(tmp_path):
    problem = write_problem(tmp_path, "log_softmax_32k", "def forward(self, x):\n    return torch.log_softmax(x, -1)",
                            "torch.randn(4096, 32768)")  # fmt: skip
    group = only_group(analysed(problem))
    assert not group.per_row and [r.kind for r in group.reduces()] == ["online_softmax"]
    for config in nonempty(launch_candidates(group), "launch candidates"):
        source = rendered(group, config)
        assert "cached in registers" in source and "load_elements<VEC, false>(row0" in source
        assert source.count("load_elements<VEC, false>(row0") == 1


@pytest.mark.parametrize(("name", "kind"), [("amax", "max"), ("max_values", "max"), ("max_keepdim", "max"),
                                            ("min_values_3d", "min")])  # fmt: skip
def test_row_max_and_min_are_one_per_row_reduction(tmp_path, name, kind):
    group = only_group(analysed(variant_problem(tmp_path, name)))
    assert group.per_row and [r.kind for r in group.reduces()] == [kind]


def test_the_max_of_two_tensors_is_elementwise(tmp_path):
    group = only_group(analysed(variant_problem(tmp_path, "max_of_two_tensors")))
    assert group.kind == "elementwise" and "fmaxf(" in rendered(group, launch_candidates(group)[0])


def test_a_ratio_of_log_probabilities_is_computed_in_the_gathering_kernel(tmp_path):
    group = only_group(analysed(variant_problem(tmp_path, "logprobs_ratio")))
    assert group.per_row and group.output.shape == (32,) and "aten.exp" in group.ops


@pytest.mark.parametrize(
    ("forward", "inputs", "op", "reason"),
    [
        ("torch.log_softmax(x, -1).gather(0, t)", "torch.randn(8, 50), torch.randint(0, 8, (1, 50))", "aten.gather",
         "only gathers along the last dimension"),
        ("x.gather(-1, t)", "torch.randn(8, 50), torch.randint(0, 50, (8, 2))", "aten.gather", "only one column per row"),
        ("x.gather(-1, t)", "torch.randn(8, 50), torch.randint(0, 50, (4, 1))", "aten.gather", "only one column per row"),
        ("x.roll(1, -1)", "torch.randn(8, 50)", "aten.roll", "no template for this op"),
    ],
)  # fmt: skip
def test_unsupported_forms_name_the_op_and_why(tmp_path, forward, inputs, op, reason):
    arguments = "x, t" if "t" in forward.replace("torch", "") else "x"
    analysis = analysed(write_problem(tmp_path, "unsupported", f"def forward(self, {arguments}):\n    return {forward}", inputs))
    assert not analysis.supported and op in analysis.blockers() and reason in analysis.blockers()


# ------------------------------------------------------------------------------------------- compiling


@needs_nvcc
@pytest.mark.parametrize("name", ["token_logprobs_bf16", "logits_entropy_bf16", "policy_logprobs_entropy_bf16"])
def test_every_launch_candidate_of_the_examples_compiles(tmp_path, name):
    # The first candidate's spills are checked with the other examples' (test_policy_compile.py, over FUSED_EXAMPLES).
    assert_every_launch_candidate_compiles(EXAMPLES / f"{name}.py", tmp_path)


@needs_nvcc
@pytest.mark.parametrize("name", ["logprobs_3d", "logprobs_ratio", "entropy_bf16_gpt2_vocab",
                                  "entropy_of_log_probs_3d_fp16", "max_values",
                                  "logprobs_and_entropy_tempered_3d_bf16"])  # fmt: skip
def test_every_launch_candidate_of_the_variants_compiles(tmp_path, name):
    assert_every_launch_candidate_compiles(variant_problem(tmp_path, name), tmp_path)


@pytest.mark.cuda_build
def test_token_logprobs_workspace_builds(tmp_path):
    built_workspace(variant_problem(tmp_path, "logprobs_ratio"), tmp_path)


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["token_logprobs_bf16", "logits_entropy_bf16", "policy_logprobs_entropy_bf16"])
def test_every_launch_candidate_of_the_examples_passes_verification(tmp_path, judge, name):  # noqa: F811
    assert_every_launch_candidate_verifies(judge, EXAMPLES / f"{name}.py", tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_launch_candidate_of_the_variants_passes_verification(tmp_path, judge, name):  # noqa: F811
    assert_every_launch_candidate_verifies(judge, variant_problem(tmp_path, name), tmp_path)
