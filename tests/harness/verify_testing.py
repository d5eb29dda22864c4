"""What the verify tests (test_verify.py, test_verify_guards.py) share: the ReLU problem, a CPU stand-in for a
custom kernel, and the trusted verifier run against a candidate class served in this process.

The stand-in: ModelNew allocates its output with torch (allowed) and computes it by reading and writing the tensors'
memory through ctypes, outside torch's dispatcher, as a CUDA kernel would.
"""

from __future__ import annotations

import ctypes
import textwrap

import torch
from torch import nn

from kernelpilot.harness.sandbox_client import InProcessModel
from kernelpilot.harness.verify import verify_candidate
from kernelpilot.problem import load_problem


RELU_PROBLEM = """
    import torch
    from torch import nn

    class Model(nn.Module):
        def forward(self, x):
            return torch.relu(x)

    def get_inputs():
        return [torch.randn(4, 8)]

    def get_init_inputs():
        return []
"""


def write_problem(tmp_path, source: str, name: str = "problem"):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return load_problem(path)


def memory(t: torch.Tensor):
    """The float32 elements of a contiguous tensor as a ctypes array over its memory."""
    return (ctypes.c_float * t.numel()).from_address(t.data_ptr())


def raw_relu(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    memory(out)[:] = [v if v > 0 else 0.0 for v in memory(x)]
    return out


class HonestRelu(nn.Module):
    def forward(self, x):
        return raw_relu(x, torch.empty_like(x))


def verify(problem, candidate_cls, *, base_seed=0, workspace=None, **kwargs):
    """The trusted verifier against `candidate_cls` served in this process (the sandbox's request handling)."""
    model = InProcessModel.from_class(problem, candidate_cls, device="cpu", seed=base_seed, workspace=workspace)
    return verify_candidate(problem, model, device="cpu", base_seed=base_seed, workspace=workspace, **kwargs)


def guard_names(result) -> list[str]:
    return [finding.guard for finding in result.guards]
