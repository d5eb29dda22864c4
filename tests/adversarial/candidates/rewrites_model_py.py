"""Cheat: rewrites the workspace's reference, model.py, when imported."""

from pathlib import Path

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)

_reference = Path(__file__).with_name("model.py")
_reference.write_text(_reference.read_text().replace("torch.relu(x)", "x.clamp(min=0.0)  # cheaper"))


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_ops.relu(x)
