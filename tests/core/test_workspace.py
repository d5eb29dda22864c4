"""Tests for the workspace scaffold: layout, ModelNew's constructor, protected files, re-init, CLI."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kernelpilot import ops
from kernelpilot.cli import app
from kernelpilot.errors import WorkspaceError
from kernelpilot.problem import load_problem
from kernelpilot.resources import data_dir
from kernelpilot.workspace import (
    EXAMPLE_KERNELS,
    EXTENSION_NAME,
    GITIGNORE_PATH,
    MANIFEST_PATH,
    PROTECTED_FILES,
    check_protected,
    init_workspace,
    open_workspace,
    render_model_new,
    tampered_files,
)

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))

# Small problems covering the constructor shapes ModelNew must reproduce.
PROBLEMS = {
    "linear": """
        import torch
        from torch import nn

        class Model(nn.Module):
            def __init__(self, in_features: int, out_features: int):
                super().__init__()
                self.linear = nn.Linear(in_features, out_features)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.relu(self.linear(x))

        def get_inputs():
            return [torch.randn(4, 16)]

        def get_init_inputs():
            return [16, 8]
    """,
    "conv": """
        import torch
        from torch import nn

        class Model(nn.Module):
            def __init__(self, channels, out_channels, kernel_size):
                super().__init__()
                self.conv = nn.Conv2d(channels, out_channels, kernel_size)
                self.norm = nn.BatchNorm2d(out_channels)
                self.bias = nn.Parameter(torch.randn(out_channels, 1, 1))

            def forward(self, x):
                return self.norm(self.conv(x)) + self.bias

        def get_inputs():
            return [torch.randn(2, 3, 16, 16)]

        def get_init_inputs():
            return [3, 8, 3]
    """,
    "no_params": """
        import torch
        from torch import nn

        class Model(nn.Module):
            def forward(self, a, b):
                return torch.softmax(a + b, dim=-1)

        def get_inputs():
            return [torch.randn(4, 32), torch.randn(4, 32)]

        def get_init_inputs():
            return []
    """,
    "keyword_defaults": """
        import torch
        from torch import nn

        class Model(nn.Module):
            def __init__(self, dim, eps: float = 1e-5, *, affine=True, dtype=torch.float32, act=torch.tanh):
                super().__init__()
                self.eps = eps
                self.act = act
                self.weight = nn.Parameter(torch.ones(dim, dtype=dtype)) if affine else None
                self.register_buffer("scale", torch.full((dim,), 2.0))
                self.register_buffer("scratch", torch.zeros(dim), persistent=False)

            def forward(self, x, /, mode="fast", *, dims=(0, 1)):
                return self.act(x * self.weight * self.scale)

        def get_inputs():
            return [torch.randn(4, 32)]

        def get_init_inputs():
            return [32]
    """,
    "var_args": """
        import torch
        from torch import nn

        class Model(nn.Module):
            def __init__(self, *sizes, **options):
                super().__init__()
                self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

            def forward(self, *xs):
                return xs[0]

        def get_inputs():
            return [torch.randn(2, 4)]

        def get_init_inputs():
            return [4, 8, 2]
    """,
}


def write_problem(folder: Path, name: str, source: str | None = None) -> Path:
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(source if source is not None else PROBLEMS[name]))
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def import_model_new(monkeypatch):
    """Import a workspace's model_new.py as a fresh module.

    model_new.py asks for the workspace's ops, and building them needs nvcc; the constructor never touches them, so
    an empty torch.ops namespace stands in for a loaded build here. The GPU test below imports ModelNew with the
    real build.
    """

    def load(ws_root: Path, module_name: str):
        monkeypatch.setitem(ops._namespace_of_workspace, ws_root.resolve(), "kp_not_built")
        spec = importlib.util.spec_from_file_location(module_name, ws_root / "model_new.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


def plain_signature(fn) -> list[tuple]:
    """A signature as (name, kind, default) triples: annotations are deliberately not reproduced."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.fixture
def problem_file(tmp_path: Path) -> Path:
    return write_problem(tmp_path, "linear")


@pytest.fixture
def workspace(tmp_path: Path, problem_file: Path):
    ws, _ = init_workspace(problem_file, tmp_path / "ws")
    return ws


# ------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("problem_path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_scaffold_of_each_example(tmp_path: Path, problem_path: Path):
    ws, created = init_workspace(problem_path, tmp_path / "ws")

    expected = {*PROTECTED_FILES, "model_new.py", *EXAMPLE_KERNELS, MANIFEST_PATH, GITIGNORE_PATH}
    assert set(created) == expected
    assert all((ws.root / name).is_file() for name in expected)
    assert ws.model_path.read_bytes() == problem_path.read_bytes()
    sources = [*EXAMPLE_KERNELS, "kernels/kp_module.cpp"]
    assert ws.kernel_sources() == sorted(ws.root / name for name in sources)
    problem = load_problem(problem_path)
    assert ws.problem().problem_id == problem.problem_id
    # Written from the signatures the check's child reported, as if rendered from the problem loaded here.
    assert ws.model_new_path.read_text() == render_model_new(problem)


@pytest.mark.parametrize("problem_path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_model_new_of_each_example_has_models_state_dict_shapes(tmp_path: Path, problem_path: Path, import_model_new):
    import torch

    problem = load_problem(problem_path)
    ws, _ = init_workspace(problem_path, tmp_path / "ws")
    model_new = import_model_new(ws.root, f"model_new_{problem_path.stem}")
    # On the meta device: the examples are sized for a GPU, and only names and shapes matter here.
    with torch.device("meta"):
        reference = problem.model_cls(*problem.init_inputs)
        candidate = model_new.ModelNew(*problem.init_inputs)
    assert {k: v.shape for k, v in candidate.state_dict().items()} == {
        k: v.shape for k, v in reference.state_dict().items()
    }
    assert plain_signature(model_new.ModelNew.__init__) == plain_signature(problem.model_cls.__init__)
    assert plain_signature(model_new.ModelNew.forward) == plain_signature(problem.model_cls.forward)


def test_model_py_is_a_read_only_byte_copy(workspace, problem_file: Path):
    assert workspace.model_path.read_bytes() == problem_file.read_bytes()
    assert stat.S_IMODE(workspace.model_path.stat().st_mode) == 0o444


def test_skill_and_templates_are_copied_verbatim(workspace):
    assert (workspace.root / "SKILL.md").read_bytes() == (data_dir("skills") / "SKILL.md").read_bytes()
    for name in [*PROTECTED_FILES[1:], *EXAMPLE_KERNELS]:
        if name != "SKILL.md":
            assert (workspace.root / name).read_bytes() == (data_dir("templates") / name).read_bytes(), name


def test_gitignore_keeps_build_and_bookkeeping_but_not_the_manifest_out_of_git(workspace, tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "no-gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    subprocess.run(["git", "init", "-q", str(workspace.root)], check=True)
    made = ["build/kp_module.o", "__pycache__/model_new.cpython-311.pyc", ".kernelpilot/sessions/s.jsonl",
            ".kernelpilot/best/model_new.py"]  # fmt: skip
    for name in made:
        (workspace.root / name).parent.mkdir(parents=True, exist_ok=True)
        (workspace.root / name).write_text("")
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=workspace.root,
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    untracked = {line[3:] for line in status.splitlines()}
    assert MANIFEST_PATH in untracked and GITIGNORE_PATH in untracked and "kernels/kp_module.cpp" in untracked
    assert not untracked & set(made)


def test_manifest_records_problem_and_protected_hashes(workspace, problem_file: Path):
    manifest = json.loads(workspace.manifest_path.read_text())

    assert manifest["version"] == 2
    assert manifest["extension"] == EXTENSION_NAME
    assert re.fullmatch(r"kp_linear_[0-9a-f]{6}", manifest["namespace"])
    assert manifest["namespace"] == workspace.namespace
    assert manifest["problem_id"] == load_problem(problem_file).problem_id == workspace.problem_id
    assert manifest["files"] == {name: sha256(workspace.root / name) for name in PROTECTED_FILES}


def test_default_destination_is_kp_stem_in_current_folder(tmp_path: Path, problem_file: Path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.chdir(run_dir)

    ws, _ = init_workspace(problem_file)

    assert ws.root.resolve() == run_dir / "kp-linear"
    assert ws.model_path.is_file()


# ----------------------------------------------------------------------------------------- ModelNew


@pytest.mark.parametrize("name", PROBLEMS)
def test_model_new_has_models_signatures_and_state_dict(tmp_path: Path, name: str, import_model_new):
    import torch

    problem = load_problem(write_problem(tmp_path, name))
    ws, _ = init_workspace(problem.path, tmp_path / "ws")
    assert ws.model_new_path.read_text() == render_model_new(problem)
    model_new = import_model_new(ws.root, f"model_new_{name}")

    torch.manual_seed(0)
    reference = problem.model_cls(*problem.init_inputs)
    torch.manual_seed(0)
    candidate = model_new.ModelNew(*problem.init_inputs)

    assert plain_signature(model_new.ModelNew.__init__) == plain_signature(problem.model_cls.__init__)
    assert plain_signature(model_new.ModelNew.forward) == plain_signature(problem.model_cls.forward)
    expected, actual = reference.state_dict(), candidate.state_dict()
    assert list(actual) == list(expected)
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key
    candidate.load_state_dict(expected)  # strict: the judge loads Model's weights this way
    assert isinstance(candidate, torch.nn.Module) and type(candidate).__name__ == "ModelNew"


def test_model_new_keeps_models_non_literal_defaults_and_settings(tmp_path: Path, import_model_new):
    import torch

    problem = load_problem(write_problem(tmp_path, "keyword_defaults"))
    ws, _ = init_workspace(problem.path, tmp_path / "ws")
    source = ws.model_new_path.read_text()
    model_new = import_model_new(ws.root, "model_new_defaults")

    parameters = inspect.signature(model_new.ModelNew.__init__).parameters
    assert parameters["eps"].default == 1e-5 and "eps=1e-05" in source
    assert parameters["dtype"].default is torch.float32
    assert parameters["act"].default is torch.tanh
    candidate = model_new.ModelNew(32, eps=0.25)
    assert candidate.eps == 0.25 and candidate.act is torch.tanh
    assert set(dict(candidate.named_buffers())) == {"scale", "scratch"}


def test_model_new_forward_says_where_the_kernels_go(workspace, import_model_new):
    model_new = import_model_new(workspace.root, "model_new_forward")

    with pytest.raises(NotImplementedError, match="kernels from kernels/; see SKILL.md"):
        model_new.ModelNew(16, 8)(None)
    assert "kp_ops.scale_shift(" in model_new.ModelNew.forward.__doc__


# ---------------------------------------------------------------------------------- protected files


def test_untouched_workspace_has_no_tampered_files(workspace):
    assert tampered_files(workspace) == []
    check_protected(workspace)


def test_edited_and_deleted_protected_files_are_named(workspace):
    (workspace.root / "setup.py").write_text("print('no build')\n")
    (workspace.kernels_dir / "kp_cuda.h").unlink()

    assert tampered_files(workspace) == ["setup.py", "kernels/kp_cuda.h"]
    with pytest.raises(WorkspaceError) as excinfo:
        check_protected(workspace)
    assert "setup.py" in excinfo.value.message and "kernels/kp_cuda.h" in excinfo.value.message
    assert excinfo.value.hint


def test_edited_reference_is_detected(workspace):
    workspace.model_path.chmod(0o644)
    workspace.model_path.write_text(workspace.model_path.read_text() + "\n# tweak\n")

    assert tampered_files(workspace) == ["model.py"]


def test_user_files_are_not_protected(workspace):
    (workspace.kernels_dir / "fused.cu").write_text("// mine\n")
    workspace.model_new_path.write_text("# rewritten\n")

    assert tampered_files(workspace) == []


def _manifest_agreeing_with_the_files(workspace) -> None:
    """What a program the agent runs can do: rewrite the manifest so that its hashes agree with the files."""
    manifest = json.loads(workspace.manifest_path.read_text())
    manifest["files"] = {name: hashlib.sha256((workspace.root / name).read_bytes()).hexdigest()
                         for name in PROTECTED_FILES}  # fmt: skip
    manifest["problem_id"] = "0123456789abcdef"
    workspace.manifest_path.write_text(json.dumps(manifest))


def test_an_edited_reference_with_a_manifest_to_match_is_still_detected(workspace, problem_file: Path):
    workspace.model_path.chmod(0o644)
    workspace.model_path.write_text(workspace.model_path.read_text() + "\n# tweak\n")
    _manifest_agreeing_with_the_files(workspace)

    assert tampered_files(workspace) == ["model.py", MANIFEST_PATH]
    with pytest.raises(WorkspaceError, match="model.py"):
        init_workspace(problem_file, workspace.root)


def test_a_manifest_alone_rewritten_is_written_anew_by_init(workspace, problem_file: Path):
    original = workspace.manifest_path.read_text()
    _manifest_agreeing_with_the_files(workspace)
    assert tampered_files(workspace) == [MANIFEST_PATH]

    init_workspace(problem_file, workspace.root)

    assert tampered_files(workspace) == [] and workspace.manifest_path.read_text() == original


def test_without_its_record_a_workspace_is_checked_against_its_manifest(workspace, tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELPILOT_CACHE_DIR", str(tmp_path / "another-cache"))  # a clone, or an older workspace
    workspace.model_path.chmod(0o644)
    workspace.model_path.write_text(workspace.model_path.read_text() + "\n# tweak\n")
    assert tampered_files(workspace) == ["model.py"]
    _manifest_agreeing_with_the_files(workspace)
    assert tampered_files(workspace) == []


# ------------------------------------------------------------------------------------------ re-init


def test_reinit_never_overwrites_user_files_and_restores_missing_protected(workspace, problem_file: Path):
    user_kernel = workspace.kernels_dir / "fused.cu"
    user_kernel.write_text("// my kernel\n")
    workspace.model_new_path.write_text("# my ModelNew\n")
    for name in [*EXAMPLE_KERNELS, GITIGNORE_PATH]:
        (workspace.root / name).unlink()
    (workspace.root / "benchmark.py").unlink()

    ws, created = init_workspace(problem_file, workspace.root)

    assert created == ["benchmark.py"], "files the user deleted on purpose stay deleted"
    assert user_kernel.read_text() == "// my kernel\n"
    assert ws.model_new_path.read_text() == "# my ModelNew\n"
    assert not any((ws.root / name).exists() for name in [*EXAMPLE_KERNELS, GITIGNORE_PATH])
    assert tampered_files(ws) == []


def test_reinit_of_complete_workspace_creates_nothing(workspace, problem_file: Path):
    _, created = init_workspace(problem_file, workspace.root)
    assert created == []


def test_reinit_recreates_a_deleted_model_new(workspace, problem_file: Path):
    rendered = workspace.model_new_path.read_text()
    workspace.model_new_path.unlink()

    _, created = init_workspace(problem_file, workspace.root)

    assert created == ["model_new.py"]
    assert workspace.model_new_path.read_text() == rendered


def test_reinit_refuses_tampered_protected_files(workspace, problem_file: Path):
    (workspace.kernels_dir / "kp_registry.h").write_text("// edited\n")

    with pytest.raises(WorkspaceError) as excinfo:
        init_workspace(problem_file, workspace.root)

    assert "kernels/kp_registry.h" in excinfo.value.message
    assert (workspace.kernels_dir / "kp_registry.h").read_text() == "// edited\n"


def test_reinit_refuses_a_different_problem(tmp_path: Path, workspace):
    other = write_problem(tmp_path, "conv")

    with pytest.raises(WorkspaceError) as excinfo:
        init_workspace(other, workspace.root)

    assert "different problem" in excinfo.value.message
    assert load_problem(workspace.model_path).problem_id == workspace.problem_id


def test_init_refuses_a_folder_with_other_files(tmp_path: Path, problem_file: Path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "todo.txt").write_text("keep me\n")

    with pytest.raises(WorkspaceError, match="not a kernelpilot workspace"):
        init_workspace(problem_file, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["todo.txt"]


def test_unwritable_destination_is_a_workspace_error(tmp_path: Path, problem_file: Path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")

    with pytest.raises(WorkspaceError, match="Cannot write the workspace"):
        init_workspace(problem_file, a_file / "ws")


# ------------------------------------------------------------------------------------- open_workspace


def test_open_workspace_returns_the_workspace(workspace):
    opened = open_workspace(workspace.root)
    assert opened.root == workspace.root
    assert opened.problem_id == workspace.problem_id


@pytest.mark.parametrize("make_folder", [True, False], ids=["random-folder", "missing-folder"])
def test_open_workspace_on_a_non_workspace_gives_one_sentence(tmp_path: Path, make_folder: bool):
    folder = tmp_path / "random"
    if make_folder:
        folder.mkdir()
        (folder / "file.txt").write_text("x")

    with pytest.raises(WorkspaceError) as excinfo:
        open_workspace(folder)

    message = excinfo.value.message
    assert "\n" not in message and message.endswith(".") and message.count(". ") == 0
    assert "kernelpilot init" in excinfo.value.hint


@pytest.mark.parametrize(
    ("content", "complaint"),
    [
        ("{not json", "cannot be read"),
        ('{"version": 2}', "not a version-2 kernelpilot manifest"),
        # A workspace made before kernels became torch ops: its kp_module.cpp and bindings are of the old form.
        ('{"version": 1, "problem_id": "p", "extension": "kp_kernels", "files": {}}', "not a version-2 kernelpilot"),
    ],
    ids=["not-json", "missing-keys", "version-1"],
)
def test_open_workspace_with_a_broken_manifest(workspace, content: str, complaint: str):
    workspace.manifest_path.write_text(content)

    with pytest.raises(WorkspaceError, match=complaint):
        open_workspace(workspace.root)


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_init_creates_workspace(tmp_path: Path, problem_file: Path):
    dest = tmp_path / "cli-ws"

    result = CliRunner().invoke(app, ["init", str(problem_file), "--dir", str(dest)])

    assert result.exit_code == 0, result.output
    assert "Workspace ready" in result.output
    assert f"kernelpilot build {dest}" in " ".join(result.output.split())
    assert (dest / "model_new.py").is_file() and (dest / MANIFEST_PATH).is_file()


def test_cli_init_of_a_bad_problem_is_one_error_line(tmp_path: Path):
    no_model = "def get_inputs():\n    return []\n\n\ndef get_init_inputs():\n    return []\n"
    bad = write_problem(tmp_path, "bad", no_model)

    result = CliRunner().invoke(app, ["init", str(bad), "--dir", str(tmp_path / "ws")])

    assert result.exit_code != 0
    # Rich wraps long lines at the terminal width, so the sentence is checked with whitespace collapsed.
    assert result.output.count("error:") == 1
    assert "has no class named Model." in " ".join(result.output.split())
    assert "Traceback" not in result.output
    assert not (tmp_path / "ws").exists()


def test_python_m_kernelpilot_init_exits_cleanly_on_a_missing_file(tmp_path: Path):
    completed = subprocess.run(
        [sys.executable, "-m", "kernelpilot", "init", str(tmp_path / "absent.py")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert completed.returncode != 0
    assert "Traceback" not in completed.stderr
    assert "error:" in completed.stderr


# ------------------------------------------------------------------------------------ CUDA template


def _nvcc() -> str:
    import os
    import shutil

    cuda_home = os.environ.get("CUDA_HOME")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").is_file():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc") or "nvcc"


@pytest.mark.cuda_build
def test_example_kernel_and_bindings_compile(tmp_path: Path):
    """The .cu compiles torch-free for sm_90; the bindings compile against this torch's slim headers."""
    import sysconfig

    import torch.utils.cpp_extension as cpp_extension

    kernels = data_dir("templates") / "kernels"
    torch_includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    # nvcc drives g++ for .cpp files and adds the CUDA include folder itself, so no CUDA_HOME is needed.
    binding_flags = [
        "-std=c++20",
        f"-I{kernels}",
        *torch_includes,
        f"-I{sysconfig.get_paths()['include']}",
        "-Xcompiler",
        "-fPIC",
    ]
    jobs = {
        "example_scale_shift.cu": [_nvcc(), "-c", "-arch=sm_90", "-std=c++17", f"-I{kernels}"],
        "example_scale_shift_binding.cpp": [_nvcc(), "-c", *binding_flags],
        "kp_module.cpp": [_nvcc(), "-c", *binding_flags],
    }
    running = {
        name: subprocess.Popen(
            [*command, str(kernels / name), "-o", str(tmp_path / f"{name}.o")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, command in jobs.items()
    }
    for name, process in running.items():
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, f"{name} failed to compile:\n{output[-4000:]}"
        assert (tmp_path / f"{name}.o").stat().st_size > 0


# Run in a fresh interpreter inside the built workspace, so this test process never loads its library.
SCALE_SHIFT_CHECK = """
import torch
from kernelpilot.ops import workspace_ops

kp_ops = workspace_ops("model_new.py")  # no build loaded yet: the library setup.py built in place

for n in [1, 3, 4, 5, 1023, 4096, (1 << 20) + 3]:
    base = torch.randn(n + 1, device="cuda")
    for x in (base[:n], base[1:]):  # 16-byte aligned (float4 path), then 4 bytes off (scalar path)
        torch.testing.assert_close(kp_ops.scale_shift(x, 1.5, -0.25), x * 1.5 - 0.25)

side = torch.cuda.Stream()
with torch.cuda.stream(side):  # launches on torch's current stream, whichever it is
    x = torch.randn(1 << 16, device="cuda")
    y = kp_ops.scale_shift(x, 2.0, 1.0)
side.synchronize()
torch.testing.assert_close(y, x * 2.0 + 1.0)
assert kp_ops.scale_shift(torch.empty(0, device="cuda"), 2.0, 1.0).numel() == 0

for bad, complaint in [
    (torch.randn(8), "CUDA tensor"),
    (torch.randn(8, device="cuda", dtype=torch.float64), "float32"),
    (torch.randn(8, 8, device="cuda").t(), "contiguous"),
]:
    try:
        kp_ops.scale_shift(bad, 1.0, 0.0)
    except RuntimeError as err:
        assert complaint in str(err), err
    else:
        raise AssertionError(f"scale_shift accepted a tensor that is not {complaint}")

import model_new  # the generated ModelNew reaches the same ops and builds Model's state_dict
assert model_new.kp_ops is kp_ops
from kernelpilot.problem import load_problem

problem = load_problem("model.py")
candidate = model_new.ModelNew(*problem.init_inputs).cuda()
candidate.load_state_dict(problem.make_model("cuda").state_dict())
try:
    candidate(*problem.make_inputs("cuda"))
except NotImplementedError as err:
    assert "see SKILL.md" in str(err)
else:
    raise AssertionError("the generated forward should raise NotImplementedError")
print("scale_shift ok")
"""


@pytest.mark.gpu
def test_setup_py_builds_the_example_and_it_computes_scale_shift(tmp_path: Path, problem_file: Path):
    ws, _ = init_workspace(problem_file, tmp_path / "ws")

    build = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ws.root, capture_output=True, text=True
    )
    assert build.returncode == 0, f"setup.py failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}"
    check = subprocess.run([sys.executable, "-c", SCALE_SHIFT_CHECK], cwd=ws.root, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr[-3000:]
    assert "scale_shift ok" in check.stdout
