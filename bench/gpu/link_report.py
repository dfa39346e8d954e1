"""How the last build linked qcoll's modules against the C++ runtime: the first thing to read
when a module built on another machine crashes in iostreams (qcoll's first GPU build did).

    python3 bench/gpu/link_report.py [BUILD_DIR]   (default: the newest build/*/CMakeCache.txt)

Prints the compilers (C++, CUDA, nvcc's host compiler and host linker), the environment
variables that change a link, the C++ compiler's libstdc++.so and .a, each module's NEEDED
entries and runtime symbols (cmake/check_cxx_runtime.py), and the _C link repeated into a
scratch file with the linker's file trace (-Wl,-t): which libstdc++ files it opened, and
which of the link's directories hold one. Exit 1 when a module fails the check.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_cxx_runtime",
                                               ROOT / "cmake" / "check_cxx_runtime.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

ENV_VARS = ("CC", "CXX", "CUDAHOSTCXX", "NVCC_CCBIN", "NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS",
            "CXXFLAGS", "LDFLAGS", "LIBRARY_PATH", "LD_LIBRARY_PATH", "CMAKE_ARGS")
RUNTIME_FILE = re.compile(r"lib(std)?c\+\+|libsupc\+\+|libgcc")


def _run(cmd: str | list[str], cwd: Path | None = None) -> str:
    done = subprocess.run(cmd, shell=isinstance(cmd, str), cwd=cwd, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return done.stdout


def _cmake_vars(text: str) -> dict[str, str]:
    """NAME:TYPE=value lines (CMakeCache.txt) and set(NAME "value") lines (CMakeFiles)."""
    found = dict(re.findall(r"^(\w+):[A-Z]+=(.*)$", text, re.M))
    found.update(re.findall(r'^set\((\w+) "([^"]*)"\)', text, re.M))
    return found


def compilers(build: Path) -> dict[str, str]:
    info = _cmake_vars((build / "CMakeCache.txt").read_text())
    for name in ("CMakeCXXCompiler.cmake", "CMakeCUDACompiler.cmake"):
        for path in build.glob(f"CMakeFiles/*/{name}"):
            info.update(_cmake_vars(path.read_text()))
    return info


def link_trace(build: Path, info: dict[str, str], module: str) -> list[str]:
    """The module's link command again, into a scratch file, with -Wl,-t: the runtime files
    the linker opened, and the libstdc++ files in the directories it searches."""
    ninja = info.get("CMAKE_MAKE_PROGRAM", "ninja")
    commands = _run([ninja, "-C", str(build), "-t", "commands", module]).splitlines()
    target = f" -o {module} "
    link = next((part for part in (commands or [""])[-1].split(" && ") if target in part), "")
    if not link:
        return [f"(no link command for {module} from {ninja} -t commands)"]
    with tempfile.TemporaryDirectory() as tmp:
        out = _run(link.replace(target, f" -o {tmp}/relink.so ") + " -Wl,-t", cwd=build)
    lines = list(dict.fromkeys(line for line in out.splitlines() if RUNTIME_FILE.search(line)))
    dirs = re.findall(r"(?:^|\s)-L(\S+)", link)
    dirs += info.get("CMAKE_CXX_IMPLICIT_LINK_DIRECTORIES", "").split(";")
    dirs += os.environ.get("LIBRARY_PATH", "").split(os.pathsep)
    for d in dict.fromkeys(d for d in dirs if d):
        held = sorted(p.name for p in Path(d).glob("libstdc++*")) if Path(d).is_dir() else []
        lines.append(f"-L {d}: {' '.join(held) or '-'}")
    return [f"link: {link.strip()}", *lines]


def main(argv: list[str]) -> int:
    if argv:
        build = Path(argv[0])
    else:
        caches = sorted((ROOT / "build").glob("*/CMakeCache.txt"), key=lambda p: p.stat().st_mtime)
        if not caches:
            print("no build/*/CMakeCache.txt: build first")
            return 1
        build = caches[-1].parent
    info = compilers(build)
    cxx = info.get("CMAKE_CXX_COMPILER", "c++")
    print(f"build dir: {build}")
    for name in ("CMAKE_CXX_COMPILER", "CMAKE_CXX_COMPILER_VERSION", "CMAKE_CUDA_COMPILER",
                 "CMAKE_CUDA_COMPILER_VERSION", "CMAKE_CUDA_HOST_COMPILER",
                 "CMAKE_CUDA_HOST_COMPILER_VERSION", "CMAKE_CUDA_HOST_LINK_LAUNCHER",
                 "CMAKE_CUDA_HOST_IMPLICIT_LINK_DIRECTORIES", "CMAKE_CUDA_HOST_IMPLICIT_LINK_LIBRARIES",
                 "CMAKE_MODULE_LINKER_FLAGS", "CMAKE_SHARED_LINKER_FLAGS"):
        print(f"{name} = {info.get(name, '(unset)')}")
    for var in ENV_VARS:
        if var in os.environ:
            print(f"env {var}={os.environ[var]}")
    for lib in ("libstdc++.so", "libstdc++.so.6", "libstdc++.a"):
        path = _run([cxx, f"-print-file-name={lib}"]).strip()
        # A bare name back means the compiler found no such file; a dangling link is as bad.
        where = (os.path.realpath(path) if os.path.exists(path) else "MISSING or dangling") \
            if os.path.isabs(path) else "not found by the compiler"
        print(f"{cxx} -print-file-name={lib}: {path} -> {where}")
    ninja_file = build / "build.ninja"
    # The modules CMake links (the check deletes one that fails it, so read them off the rules).
    modules = re.findall(r"^build (_\w+\.[^:\s]*\.so):", ninja_file.read_text(), re.M) \
        if ninja_file.exists() else [p.name for p in build.glob("_*.so")]
    failed = not modules
    for module in modules:
        if not (build / module).exists():
            failed = True
            print(f"{module}: missing (not built, or deleted by cmake/check_cxx_runtime.py)")
            continue
        print(check.report(str(build / module)))
        for problem in check.problems(str(build / module)):
            failed = True
            print(f"  FAILS: {problem}")
    core = [m for m in modules if m.startswith("_C.")]
    if core and ninja_file.exists():
        print("\n".join(link_trace(build, info, core[0])))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
