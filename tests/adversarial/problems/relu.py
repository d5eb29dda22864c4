"""ReLU over a float32 matrix: the problem most adversarial candidates cheat on."""

import torch
from torch import nn


class Model(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


def get_inputs():
    return [torch.randn(2048, 2048)]


def get_init_inputs():
    return []
