"""Knowledge-distillation loss between bf16 teacher and student logits (4,096 tokens, a 128,256-word vocabulary).

The soft-target loss of Hinton et al.: KL(teacher || student) of both distributions softened by a temperature T,
averaged over the batch and scaled by T^2 so its gradients keep their size as T changes. Each row needs the
softmax statistics of both logits rows, then a sum over the row that depends on them.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

TOKENS = 4096
VOCABULARY = 128256
TEMPERATURE = 2.0


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        student = F.log_softmax(student_logits.float() / TEMPERATURE, dim=-1)
        teacher = F.log_softmax(teacher_logits.float() / TEMPERATURE, dim=-1)
        kl = F.kl_div(student, teacher, reduction="batchmean", log_target=True)
        return kl * TEMPERATURE * TEMPERATURE


def get_inputs():
    student_logits = (torch.randn(TOKENS, VOCABULARY) * 2.0).to(torch.bfloat16)
    teacher_logits = (torch.randn(TOKENS, VOCABULARY) * 2.0).to(torch.bfloat16)
    return [student_logits, teacher_logits]


def get_init_inputs():
    return []
