"""Tests for the incremental build: real nvcc/g++ output parsed, real ninja builds, loading, the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from build_testing import ARCH, edit, write
from typer.testing import CliRunner

from kernelpilot import build
from kernelpilot.build import (
    build_lock,
    build_workspace,
    find_cublaslt,
    load_extension,
    resolve_arch,
)
from kernelpilot.build_versions import SOURCES_RECORD, prune_versions, publish_version
from kernelpilot.cli import app
from kernelpilot.agent.observations import build_text
from kernelpilot.cli.render_build import render_build
from kernelpilot.compiler_output import parse_diagnostics, parse_ptxas
from kernelpilot.toolkit import _toolkit_of, resolve_cuda_home
from kernelpilot.errors import BuildError, WorkspaceError
from kernelpilot.results import BuildResult, from_dict

REPO_ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------ real compiler output


@pytest.fixture(scope="module")
def nvcc() -> Path:
    try:
        return resolve_cuda_home() / "bin" / "nvcc"
    except BuildError as err:
        pytest.skip(f"no CUDA toolkit: {err}")


def _nvcc_output(nvcc: Path, tmp_path: Path, name: str, source: str, *flags: str) -> str:
    """Compile one .cu for sm_90 with -Xptxas -v; return everything nvcc printed."""
    cu = write(tmp_path / name, source)
    run = subprocess.run(
        [str(nvcc), "-c", "-arch=sm_90", "-Xptxas", "-v", *flags, str(cu), "-o", str(cu.with_suffix(".o"))],
        capture_output=True,
        text=True,
        env={**os.environ, "LC_ALL": "C"},
    )
    return run.stdout + run.stderr


SYNTAX_ERROR_CU = """
    __global__ void broken(float* out) {
      out[0] = 1.0f
    }
"""

UNUSED_VARIABLE_CU = """
    __global__ void noisy(float* out) {
      int unused = 3;
      out[0] = 1.0f;
    }
"""

# 48 accumulators live across a loop cannot fit in 24 registers (the sm_90 minimum): ptxas spills.
REGISTER_PRESSURE_CU = """
    __global__ void pressure(float* out, const float* in, int n) {
      float acc[48];
    #pragma unroll
      for (int k = 0; k < 48; ++k) acc[k] = in[k * n + threadIdx.x];
      for (int it = 0; it < n; ++it) {
    #pragma unroll
        for (int k = 0; k < 48; ++k) acc[k] = acc[k] * acc[(k + 1) % 48] + in[it];
      }
      float sum = 0.f;
    #pragma unroll
      for (int k = 0; k < 48; ++k) sum += acc[k];
      out[threadIdx.x] = sum;
    }
"""

SHARED_MEMORY_CU = """
    namespace kp {
    template <int kTile>
    __global__ void reverse_tile(float* data) {
      __shared__ float tile[kTile];
      tile[threadIdx.x] = data[threadIdx.x];
      __syncthreads();
      data[threadIdx.x] = tile[kTile - 1 - threadIdx.x];
    }
    template __global__ void reverse_tile<1024>(float*);
    }  // namespace kp
"""

TOO_MUCH_SHARED_CU = """
    __global__ void greedy(float* out) {
      __shared__ float huge[65536];
      huge[threadIdx.x] = 1.0f;
      __syncthreads();
      out[threadIdx.x] = huge[65535 - threadIdx.x];
    }
"""


@pytest.mark.cuda_build
def test_nvcc_syntax_error_gives_file_line_and_message(nvcc, tmp_path):
    diagnostics = parse_diagnostics(_nvcc_output(nvcc, tmp_path, "broken.cu", SYNTAX_ERROR_CU))

    (error,) = [d for d in diagnostics if d.severity == "error"]
    assert Path(error.file).name == "broken.cu"
    assert error.line == 3
    assert error.tool == "nvcc"
    assert error.message == 'expected a ";"'


@pytest.mark.cuda_build
def test_nvcc_warning_is_a_warning_not_an_error(nvcc, tmp_path):
    diagnostics = parse_diagnostics(_nvcc_output(nvcc, tmp_path, "noisy.cu", UNUSED_VARIABLE_CU))

    (warning,) = diagnostics
    assert (warning.severity, Path(warning.file).name, warning.line) == ("warning", "noisy.cu", 2)
    assert '"unused" was declared but never referenced' in warning.message


@pytest.mark.cuda_build
def test_ptxas_reports_registers_and_spills_of_a_kernel_under_register_pressure(nvcc, tmp_path):
    log = _nvcc_output(nvcc, tmp_path, "pressure.cu", REGISTER_PRESSURE_CU, "-maxrregcount=24")

    (kernel,) = parse_ptxas(log, source="pressure.cu")
    assert kernel.kernel.startswith("pressure(")  # demangled (cu++filt and c++filt spell parameters differently)
    assert kernel.arch == "sm_90"
    assert 0 < kernel.registers <= 24
    assert kernel.spill_stores > 0 and kernel.spill_loads > 0
    assert kernel.stack_bytes > 0
    assert kernel.source == "pressure.cu"


@pytest.mark.cuda_build
def test_render_shows_each_kernels_spills(nvcc, tmp_path):
    from rich.console import Console

    log = _nvcc_output(nvcc, tmp_path, "pressure.cu", REGISTER_PRESSURE_CU, "-maxrregcount=24")
    (kernel,) = parse_ptxas(log, source="kernels/pressure.cu")
    result = BuildResult(
        ok=True, workspace=str(tmp_path), extension_name="kp_kernels", arch=ARCH, compiled=["kernels/pressure.cu"],
        linked=True, resources=[kernel], seconds=1.5,
    )
    console = Console(record=True, width=200)

    render_build(console, result)

    text = console.export_text()
    assert "built kp_kernels for sm_90" in text and "recompiled kernels/pressure.cu; linked" in text
    assert "pressure " in text and "pressure.cu" in text  # names shortened to fit: parameters and folder dropped
    assert f"{kernel.spill_stores}/{kernel.spill_loads}" in text


@pytest.mark.cuda_build
def test_ptxas_reports_shared_memory_of_a_templated_kernel(nvcc, tmp_path):
    log = _nvcc_output(nvcc, tmp_path, "tile.cu", SHARED_MEMORY_CU)

    (kernel,) = parse_ptxas(log)
    # c++filt: "void kp::reverse_tile<1024>(float*)"; cu++filt: "void kp::reverse_tile<(int)1024>(float *)".
    assert kernel.kernel.replace(" ", "").replace("(int)", "") == "voidkp::reverse_tile<1024>(float*)"
    assert kernel.shared_bytes == 1024 * 4
    assert kernel.registers > 0
    assert (kernel.spill_stores, kernel.spill_loads) == (0, 0)


@pytest.mark.cuda_build
def test_ptxas_error_is_an_error_diagnostic(nvcc, tmp_path):
    diagnostics = parse_diagnostics(_nvcc_output(nvcc, tmp_path, "greedy.cu", TOO_MUCH_SHARED_CU))

    errors = [d for d in diagnostics if d.severity == "error"]
    assert errors and errors[0].tool == "ptxas"
    assert "too much shared data" in errors[0].message


@pytest.fixture(scope="module")
def gxx() -> str:
    found = shutil.which("g++")
    if found is None:
        pytest.skip("g++ is not on PATH")
    return found


def test_gcc_errors_and_warnings_carry_line_and_column(gxx, tmp_path):
    source = write(tmp_path / "binding.cpp", "int f() { int x = 1\n  return x; }\nint g(int y) { int z; return y; }\n")
    run = subprocess.run(
        [gxx, "-Wall", "-c", str(source), "-o", str(tmp_path / "binding.o")],
        capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"},
    )

    diagnostics = parse_diagnostics(run.stderr)
    error = next(d for d in diagnostics if d.severity == "error")
    assert (Path(error.file).name, error.line, error.column, error.tool) == ("binding.cpp", 2, 3, "gcc")
    assert "expected" in error.message
    unused = next(d for d in diagnostics if "'z'" in d.message)
    assert (unused.severity, unused.line) == ("warning", 3)


def test_undefined_reference_at_link_is_an_ld_error(gxx, tmp_path):
    source = write(tmp_path / "main.cpp", "int missing_launcher();\nint main() { return missing_launcher(); }\n")
    run = subprocess.run([gxx, str(source), "-o", str(tmp_path / "main")], capture_output=True, text=True)

    (error,) = [d for d in parse_diagnostics(run.stderr) if d.tool == "ld"]
    assert error.severity == "error"
    assert "undefined reference to `missing_launcher()'" in error.message


# -------------------------------------------------------------------------------- arch and toolkit


@pytest.mark.parametrize(
    ("spelled", "expected"),
    [("9.0", "9.0"), ("sm_90", "9.0"), ("90", "9.0"), ("sm_90a", "9.0a"), ("compute_100", "10.0"), ("12.0", "12.0")],
)
def test_arch_spellings_normalize_to_major_dot_minor(spelled, expected):
    assert resolve_arch(spelled) == expected


def test_arch_comes_from_the_first_torch_cuda_arch_list_entry(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    assert resolve_arch(None) == "8.0"


def test_unknown_arch_is_a_build_error():
    with pytest.raises(BuildError, match="not a CUDA architecture"):
        resolve_arch("hopper-ish")


def test_no_arch_and_no_gpu_is_a_build_error_with_a_hint(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible, so its capability is the default arch")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    with pytest.raises(BuildError) as raised:
        resolve_arch(None)
    assert "--arch 9.0" in raised.value.hint


def test_cuda_home_pointing_nowhere_is_a_build_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    with pytest.raises(BuildError, match="has no bin/nvcc"):
        resolve_cuda_home()


def test_cublaslt_comes_from_the_toolkit_first_then_from_the_nvidia_packages(monkeypatch, tmp_path):
    package = tmp_path / "site-packages" / "nvidia" / "cu13"
    write(package / "include" / "cublasLt.h", "")
    for name in ("libcublasLt.so.12", "libcublasLt.so.13", "libcublasLt.so.13.1.0.3"):
        write(package / "lib" / name, "")
    monkeypatch.setattr(build, "_nvidia_package_folders", lambda: [package])
    found = find_cublaslt(tmp_path / "toolkit")
    assert found.include_dir == package / "include" and found.library.name == "libcublasLt.so.13"
    write(tmp_path / "toolkit" / "include" / "cublasLt.h", "")
    write(tmp_path / "toolkit" / "lib64" / "libcublasLt.so", "")
    assert find_cublaslt(tmp_path / "toolkit").library == tmp_path / "toolkit" / "lib64" / "libcublasLt.so"


def test_missing_cublaslt_is_one_sentence_with_a_hint(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "_nvidia_package_folders", list)
    with pytest.raises(BuildError, match="includes cublasLt.h, but no cuBLASLt") as raised:
        find_cublaslt(tmp_path)
    assert "CUDA_HOME" in raised.value.hint


def test_a_wrapper_script_nvcc_leads_to_the_real_toolkit(nvcc, tmp_path):
    wrapper = write(tmp_path / "bin" / "nvcc", f'#!/bin/sh\nexec "{nvcc}" "$@"\n')
    wrapper.chmod(0o755)

    assert _toolkit_of(wrapper).resolve() == nvcc.parent.parent.resolve()


# -------------------------------------------------------------------------------- real builds

@pytest.mark.cuda_build
def test_cold_build_compiles_every_source_links_and_reports_resources(built):
    root, result = built

    assert result.ok, result.log
    assert result.compiled == ["kernels/scale.cu", "kernels/scale_binding.cpp"]
    assert result.linked
    assert (root / "build" / "scale.cu.o").is_file() and (root / "build" / "scale_binding.cpp.o").is_file()
    library = Path(result.library)
    assert library.name == "kp_kernels.so" and library.parent.parent == root / "build" / "versions"
    (kernel,) = result.resources
    assert kernel.kernel.startswith("scale_kernel(")
    assert kernel.source == "kernels/scale.cu" and kernel.registers > 0


@pytest.mark.cuda_build
def test_unchanged_workspace_recompiles_nothing_and_keeps_resources(built):
    root, first = built
    ninja_file = root / "build" / "build.ninja"
    written_at = ninja_file.stat().st_mtime_ns

    again = build_workspace(root, arch=ARCH)

    assert again.ok and again.compiled == [] and not again.linked
    assert again.library == first.library
    assert again.resources == first.resources  # from the per-source cache: ptxas did not run
    assert ninja_file.stat().st_mtime_ns == written_at


@pytest.mark.cuda_build
def test_edited_cu_recompiles_only_it_and_relinks_to_a_new_version(built):
    root, first = built
    edit(root / "kernels" / "scale.cu", "x[i] * a;", "a * x[i];")

    result = build_workspace(root, arch=ARCH)

    assert result.ok, result.log
    assert result.compiled == ["kernels/scale.cu"]
    assert result.linked
    assert result.library != first.library
    assert Path(first.library).is_file()  # older versions stay loadable


@pytest.mark.cuda_build
def test_header_change_recompiles_only_its_dependents(built):
    root, _ = built
    edit(root / "kernels" / "tuning.h", "kThreads = 256", "kThreads = 128")

    result = build_workspace(root, arch=ARCH)

    assert result.ok, result.log
    assert result.compiled == ["kernels/scale.cu"]  # the binding does not include tuning.h


@pytest.mark.cuda_build
def test_edited_binding_recompiles_only_the_binding(built):
    root, _ = built
    binding = root / "kernels" / "scale_binding.cpp"
    edit(binding, 'm.def("scale", &scale);', 'm.def("scale(Tensor x, float a) -> Tensor", &scale);')

    result = build_workspace(root, arch=ARCH)

    assert result.ok, result.log
    assert result.compiled == ["kernels/scale_binding.cpp"]
    assert result.linked


@pytest.mark.cuda_build
def test_lost_resource_cache_recompiles_the_cu_to_report_it_again(built):
    root, _ = built
    (root / "build" / "resources" / "scale.cu.json").unlink()
    reused = build_workspace(root, arch=ARCH)  # the version of these sources keeps its own report
    assert reused.reused and [k.source for k in reused.resources] == ["kernels/scale.cu"]
    for record in (root / "build" / "versions").glob(f"*/{SOURCES_RECORD}"):
        record.unlink()

    result = build_workspace(root, arch=ARCH)

    assert result.compiled == ["kernels/scale.cu"]
    assert [k.source for k in result.resources] == ["kernels/scale.cu"]


@pytest.mark.cuda_build
def test_compile_error_is_a_result_pointing_at_file_and_line_and_a_fix_recovers(built):
    root, _ = built
    cu = root / "kernels" / "scale.cu"
    good = cu.read_text()
    lines = good.splitlines()
    store = next(number for number, line in enumerate(lines) if "y[i] =" in line)
    lines[store] = lines[store].rstrip(";")  # nvcc reports the missing ";" at the next line's token
    cu.write_text("\n".join(lines) + "\n")
    try:
        failed = build_workspace(root, arch=ARCH)
    finally:
        cu.write_text(good)

    assert not failed.ok and failed.library is None
    (error,) = [d for d in failed.diagnostics if d.severity == "error" and d.tool == "nvcc"]
    assert (error.file, error.line) == ("kernels/scale.cu", store + 2)
    assert failed.error.startswith("1 error in kernels/scale.cu (first: scale.cu:")
    assert "FAILED" in failed.log

    recovered = build_workspace(root, arch=ARCH)  # the sources of the last good build: that build, compiled again
    assert recovered.ok and recovered.reused and recovered.compiled == [] and Path(recovered.library).is_file()


@pytest.mark.cuda_build
def test_sources_built_before_are_that_build_with_nothing_compiled(built):
    """The policy tries configurations and writes the fastest back: that content was built a few builds ago."""
    root, _ = built
    cu = root / "kernels" / "scale.cu"
    first = build_workspace(root, arch=ARCH)
    original = cu.read_text()
    edit(cu, "if (i < n)", "if (i < n && a == a)")
    other = build_workspace(root, arch=ARCH)
    assert other.ok and other.compiled == ["kernels/scale.cu"] and other.library != first.library
    cu.write_text(original)

    back = build_workspace(root, arch=ARCH)

    assert back.ok and back.reused and back.compiled == [] and not back.linked
    assert back.library == first.library and back.resources == first.resources
    assert "Build ok" in build_text(back) and "that build is reused" in build_text(back)
    from rich.console import Console

    console = Console(record=True, width=200)
    render_build(console, back)
    assert f"these sources were built before: reused versions/{Path(first.library).parent.name}" in console.export_text()
    # It is the newest build again (what model_new.py loads), and the next edit compiles as ever.
    from kernelpilot.ops import _newest_library

    assert _newest_library(root) == Path(first.library)
    edit(cu, "if (i < n)", "if (i < n && a == a)")
    assert build_workspace(root, arch=ARCH).library == other.library
    cu.write_text(original)
    assert build_workspace(root, arch=ARCH).library == first.library


@pytest.mark.cuda_build
def test_an_unreadable_record_or_another_file_under_kernels_builds_again(built):
    """A version's record names its sources by a key of build.ninja and every file under kernels/; a version
    whose record is unreadable is not reused."""
    root, _ = built
    first = build_workspace(root, arch=ARCH)
    version = Path(first.library).parent
    cu = root / "kernels" / "scale.cu"
    original = cu.read_text()
    edit(cu, "if (i < n)", "if (n > i)")
    assert not build_workspace(root, arch=ARCH).reused
    cu.write_text(original)
    (version / SOURCES_RECORD).write_text("{not json")
    again = build_workspace(root, arch=ARCH)
    assert again.ok and not again.reused and again.compiled == ["kernels/scale.cu"]
    (root / "kernels" / "notes.txt").write_text("any file under kernels/ is part of the key")
    try:
        assert not build_workspace(root, arch=ARCH).reused
    finally:
        (root / "kernels" / "notes.txt").unlink()


@pytest.mark.cuda_build
def test_cli_build_json_is_a_build_result(built):
    root, _ = built

    run = CliRunner().invoke(app, ["build", str(root), "--arch", ARCH, "--json"])

    assert run.exit_code == 0, run.output
    result = from_dict(BuildResult, json.loads(run.stdout))
    assert result.ok and result.extension_name == "kp_kernels" and result.resources


@pytest.mark.cuda_build
def test_cli_build_with_a_compile_error_exits_1_with_the_diagnostics_table(built):
    root, _ = built
    binding = root / "kernels" / "scale_binding.cpp"
    good = binding.read_text()
    line = 1 + next(n for n, text in enumerate(good.splitlines()) if "torch::empty_like(x);" in text)
    binding.write_text(good.replace("torch::empty_like(x);", "torch::empty_like(x_missing);"))
    try:
        run = CliRunner().invoke(app, ["build", str(root), "--arch", ARCH], env={"COLUMNS": "200"})
    finally:
        binding.write_text(good)

    assert run.exit_code == 1
    assert "build failed" in run.stdout and "diagnostics" in run.stdout
    assert f"kernels/scale_binding.cpp:{line}" in run.stdout and "x_missing" in run.stdout


def test_cli_build_of_a_folder_without_kernels_is_one_error_line(tmp_path):
    run = CliRunner().invoke(app, ["build", str(tmp_path), "--arch", ARCH], env={"COLUMNS": "1000"})

    assert run.exit_code == 2
    error, hint = run.stderr.splitlines()
    assert error.startswith("error: ") and "has no kernels/ folder" in error
    assert hint.startswith("hint: ")


def test_build_of_a_folder_without_kernels_raises_a_workspace_error(tmp_path):
    with pytest.raises(WorkspaceError, match="has no kernels/ folder"):
        build_workspace(tmp_path, arch=ARCH)


# ------------------------------------------------------------------------------- loading builds
# Loading a build registers its ops: tests/core/test_ops.py.


def _version_module(root: Path, version: int) -> Path:
    """A torch-free C++ source whose kp_version() returns `version`: a cheap build."""
    return write(root / "kernels" / "module.cpp", f'extern "C" int kp_version() {{ return {version}; }}\n')


def test_loading_a_failed_build_is_a_build_error():
    failed = BuildResult(ok=False, workspace="ws", extension_name="kp_kernels", arch=ARCH, error="1 error")
    with pytest.raises(BuildError, match="the build failed"):
        load_extension(failed)


# ----------------------------------------------------------------- one builder at a time, old versions


def _python(code: str, *args: str) -> subprocess.Popen:
    """Run `code` in a fresh interpreter that imports this checkout's kernelpilot."""
    source_root = str(Path(build.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source_root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], env=env, stdout=subprocess.PIPE, text=True
    )


HOLD_LOCK = """
    import sys, time
    from pathlib import Path
    from kernelpilot.build import build_lock

    build_dir = Path(sys.argv[1])
    with build_lock(build_dir):
        (build_dir / "held").touch()
        time.sleep(0.5)
        (build_dir / "released").touch()  # before the release: whoever gets the lock next must see it
"""


def _wait_for(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.01)


def test_a_second_builder_waits_for_the_lock_and_proceeds_after_its_release(tmp_path):
    build_dir = tmp_path / "build"
    holder = _python(HOLD_LOCK, str(build_dir))
    try:
        _wait_for(build_dir / "held")
        with build_lock(build_dir, timeout_s=30):
            assert (build_dir / "released").exists()
    finally:
        holder.wait(timeout=30)
    assert holder.returncode == 0


def test_a_lock_held_past_the_timeout_is_one_sentence_with_a_hint(tmp_path):
    build_dir = tmp_path / "build"
    # flock locks belong to an open file, so a second opening in this process contends like another process.
    with build_lock(build_dir), pytest.raises(BuildError) as raised:
        with build_lock(build_dir, timeout_s=0.2):
            pytest.fail("the lock was taken twice")

    error = raised.value
    assert str(error).startswith("Waited 0.2 s for another build of this workspace to release")
    assert "does not say which process holds it" in str(error)
    assert "stop it" in error.hint and "do not delete the lock file" in error.hint
    with build_lock(build_dir, timeout_s=0.2):  # released by its holder, free again
        pass


def _versions(versions_dir: Path, count: int) -> list[Path]:
    """`count` version folders, oldest first, one second apart in modification time."""
    folders = []
    for index in range(count):
        folder = versions_dir / f"{index:016x}"
        (folder / "kp_kernels.so").parent.mkdir(parents=True)
        (folder / "kp_kernels.so").write_bytes(b"library %d" % index)
        os.utime(folder, (1_000_000 + index, 1_000_000 + index))
        folders.append(folder)
    return folders


def test_pruning_keeps_the_newest_versions_and_the_pinned_and_leaves_other_files(tmp_path):
    versions_dir = tmp_path / "build" / "versions"
    folders = _versions(versions_dir, 12)
    not_a_version = [
        versions_dir / "notes.txt", versions_dir / "by-hand" / "kp_kernels.so", tmp_path / "build" / "kp_kernels.so"
    ]
    for path in not_a_version:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("not a version")

    deleted = prune_versions(versions_dir, keep=3, pinned=[folders[1]])

    kept = [folders[1], *folders[-3:]]
    assert sorted(deleted) == sorted(set(folders) - set(kept))
    assert sorted(path for path in versions_dir.iterdir() if path.name in {f.name for f in folders}) == kept
    assert all(path.is_file() for path in not_a_version)


def test_publishing_an_older_library_again_makes_its_version_the_newest(tmp_path):
    build_dir = tmp_path / "build"
    library = build_dir / "kp_kernels.so"
    library.parent.mkdir()
    library.write_bytes(b"first")
    first = publish_version(build_dir)
    os.utime(first.parent, (1_000_000, 1_000_000))
    library.write_bytes(b"second")
    second = publish_version(build_dir)
    library.write_bytes(b"first")  # the source edit undone: the same content, the same version folder

    assert publish_version(build_dir) == first
    assert prune_versions(build_dir / "versions", keep=1) == [second.parent]


BUILD_AND_PRINT = """
    import json, sys
    from kernelpilot.build import build_workspace
    from kernelpilot.results import to_dict

    print(json.dumps(to_dict(build_workspace(sys.argv[1], arch=sys.argv[2]))))
"""


@pytest.mark.cuda_build
def test_two_processes_building_one_workspace_compile_it_once(tmp_path):
    _version_module(tmp_path, 1)

    builders = [_python(BUILD_AND_PRINT, str(tmp_path), ARCH) for _ in range(2)]
    results = [from_dict(BuildResult, json.loads(builder.communicate(timeout=300)[0])) for builder in builders]

    assert all(result.ok for result in results), [result.log for result in results]
    assert sorted(result.compiled for result in results) == [[], ["kernels/module.cpp"]]
    assert results[0].library == results[1].library


# ------------------------------------------------------------------------- the scaffolded workspace


@pytest.fixture(scope="module")
def scaffolded(tmp_path_factory) -> Path:
    from kernelpilot.workspace import init_workspace

    ws, _ = init_workspace(REPO_ROOT / "examples" / "silu_scale_shift.py", tmp_path_factory.mktemp("init") / "kp-ws")
    return ws.root


@pytest.mark.cuda_build
def test_scaffolded_workspace_builds(scaffolded):
    result = build_workspace(scaffolded, arch=ARCH)

    assert result.ok, result.log
    assert set(result.compiled) == {
        "kernels/example_scale_shift.cu", "kernels/example_scale_shift_binding.cpp", "kernels/kp_module.cpp"
    }
    assert [k.source for k in result.resources] == ["kernels/example_scale_shift.cu"]
    assert not [d for d in result.diagnostics if d.severity in ("error", "warning")]


@pytest.mark.gpu
def test_scaffolded_example_runs_and_an_edited_build_loads_in_the_same_process(scaffolded):
    import torch

    first = build_workspace(scaffolded)
    assert first.ok, first.log
    first_ops = load_extension(first)
    x = torch.randn(1000, 1003, device="cuda")  # odd size: the vector loop and the scalar tail both run
    torch.testing.assert_close(first_ops.scale_shift(x, 1.5, -0.25), x * 1.5 - 0.25)

    edit(scaffolded / "kernels" / "example_scale_shift.cu", "vector_count, a, b);", "vector_count, a, b + 1.0f);")
    second = build_workspace(scaffolded)
    assert second.ok, second.log
    assert second.compiled == ["kernels/example_scale_shift.cu"]
    second_ops = load_extension(second)

    torch.testing.assert_close(second_ops.scale_shift(x, 1.5, -0.25), x * 1.5 + 0.75)
    torch.testing.assert_close(first_ops.scale_shift(x, 1.5, -0.25), x * 1.5 - 0.25)  # still the old build
