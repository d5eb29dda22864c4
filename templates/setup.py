"""Build this workspace's kernels/*.cu and kernels/*.cpp into the library `kp_kernels` (protected: do not edit).

    python setup.py build_ext --inplace

`kernelpilot build` builds the same library incrementally and faster; this file builds it with setuptools alone.
The library holds the kernels as torch custom operators: model_new.py imported on its own registers the newest
of this build and `kernelpilot build`'s (`workspace_ops(__file__)`).
"""

from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

HERE = Path(__file__).resolve().parent
KERNELS = HERE / "kernels"
# Relative paths: setuptools refuses absolute source paths in a project being installed.
SOURCES = sorted(str(p.relative_to(HERE)) for p in [*KERNELS.glob("*.cu"), *KERNELS.glob("*.cpp")])

setup(
    name="kp_kernels",
    version="0.0.0",
    ext_modules=[CUDAExtension(name="kp_kernels", sources=SOURCES, include_dirs=[str(KERNELS)])],
    cmdclass={"build_ext": BuildExtension},
)
