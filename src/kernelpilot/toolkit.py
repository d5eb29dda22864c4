"""Where the CUDA toolkit is: $CUDA_HOME or $CUDA_PATH, /usr/local/cuda, or the toolkit of the `nvcc` on PATH (through
a wrapper script too). The build compiles with it and the compiler's output is demangled with its cu++filt."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from kernelpilot.errors import BuildError


def resolve_cuda_home() -> Path:
    """The CUDA toolkit root: $CUDA_HOME/$CUDA_PATH, else /usr/local/cuda, else the toolkit of `nvcc` on PATH."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(variable)
        if value:
            if not (Path(value) / "bin" / "nvcc").is_file():
                raise BuildError(
                    f"{variable}={value} is not a CUDA toolkit (it has no bin/nvcc).",
                    hint=f"point {variable} at the folder holding bin/nvcc, e.g. /usr/local/cuda-13.0",
                )
            return Path(value)
    default = Path("/usr/local/cuda")
    if (default / "bin" / "nvcc").is_file():
        return default
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise BuildError(
            "No CUDA toolkit found: CUDA_HOME is unset, /usr/local/cuda does not exist and nvcc is not on PATH.",
            hint="install the CUDA toolkit and set CUDA_HOME to its root, e.g. export CUDA_HOME=/usr/local/cuda-13.0",
        )
    return _toolkit_of(Path(nvcc))


def _toolkit_of(nvcc: Path) -> Path:
    """The toolkit an `nvcc` belongs to, even when it is a wrapper script that execs the real one elsewhere."""
    real = nvcc.resolve()
    if (real.parent.parent / "include" / "cuda_runtime.h").is_file():
        return real.parent.parent
    # A wrapper script's own folder says nothing; nvcc's dry run prints where the real driver lives.
    dry_run = subprocess.run(
        [str(nvcc), "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True, check=False
    )
    found = re.search(r"^#\$ _HERE_=(.+)$", dry_run.stderr + dry_run.stdout, re.MULTILINE)
    if found is None:
        raise BuildError(
            f"Cannot tell which CUDA toolkit {nvcc} belongs to.",
            hint="set CUDA_HOME to the toolkit root, e.g. export CUDA_HOME=/usr/local/cuda-13.0",
        )
    return Path(found.group(1).strip()).parent
