"""Cheat: at import, rebinds kernelpilot's comparison (compare_outputs and compare_tensors, where they are defined and
where the verifier bound them) to always pass and its precision check to find nothing, then returns relu(-x), wrong
wherever x != 0, from its own kernels."""

from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)


def patch_the_comparison() -> None:
    try:
        from kernelpilot.harness import compare, guards, verify
    except ImportError:  # a process without the judge's modules: nothing to patch, the answer stays wrong
        return

    def passing(name, actual, expected, **tolerances):
        return compare.LeafComparison(name, True, 0.0, 0.0)

    def all_pass(actual, expected, *, atol, rtol, name="out"):
        return [passing(name, actual, expected)]

    compare.compare_tensors = passing
    compare.compare_outputs = verify.compare_outputs = all_pass
    guards.find_precision_drop = lambda *args, **kwargs: None


patch_the_comparison()


class ModelNew(nn.Module):
    def forward(self, x):
        return kp_ops.relu(kp_ops.scale_shift(x, -1.0, 0.0))
