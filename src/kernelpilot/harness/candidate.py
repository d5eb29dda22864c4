"""Load a candidate: its built library's kernels as torch custom operators, then `model_new.py` as a fresh module.

The library is loaded first (`build.load_extension`), so model_new.py's `workspace_ops(__file__)` finds its ops. A
long-lived worker loads many candidates, so nothing of one may leak into the next: `model_new.py` runs under a
unique module name, the workspace folder is importable only while it runs (for `from model import Model`), and
the modules it imported from the workspace are dropped afterwards, so the next workspace's `model` is its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kernelpilot.errors import KernelpilotError
from kernelpilot.results import BuildResult

if TYPE_CHECKING:
    import torch

    from kernelpilot.problem import Problem
    from kernelpilot.workspace import Workspace

_load_counter = itertools.count(1)


class CandidateError(KernelpilotError):
    """The candidate cannot be loaded: its extension or model_new.py fails to import, or ModelNew is unusable."""


def load_candidate(ws: Workspace, build_result: BuildResult | None) -> type:
    """Return the `ModelNew` class of the workspace, importing `build_result`'s extension first when there is one."""
    _load_built_extension(ws, build_result)
    module = _exec_model_new(ws)
    candidate_cls = getattr(module, "ModelNew", None)
    if candidate_cls is None:
        raise CandidateError(
            "model_new.py defines no class ModelNew.", hint="Define `class ModelNew(nn.Module)` in model_new.py."
        )
    if not isinstance(candidate_cls, type):
        raise CandidateError(
            f"ModelNew in model_new.py is a {type(candidate_cls).__name__}, not a class.",
            hint="Define `class ModelNew(nn.Module)` in model_new.py.",
        )
    return candidate_cls


def make_candidate_model(problem: Problem, candidate_cls: type, device: str) -> torch.nn.Module:
    """`ModelNew(*init_inputs)` holding the reference Model's weights, on `device`, in eval mode."""
    reference = problem.make_model("cpu")
    try:
        candidate = candidate_cls(*problem.init_inputs)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's constructor is reported, not raised
        raise CandidateError(
            f"ModelNew(*get_init_inputs()) raised {_describe(exc)}",
            hint="ModelNew must take exactly the arguments Model takes.",
        ) from None
    _adopt_weights(candidate, reference)
    return candidate.to(device).eval()


def _adopt_weights(candidate: Any, reference: torch.nn.Module) -> None:
    """Give the candidate the reference's parameters and buffers, by name; a mismatch is a CandidateError."""
    load_state_dict = getattr(candidate, "load_state_dict", None)
    if load_state_dict is None:
        raise CandidateError("ModelNew is not an nn.Module.", hint="Define `class ModelNew(nn.Module)`.")
    try:
        load_state_dict(reference.state_dict(), strict=True)
    except RuntimeError as exc:
        first_lines = " ".join(str(exc).split())[:400]
        raise CandidateError(
            f"ModelNew's parameters do not match Model's: {first_lines}",
            hint="Keep Model's parameter and buffer names and shapes (build Model inside ModelNew and adopt its modules).",
        ) from None


def _load_built_extension(ws: Workspace, build_result: BuildResult | None) -> None:
    if build_result is None:
        if ws.kernel_sources():
            raise CandidateError(
                f"{ws.root} has kernel sources but no build was given.", hint=f"Build it first: kernelpilot build {ws.root}"
            )
        return
    if not build_result.ok or not build_result.library:
        raise CandidateError(
            f"the extension was not built: {build_result.error or 'no library was produced'}",
            hint=f"Fix the build first: kernelpilot build {ws.root}",
        )
    from kernelpilot.build import load_extension

    # The judge may reuse one workspace's build for another's candidate: the ops are registered for the workspace
    # whose model_new.py runs next, which is where its workspace_ops(__file__) looks for them.
    try:
        load_extension(dataclasses.replace(build_result, workspace=str(ws.root)))
    except KernelpilotError as err:  # the library is not one of ours, or an op's schema does not fit its function
        raise CandidateError(f"the built extension could not be loaded: {err.message}", hint=err.hint) from None
    except Exception as exc:  # noqa: BLE001 - a broken .so is the candidate's error
        raise CandidateError(f"the built extension could not be loaded: {_describe(exc)}") from None


def _exec_model_new(ws: Workspace) -> ModuleType:
    """Execute model_new.py as a new module under a name no other load uses."""
    import importlib.util

    path = Path(ws.model_new_path)
    if not path.is_file():
        raise CandidateError(f"{path} does not exist.", hint="Write the candidate in model_new.py (kernelpilot init makes one).")
    module_name = f"kp_model_new_{os.getpid()}_{next(_load_counter)}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None  # a .py path always has a source loader
    module = importlib.util.module_from_spec(spec)
    with _workspace_importable(Path(ws.root)):
        # Registered under its unique name for the life of the process: inspect, dataclasses and pickling look
        # classes up through sys.modules[cls.__module__], and no later load can reuse the name.
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:
            del sys.modules[module_name]
            raise CandidateError(
                f"model_new.py raised {_describe(exc)}", hint="Run `python model_new.py` in the workspace to see the traceback."
            ) from None
    return module


@contextlib.contextmanager
def _workspace_importable(root: Path) -> Iterator[None]:
    """Make `root` importable; undo it and forget root's modules on exit."""
    root = root.resolve()
    shadowed = {name: sys.modules.pop(name) for name in _module_names_in(root) if name in sys.modules}
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.path.remove(str(root))
        for name in [name for name, mod in sys.modules.items() if _is_under(mod, root)]:
            del sys.modules[name]
        sys.modules.update(shadowed)


def _module_names_in(root: Path) -> list[str]:
    """Top-level module names that `root` provides (files and packages) and that an import would find there."""
    names = [p.stem for p in root.glob("*.py")]
    names += [p.parent.name for p in root.glob("*/__init__.py")]
    return names


def _is_under(module: ModuleType | None, root: Path) -> bool:
    filename = getattr(module, "__file__", None)
    if not filename or getattr(module, "__name__", "").startswith("kp_model_new_"):
        return False
    return Path(filename).resolve().is_relative_to(root)


def _describe(exc: BaseException) -> str:
    """`Type: first line of the message`, short enough for a one-line report."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__
