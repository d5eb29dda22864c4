"""Attention output projection in bfloat16 plus its residual: residual + Linear(attn), 4096 -> 4096, 4x2048 tokens."""

import torch
import torch.nn as nn

BATCH = 4
SEQUENCE = 2048
HIDDEN = 4096


class Model(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden).to(torch.bfloat16)

    def forward(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + self.proj(attn)


def get_inputs():
    return [
        torch.randn(BATCH, SEQUENCE, HIDDEN, dtype=torch.bfloat16),
        torch.randn(BATCH, SEQUENCE, HIDDEN, dtype=torch.bfloat16),
    ]


def get_init_inputs():
    return [HIDDEN]
