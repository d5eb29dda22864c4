"""Per-token entropy of the policy's distribution over bf16 logits (8,192 tokens, a 128,256-word vocabulary).

RL trainers log it (and some add it to the loss) every step: H = logsumexp(z) - sum(softmax(z) * z), the
softmax's statistics first, then a second sum over the row that depends on them.
"""

import torch
import torch.nn as nn

TOKENS = 8192
VOCABULARY = 128256


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        probs = torch.softmax(logits, dim=-1)
        return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def get_inputs():
    return [(torch.randn(TOKENS, VOCABULARY) * 2.0).to(torch.bfloat16)]


def get_init_inputs():
    return []
