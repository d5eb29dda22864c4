"""kernelpilot: write, verify and time fast CUDA kernels for PyTorch code.

The pipeline flows one way: problem -> workspace -> build -> verify -> bench -> reward. Around it, for a model in a
project: `kernelpilot.capture` writes a problem from a submodule's call, and `kernelpilot.load` / `kernelpilot.swap`
put an accepted workspace's kernels back into the model. They are imported on first use, so `import kernelpilot`
(and the CLI's start) does not import torch.
"""

__version__ = "0.1.0"

_LAZY = {"capture": "kernelpilot.problem_capture", "load": "kernelpilot.deploy", "swap": "kernelpilot.deploy"}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'kernelpilot' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)


def __dir__() -> list[str]:
    return sorted(name for name in [*globals(), *_LAZY] if not name.startswith("_") or name == "__version__")
