"""Cheat: replaces torch.cuda.Event with an object whose every attribute raises, hoping to break the check for
replaced timing functions (and so keep the replacement)."""

import kp_kernels
import torch
from torch import nn


class Unreadable:
    def __getattr__(self, name):
        raise ValueError(f"no {name} here")


class ModelNew(nn.Module):
    def forward(self, x):
        torch.cuda.Event = Unreadable()
        return kp_kernels.relu(x)
