"""Token log-probabilities and entropies of an RL policy over bf16 logits (4,096 tokens, a 128,256-word vocabulary).

A PPO/GRPO trainer step (as verl's actor computes it): the logits are divided by the sampling temperature, then
each sampled token's log-probability feeds the policy-gradient loss and each token's entropy the entropy bonus.
Both come from one softmax per row: the log-probability needs its max and sum of exponentials, the entropy
logsumexp(z) - sum(softmax(z) * z) the same two numbers and one more sum over the row. 4,096 rows of a Llama-3
vocabulary are 1 GB of bf16 logits, one micro-batch of an 8B-model trainer; writing the float32 log-softmax
(2 GB) is what a fused kernel avoids.
"""

import torch
import torch.nn as nn

TOKENS = 4096
VOCABULARY = 128256
TEMPERATURE = 0.7


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.float() / TEMPERATURE
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
        entropy = torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
        return log_probs, entropy


def get_inputs():
    logits = (torch.randn(TOKENS, VOCABULARY) * 2.0).to(torch.bfloat16)
    token_ids = torch.randint(0, VOCABULARY, (TOKENS,))
    return [logits, token_ids]


def get_init_inputs():
    return []
