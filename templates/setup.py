"""Build this workspace's kernels/*.cu and kernels/*.cpp into the extension `kp_kernels` (protected: do not edit).

    pip install --no-build-isolation .        # or: python setup.py build_ext --inplace

`--no-build-isolation` lets the build use the torch already installed (an isolated build would have none).
`kernelpilot build` builds the same extension incrementally and faster; this file lets the kernels be
built and used without kernelpilot.
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
