"""Load and validate a KernelBench-format problem file: `Model`, `get_inputs()` and `get_init_inputs()`.

A problem file runs in a fresh module namespace, so two problems loaded in one process never share classes, and
it is validated on meta tensors, so a problem sized for an 80 GB GPU loads in milliseconds on any machine.
Every way a file can be unusable ends in a `ProblemError`: one sentence naming the file, and a hint.

This module runs the file's code in the calling process; `problem_check` runs the same loading in a child
process with a time and a memory limit, for files kernelpilot has not run before.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import itertools
import numbers
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from kernelpilot.errors import ProblemError, ProblemMemoryError
from kernelpilot.problem_size import format_bytes, host_memory_available

if TYPE_CHECKING:
    import torch

FORMAT_HINT = (
    "A problem file defines `class Model(nn.Module)`, `get_inputs()` and `get_init_inputs()`; "
    "see the files in examples/."
)
TRACEBACK_HINT = "Run `python {file}` to see the full traceback."
EXIT_HINT = (
    "A problem file must not end the process (sys.exit(), os._exit(), exit()); remove that call "
    "(code under `if __name__ == '__main__':` does not run)."
)
MEMORY_HINT = "Make what the file builds on the host smaller (inputs are drawn on meta tensors when it can run there)."

# The stages of loading, in order; the child checking a file reports the one it was in when it hung, exited or crashed.
TOP_LEVEL = "its top level"
GET_INIT_INPUTS = "get_init_inputs()"
MODEL_INIT = "Model(*get_init_inputs())"
GET_INPUTS = "get_inputs()"

# Each execution gets its own module name, so no two loads can collide, whatever the files are called.
_module_serial = itertools.count()


@dataclass
class Problem:
    """A loaded problem: where it came from, its content id, and the three things it defines."""

    path: Path
    name: str
    source: str = field(repr=False)
    problem_id: str
    module: types.ModuleType = field(repr=False)
    model_cls: type
    get_inputs: Callable[[], list] = field(repr=False)
    get_init_inputs: Callable[[], list] = field(repr=False)
    init_inputs: list

    def make_model(self, device: Any = None) -> torch.nn.Module:
        """`Model(*init_inputs)` in eval mode, moved to `device` when one is given."""
        with _importable_from(self.path.parent):
            model = self.model_cls(*self.init_inputs)
        if device is not None:
            model = model.to(device)
        return model.eval()

    def make_inputs(self, device: Any = None, seed: int | None = None) -> list:
        """`get_inputs()` as a list, seeded when `seed` is given, with every tensor on `device` when one is given.

        The tensors are created on `device` directly: drawing a multi-GB input on the CPU and copying it takes
        seconds, drawing it on the GPU milliseconds. A tensor the file pins to another device is moved after.
        """
        import torch

        placement = torch.device(device) if device is not None else contextlib.nullcontext()
        with _importable_from(self.path.parent), placement:
            if seed is not None:
                torch.manual_seed(seed)
            inputs = list(self.get_inputs())
        if device is None:
            return inputs
        return [item.to(device) if isinstance(item, torch.Tensor) else item for item in inputs]

    def init_signature(self) -> inspect.Signature:
        """The signature of `Model.__init__`, without `self`."""
        return _without_self(inspect.signature(self.model_cls.__init__))

    def forward_signature(self) -> inspect.Signature:
        """The signature of `Model.forward`, without `self`."""
        return _without_self(inspect.signature(self.model_cls.forward))


def problem_id_of(source: str) -> str:
    """A stable id of a problem's text: the first 16 hex digits of its SHA-256, line endings normalised."""
    normalised = source.replace("\r\n", "\n").replace("\r", "\n")
    return hashlib.sha256(normalised.encode("utf-8")).hexdigest()[:16]


def load_problem(
    path: str | Path,
    *,
    validate: bool = True,
    on_stage: Callable[[str], None] | None = None,
    host_memory_bytes: int | None = None,
) -> Problem:
    """Load the problem file at `path`; raise `ProblemError` saying what is wrong if it cannot be used.

    Loading runs the file and checks that it defines `Model` (an nn.Module with a forward), `get_inputs` and
    `get_init_inputs`, and calls `get_init_inputs()`. With `validate`, it also builds `Model(*init_inputs)`
    and calls `get_inputs()` on the meta device (shapes and types, no memory) and checks what they return
    (`validated_on_meta`). `on_stage` is told each stage (TOP_LEVEL, GET_INIT_INPUTS, ...) as it starts.
    """
    file = Path(path).expanduser().resolve()
    source = _read_source(file)
    problem = _load(file, source, _compile(source, file), on_stage or _no_stage)
    if validate:
        validated_on_meta(problem, on_stage=on_stage, host_memory_bytes=host_memory_bytes)
    return problem


def check_source(path: str | Path) -> tuple[Path, str]:
    """The resolved path and the text of a readable Python file that compiles, without running any of it; else
    ProblemError."""
    file = Path(path).expanduser().resolve()
    source = _read_source(file)
    _compile(source, file)
    return file, source


def _no_stage(stage: str) -> None:
    pass


def _load(file: Path, source: str, code: types.CodeType, on_stage: Callable[[str], None]) -> Problem:
    with _importable_from(file.parent):
        on_stage(TOP_LEVEL)
        module = _execute(code, file)
        model_cls = _model_class(module, file)
        get_inputs = _function(module, "get_inputs", file)
        get_init_inputs = _function(module, "get_init_inputs", file)
        problem = Problem(
            path=file,
            name=file.stem,
            source=source,
            problem_id=problem_id_of(source),
            module=module,
            model_cls=model_cls,
            get_inputs=get_inputs,
            get_init_inputs=get_init_inputs,
            init_inputs=[],
        )
        on_stage(GET_INIT_INPUTS)
        problem.init_inputs = _as_list(_call(get_init_inputs, GET_INIT_INPUTS, file), GET_INIT_INPUTS, file)
    return problem


# ------------------------------------------------------------------------------------------ reading


def _read_source(file: Path) -> str:
    if not file.exists():
        raise ProblemError(f"Problem file {shown_path(file)} does not exist.", hint="Check the path and try again.")
    if file.is_dir():
        raise ProblemError(
            f"{shown_path(file)} is a directory, not a problem file.",
            hint="Pass the .py file itself, e.g. examples/softmax_long_rows.py.",
        )
    if file.suffix != ".py":
        raise ProblemError(f"{shown_path(file)} is not a Python file (it does not end in .py).", hint=FORMAT_HINT)
    try:
        data = file.read_bytes()
    except OSError as err:
        raise ProblemError(
            f"Problem file {shown_path(file)} cannot be read ({err.strerror}).", hint="Check its permissions."
        ) from None
    if b"\x00" in data:
        raise ProblemError(f"{shown_path(file)} is a binary file, not Python source.", hint=FORMAT_HINT)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ProblemError(
            f"{shown_path(file)} is not UTF-8 text (byte {err.start} cannot be decoded).",
            hint="Save the file as UTF-8.",
        ) from None


def _compile(source: str, file: Path) -> types.CodeType:
    try:
        # dont_inherit: this module's `from __future__` imports must not change how the problem compiles.
        return compile(source, str(file), "exec", dont_inherit=True)
    except SyntaxError as err:
        raise ProblemError(
            f"Syntax error at {shown_path(file)}:{err.lineno}: {err.msg}.",
            hint=f"Fix that line; `python -m py_compile {shown_path(file)}` shows the same error.",
        ) from None


# ---------------------------------------------------------------------------------------- executing


@contextlib.contextmanager
def _importable_from(directory: Path) -> Iterator[None]:
    """Put `directory` first on sys.path for the duration, so a problem can import the files next to it."""
    entry = str(directory)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # the problem itself may have removed it
            sys.path.remove(entry)


def _execute(code: types.CodeType, file: Path) -> types.ModuleType:
    """Run the file's code in a new module registered only while it runs, as an import would."""
    stem_as_identifier = re.sub(r"\W", "_", file.stem)
    module = types.ModuleType(f"kernelpilot_problem_{next(_module_serial)}_{stem_as_identifier}")
    module.__file__ = str(file)
    modules_before = set(sys.modules)
    sys.modules[module.__name__] = module
    try:
        exec(code, module.__dict__)
    except ModuleNotFoundError as err:
        raise ProblemError(
            f"{shown_path(file)} imports `{err.name}`, which cannot be found{_at_line(err, file)}.",
            hint="Install that package or remove the import; a problem normally needs only torch.",
        ) from None
    except ImportError as err:
        raise ProblemError(
            f"{shown_path(file)} fails to import: {_brief(err)}{_at_line(err, file)}.",
            hint=TRACEBACK_HINT.format(file=shown_path(file)),
        ) from None
    except SystemExit as err:
        raise exit_error(file, exit_code_of(err), TOP_LEVEL, _at_line(err, file)) from None
    except Exception as err:
        if is_out_of_memory(err):
            raise _memory_error(err, TOP_LEVEL, file) from None
        raise ProblemError(
            f"{shown_path(file)} raised {_brief(err)} while running its top level{_at_line(err, file)}.",
            hint=TRACEBACK_HINT.format(file=shown_path(file)),
        ) from None
    finally:
        del sys.modules[module.__name__]
        _forget_sibling_modules(file.parent, modules_before)
    return module


def _forget_sibling_modules(directory: Path, modules_before: set[str]) -> None:
    """Drop the modules the problem imported from its own folder.

    They stay reachable through the problem's globals; dropping them from sys.modules keeps a later problem in
    another folder from being handed this folder's `common.py` when it imports its own.
    """
    for name in set(sys.modules) - modules_before:
        file = getattr(sys.modules[name], "__file__", None)
        if file is None:
            continue
        try:
            first_part = Path(file).resolve().relative_to(directory).parts[0]
        except ValueError:
            continue
        top_level = name.partition(".")[0]
        if first_part in (top_level, f"{top_level}.py"):
            del sys.modules[name]


# ----------------------------------------------------------------------------------------- checking


def _model_class(module: types.ModuleType, file: Path) -> type:
    import torch

    namespace = vars(module)
    if "Model" not in namespace:
        raise ProblemError(
            f"{shown_path(file)} has no class named Model.",
            hint="Define `class Model(nn.Module)` whose forward() is the computation to speed up.",
        )
    model_cls = namespace["Model"]
    if not isinstance(model_cls, type):
        raise ProblemError(
            f"`Model` in {shown_path(file)} is {_describe(model_cls)}, not a class.",
            hint="Define `class Model(nn.Module)` whose forward() is the computation to speed up.",
        )
    if not issubclass(model_cls, torch.nn.Module):
        raise ProblemError(
            f"`Model` in {shown_path(file)} is not a subclass of torch.nn.Module.",
            hint="Declare it as `class Model(nn.Module)` and call `super().__init__()` in its __init__.",
        )
    if model_cls.forward is torch.nn.Module.forward:
        raise ProblemError(
            f"`Model` in {shown_path(file)} defines no forward() method.",
            hint="Add `def forward(self, ...)` computing the outputs from the tensors get_inputs() returns.",
        )
    return model_cls


def _function(module: types.ModuleType, name: str, file: Path) -> Callable[[], Any]:
    namespace = vars(module)
    if name not in namespace:
        raise ProblemError(f"{shown_path(file)} has no function named {name}().", hint=FORMAT_HINT)
    function = namespace[name]
    if not callable(function):
        raise ProblemError(
            f"`{name}` in {shown_path(file)} is {_describe(function)}, not a function.",
            hint=f"Define `def {name}():` returning a list.",
        )
    return function


def _call(function: Callable[[], Any], label: str, file: Path, hint: str | None = None) -> Any:
    try:
        return function()
    except (Exception, SystemExit) as err:
        raise _failure(err, label, file, hint) from None


def _failure(err: BaseException, label: str, file: Path, hint: str | None) -> ProblemError:
    """The ProblemError for `label` ending in `err`: an exit, running out of memory, or an exception."""
    if isinstance(err, ProblemError):
        return err
    if isinstance(err, SystemExit):
        return exit_error(file, exit_code_of(err), label, _at_line(err, file))
    if is_out_of_memory(err):
        return _memory_error(err, label, file)
    return ProblemError(
        f"{label} in {shown_path(file)} raised {_brief(err)}{_at_line(err, file)}.",
        hint=hint or TRACEBACK_HINT.format(file=shown_path(file)),
    )


def _call_on_meta(
    function: Callable[[], Any], label: str, file: Path, hint: str | None = None, *, host_memory_bytes: int | None
) -> Any:
    """Call `function` with tensors created on the meta device: shapes and dtypes only, no memory.

    Some valid code cannot run on meta tensors (`.item()`, data-dependent shapes): only a failure on real
    tensors is the problem's fault, so it is retried on the CPU, where every allocation is checked against
    `host_memory_bytes` (default: the memory available now) before it is made.
    """
    import torch

    from kernelpilot.host_budget import HostBudget, HostBudgetExceeded

    try:
        with torch.device("meta"):
            return function()
    except SystemExit as err:
        raise _failure(err, label, file, hint) from None
    except Exception as meta_err:
        budget_bytes = host_memory_available() if host_memory_bytes is None else host_memory_bytes
        try:
            with HostBudget(budget_bytes):
                return function()
        except HostBudgetExceeded as err:
            raise ProblemError(
                f"{label} in {shown_path(file)} cannot run on meta tensors ({_brief(meta_err, 80)}), and on the host "
                f"it would allocate {format_bytes(err.needed_bytes)}, more than the {format_bytes(err.budget_bytes)} "
                "it may use.",
                hint=f"Make {label} run on meta tensors (no .item() or data-dependent shapes), or make it smaller.",
            ) from None
        except (Exception, SystemExit) as err:
            raise _failure(err, label, file, hint) from None


def _as_list(value: Any, label: str, file: Path) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ProblemError(
        f"{label} in {shown_path(file)} returned {_describe(value)}, not a list.",
        hint=f"Make {label} return a list, e.g. `return [x, y]`.",
    )


def validated_on_meta(
    problem: Problem, *, on_stage: Callable[[str], None] | None = None, host_memory_bytes: int | None = None
) -> tuple[torch.nn.Module, list]:
    """The model and the inputs, built as meta tensors where the file's code allows, after checking what
    get_inputs() returns; ProblemError when either cannot be built or the inputs are not a list of arguments."""
    import torch

    file = problem.path
    on_stage = on_stage or _no_stage
    on_stage(MODEL_INIT)
    model = _call_on_meta(
        problem.make_model,
        MODEL_INIT,
        file,
        hint=f"Make get_init_inputs() return the arguments Model.__init__ takes: {problem.init_signature()}.",
        host_memory_bytes=host_memory_bytes,
    )
    on_stage(GET_INPUTS)
    drawn = _call_on_meta(problem.get_inputs, GET_INPUTS, file, host_memory_bytes=host_memory_bytes)
    inputs = _as_list(drawn, GET_INPUTS, file)
    if not inputs:
        raise ProblemError(
            f"get_inputs() in {shown_path(file)} returned an empty list.",
            hint="Return the tensors Model.forward() takes, e.g. `return [torch.randn(4096, 4096)]`.",
        )
    for position, item in enumerate(inputs):
        if item is not None and not isinstance(item, (torch.Tensor, numbers.Number)):
            raise ProblemError(
                f"get_inputs() in {shown_path(file)} returned {_describe(item)} at position {position}, "
                "where a tensor, a number or None was expected.",
                hint="Return the arguments of Model.forward() as a flat list of tensors and numbers.",
            )
    return model, inputs


def exit_code_of(err: SystemExit) -> int:
    """The status a SystemExit ends the process with: 0 for None, 1 for a message, else the number."""
    if err.code is None:
        return 0
    return err.code if isinstance(err.code, int) else 1


def during(stage: str) -> str:
    """'while running its top level', 'in get_inputs()': where in the loading a stage is, for a sentence."""
    return f"while running {stage}" if stage == TOP_LEVEL else f"in {stage}"


def exit_error(file: Path, code: int, stage: str, at_line: str = "") -> ProblemError:
    """The file ended the process (sys.exit, os._exit) with `code` during `stage`."""
    return ProblemError(f"{shown_path(file)} exited with code {code} {during(stage)}{at_line}.", hint=EXIT_HINT)


def is_out_of_memory(err: BaseException) -> bool:
    """Whether `err` is an allocation refused by the memory limit (Python's MemoryError or torch's)."""
    if isinstance(err, MemoryError):  # torch.OutOfMemoryError is a RuntimeError, and not always raised
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def _memory_error(err: BaseException, stage: str, file: Path) -> ProblemMemoryError:
    return ProblemMemoryError(
        f"{shown_path(file)} ran out of memory {during(stage)}{_at_line(err, file)} ({_brief(err, 100)}).",
        hint=MEMORY_HINT,
    )


# ------------------------------------------------------------------------------------------ wording


def shown_path(file: Path) -> str:
    """The file as the user most likely wrote it: relative to the working directory when it is inside it."""
    try:
        return str(file.relative_to(Path.cwd()))
    except ValueError:
        return str(file)


def _describe(value: Any) -> str:
    """'None', or 'a dict', 'an int': what a value is, for a sentence."""
    if value is None:
        return "None"
    type_name = type(value).__name__
    article = "an" if type_name[0].lower() in "aeiou" else "a"
    return f"{article} {type_name}"


def _brief(err: BaseException, limit: int = 160) -> str:
    """'ValueError: first line of the message', short enough for a one-line error."""
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0].rstrip('.')}" if lines else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _at_line(err: BaseException, file: Path) -> str:
    """' (line N)' for the deepest traceback frame inside `file`, or '' when none is."""
    line = None
    frame = err.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code.co_filename == str(file):
            line = frame.tb_lineno
        frame = frame.tb_next
    return f" (line {line})" if line is not None else ""


def _without_self(signature: inspect.Signature) -> inspect.Signature:
    return signature.replace(parameters=list(signature.parameters.values())[1:])
