"""Proof that the emulator tests catch bugs in the CUDA kernels: applies small mutations,
one at a time, to a copy of the sources, rebuilds only the emulator module (qcoll._cuda_emu)
from that copy, runs `pytest -m cuda_emu` against it and prints a table of which test
caught each mutation and how. Every mutation must be caught (exit status 1 otherwise).

--host: the same for qcoll's host GPU path (HOST_MUTATIONS), rebuilding qcoll._C_emu and the
NCCL stand-in from the copy and running `pytest -m virtual_gpu` with the copy's Python
package (its compiled modules linked in), so Python mutations need no build.

    python tests/cuda/mutations.py [--host] [--keep DIR] [--only NAME ...]

Takes a few minutes: one full build of the module, then one kernel file per mutation.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.cuda.sources_stamp import sources_stamp  # noqa: E402

# (name, file, original text, mutated text, what the mutation models)
MUTATIONS = [
    ("tail-read-off-by-one", "src/cuda/quant_team.cuh",
     "r.w[k] |= static_cast<uint32_t>(src[j < count ? j : 0]) << (16 * h);",
     "r.w[k] |= static_cast<uint32_t>(src[j <= count ? j : 0]) << (16 * h);",
     "a run's last packet reads one element past its end"),
    ("removed-syncthreads", "src/cuda/quant_team.cuh",
     "  if (threadIdx.x % 32 == 0) partial[warp] = s;\n  __syncthreads();\n",
     "  if (threadIdx.x % 32 == 0) partial[warp] = s;\n",
     "team_reduce reads the warps' partials without the barrier after they are written"),
    ("removed-second-syncthreads", "src/cuda/quant_team.cuh",
     "  __syncthreads();  // the next unit rewrites `partial`\n",
     "",
     "team_reduce lets the block's next unit rewrite the warps' partials while they are read"),
    ("shuffle-wrong-width", "src/cuda/quant_team.cuh",
     "__shfl_xor_sync(kAll, s.abs_bits, mask)",
     "__shfl_xor_sync(kAll, s.abs_bits, mask, 16)",
     "the absmax shuffle runs over 16-lane segments instead of the warp"),
    ("unaligned-vector-load", "src/cuda/quantize.cu",
     "static_cast<const typename E::Bits*>(a.input), aligned(a.input, 16)};",
     "static_cast<const typename E::Bits*>(a.input), aligned(a.input, 8)};",
     "16-byte vector loads whenever the input is 8-byte aligned"),
    ("unaligned-vector-store", "src/cuda/elementwise_kernel.cuh",
     "r.vec = runs_aligned(base, stride_bytes, items, 16);",
     "r.vec = runs_aligned(base, stride_bytes, items, 4);",
     "16-byte vector stores of raw values whenever the runs are 4-byte aligned"),
    ("rounding-half-away", "include/qcoll/quant_math.h",
     "  return rintf(v);",
     "  return roundf(v);",
     "device rounding of fp8 subnormal codes: roundf (ties away from zero) instead of rintf"),
    ("integer-rounding-half-away", "src/cuda/quant_team.cuh",
     "math::float_bits(math::add(c, kRoundingBias))",
     "math::float_bits(math::add(roundf(c), kRoundingBias))",
     "integer codes (nearest rounding) round ties away from zero instead of to even"),
    ("grid-stride-step", "src/cuda/team_kernel.cuh",
     "       first += int64_t{gridDim.x} * teams) {",
     "       first += int64_t{gridDim.x}) {",
     "the grid-stride loop of the team kernel steps by blocks instead of teams"),
    ("padding-off-by-one", "src/cuda/wire.cu",
     "const int64_t scales_end = scales_offset + 4 * groups;",
     "const int64_t scales_end = scales_offset + 4 * (groups - 1);",
     "a chunk's padding is zeroed from one scale too early, over the last group's scale"),
    ("int4-tail-nibble", "src/cuda/quant_team.cuh",
     "  if (count < kPacket) codes &= (uint64_t{1} << (count * Bits)) - 1;\n",
     "",
     "an odd int4 tail keeps the padding element's code in its high nibble"),
    ("swizzle-swapped", "src/cuda/wire.cu",
     "int64_t{k32 % nodes} * node_size + k32 / nodes",
     "int64_t{k32 / nodes} * node_size + k32 % nodes",
     "Algorithm 2's slice order transposed"),
    ("atomic-to-store", "src/cuda/team_kernel.cuh",
     "atomicMax(slot_word(s.at(s.scales, item, g)), st.abs_bits);",
     "*slot_word(s.at(s.scales, item, g)) = st.abs_bits;",
     "split-path absmax merged with a plain store instead of atomicMax"),
    ("fp8-ties-away", "include/qcoll/quant_math.h",
     "((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20)",
     "((a + 0x80000u) >> 20)",
     "fp8_e4m3 codes round ties away from zero instead of to even"),
    ("fp8-decode-max-as-nan", "include/qcoll/quant_math.h",
     "return bits_float(low == 0x7fu ? 0x7fffffffu : (sign | mag));",
     "return bits_float(low >= 0x7eu ? 0x7fffffffu : (sign | mag));",
     "fp8_e4m3 decoding reads the largest finite code (448, each group's absmax) as NaN"),
    ("divide-by-any-inverse", "include/qcoll/quant_math.h",
     "return Divisor{d, power_of_two ? div(1.0f, d) : 0.0f};",
     "return Divisor{d, div(1.0f, d)};",
     "a reduction divides by any divisor as a multiply by its rounded inverse, not only a power of two"),
    ("scale-top-not-stepped", "include/qcoll/quant_math.h",
     "  while (scale > 0.0f && !is_finite(add(mul(top, scale), offset))) scale = bits_float(float_bits(scale) - 1u);\n",
     "",
     "a group reaching FLT_MAX keeps the plain quotient, whose largest code decodes to inf"),
    ("scale-stepped-once", "include/qcoll/quant_math.h",
     "  while (scale > 0.0f && !is_finite(add(mul(top, scale), offset))) scale",
     "  if (scale > 0.0f && !is_finite(add(mul(top, scale), offset))) scale",
     "a scale steps down at most once, though some asymmetric groups need two steps to decode finite"),
    ("early-exit-before-collective", "src/cuda/team_kernel.cuh",
     "    const TeamUnit unit = team_unit<P>(sink, first + team);\n",
     "    const TeamUnit unit = team_unit<P>(sink, first + team);\n    if (unit.begin >= unit.end) return;\n",
     "threads of an empty team return before the team's shuffles and barriers"),
    ("hadamard-shuffle-sign", "src/cuda/quant_team.cuh",
     "math::butterfly(p[j].x[k], partner, upper)",
     "math::butterfly(partner, p[j].x[k], upper)",
     "the upper element of a cross-lane Hadamard pair gets upper - lower"),
    ("hadamard-register-pair", "src/cuda/quant_team.cuh",
     "p[j + s].x[k] = math::sub(lo, hi);",
     "p[j + s].x[k] = math::sub(hi, lo);",
     "the upper element of a Hadamard pair held in one lane's registers gets upper - lower"),
    ("hadamard-partial-block", "src/cuda/quant_team.cuh",
     "return size > 0 && e / size * size + size <= len;",
     "return size > 0 && e < len;",
     "a run's partial last Hadamard block is transformed too"),
    ("hadamard-unpadded-runs", "src/cuda/elementwise_kernel.cuh",
     "const int64_t per_block = r.hadamard ? r.hadamard / kPacket : 1;",
     "const int64_t per_block = 1;",
     "elementwise runs not padded to whole blocks: a block's packets straddle runs and warps"),
    ("stochastic-index", "src/cuda/quantize.cu",
     "uint64_t index(int64_t, int64_t e) const { return index_base + e; }",
     "uint64_t index(int64_t, int64_t e) const { return index_base; }",
     "stochastic rounding draws one random number for the whole tensor instead of one per element"),
]

# The host GPU path (--host): caught by `pytest -m virtual_gpu`.
HOST_MUTATIONS = [
    ("removed-stream-wait", "python/qcoll/_runtime/streams.py",
     "        stream.wait_event(ready)\n",
     "",
     "the communication stream does not wait for the caller's stream before a call"),
    ("event-on-wrong-stream", "python/qcoll/_runtime/streams.py",
     "        done.record(stream)\n        if not async_op:",
     "        done.record(caller)\n        if not async_op:",
     "a call's completion event is recorded on the caller's stream, not the communication stream"),
    ("destroy-order-swapped", "python/qcoll/group.py",
     "            for g in (self._intra, self._inter, self):",
     "            for g in ((self._intra, self._inter, self) if self.rank % 2 else\n"
     "                      (self, self._inter, self._intra)):",
     "close() destroys the family's communicators in an order that differs across ranks"),
    ("wrong-element-count", "src/comm/nccl_comm.cpp",
     "QCOLL_NCCL_ENQUEUE(api_.ncclAllGather(send.ptr, recv.ptr, static_cast<size_t>(bytes),",
     "QCOLL_NCCL_ENQUEUE(api_.ncclAllGather(send.ptr, recv.ptr, static_cast<size_t>(bytes) - 1,",
     "the NCCL all-gather moves one byte per rank too few"),
    ("missing-group-end", "src/comm/nccl_comm.cpp",
     "    c_.settle(c_.api_.ncclGroupEnd(), \"ncclGroupEnd()\", __FILE__, __LINE__);",
     "    c_.settle(ncclSuccess, \"ncclGroupEnd()\", __FILE__, __LINE__);",
     "the all-to-all's NCCL group is never ended (its sends and receives never run)"),
    ("watchdog-never-aborts", "src/comm/nccl_comm.cpp",
     "      record_failure(why);\n      abort_locked();\n      return;",
     "      record_failure(why);\n      return;",
     "the watchdog records a timeout but never aborts the communicator"),
    ("lane-joined-too-early", "src/cuda/stream_lanes.cu",
     "    QCOLL_CUDA_CHECK(cudaEventRecord(event_, streams_.inter));\n"
     "    QCOLL_CUDA_CHECK(cudaStreamWaitEvent(caller_stream(), event_, 0));\n",
     "",
     "join() makes the caller wait for the intra-node lane only"),
    ("capture-mode-left-global", "src/comm/nccl_comm.cpp",
     "  cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;",
     "  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;",
     "the watchdog queries events in the global capture mode (invalidates another thread's capture)"),
]


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, **kw)


def configure(src: Path, build: Path) -> None:
    import pybind11

    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    run(["cmake", "-S", str(src), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release",
         "-DQCOLL_CUDA=OFF", f"-DPython_EXECUTABLE={sys.executable}",
         f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
         f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={build / 'out'}"], stdout=subprocess.DEVNULL)


def build(build_dir: Path, host: bool = False) -> Path:
    jobs = os.environ.get("QCOLL_BUILD_JOBS", "2")
    targets = ["_C_emu", "nccl_emu"] if host else ["_cuda_emu"]
    run(["cmake", "--build", str(build_dir), "--target", *targets, "--parallel", jobs],
        stdout=subprocess.DEVNULL)
    if not host:
        return next((build_dir / "out").glob("_cuda_emu*.so"))
    return build_dir / "out"


def host_package(src: Path, out: Path) -> Path:
    """The copy's python/ with the installed qcoll's compiled modules and the freshly built
    virtual-GPU ones linked into its package; returns the directory for PYTHONPATH."""
    import qcoll

    package = src / "python" / "qcoll"
    installed = Path(qcoll.__file__).parent
    for so in list(installed.glob("*.so")) + list(out.glob("*.so")):
        link = package / so.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(so)
    return src / "python"


def pytest(module: Path, host_path: Path | None = None) -> tuple[int, str, float]:
    """(exit status, the first failure's test and message, seconds)."""
    env = dict(os.environ, QCOLL_EMU_MODULE=str(module), OMP_NUM_THREADS="1",
               COLUMNS="1000")  # pytest cuts its summary lines at the terminal width
    marker = "cuda_emu"
    if host_path is not None:
        env = dict(os.environ, PYTHONPATH=str(host_path), OMP_NUM_THREADS="1", COLUMNS="1000")
        marker = "virtual_gpu"
    t = time.time()
    p = subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests"), "-m", marker,
                        "-x", "-q", "-p", "no:cacheprovider", "-rf", "--tb=line"],
                       env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       cwd=str(host_path.parent if host_path else ROOT))
    failed = [l for l in p.stdout.splitlines() if l.startswith("FAILED ")]
    return p.returncode, failed[0][len("FAILED "):] if failed else "", time.time() - t


def short(failure: str) -> tuple[str, str]:
    test, _, msg = failure.partition(" - ")
    test = re.sub(r"^.*?(?=test_\w+\.py)", "", test)  # the file name, whatever path ran it
    msg = re.sub(r"0x[0-9a-f]{6,}", "0x…", msg)
    return test, (msg[:150] + "…") if len(msg) > 150 else msg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", help="work directory to keep (default: a temporary one)")
    ap.add_argument("--only", nargs="*", help="mutation names to run")
    ap.add_argument("--host", action="store_true", help="the host GPU path's mutations")
    args = ap.parse_args()
    mutations = HOST_MUTATIONS if args.host else MUTATIONS
    work = Path(args.keep or tempfile.mkdtemp(prefix="qcoll-mutations-"))
    src = work / "src-copy"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    for part in ("CMakeLists.txt", "cmake", "include", "src", "python"):
        (shutil.copytree if (ROOT / part).is_dir() else shutil.copy)(ROOT / part, src / part)
    configure(src, work / "build")
    stamp = sources_stamp(src)

    module = build(work / "build", args.host)
    host_path = host_package(src, module) if args.host else None
    status, failure, secs = pytest(module, host_path)
    marker = "virtual_gpu" if args.host else "cuda_emu"
    if status != 0:
        print(f"the unmutated sources fail the {marker} tests: {failure}")
        return 1
    print(f"baseline: pytest -m {marker} passes on the unmutated copy ({secs:.0f} s)")

    rows, missed = [], []
    for name, rel, old, new, what in mutations:
        if args.only and name not in args.only:
            continue
        path = src / rel
        text = path.read_text()
        assert text.count(old) == 1, f"{name}: the original text must occur once in {rel}"
        path.write_text(text.replace(old, new))
        try:
            module = build(work / "build", args.host)
            status, failure, secs = pytest(module, host_path)
        finally:
            path.write_text(text)
        caught = status != 0
        test, msg = short(failure) if caught else ("", "")
        rows.append((name, rel.split("/")[-1], what, "yes" if caught else "**no**", test, msg,
                     secs))
        if not caught:
            missed.append(name)
        print(f"{name}: {'caught by ' + test if caught else 'NOT CAUGHT'} ({secs:.0f} s)",
              flush=True)
    build(work / "build", args.host)  # leave the build matching the unmutated copy

    print("\n| mutation | file | what it breaks | caught | first failing test | message |")
    print("|---|---|---|---|---|---|")
    for name, file, what, caught, test, msg, _ in rows:
        print(f"| {name} | {file} | {what} | {caught} | `{test}` | {msg.replace('|', '/')} |")
    print(f"\n{len(rows) - len(missed)} of {len(rows)} mutations caught")
    if not args.host and not args.only:  # the kernels and kernel emulator, every mutation
        print(f"sources: {stamp}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
