"""Builds the pybind11 extensions flowcheck._native and flowcheck._mirror; everything else is in pyproject.toml."""
from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# flowcheck._mirror is one translation unit per part of the packet path (native/mirror/): compile them side by side
# (NPY_NUM_BUILD_JOBS caps the jobs; default: one per CPU)
ParallelCompile("NPY_NUM_BUILD_JOBS").install()

setup(
    ext_modules=[
        Pybind11Extension(
            "flowcheck._native",
            ["native/flowcheck_native.cpp"],
            depends=sorted(glob("native/*.hpp") + glob("native/third_party/**/*.h", recursive=True)),
            cxx_std=17,
            extra_compile_args=["-O3"],
        ),
        Pybind11Extension(
            "flowcheck._mirror",
            sorted(glob("native/mirror/*.cpp")),
            depends=sorted(glob("native/mirror/*.hpp")) + ["native/joined.hpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        ),
    ],
    cmdclass={"build_ext": build_ext},
)
