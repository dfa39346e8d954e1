"""The built modules use the shared C++ runtime and carry none of it (cmake/check_cxx_runtime.py,
run by CMake after each link). qcoll's first GPU build linked a libstdc++.a into _C: no NEEDED
libstdc++.so.6, std::ostream members defined in the module, and std::ostringstream crashed in
the first error message once torch's libstdc++ was loaded. The check itself is tested on tiny
libraries linked both ways, and so is CMakeLists.txt's remedy: the compiler's libstdc++.so
named ahead of a libstdc++.a that the search path would otherwise find first."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_cxx_runtime",
                                               ROOT / "cmake" / "check_cxx_runtime.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not shutil.which("readelf"),
                                reason="needs Linux and readelf (binutils)")
CXX = shutil.which(os.environ.get("CXX", "g++"))

FORMATS = r"""
#include <sstream>
#include <string>
extern "C" int formatted_length(long v) {
  std::ostringstream os;
  os << v << "." << v % 100;
  return static_cast<int>(os.str().size());
}
"""


@pytest.mark.parametrize("name", ["qcoll._C", "qcoll._cuda_emu", "qcoll._C_emu"])
def test_module_exports_none_of_qcolls_own_symbols(name):
    """The core is built with hidden visibility: a module's dynamic symbol table holds its
    PyInit, not qcoll's functions (which another library in the process could otherwise bind
    to or clash with)."""
    path = _installed(name)
    exported = check.defined_dynamic_symbols(path)
    # Entities of namespace qcoll: functions, statics of its functions, guard variables,
    # typeinfo / vtables (a std:: template instantiated on a qcoll type stays exported: the
    # standard library's headers give namespace std default visibility).
    own = [s for s in exported if re.match(r"_Z(?:Z|GVZ|T[ISV])?NK?5qcoll", s)]
    assert own == [], own[:10]
    assert f"PyInit_{name.rpartition('.')[2]}" in exported


def _installed(name: str) -> str:
    """The path of module `qcoll.X` or of library `libX.so` installed beside qcoll's modules."""
    if name.startswith("qcoll."):
        spec = importlib.util.find_spec(name)
        if spec is None:
            pytest.skip(f"{name} not built")
        return spec.origin
    spec = importlib.util.find_spec("qcoll._C")
    path = Path(spec.origin).with_name(name) if spec else None
    if path is None or not path.exists():
        pytest.skip(f"{name} not built")
    return str(path)


# The virtual GPU's module and libraries too: on the GPU image's compiler, whose unversioned
# libstdc++.so was missing, _C_emu linked libstdc++.a while _C did not.
@pytest.mark.parametrize("name", ["qcoll._C", "qcoll._cuda_emu", "qcoll._C_emu",
                                  "libqcoll_cudart_emu.so", "libnccl_emu.so"])
def test_module_needs_the_shared_runtime_and_defines_none_of_it(name):
    path = _installed(name)
    needed = check.needed(path)
    assert any(dep.startswith(check.RUNTIME_SONAMES) for dep in needed), needed
    ostream = [s for s in check.defined_dynamic_symbols(path)
               if s.startswith(("_ZNSo", "_ZNKSo"))]  # std::basic_ostream<char> members
    assert ostream == []
    assert check.problems(path) == []


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    if CXX is None:
        pytest.skip("no C++ compiler")
    path = tmp_path_factory.mktemp("cxx_runtime") / "formats.cpp"
    path.write_text(FORMATS)
    return path


def _link(source: Path, out: str, *flags: str) -> str:
    """A shared library of `source` built the way pybind11 builds the modules (-flto)."""
    target = source.parent / out
    subprocess.run([CXX, "-O2", "-fPIC", "-flto", "-shared", str(source), *flags, "-o",
                    str(target)], check=True, capture_output=True, timeout=120)
    return str(target)


def _compiler_file(name: str) -> str:
    return subprocess.run([CXX, f"-print-file-name={name}"], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_check_passes_a_shared_runtime_and_fails_a_static_one(source):
    shared = _link(source, "shared.so")
    assert check.problems(shared) == []
    static = _link(source, "static.so", "-static-libstdc++")
    found = check.problems(static)
    assert len(found) == 2 and "needs no shared C++ runtime" in found[0], found
    assert "_ZNSo9_M_insertIlEERSoT_" in check.defined_dynamic_symbols(static)
    assert check.main([shared, "--delete"]) == 0 and os.path.exists(shared)
    # --delete (CMake's POST_BUILD): a failing module is not left for an install to take.
    assert check.main([static, "--delete"]) == 1 and not os.path.exists(static)


# libstdc++.so.6: what the GPU image's build links (cmake/cxx_runtime.cmake's fallback).
@pytest.mark.parametrize("runtime_name", ["libstdc++.so", "libstdc++.so.6"])
@pytest.mark.parametrize("cause", ["archive first on the search path", "-static-libstdc++"])
def test_runtime_named_by_path_keeps_it_shared(source, cause, runtime_name):
    archive = Path(_compiler_file("libstdc++.a"))
    runtime = _compiler_file(runtime_name)
    if not archive.is_absolute() or not os.path.isabs(runtime):
        pytest.skip(f"the compiler names no libstdc++.a / {runtime_name}")
    if cause == "-static-libstdc++":
        flags = ["-static-libstdc++"]
    else:
        # A directory holding only libstdc++.a, searched before the compiler's own (as the
        # CUDA toolkit's -L directories are): g++'s implicit -lstdc++ takes the archive.
        early = source.parent / "early"
        early.mkdir(exist_ok=True)
        shutil.copy(archive, early / "libstdc++.a")
        flags = [f"-L{early}"]
    assert check.problems(_link(source, f"bad-{runtime_name}.so", *flags))
    # CMakeLists.txt's remedy (qcoll_shared_cxx_runtime): the compiler's shared runtime by
    # path, kept even where --as-needed would drop it.
    remedy = ["-Wl,--push-state,--no-as-needed", runtime, "-Wl,--pop-state"]
    assert check.problems(_link(source, f"good-{runtime_name}.so", *flags, *remedy)) == []


def _find_runtime(compiler: Path, dirs: list[Path]) -> str:
    """cmake/cxx_runtime.cmake's answer (what CMakeLists.txt links) for `compiler`."""
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake")
    out = subprocess.run([cmake, f"-DCOMPILER={compiler}", f"-DDIRS={';'.join(map(str, dirs))}",
                          "-P", str(ROOT / "cmake" / "cxx_runtime.cmake")],
                         check=True, capture_output=True, text=True, timeout=60)
    return out.stderr.strip()  # message() without a mode writes to stderr


def test_runtime_found_past_a_dangling_link_name(tmp_path):
    """The GPU image's g++ (/opt/gcc) had a dangling libstdc++.so and printed the bare name
    for -print-file-name=libstdc++.so; the system's libstdc++.so.6 must be found instead."""
    real = Path(_compiler_file("libstdc++.so.6")).resolve()
    if not real.is_absolute() or not real.exists():
        pytest.skip("the compiler names no libstdc++.so.6")
    gcc_dir, system_dir = tmp_path / "gcc", tmp_path / "system"
    gcc_dir.mkdir()
    system_dir.mkdir()
    (gcc_dir / "libstdc++.so").symlink_to(tmp_path / "missing" / "libstdc++.so.6")
    (gcc_dir / "libstdc++.a").write_bytes(b"")
    (system_dir / "libstdc++.so.6").symlink_to(real)
    compiler = tmp_path / "g++"
    # Answers -print-file-name like that g++: the dangling link's path, else the bare name.
    compiler.write_text("#!/bin/sh\ncase \"$1\" in\n"
                        f"  -print-file-name=libstdc++.so) echo {gcc_dir}/libstdc++.so ;;\n"
                        "  -print-file-name=*) echo \"${1#-print-file-name=}\" ;;\nesac\n")
    compiler.chmod(0o755)
    assert _find_runtime(compiler, [gcc_dir, system_dir]) == f"{system_dir}/libstdc++.so.6"
    assert _find_runtime(compiler, [gcc_dir]) == ""  # none: CMakeLists links as g++ does
    # The real compiler: its libstdc++.so (or .so.6), a file that exists.
    found = _find_runtime(Path(CXX), [])
    assert os.path.isabs(found) and Path(found).resolve() == real
