"""A LoRA branch added to its frozen layer's output in bfloat16: base + (alpha / r) * B(A(x)), rank 16, 4x2048 tokens.

As PEFT's LoRA Linear computes it for a 4096 -> 4096 projection of an 8B model: the frozen layer's output
(`base_out`) plus the low-rank update scaled by alpha / rank (32 / 16). The rank-16 product is tiny; the second
GEMM writes a 64 MB output and the scale and residual add read and write it again. cuBLASLt's epilogue computes
D = (alpha / r) * (A @ B) + C with base_out as C, so the update is written once.
"""

import torch
import torch.nn as nn

BATCH = 4
SEQUENCE = 2048
HIDDEN = 4096
RANK = 16
LORA_ALPHA = 32


class Model(nn.Module):
    def __init__(self, hidden: int, rank: int, lora_alpha: int):
        super().__init__()
        self.lora_A = nn.Linear(hidden, rank, bias=False).to(torch.bfloat16)
        self.lora_B = nn.Linear(rank, hidden, bias=False).to(torch.bfloat16)
        nn.init.normal_(self.lora_B.weight, std=rank**-0.5)  # trained weights: PEFT starts B at zero
        self.scaling = lora_alpha / rank

    def forward(self, x: torch.Tensor, base_out: torch.Tensor) -> torch.Tensor:
        return base_out + self.lora_B(self.lora_A(x)) * self.scaling


def get_inputs():
    return [
        torch.randn(BATCH, SEQUENCE, HIDDEN, dtype=torch.bfloat16),
        torch.randn(BATCH, SEQUENCE, HIDDEN, dtype=torch.bfloat16),
    ]


def get_init_inputs():
    return [HIDDEN, RANK, LORA_ALPHA]
