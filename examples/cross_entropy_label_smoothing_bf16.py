"""Cross-entropy with label smoothing 0.1 over bf16 language-model logits (4,096 tokens, a 128,256-word vocabulary).

F.cross_entropy(..., label_smoothing=0.1) mixes the target's loss with the mean loss over every class:
0.9 * -log p(target) + 0.1 * -mean(log p). Both come from each row's softmax statistics, the second with one
more sum over the row, and the batch mean skips padding rows (ignore_index, about a tenth of the tokens here, as
in packed SFT batches). 4,096 tokens of a Llama-3 vocabulary are 1 GB of bf16 logits; torch's decomposition
writes the float32 log-softmax (2 GB) and reads it twice more.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

TOKENS = 4096
VOCABULARY = 128256
LABEL_SMOOTHING = 0.1
IGNORE_INDEX = -100


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, label_smoothing=LABEL_SMOOTHING)


def get_inputs():
    logits = (torch.randn(TOKENS, VOCABULARY) * 2.0).to(torch.bfloat16)
    targets = torch.randint(0, VOCABULARY, (TOKENS,))
    targets = torch.where(torch.rand(TOKENS) < 0.1, IGNORE_INDEX, targets)  # padding
    return [logits, targets]


def get_init_inputs():
    return []
