"""The layers examples/models/run_tiny_gpt.py captures from TinyGPT, at its sizes and dtype, are problems the built-in
policy generates kernels for: its analysis (on the CPU, meta tensors) finds nothing unsupported. Captured on the meta
device, so the example's bf16 model costs no memory here."""

from __future__ import annotations

import pytest
import torch

from kernelpilot.policy.analysis import analyze
from kernelpilot.problem import load_problem

from kp_testing import EXAMPLES


@pytest.fixture
def captured_layers(tmp_path, monkeypatch):
    """The example's RMSNorm and SwiGLU MLP problems, captured from TinyGPT's first block as run_tiny_gpt.py does."""
    monkeypatch.syspath_prepend(str(EXAMPLES / "models"))
    import run_tiny_gpt
    from tiny_gpt import GPTConfig, TinyGPT

    with torch.device("meta"):
        model = TinyGPT(GPTConfig()).to(torch.bfloat16)
        x = torch.randn(run_tiny_gpt.BATCH, run_tiny_gpt.SEQUENCE, GPTConfig().dim, dtype=torch.bfloat16)
    return run_tiny_gpt.capture_layers(model, x, tmp_path)


def test_the_examples_captured_layers_are_supported_by_the_built_in_policy(captured_layers):
    kernels = {}
    for name, path in captured_layers.items():
        analysis = analyze(load_problem(path))
        assert analysis.supported, analysis.blockers()
        kernels[name] = [group.kind for group in analysis.generated_groups]
    assert kernels == {"rmsnorm": ["row"], "mlp": ["matmul", "matmul", "elementwise", "matmul"]}
