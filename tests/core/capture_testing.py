"""What the capture and deploy tests share: a user's package written into a temp folder (its classes importable
only from there), and ModelNew classes built the way `kernelpilot init` writes them (Model built, then adopted)."""

from __future__ import annotations

import textwrap
from pathlib import Path

# The user's layers: nested submodules, a constructor argument kept only as an attribute, a buffer outside the
# state_dict, keyword and non-tensor arguments; Net calls its MLP as a model would.
USER_LAYERS = '''
import torch
import torch.nn.functional as F
from torch import nn


class Gate(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return F.silu(self.proj(x))


class GatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, scale: float):
        super().__init__()
        self.gate = Gate(dim, hidden)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim)
        self.scale = scale
        self.register_buffer("shift", torch.randn(dim), persistent=False)

    def forward(self, x, mask=None, *, mode="plain"):
        y = self.down(self.gate(x) * self.up(x)) * self.scale + self.shift
        if mask is not None:
            y = y * mask
        return y + x if mode == "residual" else y


class Scale(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(features) + 0.5)

    def forward(self, x):
        return x * self.scale


class Net(nn.Module):
    def __init__(self, dim: int = 16, features: int = 16):
        super().__init__()
        self.mlp = GatedMLP(dim, 2 * dim, scale=0.5)
        self.layer = Scale(features)

    def forward(self, x, mask):
        return self.layer(self.mlp(x, mask, mode="residual"))
'''

# A ModelNew for a problem captured from `Scale`, calling the workspace op scale_mul (kp_testing.scale_mul_binding).
SCALE_MUL_MODEL_NEW = '''
from pathlib import Path

from torch import nn

from kernelpilot.ops import workspace_ops
from kernelpilot.problem import load_problem

kp_ops = workspace_ops(__file__)
Model = load_problem(Path(__file__).with_name("model.py"), validate=False).model_cls


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        reference = Model()
        self.__dict__.update(vars(reference))

    def forward(self, x):
        return kp_ops.scale_mul(x, self.module.scale)
'''


def write_user_package(root: Path, package: str) -> Path:
    """Write the package `package` (its `layers` module: USER_LAYERS) under root/src; return root/src, the folder
    it is importable from."""
    folder = root / "src" / package
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / "layers.py").write_text(textwrap.dedent(USER_LAYERS))
    return root / "src"


def model_new_class(problem_path: Path) -> type:
    """A ModelNew class for the problem file at `problem_path` as model_new.py defines it, computing with Model's
    forward in torch: the sharing of tensors is tested without a build."""
    from torch import nn

    from kernelpilot.problem import load_problem

    model_cls = load_problem(problem_path, validate=False).model_cls

    class ModelNew(nn.Module):
        def __init__(self):
            super().__init__()
            self.__dict__.update(vars(model_cls()))

        def forward(self, *args, **kwargs):
            return model_cls.forward(self, *args, **kwargs)

    return ModelNew
