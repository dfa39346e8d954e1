"""Build qcoll: setuptools drives CMake, which compiles the C++ core, the CUDA kernels
when nvcc is found, and the pybind11 module `qcoll._C`. torch is never a build
requirement.

Environment knobs (all optional):
  QCOLL_CUDA=AUTO|ON|OFF     build the CUDA kernels (default AUTO: when nvcc is found)
  QCOLL_CUDA_ARCHS="80;90"   SM architectures
  QCOLL_BUILD_TYPE=Release   CMake build type
  QCOLL_BUILD_JOBS=N         parallel compile jobs
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "python/qcoll/_version.py").read_text()).group(1)


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        import pybind11

        cfg = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('QCOLL_BUILD_TYPE', 'Release')}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DQCOLL_VERSION={VERSION}",
            f"-DQCOLL_CUDA={os.environ.get('QCOLL_CUDA', 'AUTO')}",
        ]
        if "QCOLL_CUDA_ARCHS" in os.environ:
            cfg.append(f"-DQCOLL_CUDA_ARCHS={os.environ['QCOLL_CUDA_ARCHS']}")
        ninja = shutil.which("ninja")
        if ninja:
            # Named explicitly: a cache from an earlier isolated build env points at a ninja
            # that no longer exists.
            cfg += ["-GNinja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        jobs = os.environ.get("QCOLL_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.run(["cmake", str(ROOT), *cfg], cwd=build_dir, check=True)
        subprocess.run(["cmake", "--build", ".", "--parallel", jobs], cwd=build_dir, check=True)


setup(
    name="qcoll",
    version=VERSION,
    description="Quantized collectives for sharded data-parallel training (ZeRO++ style)",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[CMakeExtension("qcoll._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    zip_safe=False,
)
