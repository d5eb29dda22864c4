"""Transformer MLP up-projection in bfloat16: Linear 4096 -> 16384 with bias over 4x2048 tokens, then tanh GELU."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 4
SEQUENCE = 2048
HIDDEN = 4096
INTERMEDIATE = 16384


class Model(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.up = nn.Linear(hidden, intermediate).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.up(x), approximate="tanh")


def get_inputs():
    return [torch.randn(BATCH, SEQUENCE, HIDDEN, dtype=torch.bfloat16)]


def get_init_inputs():
    return [HIDDEN, INTERMEDIATE]
