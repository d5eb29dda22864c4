"""The C syntax of the IR's pointwise ops: each `Call` op as a CUDA float expression of its operands (the codegen's
op table, as inductor's OpOverrides). The lowering (analysis.py) turns aten ops into these names; the emitter
(codegen.py) writes them out."""

from __future__ import annotations

# op -> C expression over its arguments {0}, {1}, ... (all float). Ops with scalar settings are built by
# `_elementwise` as these plus constant arguments.
C_OPS = {
    "neg": "-{0}", "exp": "expf({0})", "exp2": "exp2f({0})", "log": "logf({0})", "log2": "log2f({0})",
    "log1p": "log1pf({0})", "expm1": "expm1f({0})", "sqrt": "sqrtf({0})", "rsqrt": "rsqrtf({0})",
    "abs": "fabsf({0})", "sigmoid": "1.0f / (1.0f + expf(-{0}))", "tanh": "tanhf({0})",
    "relu": "fmaxf({0}, 0.0f)", "silu": "{0} / (1.0f + expf(-{0}))", "erf": "erff({0})", "sin": "sinf({0})",
    "cos": "cosf({0})", "reciprocal": "1.0f / {0}", "square": "{0} * {0}", "floor": "floorf({0})",
    "ceil": "ceilf({0})", "identity": "{0}", "logical_not": "({0} == 0.0f ? 1.0f : 0.0f)",
    "gelu": "0.5f * {0} * (1.0f + erff({0} * 0.70710678118654752f))",
    "gelu_tanh": "0.5f * {0} * (1.0f + tanhf(0.79788456080286536f * ({0} + 0.044715f * {0} * {0} * {0})))",
    "hardsigmoid": "fminf(fmaxf({0} + 3.0f, 0.0f), 6.0f) / 6.0f",
    "hardswish": "{0} * fminf(fmaxf({0} + 3.0f, 0.0f), 6.0f) / 6.0f",
    "mish": "{0} * tanhf(log1pf(expf({0})))",
    # elu(x, alpha, scale, input_scale); SELU and CELU are elu with their constants.
    "elu": "({0} > 0.0f ? {2} * {0} : {2} * {1} * expm1f({0} * {3}))",
    "to_bfloat16": "__bfloat162float(__float2bfloat16({0}))", "to_float16": "__half2float(__float2half({0}))",
    "to_bool": "({0} != 0.0f ? 1.0f : 0.0f)",
    "add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "div": "{0} / {1}",
    "maximum": "fmaxf({0}, {1})", "minimum": "fminf({0}, {1})", "pow": "powf({0}, {1})",
    "gt": "({0} > {1} ? 1.0f : 0.0f)", "lt": "({0} < {1} ? 1.0f : 0.0f)", "ge": "({0} >= {1} ? 1.0f : 0.0f)",
    "le": "({0} <= {1} ? 1.0f : 0.0f)", "eq": "({0} == {1} ? 1.0f : 0.0f)", "ne": "({0} != {1} ? 1.0f : 0.0f)",
    "logical_and": "({0} != 0.0f && {1} != 0.0f ? 1.0f : 0.0f)",
    "logical_or": "({0} != 0.0f || {1} != 0.0f ? 1.0f : 0.0f)",
    "leaky_relu": "({0} > 0.0f ? {0} : {0} * {1})",
    "softplus": "({0} * {1} > {2} ? {0} : log1pf(expf({0} * {1})) / {1})",
    "where": "({0} != 0.0f ? {1} : {2})", "clamp": "fminf(fmaxf({0}, {1}), {2})",
    "add_scaled": "{0} + {2} * {1}", "sub_scaled": "{0} - {2} * {1}",
    "xlogy": "({0} == 0.0f && !isnan({1}) ? 0.0f : {0} * logf({1}))",
    # smooth_l1_loss's term of a difference d with its beta, and huber_loss's with its delta, as torch computes them.
    "smooth_l1": "(fabsf({0}) < {1} ? 0.5f * fabsf({0}) * fabsf({0}) / {1} : fabsf({0}) - 0.5f * {1})",
    "huber": "(fabsf({0}) < {1} ? 0.5f * fabsf({0}) * fabsf({0}) : {1} * (fabsf({0}) - 0.5f * {1}))",
    # Row statistics: softmax-style outputs use the fast exponential, as every tuned softmax does.
    "exp_fast": "__expf({0})",
    "logsumexp_finish": "({0} == -INFINITY ? {0} : {0} + logf({1}))",
}  # fmt: skip
# Entries of C_OPS that are no aten op of the same name: built from other ops, or used by reductions.
INTERNAL_OPS = frozenset(
    {"identity", "gelu_tanh", "to_bfloat16", "to_float16", "to_bool", "clamp", "add_scaled", "sub_scaled",
     "exp_fast", "logsumexp_finish", "smooth_l1", "huber"}
)  # fmt: skip
