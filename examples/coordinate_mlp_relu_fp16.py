"""First layer of a coordinate network (NeRF-style) in float16: Linear 64 -> 256 with bias, then ReLU, over 2^20 points.

A NeRF or neural-SDF step evaluates its MLP at every sample point: 4,096 rays x 256 samples = 2^20 points, each
a 64-feature encoding (positional or hash-grid), into a 256-wide hidden layer. With K = 64 the GEMM does 34
GFLOP but writes a 512 MB output from a 128 MB input: memory-bound, so an extra read and write of the output (a
separate bias + ReLU pass, as inductor runs after cuBLAS) costs more than the GEMM itself, while cuBLASLt's
bias + ReLU epilogue writes it once.
"""

import torch
import torch.nn as nn

POINTS = 4096 * 256
ENCODED_FEATURES = 64
HIDDEN = 256


class Model(nn.Module):
    def __init__(self, encoded_features: int, hidden: int):
        super().__init__()
        self.layer = nn.Linear(encoded_features, hidden).to(torch.float16)

    def forward(self, encoded: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.layer(encoded))


def get_inputs():
    return [torch.randn(POINTS, ENCODED_FEATURES, dtype=torch.float16)]


def get_init_inputs():
    return [ENCODED_FEATURES, HIDDEN]
