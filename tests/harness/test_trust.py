"""The trust boundary's CPU-testable parts: shared tensors, the scale check, fingerprints, the signed cache, seeds,
the trusted clock's guard. The processes themselves are exercised in test_worker.py and test_judge.py."""

from __future__ import annotations

import ctypes
import json
import os
import stat

import numpy as np
import pytest
import torch

from kernelpilot.harness import cache
from kernelpilot.harness.sandbox_client import InProcessModel
from kernelpilot.harness.shared import SharedArena, open_reference, open_tree, share_tree
from kernelpilot.harness.timing import UNACCOUNTED_TIME, find_unaccounted_time, typical_unaccounted
from kernelpilot.harness.compare import compare_tensors
from kernelpilot.harness.verify import fingerprint, verify_candidate
from kernelpilot.problem import load_problem
from kernelpilot.results import Timing

# ------------------------------------------------------------------------------------------ shared tensors


def test_a_shared_tensor_is_the_same_memory_on_both_sides_with_its_strides():
    with SharedArena("cpu") as arena:
        source = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous: strides (1, 4)
        shared, reference = arena.copy_of(source)
        json.dumps(reference)  # a reference is plain JSON
        opened = open_reference(reference)
        assert opened.stride() == source.stride() and torch.equal(opened, source)
        opened.fill_(7.0)  # the sandbox writes its slot...
        assert torch.equal(shared, torch.full_like(source, 7.0))  # ...and the trusted side sees it


def test_inputs_cross_as_a_tree_of_shared_tensors_and_plain_values():
    with SharedArena("cpu") as arena:
        tree = [torch.ones(2), 3, {"scale": 0.5, "mask": torch.zeros(2, dtype=torch.bool)}, None, torch.float16]
        _, description = share_tree(arena, tree)
        opened = open_tree(json.loads(json.dumps(description)))
        assert torch.equal(opened[0], tree[0]) and opened[1] == 3 and opened[2]["scale"] == 0.5
        assert opened[2]["mask"].dtype == torch.bool and opened[3] is None and opened[4] is torch.float16
        with pytest.raises(TypeError, match="cannot cross to the sandbox"):
            share_tree(arena, [object()])


def test_closing_the_arena_removes_its_files():
    arena = SharedArena("cpu")
    _, reference = arena.copy_of(torch.ones(4))
    assert os.path.exists(reference["path"])
    arena.close()
    assert not os.path.exists(reference["path"])


# ------------------------------------------------------------------------------------------ the scale check

def softmax_rows(columns: int = 32768) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.softmax(torch.randn(8, columns), dim=-1)


def test_noise_under_atol_fails_the_scale_check_and_an_honest_answer_passes():
    expected = softmax_rows()
    assert float(expected.max()) < 1e-2, "every output is below atol: the element test alone passes anything"
    constant = torch.full_like(expected, 1 / expected.shape[-1])
    noise = torch.rand_like(expected) * 1e-3
    honest = torch.softmax(torch.log(expected.double()), dim=-1).float()  # the same answer, computed another way
    for wrong in (constant, noise):
        verdict = compare_tensors("out", wrong, expected, atol=1e-2, rtol=1e-2)
        assert not verdict.ok and "scale" in verdict.message and "no better than a constant" in verdict.message
    assert compare_tensors("out", honest, expected, atol=1e-2, rtol=1e-2).ok


def test_the_scale_check_leaves_outputs_the_tolerance_resolves_and_low_precision_outputs_alone():
    torch.manual_seed(0)
    expected = torch.randn(64, 64)  # spread 1, far wider than atol: the element test decides
    assert compare_tensors("out", expected + 5e-3, expected, atol=1e-2, rtol=1e-2).ok
    small = softmax_rows().bfloat16()  # bf16 rounding stays far below the outputs' spread
    assert compare_tensors("out", small.float().bfloat16(), small, atol=1e-2, rtol=1e-2).ok


# ------------------------------------------------------------------------------------------ fingerprints


# A group norm's output has mean 0 per group, so the mean over everything is 0 up to rounding: the reference's
# outputs are noise (KernelBench L2 23 has this shape), and no answer can be far below their spread.
GROUP_NORM_MEAN = """
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(4, 64)

    def forward(self, x):
        return self.norm(x).mean(dim=[1, 2, 3])


def get_inputs():
    return [torch.randn(32, 64, 8, 8)]


def get_init_inputs():
    return []
"""


def _elements(t: torch.Tensor) -> np.ndarray:
    """A contiguous float32 tensor's memory as a numpy array: computing there runs no torch op, as a kernel would."""
    return np.ctypeslib.as_array((ctypes.c_float * t.numel()).from_address(t.data_ptr()))


class _HoldsGroupNorm(torch.nn.Module):
    """The reference's parameters, which a candidate holds under the same names."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.GroupNorm(4, 64)


class GroupNormMeanOtherOrder(_HoldsGroupNorm):
    """The same computation with its sums in another order: an honest candidate's rounding."""

    def forward(self, x):
        out = torch.empty(x.shape[0])
        groups = _elements(x).reshape(x.shape[0], 4, -1)
        centred = groups - groups.mean(axis=-1, keepdims=True, dtype=np.float32)
        normed = centred / np.sqrt((centred * centred).mean(axis=-1, keepdims=True, dtype=np.float32) + 1e-5)
        weight, bias = _elements(self.norm.weight.data), _elements(self.norm.bias.data)
        normed = normed.reshape(x.shape) * weight[:, None, None] + bias[:, None, None]
        _elements(out)[:] = normed.reshape(x.shape[0], -1).sum(axis=1, dtype=np.float32) / normed[0].size
        return out


class GroupNormMeanZeros(_HoldsGroupNorm):
    def forward(self, x):
        out = torch.empty(x.shape[0])
        _elements(out)[:] = 0.0
        return out


class GroupNormMeanNoise(_HoldsGroupNorm):
    """Reads nothing: noise as small as the reference's own, different on every call."""

    def forward(self, x):
        out = torch.empty(x.shape[0])
        _elements(out)[:] = np.random.default_rng().standard_normal(x.shape[0], dtype=np.float32) * 3e-9
        return out


class SoftmaxNoise(torch.nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        _elements(out)[:] = np.random.default_rng(0).random(x.numel(), dtype=np.float32) * 1e-3
        return out


SOFTMAX_LONG_ROWS = """
import torch
from torch import nn


class Model(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)


def get_inputs():
    return [torch.randn(8, 32768)]


def get_init_inputs():
    return []
"""


def test_where_the_reference_is_rounding_noise_no_answer_passes_and_the_message_says_why(tmp_path):
    (tmp_path / "group_norm_mean.py").write_text(GROUP_NORM_MEAN)
    problem = load_problem(tmp_path / "group_norm_mean.py")
    # Noise that reads nothing is as close to the reference as an honest answer in another order, and 0 (the exact
    # answer) as close as either: none passes, and the message says the problem is why.
    for candidate in (GroupNormMeanOtherOrder, GroupNormMeanNoise, GroupNormMeanZeros):
        model = InProcessModel.from_class(problem, candidate, device="cpu", seed=0)
        result = verify_candidate(problem, model, device="cpu", trials=3)
        assert not result.ok and result.error_kind == "mismatch", result.message
        assert "out: the reference's outputs are rounding noise (their spread is" in result.message, result.message
        assert "no answer can be told from noise" in result.message


def test_noise_under_atol_still_fails_where_the_reference_resolves_its_outputs(tmp_path):
    (tmp_path / "softmax.py").write_text(SOFTMAX_LONG_ROWS)
    problem = load_problem(tmp_path / "softmax.py")
    model = InProcessModel.from_class(problem, SoftmaxNoise, device="cpu", seed=0)
    result = verify_candidate(problem, model, device="cpu", trials=2)
    assert not result.ok and "no better than a constant answer" in result.message


def test_fingerprints_tell_equal_values_from_different_ones():
    torch.manual_seed(0)
    x = torch.randn(1000)
    y = x.clone()
    assert fingerprint(x) == fingerprint(y)
    y[517] = torch.nextafter(y[517], torch.tensor(float("inf")))  # one ulp at one place
    assert fingerprint(x) != fingerprint(y)
    nan = torch.tensor([float("nan"), 1.0])
    assert fingerprint(nan) == fingerprint(nan.clone())
    assert fingerprint(torch.zeros(4)) != fingerprint(torch.zeros(2, 2))


# ------------------------------------------------------------------------------------------ the signed cache


def test_a_cache_entry_without_the_judges_signature_is_ignored(tmp_path):
    key = {"problem_id": "p", "gpu": "H100"}
    path = cache.store_entry("baselines", key, {"eager": 1.0}, tmp_path)
    assert cache.load_entry("baselines", key, tmp_path) == {"eager": 1.0}
    key_file = tmp_path / cache.KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600

    forged = json.loads(path.read_text())
    forged["value"] = {"eager": 25.0}  # a slower baseline, keeping the old signature
    path.write_text(json.dumps(forged))
    assert cache.load_entry("baselines", key, tmp_path) is None
    del forged["hmac"]  # no signature at all, as a candidate without the key writes it
    path.write_text(json.dumps(forged))
    assert cache.load_entry("baselines", key, tmp_path) is None


# ------------------------------------------------------------------------------------------ seeds

RELU = """
import torch
from torch import nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(16, 16)]


def get_init_inputs():
    return []
"""


class PlainRelu(torch.nn.Module):
    def forward(self, x):
        return x.clamp(min=0)


def test_seeds_nobody_chose_are_drawn_per_run_and_recorded(tmp_path):
    (tmp_path / "relu.py").write_text(RELU)
    problem = load_problem(tmp_path / "relu.py")
    seeds = []
    for _ in range(2):
        model = InProcessModel.from_class(problem, PlainRelu, device="cpu", seed=0)
        result = verify_candidate(problem, model, device="cpu", trials=2)
        seeds.append(result.base_seed)
        assert [trial.seed for trial in result.trials][:1] == [result.base_seed]
    assert seeds[0] != seeds[1]


# ------------------------------------------------------------------------------------------ the clock


def timing(median_ms: float, unaccounted_ms: float) -> Timing:
    return Timing(median_ms, median_ms, median_ms, median_ms, 20, unaccounted_ms=unaccounted_ms)


def test_time_the_sandbox_did_not_report_fails_beyond_the_protocols_own_cost():
    assert find_unaccounted_time(timing(1.0, 0.30), clean_unaccounted_ms=0.28) is None
    hidden = find_unaccounted_time(timing(0.001, 1.30), clean_unaccounted_ms=0.28)
    assert hidden is not None and hidden.guard == UNACCOUNTED_TIME and hidden.severity == "fail"
    assert "1.020 ms longer on the judge's clock" in hidden.message
    # A long call may take a tenth of its own time more (noise scales with the call), not a fifth.
    assert find_unaccounted_time(timing(10.0, 1.2), clean_unaccounted_ms=0.3) is None
    assert find_unaccounted_time(timing(8.0, 2.3), clean_unaccounted_ms=0.3) is not None  # 10 ms reported as 8
    # On a CPU (tests on busy machines) the floor is 15 ms and the share a quarter.
    assert find_unaccounted_time(timing(100.0, 30.0), clean_unaccounted_ms=6.0, device_type="cpu") is None
    assert find_unaccounted_time(timing(100.0, 50.0), clean_unaccounted_ms=6.0, device_type="cpu") is not None


def test_a_cpu_series_held_up_half_the_time_is_load_but_work_outside_every_window_is_not():
    held_up = [0.7, 9.0, 0.8, 12.0, 0.6, 8.5, 0.7, 10.0, 9.5, 11.0, 0.7, 8.8]  # a busy machine: most runs late
    assert typical_unaccounted(held_up, "cpu") < 1.0
    assert typical_unaccounted(held_up, "cuda") > 4.0  # (a GPU's series is judged by its median)
    outside = [30.0 + value for value in held_up]
    assert typical_unaccounted(outside, "cpu") > 30.0
    assert typical_unaccounted([0.7, 9.0, 0.8], "cpu") == 0.8  # too few runs for quartiles: the median


def test_copying_into_slots_leaves_no_reference_cycle_holding_them():
    """The judge gets a lent CUDA block back only once the sandbox has let go of it; a slot kept alive by a
    reference cycle until the garbage collector ran held one output's memory per call in the judge (60 GB on
    KernelBench L1 63 after five trials)."""
    import gc
    import weakref

    from kernelpilot.harness.sandbox import copy_into_slots

    slots = [torch.zeros(3), torch.zeros(2)]
    watch = [weakref.ref(slot) for slot in slots]
    gc.disable()
    try:
        structure = copy_into_slots((torch.ones(3), {"b": torch.ones(2)}, 7), slots)
        del slots
        assert [ref() for ref in watch] == [None, None], "the slots outlived the copy without the garbage collector"
    finally:
        gc.enable()
    assert structure["items"][0]["copied"] and structure["items"][1]["items"]["b"]["copied"]
    assert structure["items"][2] == {"t": "value", "v": 7}
