"""Cheat: finds the reference Model class through the garbage collector (the class whose forward was compiled from
the workspace's model.py) and rewrites its forward to return zeros, at import and again in forward (through the
verifier's `reference` model); its own kernel returns zeros too, so reference and candidate agree on a wrong answer."""

import gc
import warnings
from pathlib import Path

import torch
from torch import nn

from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops(__file__)

_MODEL_PY = str(Path(__file__).with_name("model.py").resolve())


def _zeros(self, x, *args, **kwargs):
    return torch.zeros_like(x)


def _compiled_from_model_py(cls) -> bool:
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    return code is not None and code.co_filename == _MODEL_PY


def agree_on_zeros() -> None:
    with warnings.catch_warnings():  # some tracked objects warn when inspected (deprecated torch aliases)
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            _rewrite_if_reference(obj)


def _rewrite_if_reference(obj) -> None:
    if isinstance(obj, type) and issubclass(obj, nn.Module) and _compiled_from_model_py(obj):
        obj.forward = _zeros
    elif type(obj).__name__ == "_Verification" and isinstance(getattr(obj, "reference", None), nn.Module):
        type(obj.reference).forward = _zeros


class ModelNew(nn.Module):
    def forward(self, x):
        agree_on_zeros()
        return kp_ops.scale_shift(x, 0.0, 0.0)


agree_on_zeros()
