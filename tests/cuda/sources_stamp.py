"""The stamp of the sources the CUDA kernel emulator's recorded results describe: the kernels
(src/cuda), quant_math.h and the emulator (src/testing/emu, without the virtual GPU's CUDA
runtime and NCCL stand-in in cudart/ and nccl/, which qcoll._cuda_emu does not compile).
bench/results/cuda-emu-asan.txt (tests/cuda/emu_asan.sh) and the kernel mutation table of
docs/emulators.md (tests/cuda/mutations.py) carry it; test_emu_results_stamp.py fails when a
recorded stamp is not that of the current sources.

    python tests/cuda/sources_stamp.py      prints the stamp line, e.g. cuda-emu-sources 1a2b...
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("src/cuda", "src/testing/emu", "include/qcoll/quant_math.h")
NOT_COVERED = ("src/testing/emu/cudart", "src/testing/emu/nccl")
PREFIX = "cuda-emu-sources"


def covered_files(root: Path = ROOT) -> list[str]:
    files = []
    for part in SOURCES:
        path = root / part
        for f in [path] if path.is_file() else path.rglob("*"):
            rel = f.relative_to(root).as_posix()
            if f.is_file() and not rel.startswith(tuple(n + "/" for n in NOT_COVERED)):
                files.append(rel)
    if not files:
        raise FileNotFoundError(f"no CUDA emulator sources under {root}")
    return sorted(files)


def sources_stamp(root: Path = ROOT) -> str:
    """'cuda-emu-sources <16 hex digits>': SHA-256 of each covered file's path and bytes."""
    h = hashlib.sha256()
    for rel in covered_files(root):
        data = (root / rel).read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return f"{PREFIX} {h.hexdigest()[:16]}"


if __name__ == "__main__":
    print(sources_stamp(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT))
