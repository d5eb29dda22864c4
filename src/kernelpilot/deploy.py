"""Put an accepted workspace back into a model: `kernelpilot.load` (its verified ModelNew class) and
`kernelpilot.swap` (a submodule replaced by a ModelNew that shares the submodule's tensors).

Only what `kernelpilot accept` verified is loaded: the workspace's lock file must exist, be for the workspace's
problem, and record the SHA-256 of exactly the candidate files there now, and the protected files must be as
`init` wrote them. The kernels are then built (incrementally: nothing recompiles when the build is current) and
loaded through the same path the judge's sandbox uses (`build.load_extension` via `harness.candidate`), so a
workspace loads the same way everywhere, from any working directory.

A swapped-in ModelNew is built on the meta device (no memory, and no copy of the captured weights is read into
it) and then given the submodule's own Parameter and buffer objects by name: the same tensors, so training,
`load_state_dict` and `.to()` on the model keep acting on what ModelNew computes with.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kernelpilot.errors import KernelpilotError
from kernelpilot.workspace import display_path

if TYPE_CHECKING:
    import torch

    from kernelpilot.results import BuildResult
    from kernelpilot.workspace import Workspace

# The ModelNew classes loaded in this process, by workspace, library and accepted files: loading again is free.
_loaded: dict[tuple[str, str | None, tuple[tuple[str, str], ...]], type] = {}


class DeployError(KernelpilotError):
    """A workspace that cannot be loaded as accepted, or a submodule it cannot replace."""


def load(workspace: str | os.PathLike[str], *, arch: str | None = None) -> type:
    """The verified ModelNew class of an accepted workspace, its kernels built if needed (for `arch`, default: the
    visible GPU's, or TORCH_CUDA_ARCH_LIST). DeployError when nothing was accepted there or the candidate changed
    since; WorkspaceError, BuildError or CandidateError when the workspace, the toolchain or the build fails."""
    from kernelpilot.harness.candidate import load_candidate
    from kernelpilot.workspace import check_protected, open_workspace

    ws = open_workspace(workspace)
    check_protected(ws)
    accepted_files = _require_accepted(ws)
    build = _build(ws, arch)
    key = (str(ws.root), build.library, tuple(sorted(accepted_files.items())))
    if key not in _loaded:
        _loaded[key] = load_candidate(ws, build)
    return _loaded[key]


def swap(
    model: torch.nn.Module, target: str, workspace: str | os.PathLike[str], *, arch: str | None = None
) -> torch.nn.Module:
    """Replace `model`'s submodule `target` ("blocks.0.mlp") with the accepted workspace's ModelNew, holding the
    submodule's own parameters and buffers (the same tensors, not copies) in the submodule's train/eval mode and
    on its device; return the ModelNew instance. The workspace's problem must hold tensors of the same names (under
    a common prefix, such as the `module.` of a captured problem), shapes and dtypes as the submodule."""
    from kernelpilot.problem import load_problem
    from kernelpilot.workspace import open_workspace

    _submodule(model, target)  # a wrong name is reported before minutes of building
    model_new_cls = load(workspace, arch=arch)
    ws = open_workspace(workspace)
    init_inputs = load_problem(ws.model_path, validate=False).init_inputs
    return swap_module(model, target, model_new_cls, init_inputs, origin=display_path(ws.root))


def swap_module(
    model: torch.nn.Module,
    target: str,
    model_new_cls: type,
    init_inputs: list | tuple = (),
    *,
    origin: str = "ModelNew",
) -> torch.nn.Module:
    """`swap` with the class given: `model_new_cls(*init_inputs)` replaces the submodule `target`, sharing its
    tensors; `origin` names where the class came from in errors."""
    original = _submodule(model, target)
    replacement = _construct(model_new_cls, init_inputs, origin)
    _share_tensors(replacement, original, target, origin)
    device = next((tensor.device for tensor in _tensors(original).values()), None)
    if device is not None:
        replacement.to(device)  # tensors ModelNew keeps besides the shared ones; the shared ones are there already
    replacement.train(original.training)
    parent_name, _, name = target.rpartition(".")
    setattr(model.get_submodule(parent_name), name, replacement)
    return replacement


# ------------------------------------------------------------------------------------------ accepted


def _require_accepted(ws: Workspace) -> dict[str, str]:
    """The accepted files' hashes from the lock file; DeployError unless they are the workspace's files now."""
    from kernelpilot.lockfile import LOCK_NAME, LockFileError, changed_files, lock_path, read_lock

    shown = display_path(ws.root)
    if not lock_path(ws).is_file():
        raise DeployError(
            f"{shown} has no accepted candidate: there is no {LOCK_NAME} in it.",
            hint=f"Verify and accept it first: kernelpilot accept {shown} (--no-commit writes only the lock file).",
        )
    try:
        lock = read_lock(lock_path(ws))
    except LockFileError as err:
        raise DeployError(err.message, hint=err.hint) from None
    if lock.problem_id != ws.problem_id:
        raise DeployError(
            f"The lock file of {shown} was written for another problem than the workspace's model.py.",
            hint=f"Accept the workspace again: kernelpilot accept {shown}",
        )
    changed = changed_files(ws, lock)
    if changed:
        raise DeployError(
            f"The candidate in {shown} changed since it was accepted ({', '.join(changed)}), so a build of it is "
            "not what was verified.",
            hint=f"Accept it again (kernelpilot accept {shown}), or bring back the accepted files "
            f"(git checkout -- {shown}).",
        )
    return lock.files


def _build(ws: Workspace, arch: str | None) -> BuildResult:
    """The current build of the workspace's kernels: ninja recompiles only what changed, nothing when it is current."""
    from kernelpilot.build import build_workspace

    result = build_workspace(ws.root, arch=arch)
    if not result.ok:
        raise DeployError(
            f"The accepted kernels of {display_path(ws.root)} do not build here: {result.error}",
            hint=f"`kernelpilot build {display_path(ws.root)}` shows the compiler's messages.",
        )
    return result


# ------------------------------------------------------------------------------------------- swapping


def _submodule(model: Any, target: str) -> torch.nn.Module:
    import torch

    if not isinstance(model, torch.nn.Module):
        raise DeployError(f"kernelpilot.swap takes an nn.Module, not a {type(model).__name__}.",
                          hint="Pass the model that holds the submodule to replace.")  # fmt: skip
    if not target:
        raise DeployError("kernelpilot.swap needs the name of a submodule to replace, and got an empty one.",
                          hint="Name it as named_modules() does, e.g. 'blocks.0.mlp'; for a whole model, "
                          "use kernelpilot.load(WORKSPACE) and build ModelNew yourself.")  # fmt: skip
    try:
        return model.get_submodule(target)
    except AttributeError:
        raise DeployError(
            f"{type(model).__name__} has no submodule {target!r}.",
            hint="Name it as model.named_modules() lists it, e.g. 'blocks.0.mlp'.",
        ) from None


def _construct(model_new_cls: type, init_inputs: list | tuple, origin: str) -> torch.nn.Module:
    """ModelNew(*init_inputs), on the meta device where its constructor allows (its tensors are replaced next),
    else on the CPU."""
    import torch

    try:
        with torch.device("meta"):
            return model_new_cls(*init_inputs)
    except Exception:  # noqa: BLE001 - a constructor that cannot run on meta tensors still can on real ones
        pass
    try:
        return model_new_cls(*init_inputs)
    except Exception as err:  # noqa: BLE001 - the user's constructor, reported in a sentence
        first_line = (str(err).strip().splitlines() or [""])[0][:200]
        raise DeployError(
            f"ModelNew(*get_init_inputs()) of {origin} raised {type(err).__name__}: {first_line}",
            hint="Run `kernelpilot eval WORKSPACE` to see whether the workspace still loads.",
        ) from None


def _share_tensors(replacement: torch.nn.Module, original: torch.nn.Module, target: str, origin: str) -> None:
    """Give every parameter and buffer of `replacement` the object `original` holds under the same name (after a
    common prefix); DeployError when names, shapes or dtypes differ, or a tensor of ModelNew is left unshared on
    the meta device."""
    wanted, offered = _tensors(replacement), _tensors(original)
    prefix = _common_prefix(list(wanted), list(offered))
    if prefix is None:
        raise DeployError(
            f"The tensors of {origin}'s ModelNew ({_some(wanted)}) are not those of {target!r} ({_some(offered)}).",
            hint="Swap in the workspace of the problem captured from that submodule (or one of the same class).",
        )
    for name, tensor in wanted.items():
        source = offered[name[len(prefix):]]
        if source.shape != tensor.shape or source.dtype != tensor.dtype:
            raise DeployError(
                f"{target}.{name[len(prefix):]} is {_shape(source)}, and the workspace's kernels were made for "
                f"{_shape(tensor)}.",
                hint="Capture the submodule as it is now and optimize that problem, or swap a submodule of the sizes "
                "and dtype the workspace was made for.",
            )
    for name in wanted:
        owner_name, _, attribute = name.rpartition(".")
        setattr(replacement.get_submodule(owner_name), attribute, offered[name[len(prefix):]])
    leftover = _meta_tensors(replacement)
    if leftover:
        raise DeployError(
            f"ModelNew of {origin} keeps tensors outside its parameters and buffers ({', '.join(leftover[:3])}), "
            f"which cannot be taken from {target!r}.",
            hint="Register them as buffers in ModelNew (register_buffer), so they are shared by name.",
        )


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not) by its dotted name, shared ones under each of their names."""
    tensors: dict[str, torch.Tensor] = {}
    for module_name, submodule in module.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for name, parameter in submodule.named_parameters(recurse=False, remove_duplicate=False):
            tensors[prefix + name] = parameter
        for name, buffer in submodule.named_buffers(recurse=False, remove_duplicate=False):
            tensors[prefix + name] = buffer
    return tensors


def _common_prefix(wanted: list[str], offered: list[str]) -> str | None:
    """The prefix P with {P + name for name in offered} == set(wanted): "" or a dotted path of ModelNew ending in
    ".", the shortest that fits; None when none does."""
    candidates = {""} | {name[: i + 1] for name in wanted for i, char in enumerate(name) if char == "."}
    for prefix in sorted(candidates, key=len):
        if {prefix + name for name in offered} == set(wanted):
            return prefix
    return None


def _meta_tensors(module: torch.nn.Module) -> list[str]:
    """Names of the meta tensors `module` and its submodules keep as plain attributes or unshared slots."""
    import torch

    found = [name for name, tensor in _tensors(module).items() if tensor.is_meta]
    for module_name, submodule in module.named_modules():
        for name, value in vars(submodule).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                found.append(f"{module_name}.{name}" if module_name else name)
    return found


def _some(tensors: dict[str, Any]) -> str:
    names = sorted(tensors)
    if not names:
        return "none"
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _shape(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
