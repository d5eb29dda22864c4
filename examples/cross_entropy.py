"""Mean cross-entropy of language-model logits (16,384 tokens, a 32,000-word vocabulary) against integer targets."""

import torch
import torch.nn as nn
import torch.nn.functional as F

TOKENS = 16384
VOCABULARY = 32000


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, targets)


def get_inputs():
    return [torch.randn(TOKENS, VOCABULARY) * 4.0, torch.randint(0, VOCABULARY, (TOKENS,))]


def get_init_inputs():
    return []
