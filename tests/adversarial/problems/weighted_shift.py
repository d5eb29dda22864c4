"""A learned offset plus a small multiple of the input: out = weight + 1e-3 * x. The output's spread is the
weight's, fixed structure; what the input adds moves each element by about 1e-3 from draw to draw, less than
atol + rtol * |out|."""

import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 1024))

    def forward(self, x):
        return self.weight + 1e-3 * x


def get_inputs():
    return [torch.randn(64, 1024)]


def get_init_inputs():
    return []
