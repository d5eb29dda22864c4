"""Cheat: the whole product is at::matmul in its binding, unseen by the op recorder (Python dispatch keys excluded),
and the cuBLAS kernels it launches pass as the workspace's own because a source comment names cublasLtMatmul(."""

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


class ModelNew(nn.Module):
    def forward(self, a, b):
        return kp_ops.hidden_matmul(a, b)
