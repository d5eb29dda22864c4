"""Incremental build of a workspace's extension: our own build.ninja with cpp_extension's flags, run by ninja.

Why not `torch.utils.cpp_extension.load`: its versioner renames the extension (`name_v1`, `name_v2`, ...) on
every change, and with it `-DTORCH_EXTENSION_NAME`, which invalidates every object. Here the library is always
`kp_kernels.so` and nothing about a build is compiled in (the ops' torch namespace is given at load time), each
source has its own object with a depfile, so a one-file edit recompiles one file. Each linked library is copied
to `build/versions/<content hash>/`, a new path per build, so one long-lived process can load build after build
(`load_extension`). Compiler output becomes `Diagnostic`s and `-Xptxas -v` output becomes
`KernelResources`, cached per source so every build reports the resources of all kernels. A source that
includes cublasLt.h (cudnn.h) gets cuBLASLt's (cuDNN's) headers, and the library links it, from the CUDA toolkit
or from the nvidia pip packages torch depends on; other builds are unchanged. One builder at a time works in a build folder
(`build_lock`). The versions, their pruning and the builds of sources built before are `build_versions.py`'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kernelpilot.build_objects import drop_unrecorded, object_name, record_compiled
from kernelpilot.build_versions import (Cache, prune_versions, publish_version, record_sources, reused_version,
                                       sources_key)
from kernelpilot.errors import BuildError, WorkspaceError
from kernelpilot.compiler_output import EdgeLog, edge_logs, parse_diagnostics, parse_ptxas
from kernelpilot.pch import include_flags
from kernelpilot.results import BuildResult, Diagnostic, KernelResources, from_dict, to_dict
from kernelpilot.toolkit import resolve_cuda_home
from kernelpilot.workspace import EXTENSION_NAME, Workspace
from kernelpilot.workspace_files import is_plain_file, open_to_append, write_file

NINJA_STATUS = "[kp %f/%t] "  # a prefix no compiler prints, so each edge's log block can be found

_ARCH_HINT = "say which GPU to build for, e.g. --arch 9.0 (H100) or TORCH_CUDA_ARCH_LIST=9.0"
# For callers with no --arch option (eval, watch, accept, check: the judge builds for them).
_ARCH_ENV_HINT = "Say which GPU to build for, e.g. export TORCH_CUDA_ARCH_LIST=9.0 (H100)."

BUILD_LOCK_NAME = "build.lock"
LOCK_TIMEOUT_S = 600.0  # generous: a cold build of a few bindings takes about a minute on two cores

# ------------------------------------------------------------------------------------------ toolchain


def resolve_arch(arch: str | None, *, arch_option: bool = True) -> str:
    """The compute capability to build for as "major.minor" (suffix kept: "9.0a"), from --arch, the env, or the GPU.

    `arch_option=False` words the error for a caller that has no --arch option to suggest.
    """
    if arch:
        return _normalize_arch(arch, origin="--arch")
    listed = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split()
    if listed:
        return _normalize_arch(listed[0].removesuffix("+PTX"), origin="TORCH_CUDA_ARCH_LIST")
    capability = _visible_gpu_capability()
    if capability is None:
        if not arch_option:
            raise BuildError("No GPU is visible and TORCH_CUDA_ARCH_LIST is not set, so there is no CUDA architecture "
                             "to build for.", hint=_ARCH_ENV_HINT)  # fmt: skip
        raise BuildError("No GPU visible and no --arch or TORCH_CUDA_ARCH_LIST given.", hint=_ARCH_HINT)
    return f"{capability[0]}.{capability[1]}"


def _normalize_arch(text: str, origin: str) -> str:
    spelled = re.fullmatch(r"(?:sm_|compute_)?(\d+)\.?(\d)([af]?)", text.strip().lower())
    if spelled is None:
        raise BuildError(f"{origin} value {text!r} is not a CUDA architecture.", hint=_ARCH_HINT)
    major, minor, suffix = spelled.groups()
    return f"{major}.{minor}{suffix}"


def _visible_gpu_capability() -> tuple[int, int] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def _gencode(arch: str) -> str:
    """The nvcc target for an arch: 9.0 -> compute_90 and sm_90 (an "a"/"f" feature suffix is kept in both)."""
    number = arch.replace(".", "")
    return f"-gencode=arch=compute_{number},code=sm_{number}"


@dataclass(frozen=True)
class Toolchain:
    """The programs a build runs."""

    cuda_home: Path
    nvcc: Path
    cxx: str
    ninja: str


def find_toolchain() -> Toolchain:
    cuda_home = resolve_cuda_home()
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise BuildError(f"The C++ compiler {cxx!r} is not on PATH.", hint="install g++ or set CXX to a C++ compiler")
    return Toolchain(cuda_home=cuda_home, nvcc=cuda_home / "bin" / "nvcc", cxx=cxx, ninja=_find_ninja())


def _find_ninja() -> str:
    try:
        import ninja

        bundled = Path(ninja.BIN_DIR) / "ninja"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    on_path = shutil.which("ninja")
    if on_path is None:
        raise BuildError("ninja is not installed.", hint="pip install ninja")
    return on_path


# --------------------------------------------------------------------------------- cuBLASLt and cuDNN


@dataclass(frozen=True)
class _Library:
    """A library kernels may call, by the header that marks a source calling it: where its header and shared
    library are found, and how the error names it when they are not."""

    name: str  # "cuBLASLt"
    header: str  # "cublasLt.h"
    stem: str  # "libcublasLt.so": the unversioned name; libcublasLt.so.<major> will do
    hint: str

    def included_by(self, source: Path) -> bool:
        pattern = rf'^\s*#\s*include\s*[<"]{re.escape(self.header)}[>"]'
        return re.search(pattern, source.read_text(errors="replace"), re.MULTILINE) is not None


CUBLASLT = _Library("cuBLASLt", "cublasLt.h", "libcublasLt.so",
                    "install a CUDA toolkit with cuBLAS and point CUDA_HOME at it, or pip install the nvidia cuBLAS "
                    "wheel of your torch's CUDA version")  # fmt: skip
CUDNN = _Library("cuDNN", "cudnn.h", "libcudnn.so",
                 "install cuDNN into the CUDA toolkit CUDA_HOME points at, or pip install the nvidia-cudnn wheel of "
                 "your torch's CUDA version (torch's CUDA wheels depend on it)")  # fmt: skip
LIBRARIES = (CUBLASLT, CUDNN)


@dataclass(frozen=True)
class _FoundLibrary:
    """Where a library's header and shared library are."""

    include_dir: Path
    library: Path


def find_library(library: _Library, cuda_home: Path) -> _FoundLibrary:
    """The library from the toolkit (include/, lib64/ or lib/), else from the nvidia pip packages (nvidia/*/include,
    lib/: torch's CUDA wheels bring them there, often with only the versioned lib<name>.so.<major>)."""
    toolkit = [(cuda_home / "include", cuda_home / "lib64"), (cuda_home / "include", cuda_home / "lib")]
    packages = [(folder / "include", folder / "lib") for folder in _nvidia_package_folders()]
    for include_dir, library_dir in toolkit + packages:
        shared = _shared_library(library_dir, library.stem)
        if (include_dir / library.header).is_file() and shared is not None:
            return _FoundLibrary(include_dir, shared)
    raise BuildError(
        f"A kernel includes {library.header}, but no {library.name} ({library.header} with {library.stem}) was found "
        f"under {cuda_home} or in the nvidia pip packages.",
        hint=library.hint,
    )


def find_cublaslt(cuda_home: Path) -> _FoundLibrary:
    return find_library(CUBLASLT, cuda_home)


def find_cudnn(cuda_home: Path) -> _FoundLibrary:
    return find_library(CUDNN, cuda_home)


def _nvidia_package_folders() -> list[Path]:
    """The folders of the `nvidia` namespace package (nvidia/cu13, nvidia/cublas, ...), if it is installed."""
    try:
        import nvidia
    except ImportError:
        return []
    return sorted(folder for root in nvidia.__path__ for folder in Path(root).iterdir() if folder.is_dir())


def _shared_library(folder: Path, stem: str) -> Path | None:
    """`stem` (libcublasLt.so), else the newest versioned `stem`.<major> in `folder`."""
    if (folder / stem).is_file():
        return folder / stem
    versioned = [path for path in folder.glob(f"{stem}.*") if path.suffix.lstrip(".").isdigit()]
    return max(versioned, key=lambda path: int(path.suffix.lstrip(".")), default=None)


def _library_link_flags(found: _FoundLibrary) -> list[str]:
    # The full path: a folder with only libcublasLt.so.13 has nothing -lcublasLt would find.
    return [str(found.library), f"-Wl,-rpath,{found.library.parent}"]


# -------------------------------------------------------------------------------------------- flags


@dataclass(frozen=True)
class _TorchFlags:
    """What torch says an extension needs: headers, libraries, ABI defines, nvcc defaults."""

    include_dirs: tuple[str, ...]
    library_dir: str
    abi_defines: tuple[str, ...]
    common_nvcc_flags: tuple[str, ...]


@functools.cache
def _torch_flags() -> _TorchFlags:
    import torch

    if torch.version.cuda is None:
        raise BuildError(
            f"The installed torch {torch.__version__} is a CPU build, which cannot build CUDA extensions.",
            hint="install a CUDA build of torch, e.g. pip install torch --index-url https://download.pytorch.org/whl/cu130",
        )
    with _quiet_logger("torch.utils.cpp_extension"):  # it warns about its own CUDA_HOME guess, which we don't use
        from torch.utils import cpp_extension
    # Called without arguments on purpose: the keyword differs across torch versions (`cuda=True` before,
    # `device_type="cuda"` now), and the CUDA part is the toolkit cpp_extension guessed from PATH at import,
    # which a wrapper nvcc gets wrong. Torch's own paths come from here, CUDA's from resolve_cuda_home().
    include_dirs = [*cpp_extension.include_paths(), sysconfig.get_path("include", scheme="posix_prefix")]
    library_dir = cpp_extension.library_paths()[0]  # torch's lib/, first whatever the torch version
    abi = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *_pybind11_abi_flags(cpp_extension)]
    return _TorchFlags(tuple(include_dirs), library_dir, tuple(abi), tuple(cpp_extension.COMMON_NVCC_FLAGS))


def _pybind11_abi_flags(cpp_extension: types.ModuleType) -> list[str]:
    """pybind11 ABI defines matching torch's, so pybind types cross between torch and the extension."""
    helper = getattr(cpp_extension, "_get_pybind11_abi_build_flags", None)
    if helper is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return list(helper())
    import torch

    flags = []
    for part in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):
        value = getattr(torch._C, f"_PYBIND11_{part}", None)
        if value is not None:
            flags.append(f'-DPYBIND11_{part}="{value}"')
    return flags


@contextlib.contextmanager
def _quiet_logger(name: str):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# The workspace's own paths as the compilers see them, relative to the build folder ninja runs in: build.ninja then
# names nothing of where the workspace is, so a copy of it with its build folder builds nothing again (the builds
# ahead, `build_ahead.py`), and a moved workspace keeps its objects.
KERNELS_FROM_BUILD = "../kernels"


def _compile_flags(toolchain: Toolchain, torch_flags: _TorchFlags) -> list[str]:
    """Defines and include paths shared by g++ and nvcc."""
    includes = [*torch_flags.include_dirs, str(toolchain.cuda_home / "include")]
    return [
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *torch_flags.abi_defines,
        f"-I{KERNELS_FROM_BUILD}",
        *(arg for path in includes for arg in ("-isystem", path)),
    ]


def _cxx_flags(common: list[str]) -> list[str]:
    # -O1: bindings only check tensors and call a launcher; measured on a slim binding (2 cores, g++ 12):
    # -O1 11.7 s, -O2 13.2 s (median of 3).
    # C++20: torch >= 2.10 headers refuse anything older.
    return [*common, "-O1", "-fPIC", "-std=c++20"]


def _cuda_flags(common: list[str], arch: str, toolchain: Toolchain, torch_flags: _TorchFlags) -> list[str]:
    # No --use_fast_math: it changes results (denormals, division, transcendentals) and verification must
    # judge the kernel as written. -Xptxas -v feeds the resource report; -lineinfo feeds profilers.
    host = ["-ccbin", toolchain.cxx] if "CXX" in os.environ else []
    relaxed_constexpr = [] if "--expt-relaxed-constexpr" in torch_flags.common_nvcc_flags else ["--expt-relaxed-constexpr"]
    return [
        *host,
        *common,
        *torch_flags.common_nvcc_flags,
        *relaxed_constexpr,
        "-O3",
        "-lineinfo",
        "-Xptxas",
        "-v",
        _gencode(arch),
        "-std=c++20",
        "-Xcompiler",
        "-fPIC",
    ]


def _link_flags(toolchain: Toolchain, torch_flags: _TorchFlags) -> list[str]:
    cuda_lib = toolchain.cuda_home / "lib64"
    if not cuda_lib.is_dir():
        cuda_lib = toolchain.cuda_home / "lib"
    torch_libs = ["-lc10", "-lc10_cuda", "-ltorch_cpu", "-ltorch_cuda", "-ltorch", "-ltorch_python"]
    return [
        "-shared",
        f"-L{torch_flags.library_dir}",
        *torch_libs,
        f"-L{cuda_lib}",
        "-lcudart",
        # Lets the library resolve torch's libraries even when loaded before `import torch`.
        f"-Wl,-rpath,{torch_flags.library_dir}",
    ]


# --------------------------------------------------------------------------------------- build.ninja


def kernel_sources(ws: Workspace) -> list[Path]:
    """What to compile; any folder with kernels/ will do (no manifest needed), so tests and scripts can build."""
    if not ws.root.is_dir():
        raise WorkspaceError(
            f"{ws.root} does not exist.", hint="Pass the folder `kernelpilot init PROBLEM.py` made (see its --dir)."
        )
    if not ws.kernels_dir.is_dir():
        raise WorkspaceError(
            f"{ws.root} has no kernels/ folder, so it is not a kernelpilot workspace.",
            hint="create one with `kernelpilot init PROBLEM.py`, or pass the workspace folder",
        )
    sources = ws.kernel_sources()
    if not sources:
        raise WorkspaceError(
            f"{ws.kernels_dir} holds no .cu or .cpp file to build.", hint="add kernels/<name>.cu and its binding"
        )
    _check_build_folder(ws)
    return sources


def _check_build_folder(ws: Workspace) -> None:
    """Refuse a build folder that is a link or leads out of the workspace: a builder (the judge's worker is not
    confined) would write its objects and libraries wherever it leads, and whoever wrote the workspace chose where.
    (Every write of a build refuses such a link too, `workspace_files.py`; this says so before anything is built.)"""
    for folder in (ws.build_dir, ws.build_dir / "versions", ws.build_dir / "resources"):
        if folder.is_symlink() or (folder.exists() and not folder.resolve().is_relative_to(ws.root.resolve())):
            raise WorkspaceError(f"{folder} is a link, so a build would write wherever it leads.",
                                 hint=f"remove it (rm {folder}); the next build makes a folder there")  # fmt: skip


def _from_build(root: Path, source: Path) -> str:
    """kernels/foo.cu as the build folder sees it: ../kernels/foo.cu."""
    return f"{KERNELS_FROM_BUILD}/{source.relative_to(root / 'kernels').as_posix()}"


def _ninja_path(path: str) -> str:
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _ninja_value(args: list[str]) -> str:
    return shlex.join(args).replace("$", "$$")


def render_ninja(root: Path, sources: list[Path], toolchain: Toolchain, arch: str) -> str:
    torch_flags = _torch_flags()
    common = _compile_flags(toolchain, torch_flags)
    # The libraries each source calls (by the headers it includes), found once per build.
    callers = {library: [source for source in sources if library.included_by(source)] for library in LIBRARIES}
    found = {library: find_library(library, toolchain.cuda_home) for library in LIBRARIES if callers[library]}
    link_flags = _link_flags(toolchain, torch_flags) + [flag for lib in found.values() for flag in _library_link_flags(lib)]
    # torch's headers precompiled once for every workspace (pch.py), with the flags minus this workspace's -I.
    pch = include_flags(toolchain.cxx, [f for f in _cxx_flags(common) if f != f"-I{KERNELS_FROM_BUILD}"], sources)
    lines = [
        "# Written by kernelpilot's build.py; rewritten only when its content changes.",
        "ninja_required_version = 1.3",
        f"cxx = {_ninja_value([toolchain.cxx])}",
        f"nvcc = {_ninja_value([str(toolchain.nvcc)])}",
        f"cxx_flags = {_ninja_value(_cxx_flags(common) + pch)}",
        f"cuda_flags = {_ninja_value(_cuda_flags(common, arch, toolchain, torch_flags))}",
        f"link_flags = {_ninja_value(link_flags)}",
        "",
        "rule compile_cxx",
        "  command = $cxx -MMD -MF $out.d $cxx_flags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = compile $source",
        "",
        "rule compile_cuda",
        "  command = $nvcc --generate-dependencies-with-compile --dependency-output $out.d $cuda_flags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = compile $source",
        "",
        "rule link",
        "  command = $cxx $in $link_flags -o $out",
        "  description = link $out",
        "",
    ]
    objects = []
    for source in sources:
        rule = "compile_cuda" if source.suffix == ".cu" else "compile_cxx"
        objects.append(_ninja_path(object_name(source)))
        lines.append(f"build {objects[-1]}: {rule} {_ninja_path(_from_build(root, source))}")
        lines.append(f"  source = {source.relative_to(root).as_posix().replace('$', '$$')}")
        includes = [str(found[lib].include_dir) for lib in found if source in callers[lib]]
        if includes:
            # Only these edges see the libraries' headers (after the toolkit's, so its CUDA headers win): the
            # commands of all other edges stay as they were, and so do their objects.
            with_library = [*common, *(flag for folder in includes for flag in ("-isystem", folder))]
            cxx = _cxx_flags(with_library) + pch
            flags = _cuda_flags(with_library, arch, toolchain, torch_flags) if source.suffix == ".cu" else cxx
            lines.append(f"  {'cuda' if source.suffix == '.cu' else 'cxx'}_flags = {_ninja_value(flags)}")
    library = f"{EXTENSION_NAME}.so"
    # The linked libraries are implicit inputs: a different library file relinks.
    implicit = "".join(f" {_ninja_path(str(lib.library))}" for lib in found.values())
    implicit = f" |{implicit}" if implicit else ""
    lines += ["", f"build {library}: link {' '.join(objects)}{implicit}", f"default {library}", ""]
    return "\n".join(lines)


def _write_if_changed(path: Path, text: str, within: Path) -> bool:
    """Write `text` unless the file already holds it (ninja rebuilds edges whose command changed); a link there is
    replaced, never written through (`workspace_files.py`)."""
    if is_plain_file(path) and path.read_text(errors="replace") == text:
        return False
    write_file(path, text, within)
    return True


# ---------------------------------------------------------------------------------------- running


def _run_ninja(build_dir: Path, ninja: str, jobs: int, verbose: bool) -> tuple[int, str]:
    """Run ninja in `build_dir`; return its exit code and its whole output (streamed to stderr when verbose)."""
    env = {**os.environ, "NINJA_STATUS": NINJA_STATUS, "LC_ALL": "C"}  # C locale: plain quotes in gcc messages
    process = subprocess.Popen(
        [ninja, "-C", str(build_dir), "-j", str(jobs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=env,
    )
    lines = []
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        if verbose:
            sys.stderr.write(line)
    return process.wait(), "".join(lines)


def _drop_objects_without_resources(build_dir: Path, sources: list[Path]) -> None:
    """ptxas reports only on a compile, so a .cu whose report is missing is recompiled to get it back."""
    for source in sources:
        if source.suffix == ".cu" and not _resources_file(build_dir, source).is_file():
            (build_dir / object_name(source)).unlink(missing_ok=True)


def _resources_file(build_dir: Path, source: Path) -> Path:
    return build_dir / "resources" / f"{source.name}.json"


def _save_resources(root: Path, build_dir: Path, edges: list[EdgeLog]) -> None:
    """Cache the ptxas report of each .cu compiled by this build."""
    for edge in edges:
        if edge.action != "compile" or edge.failed or not edge.subject.endswith(".cu"):
            continue
        path = _resources_file(build_dir, root / edge.subject)
        write_file(path, json.dumps(to_dict(parse_ptxas(edge.text, source=edge.subject)), indent=1), root)


def _load_resources(build_dir: Path, sources: list[Path]) -> list[KernelResources]:
    resources = []
    for source in sources:
        path = _resources_file(build_dir, source)
        if source.suffix == ".cu" and is_plain_file(path):
            resources += [from_dict(KernelResources, item) for item in json.loads(path.read_text())]
    return resources


def build_workspace(
    root: Path,
    *,
    arch: str | None = None,
    jobs: int | None = None,
    verbose: bool = False,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
    cache: Cache = None,
) -> BuildResult:
    """Build `root/kernels/*` into `root/build/kp_kernels.so`, recompiling only what changed.

    A build waits up to `lock_timeout_s` for another one of the same workspace to finish, then finds its work
    done. `cache` holds the signed records of the versions built (`build_versions.py`; None: the default cache
    folder). A compile error is not an exception: the result has ok=False, the diagnostics and the log. A missing
    toolchain, a folder that is not a workspace, or a lock wait that times out raises a KernelpilotError.
    """
    started = time.perf_counter()
    ws = Workspace(Path(root).resolve())
    sources = kernel_sources(ws)
    arch = resolve_arch(arch)
    toolchain = find_toolchain()
    with build_lock(ws.build_dir, timeout_s=lock_timeout_s):
        result = build_locked(ws.root, ws.build_dir, sources, arch, toolchain, jobs or os.cpu_count() or 1, verbose,
                              cache=cache)  # fmt: skip
    result.seconds = round(time.perf_counter() - started, 3)
    return result


def build_locked(
    root: Path, build_dir: Path, sources: list[Path], arch: str, toolchain: Toolchain, jobs: int, verbose: bool,
    *, reuse: bool = True, cache: Cache = None,
) -> BuildResult:
    """Write build.ninja, run ninja, publish the library and prune old versions; the caller holds the build lock.
    Sources a kept version was built from are not compiled again: that version is the build (with `reuse`; without,
    ninja brings the build folder's objects up to date all the same)."""
    ninja_text = render_ninja(root, sources, toolchain, arch)
    _write_if_changed(build_dir / "build.ninja", ninja_text, root)
    key = sources_key(root, ninja_text)
    reused = reused_version(root, build_dir, key, arch, cache) if key is not None and reuse else None
    if reused is not None:
        return reused
    drop_unrecorded(root, build_dir, sources, cache)  # what the workspace's writer put in the build folder
    _drop_objects_without_resources(build_dir, sources)

    returncode, log = _run_ninja(build_dir, toolchain.ninja, jobs, verbose)
    edges = edge_logs(log)
    _save_resources(root, build_dir, edges)
    compiled = [e.subject for e in edges if e.action == "compile" and not e.failed and e.subject]
    record_compiled(root, build_dir, toolchain.ninja, compiled, cache)
    diagnostics = [_relative_to(root, build_dir, d) for d in parse_diagnostics(log)]
    ok = returncode == 0
    library = publish_version(build_dir) if ok else None
    resources = _load_resources(build_dir, sources)
    if library is not None:
        if key is not None:
            record_sources(library.parent, key, resources, cache)
        prune_versions(library.parent.parent, pinned=[library.parent])
    return BuildResult(
        ok=ok,
        workspace=str(root),
        extension_name=EXTENSION_NAME,
        arch=arch,
        library=str(library) if library else None,
        compiled=[e.subject for e in edges if e.action == "compile"],
        linked=any(e.action == "link" and not e.failed for e in edges),
        diagnostics=diagnostics,
        resources=resources,
        log=log,
        error=None if ok else _failure_summary(diagnostics),
    )


def _relative_to(root: Path, build_dir: Path, diagnostic: Diagnostic) -> Diagnostic:
    """Paths inside the workspace shown as kernels/foo.cu, rather than absolute or relative to the build folder (the
    compilers' working folder)."""
    if diagnostic.file:
        with contextlib.suppress(ValueError, OSError):
            diagnostic.file = (build_dir / diagnostic.file).resolve().relative_to(root.resolve()).as_posix()
    return diagnostic


def _failure_summary(diagnostics: list[Diagnostic]) -> str:
    """One sentence: how many errors, where, and the first one."""
    errors = [d for d in diagnostics if d.severity == "error" and d.tool != "ninja"]
    errors = errors or [d for d in diagnostics if d.severity == "error"]
    if not errors:
        return "The build failed without a compiler message; see the log."
    files = list(dict.fromkeys(d.file for d in errors if d.file))
    first = errors[0]
    where = f"{Path(first.file).name}:{first.line}: " if first.file and first.line else ""
    place = f" in {', '.join(files)}" if files else ""
    count = f"{len(errors)} error{'s' if len(errors) != 1 else ''}"
    return f"{count}{place} (first: {where}{first.message})"


# ------------------------------------------------------------------------------ lock and versions


@contextlib.contextmanager
def build_lock(build_dir: Path, *, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the exclusive lock of `build_dir`, waiting up to `timeout_s` for another builder to release it.

    Two ninjas in one folder would race on the same objects, .ninja_log and library. flock is advisory and
    per open file: it is released when its holder exits, however it exits, so a crashed build never leaves a
    stale lock. The lock file itself is never deleted: a builder that opened the old file and one that creates
    a new one would both hold "the" lock. A link planted in its place is deleted all the same, and a file made: the
    link is nobody's lock, and opening through it would create or open a file wherever it leads.
    """
    path = build_dir / BUILD_LOCK_NAME
    # Opened to append: opening never truncates or replaces the file someone may hold.
    with open_to_append(path, build_dir.parent) as descriptor:
        _acquire(descriptor, path, timeout_s)
        try:
            yield
        finally:
            fcntl.flock(descriptor, fcntl.LOCK_UN)


def _acquire(descriptor: int, path: Path, timeout_s: float) -> None:
    """flock(LOCK_EX) with a deadline: flock itself blocks forever, so poll it without blocking. A builder that has
    to wait says so once on stderr, so a person at `kernelpilot build` knows why nothing happens."""
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BuildError(
                f"Waited {timeout_s:g} s for another build of this workspace to release {path} "
                "(a file lock does not say which process holds it).",
                hint="wait for the other build (the agent's Compile tool, `kernelpilot watch`, another terminal) "
                "to finish, or stop it; do not delete the lock file, it is not what holds the lock",
            )
        if not announced:
            sys.stderr.write(f"waiting for another build to release {path}\n")
            announced = True
        time.sleep(min(0.1, remaining))


# ---------------------------------------------------------------------------------------- loading


def load_extension(result: BuildResult) -> types.ModuleType:
    """Load the build's versioned library and register its kernels as torch custom operators; return
    `torch.ops.<namespace>`, whose attributes are the ops.

    The workspace's model_new.py, executed next, reaches the same ops through `kernelpilot.ops.workspace_ops`. A new
    build is a new file, so it loads in the same process beside the earlier ones, under a namespace of its own when
    the workspace's is taken (`kernelpilot.ops` says why); loading the same build again registers nothing.
    """
    if not result.ok or not result.library:
        raise BuildError(
            "There is no library to load: the build failed.", hint="fix the errors `kernelpilot build` reports"
        )
    import torch

    from kernelpilot.ops import load_library

    return getattr(torch.ops, load_library(result.library, result.workspace))
