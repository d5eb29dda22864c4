"""The matmul family: one cuBLASLt call with its epilogue (alpha, bias, residual, ReLU or tanh-GELU), its
candidates (cuBLASLt's best heuristic algorithms) and its template context."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kernelpilot.policy.codegen import (
    CUDA_DATA_TYPES,
    EPILOGUES,
    ITEM_SIZES,
    MATMUL_CANDIDATES,
    c_literal,
    describe_source,
    launcher_name,
)
from kernelpilot.policy.ir import EPILOGUE_ACTIVATIONS, MATMUL_ALIGNMENT, Group, Leaf, matrix_strides
from kernelpilot.policy.leading import describe_leading


@dataclass(frozen=True)
class MatmulConfig:
    """Which of cuBLASLt's heuristic algorithms a matmul group runs: the `algorithm`-th result, best first."""

    algorithm: int

    @property
    def label(self) -> str:
        return f"cuBLASLt heuristic algorithm {self.algorithm + 1} of {MATMUL_CANDIDATES}"


def matmul_candidates(group: Group) -> list[MatmulConfig]:
    """cuBLASLt's best heuristic algorithms, in its order."""
    return [MatmulConfig(index) for index in range(MATMUL_CANDIDATES)]


def matmul_context(group: Group, config: MatmulConfig) -> dict[str, Any]:
    """What matmul.cu.j2 needs: cuBLASLt's problem (m, n, k, batch), each operand's layout and op, the epilogue."""
    matmul = group.matmul
    m, n, k = matmul.mnk
    index = {source: i for i, source in enumerate(group.tensors)}
    product = "A @ B" if matmul.alpha == 1.0 else f"{matmul.alpha:g} * (A @ B)"
    formula = product + " + C" * bool(matmul.residual) + " + bias" * bool(matmul.bias)
    if matmul.activation:
        formula = f"{EPILOGUE_ACTIVATIONS[matmul.activation]}({formula})"
    return {
        "description": group.describe(),
        "config": config,
        "candidates": MATMUL_CANDIDATES,
        "alignment": MATMUL_ALIGNMENT,
        "formula": formula,
        "data_type": CUDA_DATA_TYPES[matmul.dtype],
        "epilogue": EPILOGUES[(matmul.bias is not None, matmul.activation)],
        "alpha": c_literal(matmul.alpha),
        # cuBLASLt's m, n: the transposed product's (see the template's header).
        "m": n,
        "n": m,
        "k": k,
        "batch": matmul.batch,
        # A runtime batch (leading.py): our M is the batch times this many rows, and plans are built per M.
        "leading": group.leading_free,
        "free_dims": group.free_dims,
        "rows_per_batch": m // math.prod(group.output.shape[: group.free_dims]) if group.leading_free else m,
        # A strided batch whose count is the runtime batch times this many matrices: plans are built per count.
        "batched_leading": group.leading_free and matmul.batch > 1,
        "matrices_per_batch": matmul.batch // group.output.shape[0] if group.leading_free else matmul.batch,
        "shapes": describe_leading(group),
        "lt_a": _lt_operand(matmul.b, "B", index[matmul.b.source]),
        "lt_b": _lt_operand(matmul.a, "A", index[matmul.a.source]),
        "bias": index[matmul.bias.source] if matmul.bias else None,
        "residual": index[matmul.residual.source] if matmul.residual else None,
        "tensor_count": len(group.tensors),
        "launcher": launcher_name(group),
    }


def _lt_operand(leaf: Leaf, role: str, tensor: int) -> dict[str, Any]:
    """Our row-major operand X (R x C) as cuBLASLt's column-major operand X^T (C x R).

    A row-major X in memory is already X^T column-major (no transpose); a transposed view of X (unit stride
    down its rows, such as a Linear weight's `.t()`) is X column-major, which cuBLASLt transposes (CUBLAS_OP_T).
    """
    rows, cols = leaf.shape[-2:]
    transposed, leading = matrix_strides(leaf.shape[-2:], leaf.strides[-2:])
    stored = (rows, cols) if transposed else (cols, rows)
    how = "transposed by cuBLASLt" if transposed else "read as it is"
    return {
        "tensor": tensor,
        "name": f"our {role}",
        "offset_bytes": leaf.offset * ITEM_SIZES[leaf.source.dtype],
        "op": "CUBLAS_OP_T" if transposed else "CUBLAS_OP_N",
        "rows": stored[0],
        "cols": stored[1],
        "ld": leading,
        "batch_stride": leaf.strides[0] if len(leaf.shape) == 3 else 0,
        "comment": f"our {role}, {describe_source(leaf.source)}, {rows}x{cols} with strides "
        f"({', '.join(map(str, leaf.strides))}): column-major {stored[0]}x{stored[1]}, {how}",
    }
