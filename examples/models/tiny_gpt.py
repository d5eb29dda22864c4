"""A small GPT-style decoder stack: pre-norm blocks of RMSNorm, causal attention through SDPA and a SwiGLU MLP,
with residuals, and a final RMSNorm. It takes token embeddings (batch, sequence, dim) and returns hidden states.

It is the user model of `run_tiny_gpt.py`, which captures two of its layers as KernelBench-format problems,
optimizes them with kernelpilot's built-in policy, and swaps the verified kernels back in. Nothing here knows
about kernelpilot: it is the kind of module an ML project already has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    dim: int = 1024
    heads: int = 16
    layers: int = 4
    mlp_hidden: int = 2816  # about 8/3 of dim, a multiple of 64, as LLaMA sizes SwiGLU
    eps: float = 1e-6


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), bias-free."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, sequence, dim = x.shape
        q, k, v = self.qkv(x).view(batch, sequence, 3, self.heads, dim // self.heads).unbind(dim=2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, sequence, dim))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.eps)
        self.attn = CausalSelfAttention(config.dim, config.heads)
        self.mlp_norm = RMSNorm(config.dim, config.eps)
        self.mlp = SwiGLU(config.dim, config.mlp_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.dim, config.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)
