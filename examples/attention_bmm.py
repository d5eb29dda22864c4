"""Unfused attention over (batch, heads, tokens, head_dim): scores by batched matmul, softmax, then values."""

import torch
import torch.nn as nn

BATCH = 4
HEADS = 16
TOKENS = 1024
HEAD_DIM = 64


class Model(nn.Module):
    def __init__(self, head_dim: int):
        super().__init__()
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-2, -1) * self.scale
        return torch.softmax(scores, dim=-1) @ v


def get_inputs():
    return [torch.randn(BATCH, HEADS, TOKENS, HEAD_DIM) for _ in range(3)]


def get_init_inputs():
    return [HEAD_DIM]
