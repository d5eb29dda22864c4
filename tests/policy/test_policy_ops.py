"""Ops the policy lowers beyond its examples: in-place spellings, more activations, batch norm, reductions over
several or non-trailing dims, pooling. Each is checked for meaning on the CPU (the analysis' groups, run by the
executable spec, compute what Model computes) and, with the `gpu` marker, built and verified on a GPU."""

from __future__ import annotations

import pytest

from policy_testing import analysed, assert_generated_kernels_verify, check_against_model, write_problem

# name -> (forward, inputs, __init__ lines): small problems using the ops, each supported.
PROBLEMS = {
    # In-place ops on values computed in forward, and through a view of one: the functionalised trace.
    "in_place_activations": ("""
        def forward(self, x, y):
            h = x * 2.0
            h.relu_()
            h += y
            F.hardtanh_(h.mul_(0.5), -0.25, 0.25)
            return h
        """, "torch.randn(16, 64), torch.randn(16, 64)", ""),
    "in_place_residual_block": ("""
        def forward(self, x):
            out = self.linear(x)
            out += x
            out = torch.relu_(out)
            return out
        """, "torch.randn(32, 64)", "self.linear = nn.Linear(64, 64)"),
}


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_ops_compute_what_the_model_computes(tmp_path, name):
    forward, inputs, init = PROBLEMS[name]
    check_against_model(write_problem(tmp_path, name, forward, inputs, init), atol=1e-5)


@pytest.mark.parametrize(
    ("forward", "reason"),
    [
        # A write into the caller's tensor is a side effect no generated kernel has.
        ("def forward(self, x):\n    x.relu_()\n    return x * 2", "writes in place into a forward argument"),
        ("def forward(self, x):\n    x.add_(1.0)\n    return x", "writes in place into a forward argument"),
    ],
)
def test_writes_into_forward_arguments_are_named(tmp_path, forward, reason):
    analysis = analysed(write_problem(tmp_path, "writes", forward, "torch.randn(8, 16)"))
    assert not analysis.supported and reason in analysis.blockers()


def test_a_write_through_a_view_is_seen_by_every_later_reader_or_refused(tmp_path):
    # The slice's in-place add changes h too: a policy that ignored the alias would return h without it.
    forward = """
    def forward(self, x):
        h = x * 3.0
        h[:, :8].add_(1.0)
        return h + 1.0
    """
    analysis = analysed(write_problem(tmp_path, "view_write", forward, "torch.randn(8, 16)"))
    assert not analysis.supported and "slice_scatter" in analysis.blockers()


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_generated_kernels_verify_on_the_gpu(judge, tmp_path, name):
    forward, inputs, init = PROBLEMS[name]
    assert_generated_kernels_verify(judge, write_problem(tmp_path, name, forward, inputs, init), tmp_path)
