"""A workspace's kernels as torch custom operators: a built library's ops registered under a namespace, and
`workspace_ops`, the accessor through which model_new.py calls them as `torch.ops.<namespace>.<op>`.

Every workspace has a namespace of its own (`kp_<problem>_<6 hex>`, chosen by `init` and kept in its manifest), so
any number of workspaces load into one process. Loading a library registers nothing: the loader calls its
`kp_register_ops(namespace)` (kernels/kp_module.cpp), so the namespace is chosen here, at load time, and never
compiled in: no object is rebuilt for it.

Why a second build of a workspace gets `<namespace>_2`: torch allows one library per namespace, and the first
build's ops cannot be taken back while ModelNew instances and compiled graphs made from it may still call them. So
a different build of the same workspace loaded into the same process (a rebuild in a notebook, a long-lived process
swapping in a new candidate, scripts/bench_build.py) registers its ops under `<namespace>_2`, `_3`, ...: the earlier
build keeps working under its name, and a model_new.py executed after the load reaches the new one through
`workspace_ops`. The judge loads each candidate in a fresh sandbox, where the namespace is the manifest's own.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import types
from pathlib import Path

import torch

from kernelpilot.errors import KernelpilotError
from kernelpilot.workspace import EXTENSION_NAME, Workspace

REGISTER_FUNCTION = "kp_register_ops"  # defined by kernels/kp_module.cpp

_lock = threading.Lock()
_namespace_of_library: dict[Path, str] = {}  # a loaded library (resolved path) -> the namespace of its ops
_namespace_of_workspace: dict[Path, str] = {}  # a workspace root -> the namespace of the build loaded last for it


class OpsError(KernelpilotError):
    """A built library's ops cannot be registered, or model_new.py asks for the ops of a workspace with no build."""


def load_library(library: Path | str, workspace: Path | str) -> str:
    """Load a library built from `workspace`'s kernels/ and register its ops; return their namespace.

    The namespace is the workspace's, or `<namespace>_<n>` when another library took it in this process (see the
    module's docstring). Loading the same library file again registers nothing and returns its namespace. Either
    way the workspace's model_new.py, executed next, reaches this library's ops through `workspace_ops`.
    """
    library, root = Path(library).resolve(), Path(workspace).resolve()
    with _lock:
        namespace = _namespace_of_library.get(library)
        if namespace is None:
            namespace = _free_namespace(Workspace(root).namespace)
            _register(library, namespace)
            _namespace_of_library[library] = namespace
        _namespace_of_workspace[root] = namespace
    return namespace


def workspace_ops(model_new_file: Path | str) -> types.ModuleType:
    """`torch.ops.<namespace>` of the build loaded for the workspace that holds `model_new_file` (model_new.py passes
    its `__file__`); its attributes are the ops, `kp_ops.scale_shift(x, 2.0, 1.0)`.

    When no build of the workspace is loaded in this process yet (model_new.py imported on its own), the newest
    library built for it is loaded: `kernelpilot build`'s, or one setup.py built in place.
    """
    root = Path(model_new_file).resolve().parent
    with _lock:
        namespace = _namespace_of_workspace.get(root)
    if namespace is None:
        namespace = load_library(_newest_library(root), root)
    return getattr(torch.ops, namespace)


def loaded_namespaces() -> frozenset[str]:
    """The namespaces under which this process registered workspace ops."""
    with _lock:
        return frozenset(_namespace_of_library.values())


def _free_namespace(base: str) -> str:
    """`base`, else the first of `base_2`, `base_3`, ... that no library of this process has taken."""
    with_ops = {name.split("::", 1)[0] for name in torch._C._dispatch_get_all_op_names()}
    taken = set(_namespace_of_library.values()) | with_ops
    candidates = itertools.chain([base], (f"{base}_{n}" for n in itertools.count(2)))
    return next(name for name in candidates if name not in taken)


def _register(library: Path, namespace: str) -> None:
    """dlopen `library` (its symbols kept local, so two builds never resolve to each other's) and register its ops."""
    try:
        # PyDLL: the call keeps the GIL, so torch may run Python while it registers.
        handle = ctypes.PyDLL(str(library), mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as err:
        raise OpsError(
            f"The library {library} cannot be loaded: {err}.",
            hint="an undefined symbol usually means a launcher declared in a binding is not defined in any .cu file",
        ) from None
    try:
        register = getattr(handle, REGISTER_FUNCTION)
    except AttributeError:
        raise OpsError(
            f"The library {library} has no {REGISTER_FUNCTION}: it was not built with this kernelpilot's "
            "kernels/kp_module.cpp, so its kernels are not torch operators.",
            hint="create a new workspace with `kernelpilot init PROBLEM.py --dir NEW` and move your kernels over "
            "(bindings register their ops with KP_OP; see SKILL.md)",
        ) from None
    register.restype, register.argtypes = ctypes.c_char_p, [ctypes.c_char_p]
    error = register(namespace.encode())
    if error is not None:
        detail = " ".join(error.decode(errors="replace").split())[:1000]
        raise OpsError(
            f"The ops of {library.name} could not be registered as torch.ops.{namespace}: {detail}",
            hint="check each KP_OP's schema against its function's parameters and return type (SKILL.md lists the "
            "types)",
        )


def _newest_library(root: Path) -> Path:
    """The library built last for the workspace `root`: the newest build/versions/<hash>/ (each build marks its
    version as just built) or the newest kp_kernels*.so setup.py built in place."""
    library = f"{EXTENSION_NAME}.so"
    built = [(folder.stat().st_mtime_ns, folder / library)
             for folder in (root / "build" / "versions").glob("*") if (folder / library).is_file()]  # fmt: skip
    in_place = [(path.stat().st_mtime_ns, path) for path in root.glob(f"{EXTENSION_NAME}*.so")]
    if not built and not in_place:
        raise OpsError(
            f"No build of the workspace {root} is loaded or built, so model_new.py has no kernels to call.",
            hint=f"build it first: kernelpilot build {root}",
        )
    return max(built + in_place)[1]
