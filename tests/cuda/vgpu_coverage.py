"""Line coverage of qcoll's host GPU code (src/comm/ and src/cuda/stream_lanes.cu) under
the virtual_gpu tests: builds qcoll._C_emu with gcov instrumentation of those sources
(QCOLL_VGPU_COVERAGE=ON) from this checkout in a scratch directory, runs
`pytest -m virtual_gpu` with it (this checkout's Python package, the installed qcoll's other
compiled modules linked in), and prints each file's executed lines (gcov). Exit status 1
when the tests fail or the files together are under --min percent (default 90).

    python tests/cuda/vgpu_coverage.py [--keep DIR] [--build DIR] [--min 90]

--build: an existing CMake build directory of this checkout to reconfigure and reuse (only
the instrumented sources then recompile).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: tests.* from the repo
from tests.cuda.mutations import host_package  # noqa: E402 (the package overlay the mutation runs use too)

ROOT = Path(__file__).resolve().parents[2]
FILES = ["src/comm/communicator.cpp", "src/comm/nccl_loader.cpp", "src/comm/nccl_comm.cpp",
         "src/cuda/stream_lanes.cu"]


def main() -> int:
    import pybind11

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", help="work directory to keep (default: a temporary one)")
    ap.add_argument("--min", type=float, default=90.0)
    ap.add_argument("--build", help="an existing build directory of this checkout to reuse")
    args = ap.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="qcoll-vgpu-coverage-"))
    build = Path(args.build).resolve() if args.build else work / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), *gen, "-DQCOLL_CUDA=OFF",
                    "-DQCOLL_VGPU_COVERAGE=ON", f"-DPython_EXECUTABLE={sys.executable}",
                    f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
                    f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={build / 'out'}"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", "_C_emu", "nccl_emu", "--parallel",
                    os.environ.get("QCOLL_BUILD_JOBS", "2")], check=True, stdout=subprocess.DEVNULL)
    for gcda in build.rglob("*.gcda"):  # a kept directory: count this run only
        gcda.unlink()
    python = work / "python"
    if python.exists():
        shutil.rmtree(python)
    shutil.copytree(ROOT / "python", python)
    host_package(work, build / "out")
    env = dict(os.environ, PYTHONPATH=str(python), OMP_NUM_THREADS="1")
    tests = subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests"), "-m", "virtual_gpu",
                            "-q", "-p", "no:cacheprovider"], env=env, cwd=str(work))
    found = {}
    for gcda in build.rglob("*.gcda"):
        out = subprocess.run(["gcov", "-n", "-o", str(gcda.parent), str(gcda)], cwd=str(work),
                             text=True, capture_output=True).stdout
        for name, pct, lines in re.findall(r"File '([^']+)'\nLines executed:([\d.]+)% of (\d+)", out):
            for f in FILES:
                if os.path.realpath(name) == str(ROOT / f):
                    found[f] = (float(pct), int(lines))
    print("\n| file | lines | executed |\n|---|---|---|")
    low = tests.returncode != 0
    total_lines = total_run = 0
    for f in FILES:
        pct, lines = found.get(f, (0.0, 0))
        total_lines += lines
        total_run += round(pct * lines / 100)
        print(f"| {f} | {lines} | {pct:.1f}% |")
    total = 100 * total_run / total_lines if total_lines else 0.0
    print(f"| all | {total_lines} | {total:.1f}% |")
    low |= total < args.min
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if low else 0


if __name__ == "__main__":
    sys.exit(main())
