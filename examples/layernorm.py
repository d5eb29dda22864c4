"""LayerNorm with affine weight and bias over the hidden size of a batch of transformer activations."""

import torch
import torch.nn as nn

BATCH = 16
SEQUENCE = 2048
HIDDEN = 4096


class Model(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, eps=eps)
        # Random affine parameters, so a kernel that ignores them cannot pass verification.
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def get_inputs():
    return [torch.randn(BATCH, SEQUENCE, HIDDEN)]


def get_init_inputs():
    return [HIDDEN, 1e-5]
