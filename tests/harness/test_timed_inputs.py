"""The judge's side of a timed run's inputs (timed_inputs.py): drawn per seed into tensors lent once, lent anew
where their layout changes, and what the model's process opens is what the judge drew."""

from __future__ import annotations

import torch

from kernelpilot.harness.shared import SharedArena, open_tree
from kernelpilot.harness.timed_inputs import TimedInputs
from kernelpilot.problem import load_problem
from kp_testing import write_problem

FIXED = """
import torch
from torch import nn

class Model(nn.Module):
    def forward(self, x, k):
        return x * k

def get_inputs():
    return [torch.randn(4, 8), 3]

def get_init_inputs():
    return []
"""

# Rows drawn with the inputs: the layout changes from one seed to another.
VARYING = """
import torch
from torch import nn

class Model(nn.Module):
    def forward(self, x):
        return x * 2

def get_inputs():
    return [torch.randn(int(torch.randint(2, 6, ())), 8)]

def get_init_inputs():
    return []
"""


def test_each_run_rewrites_the_lent_tensors_in_place_and_the_model_side_reads_the_draw(tmp_path):
    problem = load_problem(write_problem(tmp_path, FIXED))
    cpu = torch.device("cpu")
    with SharedArena(cpu) as arena:
        inputs = TimedInputs(problem, arena, cpu, seed=1)
        lent = open_tree(inputs.description)  # as the model's process maps them at bind
        for seed in (7, 8):
            assert inputs.feed(seed) == {}, "same layout: nothing to send"
            expected = problem.make_inputs(cpu, seed)
            assert torch.equal(lent[0], expected[0]) and lent[1] == 3


def test_a_layout_that_changes_is_lent_anew_and_named_in_every_later_run(tmp_path):
    problem = load_problem(write_problem(tmp_path, VARYING))
    cpu = torch.device("cpu")
    rows = {seed: problem.make_inputs(cpu, seed)[0].shape[0] for seed in range(40)}
    first = 0
    other = next(seed for seed in rows if rows[seed] != rows[first])
    same_as_other = next(seed for seed in rows if seed != other and rows[seed] == rows[other])
    with SharedArena(cpu) as arena:
        inputs = TimedInputs(problem, arena, cpu, seed=first)
        changed = inputs.feed(other)
        assert "inputs" in changed and torch.equal(open_tree(changed["inputs"])[0], problem.make_inputs(cpu, other)[0])
        again = inputs.feed(same_as_other)  # the same layout as the last, but the other process may hold the first
        assert "inputs" in again and torch.equal(open_tree(again["inputs"])[0], problem.make_inputs(cpu, same_as_other)[0])
