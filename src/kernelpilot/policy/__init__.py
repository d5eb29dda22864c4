"""The built-in offline policy: analyse the forward on meta tensors, generate fused CUDA kernels from
templates/policy/, and drive them through the agent's tools like any other `Model`."""

from kernelpilot.policy.policy import BuiltinPolicy

__all__ = ["BuiltinPolicy"]
