"""Honest precision: a float32 problem is computed in float32 in every process of the judge.

torch's defaults let cuDNN convolutions run float32 in TF32 (10 mantissa bits) and `torch.compile` follows the
same switches, so an eager or compiled baseline of a float32 convolution would be timed at TF32 speed while the
reference the candidate must match is meant to be float32. Every judge process (the worker holding the reference,
the clean baselines' sandboxes, the candidate's sandbox before its code loads) pins the switches to float32.
A user who wants TF32 says so with KERNELPILOT_ALLOW_TF32=1 in the environment the judge starts from; the setting
is part of the cached baselines' key.
"""

from __future__ import annotations

import os

ALLOW_TF32_ENV = "KERNELPILOT_ALLOW_TF32"


def tf32_allowed(environ: dict[str, str] | None = None) -> bool:
    """Whether the user asked for TF32 math in float32 matmuls and convolutions."""
    value = (os.environ if environ is None else environ).get(ALLOW_TF32_ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def pin_float32_math() -> bool:
    """Set torch's TF32 switches (cuBLAS matmuls, cuDNN convolutions, the float32 matmul precision) to what the
    user asked for: off unless KERNELPILOT_ALLOW_TF32 is set. Returns whether TF32 is allowed."""
    import torch

    allowed = tf32_allowed()
    torch.backends.cuda.matmul.allow_tf32 = allowed
    torch.backends.cudnn.allow_tf32 = allowed
    torch.set_float32_matmul_precision("high" if allowed else "highest")
    return allowed

