"""Broken: asks for a 1 TiB scratch buffer before computing."""

import torch
from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        torch.empty(1 << 40, dtype=torch.uint8, device=x.device)
        return kp_ops.relu(x)
