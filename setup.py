"""Builds the pybind11 extensions flowcheck._native and flowcheck._mirror; everything else is in pyproject.toml."""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "flowcheck._native",
            ["native/flowcheck_native.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        ),
        Pybind11Extension(
            "flowcheck._mirror",
            ["native/mirror.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        ),
    ],
    cmdclass={"build_ext": build_ext},
)
