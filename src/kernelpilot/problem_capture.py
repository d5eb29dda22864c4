"""Capture a submodule of a running model as a KernelBench-format problem file (`kernelpilot.capture`).

    with kernelpilot.capture(model.blocks[0].mlp, "problems/mlp.py"):
        model(x)

At the submodule's first call inside the block, two files are written: `problems/mlp.pt`, the module itself as
torch.save writes it, and `problems/mlp.py`, whose Model loads that file and calls the module exactly as it was
called, whose get_inputs() draws random tensors of the call's shapes and dtypes, and whose get_init_inputs() is
empty. `kernelpilot init` and `optimize` take the problem file as it is.

Why the pickled module and not the class's source: a built module's constructor arguments are gone, its
submodules may be of other classes, and its class may use the rest of the user's package. A pickle names every
class and function by its import path, so the problem imports the user's code as the model did; the folders that
code was imported from are written into the problem for a process (the judge's) that lacks them on its path.
What a pickle cannot name is refused in one sentence: a class defined in the script being run (`__main__`) or
inside a function.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import inspect
import keyword
import math
import os
import pickle
import site
import sys
import sysconfig
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelpilot.errors import KernelpilotError
from kernelpilot.resources import template_environment

if TYPE_CHECKING:
    import torch

PROBLEM_TEMPLATE = "captured_problem.py.j2"
MODULE_SUFFIX = ".pt"
PARTIAL_SUFFIX = ".partial"
# Floating dtypes torch.randn draws directly; the others (float8 ...) are drawn in float32 and converted.
_RANDN_DTYPES = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128")
_PLAIN_ARGUMENTS_HINT = (
    "Capture a module whose call takes tensors (alone or in a tuple or list) and plain values: numbers, strings, "
    "None, torch dtypes, and tuples, lists or dicts of them."
)


class CaptureError(KernelpilotError):
    """A module, or a call of it, that cannot be written down as a problem file."""


@dataclass
class CapturedProblem:
    """What a capture wrote: the problem file, the module file beside it, and what the problem imports."""

    problem: Path
    module_file: Path
    class_path: str  # "package.module.ClassName" of the captured module
    import_roots: list[str]  # folders the problem puts on sys.path while it unpickles the module


@dataclass
class _Slot:
    """One argument of the captured call: its name in Model.forward, the keyword it was passed by (None:
    positionally), and its value."""

    name: str
    keyword: str | None
    value: Any


@dataclass
class _CallSource:
    """The captured call as source text: Model.forward's parameters, the module call's arguments, and
    get_inputs()'s expressions (one per tensor parameter, in order)."""

    parameters: list[str]
    arguments: list[str]
    inputs: list[str]


class Capture(contextlib.ContextDecorator):
    """A context manager (or decorator) that writes the problem at the module's first call inside it.

    Once it has written its problem, using it again writes nothing: the first captured call is the problem.
    """

    def __init__(self, module: torch.nn.Module, problem_path: Path):
        self.module = module
        self.problem_path = problem_path
        self.result: CapturedProblem | None = None
        self._handle: Any = None

    def __enter__(self) -> Capture:
        if self.result is None and self._handle is None:
            self._handle = self.module.register_forward_pre_hook(self._on_call, with_kwargs=True)
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> bool:
        self._stop()
        if exc_type is None and self.result is None:
            raise CaptureError(
                f"The captured {type(self.module).__name__} was not called inside the capture, so nothing was written.",
                hint="Run the model's forward inside the `with kernelpilot.capture(...)` block (or the decorated "
                "function), and pass the submodule the forward calls, e.g. model.blocks[0].mlp.",
            )
        return False

    def _on_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._stop()  # first: the module is saved without this hook, and a failure below does not repeat per call
        self.result = write_problem(module, args, kwargs, self.problem_path)

    def _stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def capture(module: torch.nn.Module, problem_path: str | os.PathLike[str]) -> Capture:
    """Capture `module`'s first call inside the returned context manager (or decorated function) as the problem
    file `problem_path` (a .py file), with the module saved beside it as `<stem>.pt`; existing files of those
    names are replaced. Arguments that cannot work are refused now, with a CaptureError."""
    import torch

    if not isinstance(module, torch.nn.Module):
        raise CaptureError(
            f"kernelpilot.capture takes an nn.Module, not {_a(type(module).__name__)}.",
            hint="Pass the submodule whose call to capture, e.g. kernelpilot.capture(model.blocks[0].mlp, 'mlp.py').",
        )
    path = Path(problem_path).expanduser().resolve()
    if path.suffix != ".py":
        raise CaptureError(f"The problem file {path} does not end in .py.", hint="Name it e.g. problems/mlp.py.")
    if path.is_dir():
        raise CaptureError(f"{path} is a folder, not a problem file.", hint="Name a .py file inside it, e.g. mlp.py.")
    return Capture(module, path)


def write_problem(module: torch.nn.Module, args: tuple, kwargs: dict, problem_path: Path) -> CapturedProblem:
    """Write the problem of `module` called with `args` and `kwargs`: the module file, then the problem file.

    Both are written under temporary names and renamed when complete; on any failure neither is left behind.
    """
    call = _call_source(_slots(module, args, kwargs), type(module).__name__)
    module_file = problem_path.with_suffix(MODULE_SUFFIX)
    created_folders = _make_folder(problem_path.parent)
    partial_module = module_file.with_name(module_file.name + PARTIAL_SUFFIX)
    partial_problem = problem_path.with_name(problem_path.name + PARTIAL_SUFFIX)
    try:
        import_roots = _save_module(module, partial_module)
        with partial_module.open("rb") as saved:
            digest = hashlib.file_digest(saved, "sha256").hexdigest()
        partial_problem.write_text(_problem_source(module, call, module_file, digest, import_roots))
        os.replace(partial_module, module_file)
        os.replace(partial_problem, problem_path)
    except BaseException as err:
        for leftover in (partial_module, partial_problem):
            leftover.unlink(missing_ok=True)
        for folder in reversed(created_folders):
            with contextlib.suppress(OSError):
                folder.rmdir()
        if isinstance(err, OSError):
            raise CaptureError(
                f"Cannot write the captured problem {problem_path}: {err.strerror or err}.",
                hint="Pass a path in a writable folder.",
            ) from None
        raise
    cls = type(module)
    return CapturedProblem(problem_path, module_file, f"{cls.__module__}.{cls.__qualname__}", import_roots)


# ------------------------------------------------------------------------------------------- the call


def _slots(module: torch.nn.Module, args: tuple, kwargs: dict) -> list[_Slot]:
    """The call's arguments, named after the parameters of the module's forward they bind to.

    A positional argument stays positional (an element of *args is named `args_0`, ...); one passed by keyword, or
    after a positional parameter left to its default, is passed by keyword. A forward without an inspectable
    signature gets `arg0`, `arg1`, ... and the keywords as given.
    """
    kind = inspect.Parameter
    try:
        signature = inspect.signature(module.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return [_Slot(f"arg{i}", None, value) for i, value in enumerate(args)] + [
            _Slot(name, name, value) for name, value in kwargs.items()
        ]
    slots, positional = [], True
    for parameter in signature.parameters.values():
        if parameter.name not in bound.arguments:
            positional = positional and parameter.kind not in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)
            continue
        value = bound.arguments[parameter.name]
        if parameter.kind is kind.VAR_POSITIONAL:
            slots += [_Slot(f"{parameter.name}_{i}", None, item) for i, item in enumerate(value)]
        elif parameter.kind is kind.VAR_KEYWORD:
            slots += [_Slot(name, name, item) for name, item in value.items()]
        elif parameter.kind is kind.KEYWORD_ONLY or not positional:
            slots.append(_Slot(parameter.name, parameter.name, value))
        else:
            slots.append(_Slot(parameter.name, None, value))
    return slots


def _call_source(slots: list[_Slot], class_name: str) -> _CallSource:
    """Model.forward's parameters and the module call's arguments for these slots.

    Tensors become the required parameters, in call order, and get_inputs() draws them; a tuple or list of tensors
    becomes one parameter per tensor, put back together in the call. Plain values become parameters whose default
    is the captured value, so `model(*get_inputs())` repeats the call and a caller may still pass them. A plain
    value passed positionally before a tensor becomes keyword-only: passing it positionally to the problem's
    forward (or to a ModelNew swapped in for the module) then fails loudly instead of shifting the tensors.
    """
    taken: set[str] = {"self"}
    tensors: list[str] = []
    inputs: list[str] = []
    defaults: list[str] = []
    keyword_only: list[str] = []
    arguments: list[str] = []
    is_tensors = [_tensor_parts(slot.value) is not None for slot in slots]
    for index, slot in enumerate(slots):
        parts = _tensor_parts(slot.value)
        if parts is not None:
            wanted = [slot.name] if _is_tensor(slot.value) else [f"{slot.name}_{i}" for i in range(len(parts))]
            names = [_unique_name(name, taken) for name in wanted]
            tensors += names
            inputs += [_random_tensor_source(part, name) for part, name in zip(parts, names)]
            expression = names[0] if _is_tensor(slot.value) else _sequence_source(slot.value, names)
        else:
            literal = literal_source(slot.value)
            if literal is None:
                raise CaptureError(
                    f"The argument `{slot.name}` of the captured {class_name} call is {_a(type(slot.value).__name__)}, "
                    "which a problem file cannot write down.",
                    hint=_PLAIN_ARGUMENTS_HINT,
                )
            expression = _unique_name(slot.name, taken)
            before_a_tensor = slot.keyword is None and any(is_tensors[index + 1:])
            (keyword_only if before_a_tensor else defaults).append(f"{expression}={literal}")
        arguments.append(_argument_source(slot.keyword, expression))
    if not tensors:
        raise CaptureError(
            f"The captured {class_name} call passed no tensor, so there is nothing for kernels to compute on.",
            hint="Capture a module whose forward takes tensors.",
        )
    parameters = ["self", *tensors, *defaults] + (["*", *keyword_only] if keyword_only else [])
    return _CallSource(parameters, arguments, inputs)


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _tensor_parts(value: Any) -> list[torch.Tensor] | None:
    """[value] for a tensor, its items for a non-empty tuple or list of tensors, else None."""
    if _is_tensor(value):
        return [value]
    if type(value) in (tuple, list) and value and all(_is_tensor(item) for item in value):
        return list(value)
    return None


def _sequence_source(value: tuple | list, names: list[str]) -> str:
    if type(value) is list:
        return f"[{', '.join(names)}]"
    return f"({names[0]},)" if len(names) == 1 else f"({', '.join(names)})"


def _argument_source(keyword_name: str | None, expression: str) -> str:
    if keyword_name is None:
        return expression
    if keyword_name.isidentifier() and not keyword.iskeyword(keyword_name):
        return f"{keyword_name}={expression}"
    return f"**{{{keyword_name!r}: {expression}}}"


def _unique_name(wanted: str, taken: set[str]) -> str:
    """`wanted` as a parameter name no other parameter has (a keyword or a non-identifier becomes `arg`)."""
    name = wanted if wanted.isidentifier() and not keyword.iskeyword(wanted) else "arg"
    while name in taken:
        name += "_"
    taken.add(name)
    return name


def literal_source(value: Any) -> str | None:
    """Source text that evaluates to `value` in the problem file (which imports torch), or None when there is none:
    a Python literal that evaluates back to an equal value of the same type, a non-finite float, or a torch dtype."""
    import torch

    if isinstance(value, torch.dtype):
        return str(value)
    if type(value) is float and not math.isfinite(value):
        return f'float("{value}")'
    text = repr(value)
    try:
        parsed = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return text if type(parsed) is type(value) and parsed == value else None


def _random_tensor_source(tensor: torch.Tensor, name: str) -> str:
    """The expression get_inputs() draws a tensor like `tensor` with: the same shape and dtype; integers within
    the captured values' range, booleans True about as often as captured, floating point from a normal
    distribution."""
    import torch

    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        raise CaptureError(
            f"The tensor `{name}` of the captured call is not a dense tensor ({tensor.layout}), which get_inputs() "
            "cannot draw.",
            hint="Capture a module whose call takes dense (strided) tensors.",
        )
    shape, dtype = tuple(tensor.shape), str(tensor.dtype)
    dtype_name = dtype.removeprefix("torch.")
    if tensor.dtype == torch.bool:
        fraction = round(tensor.float().mean().item(), 3) if tensor.numel() and not tensor.is_meta else 0.5
        return f"torch.rand({shape}) < {fraction}"
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        if dtype_name in _RANDN_DTYPES:
            return f"torch.randn({shape}, dtype={dtype})"
        return f"torch.randn({shape}).to({dtype})"
    low, high = (int(tensor.min()), int(tensor.max())) if tensor.numel() and not tensor.is_meta else (0, 0)
    return f"torch.randint({low}, {high + 1}, {shape}, dtype={dtype})"


# ----------------------------------------------------------------------------------------- the module


def _save_module(module: torch.nn.Module, file: Path) -> list[str]:
    """torch.save `module` to `file`; return the folders, outside Python's own, that the classes and functions the
    pickle names were imported from. CaptureError when it cannot be pickled, or names what no import can find."""
    import torch

    named: set[tuple[str, str]] = set()
    try:
        torch.save(module, file, pickle_module=_recording_pickle(named))
    except (pickle.PicklingError, AttributeError, TypeError, RuntimeError) as err:
        raise CaptureError(
            f"The captured {type(module).__name__} cannot be saved with torch.save ({_first_line(err)}).",
            hint="A class or function defined inside another function cannot be pickled; define it at the top level "
            "of a module, and keep lambdas and open files out of the module's attributes.",
        ) from None
    in_main = sorted(qualname for module_name, qualname in named if module_name == "__main__")
    if in_main:
        raise CaptureError(
            f"{', '.join(in_main)} {'is' if len(in_main) == 1 else 'are'} defined in the script being run (__main__), "
            "so a problem file cannot import it.",
            hint="Move the model's classes into a module of your project (e.g. models.py) and import them in the "
            "script.",
        )
    return _import_roots(sorted({module_name for module_name, _ in named}))


def _recording_pickle(named: set[tuple[str, str]]) -> types.ModuleType:
    """A stand-in for the pickle module whose Pickler records (module, qualname) of every class and function it
    writes: torch.save builds its own Pickler on top of the one it is given."""

    class RecordingPickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
                named.add((getattr(obj, "__module__", None) or "", obj.__qualname__))
            return NotImplemented

    recording = types.ModuleType("kernelpilot_recording_pickle")
    recording.Pickler = RecordingPickler  # type: ignore[attr-defined]
    return recording


def _import_roots(module_names: list[str]) -> list[str]:
    """The sys.path folders the named modules were imported from, leaving out the standard library's and the
    installed packages' (any Python that runs torch has those)."""
    own = _python_folders()
    roots: list[str] = []
    for name in module_names:
        root = _import_root(name)
        if root is not None and not any(root.is_relative_to(folder) for folder in own) and str(root) not in roots:
            roots.append(str(root))
    return roots


def _import_root(module_name: str) -> Path | None:
    """The folder whose entry on sys.path the top-level package (or module) of `module_name` was found in."""
    top = sys.modules.get(module_name.partition(".")[0])
    file = getattr(top, "__file__", None)
    if file:
        path = Path(file).resolve()
        return path.parent.parent if path.stem == "__init__" else path.parent
    locations = list(getattr(top, "__path__", []))  # a namespace package has no __init__.py
    return Path(locations[0]).resolve().parent if locations else None


def _python_folders() -> list[Path]:
    """The standard library's and the installed packages' folders of this Python."""
    folders = {sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    folders.update(site.getsitepackages())
    with contextlib.suppress(AttributeError):  # some embedded Pythons have no user site
        folders.add(site.getusersitepackages())
    return [Path(folder).resolve() for folder in folders if folder]


# ------------------------------------------------------------------------------------------- the file


def _problem_source(
    module: torch.nn.Module, call: _CallSource, module_file: Path, digest: str, import_roots: list[str]
) -> str:
    cls = type(module)
    return template_environment("templates").get_template(PROBLEM_TEMPLATE).render(
        class_name=cls.__name__,
        class_path=f"{cls.__module__}.{cls.__qualname__}",
        module_file=module_file.name,
        module_file_literal=repr(module_file.name),
        module_sha256_literal=repr(digest),
        captured_in_literal=repr(str(module_file.parent)),
        import_root_literals=[repr(root) for root in import_roots],
        forward_parameters=call.parameters,
        call_arguments=call.arguments,
        inputs=call.inputs,
    )


def _make_folder(folder: Path) -> list[Path]:
    """Create `folder` and its missing parents; return the ones created, outermost first."""
    missing = [parent for parent in (folder, *folder.parents) if not parent.exists()][::-1]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CaptureError(
            f"Cannot create the folder {folder}: {err.strerror or err}.", hint="Pass a path in a writable folder."
        ) from None
    return missing


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__
