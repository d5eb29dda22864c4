"""Cross-entropy plus PaLM's z-loss over bf16 language-model logits (4,096 tokens, a 128,256-word vocabulary).

The z-loss, 1e-4 * logsumexp(z)^2 averaged over tokens, keeps the softmax normaliser near 1 (log Z near 0) for
stable large-model training. Both terms come from each row's softmax statistics: the target's log-probability
needs its max and sum of exponentials, and log Z is made of the same two numbers.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

TOKENS = 4096
VOCABULARY = 128256
Z_LOSS_WEIGHT = 1e-4


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return F.cross_entropy(logits, targets) + Z_LOSS_WEIGHT * z_loss


def get_inputs():
    logits = (torch.randn(TOKENS, VOCABULARY) * 2.0).to(torch.bfloat16)
    targets = torch.randint(0, VOCABULARY, (TOKENS,))
    return [logits, targets]


def get_init_inputs():
    return []
