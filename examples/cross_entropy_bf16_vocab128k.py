"""Mean cross-entropy of bf16 language-model logits (4,096 tokens, a 128,256-word vocabulary, padding ignored)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

TOKENS = 4096
VOCABULARY = 128256
PADDING = -100  # F.cross_entropy's default ignore_index: padded positions add no loss and are not counted


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, targets, ignore_index=PADDING)


def get_inputs():
    logits = (torch.randn(TOKENS, VOCABULARY) * 4.0).to(torch.bfloat16)
    targets = torch.randint(0, VOCABULARY, (TOKENS,))
    targets[TOKENS - TOKENS // 8 :] = PADDING  # the last eighth of the batch is padding
    return [logits, targets]


def get_init_inputs():
    return []
