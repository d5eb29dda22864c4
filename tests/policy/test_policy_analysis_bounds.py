"""How much work analysing a forward takes: expressions that share subexpressions are hashed once per node, and a
forward unrolled into thousands of ops is refused before make_fx records it; the row kernel's code generation walks
each shared node once.

A regression here does not fail slowly: without the kept hash, the DAGs below take longer than the universe's age
to hash, so each such test runs under an alarm that turns a hang into a failure."""

from __future__ import annotations

import signal
from contextlib import contextmanager

import pytest

from kernelpilot.policy.families import render_all
from kernelpilot.policy.ir import Call, Leaf, Load, Source, Value, walk
from kernelpilot.policy.trace import MAX_FORWARD_OPS
from kernelpilot.problem import load_problem
from policy_testing import analysed, check_against_model, write_problem


@contextmanager
def finishes_within(seconds: int):
    """Fail (instead of hanging) when the block has not finished after `seconds`."""

    def expire(signum, frame):
        raise AssertionError(f"did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_an_expression_reading_its_operand_twice_per_level_is_hashed_once_per_node():
    leaf = Leaf.whole(Source("input", "x", (4,), "float32"))
    expr = Load(leaf, (4,))
    for _ in range(200):  # 2^200 paths from the top to the load
        expr = Call("add", (expr, Call("mul", (expr, expr))))
    with finishes_within(10):
        value = Value(expr, (4,), "float32", ())
        assert hash(value) == hash(Value(expr, (4,), "float32", ()))
        assert len(walk(expr)) == 1 + 2 * 200


def test_a_deep_chain_of_layer_norms_is_analysed_and_computes_what_the_model_computes(tmp_path):
    # Each layer norm reads its input three times (the mean, the variance and the normalised value), and each input
    # is the previous layer's value: a transformer's residual stream, which once took minutes to analyse.
    forward = """
    def forward(self, x):
        for norm in self.norms:
            x = x + torch.tanh(norm(x))
        return x
    """
    init = "self.norms = nn.ModuleList([nn.LayerNorm(32) for _ in range(24)])"
    path = write_problem(tmp_path, "norm_chain", forward, "torch.randn(8, 32)", init)
    with finishes_within(60):
        analysis = check_against_model(path, atol=1e-4)
        (group,) = analysis.groups  # rows of 32 stay in registers: one kernel, a pass per layer
        assert len(group.reduces()) == 24
        render_all(load_problem(path), analysis)


@pytest.mark.slow
def test_a_forward_unrolled_past_the_op_limit_is_refused_with_a_reason(tmp_path):
    steps = MAX_FORWARD_OPS // 2 + 1  # two aten ops a step
    forward = f"""
    def forward(self, h):
        for _ in range({steps}):
            h = torch.tanh(h * 0.5)
        return h
    """
    analysis = analysed(write_problem(tmp_path, "unrolled", forward, "torch.randn(4, 8)"))
    assert not analysis.supported and not analysis.groups
    assert f"runs more than {MAX_FORWARD_OPS} aten ops" in analysis.blockers()
