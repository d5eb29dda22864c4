"""Per-token log-probabilities of sampled tokens over bf16 policy logits (8,192 tokens, a 128,256-word vocabulary).

The "selective log-softmax" of RL trainers (PPO, GRPO): the log-probability the policy gives each token it
sampled, without keeping the (tokens, vocabulary) log-softmax around.
"""

import torch
import torch.nn as nn

TOKENS = 8192
VOCABULARY = 128256


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        return log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


def get_inputs():
    logits = (torch.randn(TOKENS, VOCABULARY) * 2.0).to(torch.bfloat16)
    token_ids = torch.randint(0, VOCABULARY, (TOKENS,))
    return [logits, token_ids]


def get_init_inputs():
    return []
