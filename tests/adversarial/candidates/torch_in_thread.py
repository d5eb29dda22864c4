"""Cheat: computes with torch in a helper thread, where a dispatcher mode of the calling thread does not look."""

import threading

import torch
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        result = {}
        helper = threading.Thread(target=lambda: result.update(y=torch.relu(x)))
        helper.start()
        helper.join()
        return result["y"]
