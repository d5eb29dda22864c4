"""verify_candidate on CPU tensors: its trials, each on its own seed; the comparison of outputs with the reference
(mismatches, shapes, dtypes and structures, NaN and Inf, the tolerance); the candidate's errors (raising, a problem
whose inputs fail, the wrong weights); and the verifier's own failures told apart from the candidate's. The
anti-cheat guards are in test_verify_guards.py.

A CPU stand-in for a custom kernel (verify_testing.py): ModelNew allocates its output with torch (allowed) and
computes it by reading and writing the tensors' memory through ctypes, outside torch's dispatcher, as a CUDA kernel
would.
"""

from __future__ import annotations

import math
from unittest.mock import Mock

import pytest
import torch
from torch import nn

from kernelpilot.harness import guards
from kernelpilot.harness.compare import compare_outputs
from kernelpilot.harness.verify import SEED_STRIDE, describe_exception

from verify_testing import RELU_PROBLEM, HonestRelu, guard_names, memory, raw_relu, verify, write_problem


# ------------------------------------------------------------------------------------------ passing


def test_honest_candidate_passes_every_trial_on_its_own_seed(relu_problem):
    result = verify(relu_problem, HonestRelu, base_seed=3)

    assert result.ok, result.message
    assert result.error_kind is None and result.guards == []
    assert [t.seed for t in result.trials] == [3 + i * SEED_STRIDE for i in range(5)]
    assert all(t.ok and t.max_abs_error == 0.0 and t.max_rel_error == 0.0 for t in result.trials)
    assert all(t.worst_index is not None and t.output == "out" for t in result.trials)
    assert result.message.startswith("5 trials passed")


def test_trials_draw_different_inputs(relu_problem):
    seen = []

    class Recording(HonestRelu):
        def forward(self, x):
            seen.append(memory(x)[0])
            return super().forward(x)

    verify(relu_problem, Recording)
    assert len(set(seen)) == 5


# ------------------------------------------------------------------------------------------ mismatches


def test_mismatch_reports_max_errors_and_worst_index(relu_problem):
    class OffByHalfAtOnePlace(nn.Module):
        def forward(self, x):
            out = raw_relu(x, torch.empty_like(x))
            memory(out)[2 * 8 + 3] += 0.5
            return out

    result = verify(relu_problem, OffByHalfAtOnePlace)

    assert not result.ok and result.error_kind == "mismatch"
    (trial,) = result.trials  # the first failing trial ends the run
    assert trial.worst_index == [2, 3] and trial.output == "out"
    assert trial.max_abs_error == pytest.approx(0.5)
    assert "1 of 32 elements outside tolerance" in trial.message and "worst at [2, 3]" in trial.message
    assert "seed 0" in result.message


def test_wrong_on_the_second_seed_only_fails_on_trial_two(relu_problem):
    class RightOnce(nn.Module):
        calls = 0

        def forward(self, x):
            type(self).calls += 1
            out = raw_relu(x, torch.empty_like(x))
            if self.calls > 1:
                memory(out)[0] = memory(out)[0] + 1.0
            return out

    result = verify(relu_problem, RightOnce)

    assert result.error_kind == "mismatch"
    assert [t.ok for t in result.trials] == [True, False]
    assert result.trials[1].seed == SEED_STRIDE and f"seed {SEED_STRIDE}" in result.message


@pytest.mark.parametrize(
    ("forward", "expected_text"),
    [
        (lambda x: raw_relu(x, torch.empty_like(x)).view(-1), "has shape (32,), the reference's is (4, 8)"),
        (lambda x: torch.zeros(4, 8, dtype=torch.float64), "has dtype torch.float64"),
        (lambda x: (raw_relu(x, torch.empty_like(x)),), "is a tuple, the reference returns a tensor"),
        (lambda x: None, "is None, the reference returns a tensor"),
    ],
    ids=["shape", "dtype", "structure", "none"],
)
def test_wrong_shape_dtype_or_structure_fails(relu_problem, forward, expected_text):
    candidate_cls = type("Candidate", (nn.Module,), {"forward": lambda self, x: forward(x)})
    result = verify(relu_problem, candidate_cls)

    assert result.error_kind == "mismatch"
    assert expected_text in result.trials[0].message


def test_nan_where_the_reference_has_none_fails(relu_problem):
    class LeavesOneNaN(nn.Module):
        def forward(self, x):
            out = raw_relu(x, torch.empty_like(x))
            memory(out)[9] = math.nan
            return out

    result = verify(relu_problem, LeavesOneNaN)

    assert result.error_kind == "mismatch"
    assert result.trials[0].worst_index == [1, 1]
    assert "has NaN at 1 positions where the reference has none" in result.trials[0].message


def test_nan_where_the_reference_has_nan_passes(tmp_path):
    problem = write_problem(tmp_path, RELU_PROBLEM.replace("torch.relu(x)", "torch.log(x)"))

    class RawLog(nn.Module):
        def forward(self, x):
            out = torch.empty_like(x)
            memory(out)[:] = [math.log(v) if v > 0 else (-math.inf if v == 0 else math.nan) for v in memory(x)]
            return out

    result = verify(problem, RawLog)
    assert result.ok, result.message


def test_compare_outputs_handles_nested_structures_and_exact_dtypes():
    expected = {"a": (torch.ones(2), [torch.tensor([1, 2])]), "b": 3.0}
    same = {"a": (torch.ones(2), [torch.tensor([1, 2])]), "b": 3.0}
    assert all(leaf.ok for leaf in compare_outputs(same, expected, atol=1e-2, rtol=1e-2))

    off_by_one_int = {"a": (torch.ones(2), [torch.tensor([1, 3])]), "b": 3.0}
    leaves = compare_outputs(off_by_one_int, expected, atol=1e-2, rtol=1e-2)
    (failing,) = [leaf for leaf in leaves if not leaf.ok]
    assert failing.name == "out['a'][1][0]" and failing.worst_index == [1]

    wrong_keys = compare_outputs({"a": expected["a"]}, expected, atol=1e-2, rtol=1e-2)
    assert not wrong_keys[0].ok and "has 1 items" in wrong_keys[0].message


def test_inf_of_the_wrong_sign_fails_and_matching_inf_passes():
    expected = torch.tensor([math.inf, -math.inf, 1.0])
    (matching,) = compare_outputs(expected.clone(), expected, atol=1e-2, rtol=1e-2)
    (flipped,) = compare_outputs(torch.tensor([math.inf, math.inf, 1.0]), expected, atol=1e-2, rtol=1e-2)

    assert matching.ok
    assert not flipped.ok and flipped.worst_index == [1] and "Inf at 1 positions" in flipped.message


def test_tolerance_is_atol_plus_rtol_times_expected():
    expected = torch.tensor([100.0, 0.0])
    (inside,) = compare_outputs(torch.tensor([101.0, 0.01]), expected, atol=1e-2, rtol=1e-2)
    (outside,) = compare_outputs(torch.tensor([101.02, 0.0]), expected, atol=1e-2, rtol=1e-2)

    assert inside.ok and inside.max_abs_error == pytest.approx(1.0) and inside.max_rel_error == pytest.approx(0.01)
    assert not outside.ok and outside.worst_index == [0]


# ------------------------------------------------------------------------------------------ errors


def test_candidate_that_raises_is_a_runtime_error(relu_problem):
    class Raises(nn.Module):
        def forward(self, x):
            raise ValueError("boom\nsecond line")

    result = verify(relu_problem, Raises)

    assert not result.ok and result.error_kind == "runtime" and result.trials == []
    assert "ValueError: boom" in result.message and "second line" not in result.message
    assert result.traceback == ""


def test_a_problem_whose_get_inputs_raises_is_a_reference_error(tmp_path):
    problem = write_problem(
        tmp_path,
        RELU_PROBLEM.replace(
            "return [torch.randn(4, 8)]",
            # Fine on the meta device, where loading the problem checks it; broken on a real one.
            'assert torch.empty(0).is_meta, "no data today"\n        return [torch.randn(4, 8)]',
        ),
    )

    result = verify(problem, HonestRelu)

    assert result.error_kind == "reference"
    assert "the problem's get_inputs() raised AssertionError: no data today" in result.message


def test_exception_description_names_the_kernel_location():
    error = RuntimeError("launch failed\nkernels/relu.cu:42: cudaGetLastError() failed")
    assert describe_exception(error) == "RuntimeError: launch failed (at kernels/relu.cu:42)"


def test_exception_description_of_a_heading_names_the_error_it_introduces():
    """torch.compile's compile workers report "An exception occurred in a subprocess:" and the worker's traceback;
    the traceback's last line is what went wrong."""
    details = ("An exception occurred in a subprocess:\n\nName=<unknown>\nTraceback (most recent call last):\n"
               '  File "worker.py", line 3, in run\n    init()\n'
               "RuntimeError: Unexpected error from cudaGetDeviceCount(). Error 304: OS call failed\n")
    error = RuntimeError(details)
    assert describe_exception(error) == (
        "RuntimeError: An exception occurred in a subprocess: ... "
        "RuntimeError: Unexpected error from cudaGetDeviceCount(). Error 304: OS call failed"
    )
    assert describe_exception(RuntimeError("one line:")) == "RuntimeError: one line:"


# y = x * weight, the weight a parameter the candidate must receive from the reference Model.
WEIGHT_PROBLEM = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return x * self.weight

def get_inputs():
    return [torch.randn(4, 8)]

def get_init_inputs():
    return [8]
"""


def test_state_dict_mismatch_is_a_clear_init_failure(tmp_path):
    problem = write_problem(tmp_path, WEIGHT_PROBLEM)

    class Renamed(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.scale = nn.Parameter(torch.randn(n))

    result = verify(problem, Renamed)

    assert result.error_kind == "init"
    assert "do not match Model's state_dict" in result.message and "weight" in result.message


def test_candidate_gets_the_reference_weights(tmp_path):
    problem = write_problem(tmp_path, WEIGHT_PROBLEM)

    class RawScale(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(n))

        def forward(self, x):
            out = torch.empty_like(x)
            w = list(memory(self.weight.detach()))
            memory(out)[:] = [v * w[i % len(w)] for i, v in enumerate(memory(x))]
            return out

    result = verify(problem, RawScale)
    assert result.ok, result.message


# ------------------------------------------------------------------------------------------ the verifier failing

# A guard with a bug. A Mock, not a function defined here: this file holds the test candidates, so code in it is
# the candidate's, and what the candidate's code raises is the candidate's error.
def broken_guard() -> Mock:
    return Mock(side_effect=RuntimeError("a bug in the aliasing guard"))


def test_a_trusted_guard_that_raises_is_a_harness_error_with_its_traceback(relu_problem, monkeypatch):
    monkeypatch.setattr(guards, "find_mutated_inputs", broken_guard())

    result = verify(relu_problem, HonestRelu)

    assert not result.ok and result.error_kind == "harness"
    assert result.message.startswith(
        "kernelpilot's verifier failed, not the candidate: RuntimeError: a bug in the aliasing guard "
        "(in _check_trusted, verify.py:"
    )
    assert "please report it with the traceback kept in the verify result's `traceback` field" in result.message
    assert result.traceback.startswith("Traceback (most recent call last)")
    assert "find_mutated_inputs(" in result.traceback and "a bug in the aliasing guard" in result.traceback


def test_a_guard_that_raises_on_the_sandbox_side_is_the_candidates_error(relu_problem, monkeypatch):
    # Everything next to candidate code answers for the candidate: no failure there may dodge a verdict.
    monkeypatch.setattr(guards, "find_output_aliasing", broken_guard())

    result = verify(relu_problem, HonestRelu)

    assert (result.ok, result.error_kind) == (False, "runtime")
    assert "a bug in the aliasing guard" in result.message


def test_a_guard_that_failed_before_the_verifier_broke_still_decides(relu_problem, monkeypatch):
    monkeypatch.setattr(guards, "find_mutated_inputs", broken_guard())

    class TorchRelu(nn.Module):
        def forward(self, x):
            return torch.relu(x)

    result = verify(relu_problem, TorchRelu)

    assert result.error_kind == "guard" and guard_names(result) == ["torch-compute"]
    assert "kernelpilot's verifier failed" in result.message and "a bug in the aliasing guard" in result.traceback


def test_the_candidates_code_raising_inside_a_check_is_the_candidates_runtime_error(relu_problem):
    class Grumpy(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            raise RuntimeError("grumpy tensors refuse to be read")

    class ReturnsGrumpy(nn.Module):
        def forward(self, x):
            return raw_relu(x, torch.empty_like(x)).as_subclass(Grumpy)

    result = verify(relu_problem, ReturnsGrumpy)

    assert result.error_kind == "runtime" and result.traceback == ""
    assert result.message == (
        "the candidate's process, handling call, raised RuntimeError: grumpy tensors refuse to be read"
    )


class SlowRelu(nn.Module):
    """Right, but each call takes 150 ms: a launch configuration that cannot beat one of a few ms."""

    def forward(self, x):
        import time

        time.sleep(0.15)
        return raw_relu(x, torch.empty_like(x))


def test_a_candidate_far_slower_than_the_time_to_beat_is_stopped_after_two_trials_untimed(relu_problem):
    stopped = verify(relu_problem, SlowRelu, trials=5, slower_than_ms=2.0)
    assert not stopped.ok and stopped.error_kind == "slower"
    assert [trial.ok for trial in stopped.trials] == [True, True]
    assert "stopped after 2 trials" in stopped.message and "2 ms to beat" in stopped.message

    # Without a time to beat, or with one it does not exceed several times over, it is verified as usual.
    assert verify(relu_problem, SlowRelu, trials=3).ok
    assert verify(relu_problem, SlowRelu, trials=3, slower_than_ms=100.0).ok
    # A fast candidate is never stopped, whatever the time to beat.
    assert verify(relu_problem, HonestRelu, trials=5, slower_than_ms=0.001).ok


def test_a_guard_failure_outranks_stopping_as_slower(relu_problem):
    class SlowTorch(nn.Module):
        def forward(self, x):
            import time

            time.sleep(0.15)
            return torch.relu(x)

    result = verify(relu_problem, SlowTorch, trials=5, slower_than_ms=2.0)
    assert result.error_kind == "guard" and "torch-compute" in result.message
