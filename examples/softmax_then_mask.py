"""Softmax of attention scores, then multiplied by a keep-mask: a two-op chain across a row reduction."""

import torch
import torch.nn as nn

BATCH = 16
HEADS = 16
QUERIES = 1024
KEYS = 1024


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, scores: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores, dim=-1) * keep_mask


def get_inputs():
    # One mask of 0.0/1.0 shared by every batch and head, broadcast over both.
    keep_mask = (torch.rand(QUERIES, KEYS) > 0.1).float()
    return [torch.randn(BATCH, HEADS, QUERIES, KEYS), keep_mask]


def get_init_inputs():
    return []
