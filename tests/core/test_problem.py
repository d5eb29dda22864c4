"""Tests of the problem loader: every way a file can be unusable, the examples, ids, isolation, inputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernelpilot.errors import ProblemError
from kernelpilot.problem import Problem, load_problem, problem_id_of

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

VALID = '''\
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x * self.scale


def get_inputs():
    return [torch.randn(4, 8)]


def get_init_inputs():
    return [2.0]
'''


def write(folder: Path, text: str, name: str = "problem.py") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def replaced(old: str, new: str) -> str:
    """VALID with one piece of it replaced (the piece must be there, so a typo cannot make a test vacuous)."""
    assert old in VALID
    return VALID.replace(old, new)


def load_error(path: Path, *key_phrases: str) -> ProblemError:
    """Load `path`, expecting a ProblemError: one line, naming the file, containing every key phrase."""
    with pytest.raises(ProblemError) as caught:
        load_problem(path)
    message = str(caught.value)
    assert "\n" not in message
    assert path.name in message
    for phrase in key_phrases:
        assert phrase in message
    assert caught.value.hint
    return caught.value


# ------------------------------------------------------------------------------------- the file itself


def test_missing_file(tmp_path):
    load_error(tmp_path / "absent.py", "does not exist")


def test_directory(tmp_path):
    folder = tmp_path / "problems.py"
    folder.mkdir()
    load_error(folder, "is a directory")


def test_not_a_python_file(tmp_path):
    load_error(write(tmp_path, VALID, name="problem.txt"), "not a Python file")


def test_binary_file(tmp_path):
    path = tmp_path / "problem.py"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00")
    load_error(path, "binary file")


def test_not_utf8(tmp_path):
    path = tmp_path / "problem.py"
    path.write_bytes("# caf\u00e9 in latin-1\n".encode("latin-1") + VALID.encode())
    load_error(path, "not UTF-8")


def test_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, replaced("    return [2.0]", "    return [2.0"))
    line = VALID.splitlines().index("    return [2.0]") + 1
    load_error(path, "Syntax error", f"problem.py:{line}")


# ---------------------------------------------------------------------------------- running the file


def test_missing_module_is_named(tmp_path):
    path = write(tmp_path, "import kp_no_such_module\n" + VALID)
    load_error(path, "`kp_no_such_module`", "cannot be found", "(line 1)")


def test_other_import_error(tmp_path):
    path = write(tmp_path, "from torch import kp_no_such_name\n" + VALID)
    load_error(path, "fails to import", "kp_no_such_name")


def test_exception_at_top_level(tmp_path):
    path = write(tmp_path, VALID + "SIZE = 1 // 0\n")
    line = len(VALID.splitlines()) + 1
    load_error(path, "ZeroDivisionError", "top level", f"(line {line})")


def test_exit_at_top_level(tmp_path):
    path = write(tmp_path, "import sys\nsys.exit(3)\n" + VALID)
    load_error(path, "exited with code 3", "top level", "(line 2)")


def test_main_guard_does_not_run(tmp_path):
    path = write(tmp_path, VALID + "if __name__ == '__main__':\n    raise SystemExit('ran as a script')\n")
    assert load_problem(path).name == "problem"


# ------------------------------------------------------------------------------ what the file defines


def test_no_model(tmp_path):
    load_error(write(tmp_path, replaced("class Model(nn.Module)", "class Net(nn.Module)")), "no class named Model")


def test_model_not_a_class(tmp_path):
    path = write(tmp_path, VALID + "\n\ndef Model(scale):\n    return nn.Identity()\n")
    load_error(path, "`Model`", "is a function, not a class")


def test_model_not_a_module(tmp_path):
    path = write(tmp_path, replaced("class Model(nn.Module)", "class Model"))
    load_error(path, "`Model`", "not a subclass of torch.nn.Module")


def test_model_without_forward(tmp_path):
    load_error(write(tmp_path, replaced("def forward(self, x)", "def foward(self, x)")), "defines no forward()")


def test_an_empty_file_is_told_about_model_first(tmp_path):
    load_error(write(tmp_path, "import torch\n"), "no class named Model")


@pytest.mark.parametrize("name", ["get_inputs", "get_init_inputs"])
def test_missing_function(tmp_path, name):
    load_error(write(tmp_path, replaced(f"def {name}()", f"def other_{name}()")), f"no function named {name}()")


@pytest.mark.parametrize("name", ["get_inputs", "get_init_inputs"])
def test_function_not_callable(tmp_path, name):
    load_error(write(tmp_path, VALID + f"\n{name} = [1, 2]\n"), f"`{name}`", "is a list, not a function")


def test_get_init_inputs_raises(tmp_path):
    path = write(tmp_path, replaced("return [2.0]", "raise ValueError('no config given')"))
    load_error(path, "get_init_inputs()", "raised ValueError: no config given", "(line ")


def test_get_inputs_raises(tmp_path):
    path = write(tmp_path, replaced("return [torch.randn(4, 8)]", "return [torch.randn(4, 8) @ torch.randn(5, 8)]"))
    load_error(path, "get_inputs()", "raised RuntimeError")


def test_get_init_inputs_wrong_type(tmp_path):
    path = write(tmp_path, replaced("return [2.0]", "return {'scale': 2.0}"))
    load_error(path, "get_init_inputs()", "returned a dict, not a list")


def test_get_inputs_returns_a_bare_tensor(tmp_path):
    path = write(tmp_path, replaced("return [torch.randn(4, 8)]", "return torch.randn(4, 8)"))
    load_error(path, "get_inputs()", "returned a Tensor, not a list")


def test_get_inputs_returns_none(tmp_path):
    path = write(tmp_path, replaced("return [torch.randn(4, 8)]", "pass"))
    load_error(path, "get_inputs()", "returned None, not a list")


def test_get_inputs_empty(tmp_path):
    load_error(write(tmp_path, replaced("return [torch.randn(4, 8)]", "return []")), "returned an empty list")


def test_get_inputs_bad_item(tmp_path):
    path = write(tmp_path, replaced("return [torch.randn(4, 8)]", "return [torch.randn(4, 8), 'fast']"))
    load_error(path, "returned a str at position 1", "tensor, a number or None")


def test_model_constructor_raises(tmp_path):
    path = write(tmp_path, replaced("return [2.0]", "return [2.0, 3.0]"))
    err = load_error(path, "Model(*get_init_inputs())", "raised TypeError")
    assert "(scale)" in err.hint


# ----------------------------------------------------------------------------------- what loads fine


def test_tuples_become_lists(tmp_path):
    path = write(
        tmp_path,
        replaced("return [2.0]", "return (2.0,)").replace("return [torch.randn(4, 8)]", "return (torch.randn(4, 8),)"),
    )
    problem = load_problem(path)
    assert problem.init_inputs == [2.0]
    assert isinstance(problem.make_inputs(), list)


def test_validation_uses_meta_tensors(tmp_path):
    """A 4 TB input would fail or take hours if validation allocated it."""
    path = write(tmp_path, replaced("torch.randn(4, 8)", "torch.randn(1_000_000, 1_000_000)"))
    assert load_problem(path).name == "problem"


def test_code_meta_tensors_cannot_run_is_retried_on_cpu(tmp_path):
    path = write(tmp_path, replaced("self.scale = scale", "self.scale = float(torch.tensor(scale).item())"))
    assert load_problem(path).make_model().scale == 2.0


def test_without_validation_inputs_are_not_drawn(tmp_path):
    path = write(tmp_path, replaced("return [torch.randn(4, 8)]", "raise RuntimeError('expensive')"))
    problem = load_problem(path, validate=False)
    assert problem.init_inputs == [2.0]
    with pytest.raises(RuntimeError, match="expensive"):
        problem.make_inputs()


def test_problem_fields_and_signatures(tmp_path):
    path = write(tmp_path, VALID)
    problem = load_problem(path)
    assert problem.path == path.resolve()
    assert problem.name == "problem"
    assert problem.source == VALID
    assert problem.problem_id == problem_id_of(VALID)
    assert issubclass(problem.model_cls, torch.nn.Module)
    assert str(problem.init_signature()) == "(scale)"
    assert str(problem.forward_signature()) == "(x)"


def test_make_model_is_in_eval_mode(tmp_path):
    model = load_problem(write(tmp_path, VALID)).make_model(device="cpu")
    assert not model.training
    assert model.scale == 2.0


# --------------------------------------------------------------------------------------- problem ids


def test_problem_id_is_stable_across_loads(tmp_path):
    path = write(tmp_path, VALID)
    assert load_problem(path).problem_id == load_problem(path).problem_id


def test_problem_id_changes_with_the_source(tmp_path):
    first = load_problem(write(tmp_path, VALID, name="a.py"))
    second = load_problem(write(tmp_path, replaced("return [2.0]", "return [3.0]"), name="b.py"))
    assert first.problem_id != second.problem_id


def test_problem_id_ignores_line_endings():
    assert problem_id_of(VALID) == problem_id_of(VALID.replace("\n", "\r\n"))
    assert len(problem_id_of(VALID)) == 16


# --------------------------------------------------------------------------------------- isolation


def test_examples_do_not_leak_into_each_other():
    softmax = load_problem(EXAMPLES / "softmax_long_rows.py")
    layernorm = load_problem(EXAMPLES / "layernorm.py")
    assert softmax.model_cls is not layernorm.model_cls
    assert softmax.module.Model is softmax.model_cls
    assert softmax.module.__name__ != layernorm.module.__name__
    assert not hasattr(softmax.module, "HIDDEN")
    assert softmax.module.__name__ not in sys.modules
    assert layernorm.module.__name__ not in sys.modules


def test_same_file_twice_gives_fresh_classes(tmp_path):
    path = write(tmp_path, VALID)
    assert load_problem(path).model_cls is not load_problem(path).model_cls


def test_siblings_are_importable_without_leaking(tmp_path):
    sys_path_before = list(sys.path)
    problems = []
    for scale in (2.0, 3.0):
        folder = tmp_path / f"scale_{scale:g}"
        folder.mkdir()
        write(folder, f"SCALE = {scale}\n", name="kp_sibling_settings.py")
        source = "from kp_sibling_settings import SCALE\n" + replaced("return [2.0]", "return [SCALE]")
        problems.append(load_problem(write(folder, source)))
    assert [problem.init_inputs for problem in problems] == [[2.0], [3.0]]
    assert "kp_sibling_settings" not in sys.modules
    assert sys.path == sys_path_before


# ------------------------------------------------------------------------------------------- inputs


def test_make_inputs_is_reproducible_with_a_seed(tmp_path):
    problem = load_problem(write(tmp_path, VALID))
    first, again, other = (problem.make_inputs(seed=seed) for seed in (7, 7, 8))
    assert torch.equal(first[0], again[0])
    assert not torch.equal(first[0], other[0])
    assert first[0].device.type == "cpu"


@pytest.mark.gpu
def test_make_inputs_on_the_gpu(tmp_path):
    source = replaced("return [torch.randn(4, 8)]", "return [torch.randn(4, 8), torch.ones(3, device='cpu'), 0.5]")
    problem = load_problem(write(tmp_path, source))
    drawn, stray, number = problem.make_inputs(device="cuda", seed=0)
    assert drawn.is_cuda and stray.is_cuda
    assert number == 0.5
    assert torch.equal(drawn, problem.make_inputs(device="cuda", seed=0)[0])


@pytest.mark.gpu
def test_examples_run_on_the_gpu():
    problem = load_problem(EXAMPLES / "small_mlp_block.py")
    model = problem.make_model(device="cuda")
    output = model(*problem.make_inputs(device="cuda", seed=0))
    assert output.is_cuda and output.shape == (16, 256)


# ------------------------------------------------------------------------------------------ examples


EXAMPLE_FILES = sorted(EXAMPLES.glob("*.py"))


def test_there_are_enough_examples():
    assert len(EXAMPLE_FILES) >= 12


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[path.stem for path in EXAMPLE_FILES])
def test_example_loads_and_validates(path):
    problem = load_problem(path)
    assert isinstance(problem, Problem)
    assert problem.module.__doc__, f"{path.name} needs a one-line module docstring"
    inputs = problem.make_inputs(device="meta")
    assert any(isinstance(item, torch.Tensor) for item in inputs)
    with torch.device("meta"):
        problem.make_model()(*inputs)


def test_examples_readme_lists_every_example():
    readme = (EXAMPLES / "README.md").read_text()
    assert [path.name for path in EXAMPLE_FILES if f"`{path.name}`" not in readme] == []


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_init_reports_a_bad_problem_in_one_line(tmp_path):
    """The real entry point, in its own process: one error line, a non-zero exit, no traceback, no workspace."""
    problem = write(tmp_path, replaced("class Model(nn.Module)", "class Net(nn.Module)"), name="broken.py")
    completed = subprocess.run(
        [sys.executable, "-m", "kernelpilot", "init", str(problem)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode != 0
    assert "Traceback" not in completed.stderr
    assert [line for line in completed.stderr.splitlines() if line.startswith("error:")] == [
        "error: broken.py has no class named Model."
    ]
    assert not (tmp_path / "kp-broken").exists()


def init_stderr_lines(problem: Path, monkeypatch) -> list[str]:
    """`kernelpilot init PROBLEM` in this process (faster than a subprocess); the lines it wrote to stderr."""
    from typer.testing import CliRunner

    from kernelpilot.cli import app

    monkeypatch.chdir(problem.parent)
    result = CliRunner().invoke(app, ["init", str(problem)])
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit)
    return result.stderr.splitlines()


def test_cli_keeps_a_long_message_on_one_line(tmp_path, monkeypatch):
    problem = write(tmp_path, replaced("return [2.0]", "return [2.0, 3.0]"), name="broken.py")
    assert init_stderr_lines(problem, monkeypatch)[0] == (
        "error: Model(*get_init_inputs()) in broken.py raised TypeError: "
        "Model.__init__() takes 2 positional arguments but 3 were given."
    )


def test_cli_prints_brackets_in_a_message_literally(tmp_path, monkeypatch):
    problem = write(tmp_path, replaced("return [2.0]", "return {'scale': 2.0}"), name="broken.py")
    assert "hint: Make get_init_inputs() return a list, e.g. `return [x, y]`." in init_stderr_lines(problem, monkeypatch)
