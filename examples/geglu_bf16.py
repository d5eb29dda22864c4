"""GeGLU gate in bfloat16: gelu(tanh approximation) of the gate times the value, elementwise."""

import torch
import torch.nn as nn
import torch.nn.functional as F

TOKENS = 16384
HIDDEN = 16384


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, gate: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") * value


def get_inputs():
    return [
        torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16),
        torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16),
    ]


def get_init_inputs():
    return []
