"""The built-in policy's C expressions (policy/c_ops.py's C_OPS) against their CPU spec (policy/cpu_spec.py's
TORCH_OPS): every expression, compiled by the host C compiler and run on sample arguments, computes what its spec
says, and the spec means what torch means by the op."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess

import pytest
import torch

from kernelpilot.policy.c_ops import C_OPS
from kernelpilot.policy.cpu_spec import TORCH_OPS


# --------------------------------------------------------------------------- C_OPS against its CPU spec

# Stand-ins for the CUDA intrinsics C_OPS uses, so the host compiler evaluates its expressions as the GPU would
# (bf16 and fp16 conversions round to nearest even, as __float2bfloat16 and __float2half do).
C_SPEC_PRELUDE = r"""
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
static float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static float fast_expf(float x) { return expf(x); }
#define __expf fast_expf
static float __float2bfloat16(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return f;
  u += 0x7fffu + ((u >> 16) & 1u); u &= 0xffff0000u; memcpy(&f, &u, 4); return f;
}
static float __bfloat162float(float x) { return x; }
static float __float2half(float f) { return (float)(_Float16)f; }
static float __half2float(float x) { return x; }
"""
SAMPLES = (-4.0, -1.5, -0.5, 0.0, 0.3, 1.0, 2.5, 7.0, 1.00390625)


def arity(op: str) -> int:
    return 1 + max(int(n) for n in re.findall(r"\{(\d)\}", C_OPS[op]))


def sample_arguments(op: str) -> list[tuple[float, ...]]:
    n = arity(op)
    values = SAMPLES if n < 3 else SAMPLES[::2]
    return [tuple(args) for args in itertools.product(values, repeat=n)]


@pytest.fixture(scope="module")
def c_ops_on_the_host(tmp_path_factory) -> dict[str, list[float]]:
    """Every C_OPS expression compiled by the host C compiler and run on the sample arguments."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no host C compiler (cc) on PATH")
    lines = [C_SPEC_PRELUDE, "int main(void) {"]
    for op in sorted(C_OPS):
        for args in sample_arguments(op):
            names = [f"a{i}" for i in range(len(args))]
            declared = " ".join(f"float {name} = {value!r}f;" for name, value in zip(names, args))
            lines.append(f'  {{ {declared} printf("{op} %.9g\\n", (double)({C_OPS[op].format(*names)})); }}')
    lines.append("  return 0;\n}")
    folder = tmp_path_factory.mktemp("c_ops")
    (folder / "c_ops.c").write_text("\n".join(lines))
    subprocess.run([compiler, "-O0", "-std=gnu11", "-o", str(folder / "c_ops"), str(folder / "c_ops.c"), "-lm"],
                   check=True, capture_output=True, text=True)  # fmt: skip
    printed = subprocess.run([str(folder / "c_ops")], check=True, capture_output=True, text=True).stdout
    results: dict[str, list[float]] = {}
    for line in printed.splitlines():
        op, value = line.split()
        results.setdefault(op, []).append(float(value))
    return results


def test_every_c_op_has_a_cpu_spec():
    assert set(TORCH_OPS) == set(C_OPS)


@pytest.mark.parametrize("op", sorted(C_OPS))
def test_each_c_op_computes_what_its_cpu_spec_says(c_ops_on_the_host, op):
    arguments = sample_arguments(op)
    columns = [torch.tensor(column, dtype=torch.float64) for column in zip(*arguments)]
    expected = TORCH_OPS[op](*columns).double()
    actual = torch.tensor(c_ops_on_the_host[op], dtype=torch.float64)
    torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-6, equal_nan=True)


# aten ops of the same name whose arguments are all tensors: the spec must mean what torch means by them.
ATEN_NAMED_OPS = sorted(op for op in C_OPS if hasattr(torch, op) and op not in
                        {"where", "clamp", "xlogy", "relu", "pow", "logical_not", "logical_and", "logical_or"})  # fmt: skip


@pytest.mark.parametrize("op", ATEN_NAMED_OPS)
def test_each_aten_named_c_op_means_what_torch_means(op):
    arguments = sample_arguments(op)
    columns = [torch.tensor(column, dtype=torch.float64) for column in zip(*arguments)]
    torch.testing.assert_close(TORCH_OPS[op](*columns).double(), getattr(torch, op)(*columns).double(), equal_nan=True)


@pytest.mark.parametrize("op", ["relu", "pow", "where", "clamp", "xlogy", "logical_not", "logical_and", "logical_or",
                                "leaky_relu", "softplus", "hardsigmoid", "hardswish", "gelu", "silu"])  # fmt: skip
def test_each_c_op_with_settings_means_what_torch_means(op):
    x, y = torch.tensor(SAMPLES, dtype=torch.float64), torch.tensor(SAMPLES[::-1], dtype=torch.float64)
    torch_meaning = {
        "relu": lambda: torch.relu(x), "pow": lambda: torch.pow(x, y), "where": lambda: torch.where(x != 0, x, y),
        "clamp": lambda: torch.clamp(x, -1.0, 2.0), "xlogy": lambda: torch.xlogy(x, y),
        "logical_not": lambda: torch.logical_not(x).double(), "logical_and": lambda: torch.logical_and(x, y).double(),
        "logical_or": lambda: torch.logical_or(x, y).double(),
        "leaky_relu": lambda: torch.nn.functional.leaky_relu(x, 0.01),
        "softplus": lambda: torch.nn.functional.softplus(x, beta=2.0, threshold=5.0),
        "hardsigmoid": lambda: torch.nn.functional.hardsigmoid(x), "hardswish": lambda: torch.nn.functional.hardswish(x),
        "gelu": lambda: torch.nn.functional.gelu(x), "silu": lambda: torch.nn.functional.silu(x),
    }[op]()
    settings = {"clamp": (torch.tensor(-1.0), torch.tensor(2.0)), "leaky_relu": (torch.tensor(0.01),),
                "softplus": (torch.tensor(2.0), torch.tensor(5.0))}  # fmt: skip
    args = {"pow": (x, y), "where": (x, x, y), "xlogy": (x, y), "logical_and": (x, y), "logical_or": (x, y)}
    spec = TORCH_OPS[op](*args.get(op, (x, *settings.get(op, ()))))
    torch.testing.assert_close(spec.double(), torch_meaning.double(), equal_nan=True)
