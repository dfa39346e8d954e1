"""Global loads in flight per thread, read from the SASS of the CUDA kernels (no GPU needed).

    python bench/gpu/sass_loads.py [--arch sm_90] [--nvdisasm PATH] [--json PATH]

Compiles src/cuda/quantize.cu and wire.cu to cubins with the project's device flags
(-O3 --fmad=false), disassembles them with nvdisasm (not in the CUDA 13 toolkit's nvcc-only
install: `pip install nvidia-cuda-nvdisasm`, then pass --nvdisasm or put it on PATH) and,
per kernel, walks its instructions in program order: each LDG adds its bytes to the loads
outstanding, and the first instruction that reads a register an outstanding load writes
consumes it. The largest number of bytes outstanding when a load is first consumed is the
figure: how many bytes one thread keeps in flight before it waits (the issue's "one 16-byte
packet before loading the next" is 16). Static and approximate: branches are ignored (a
predicated load counts), and loads of a loop's next trip are not overlapped with this one.
Bytes per SM = that figure x the threads per SM the kernel's launch bounds guarantee.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WIDTH = {"128": 16, "64": 8, "U8": 1, "S8": 1, "U16": 2, "S16": 2}
LDG = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?LDG((?:\.\w+)*)\s+(R\d+),")
INSN = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)\s*(.*?);")
REG = re.compile(r"\bR(\d+)\b")
FUNC = re.compile(r"^\.text\.(\S+):$")
# Instructions whose first operand is a source too (stores, branches and the like).
NO_DEST = ("ST", "RED", "ATOM", "BRA", "BSYNC", "BSSY", "EXIT", "RET", "CALL", "BAR", "WARPSYNC")


def load_bytes(suffixes: str) -> int:
    for part in suffixes.split(".")[1:]:
        if part in WIDTH:
            return WIDTH[part]
    return 4


def regs_of(first: int, nbytes: int) -> set:
    return set(range(first, first + max(1, nbytes // 4)))


def analyse(sass: str) -> dict:
    """{kernel: (largest bytes outstanding at a first use, number of LDGs)}."""
    result, name, pending, peak, count = {}, None, [], 0, 0

    def close():
        if name:
            result[name] = (peak, count)

    for line in sass.splitlines():
        m = FUNC.match(line)
        if m:
            close()
            name, pending, peak, count = m.group(1), [], 0, 0
            continue
        m = INSN.match(line)
        if not m or name is None:
            continue
        op, operands = m.group(1), m.group(2)
        regs = [int(r) for r in REG.findall(operands)]
        sources = regs if op.startswith(NO_DEST) else regs[1:]
        used = [p for p in pending if p[0] & set(sources)]
        if used:
            peak = max(peak, sum(p[1] for p in pending))
            pending = [p for p in pending if p not in used]
        ld = LDG.match(line)
        if ld:
            nbytes = load_bytes(ld.group(1))
            count += 1
            pending.append((regs_of(int(ld.group(2)[1:]), nbytes), nbytes))
        elif regs and not op.startswith(NO_DEST):  # a register overwritten: no longer pending
            pending = [p for p in pending if regs[0] not in p[0]]
    close()
    return result


def demangle(names):
    tool = shutil.which("c++filt")
    if not tool:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), text=True, capture_output=True).stdout
    return dict(zip(names, out.splitlines()))


def short(kernel: str) -> str:
    """The kernel's name and template arguments, without namespaces and parameter list."""
    kernel = re.sub(r"qcoll::(cuda::)?(team::)?|\(anonymous namespace\)::|^void ", "", kernel)
    depth = 0
    for i in range(len(kernel) - 1, -1, -1):  # the balanced (...) at the end
        depth += {")": 1, "(": -1}.get(kernel[i], 0)
        if depth == 0:
            return kernel[:i]
    return kernel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
    ap.add_argument("--json")
    args = ap.parse_args()
    if not args.nvdisasm:
        sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, then --nvdisasm PATH")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for src in ("quantize", "wire"):
            cubin = Path(tmp) / f"{src}.cubin"
            subprocess.run(["nvcc", "-O3", "--fmad=false", "-std=c++17", f"-arch={args.arch}",
                            f"-I{ROOT / 'include'}", f"-I{ROOT / 'src'}", "-cubin",
                            str(ROOT / "src" / "cuda" / f"{src}.cu"), "-o", str(cubin)], check=True)
            sass = subprocess.run([args.nvdisasm, "-c", str(cubin)], check=True, text=True,
                                  capture_output=True).stdout
            found = analyse(sass)
            names = demangle(list(found))
            for mangled, (peak, count) in found.items():
                if count:
                    rows.append({"file": f"{src}.cu", "kernel": short(names[mangled]),
                                 "bytes_in_flight_per_thread": peak, "loads": count})
    by_kind = defaultdict(list)
    for r in rows:
        source = re.search(r"\w+Source", r["kernel"])
        key = (r["file"], r["kernel"].split("<")[0], source.group(0) if source else "-")
        by_kind[key].append(r["bytes_in_flight_per_thread"])
    print(f"{'file':<12} {'kernel':<20} {'source':<16} {'instances':>9}  "
          "bytes in flight per thread: min / median / max")
    for (file, kernel, source), values in sorted(by_kind.items()):
        values.sort()
        print(f"{file:<12} {kernel:<20} {source:<16} {len(values):>9}  "
              f"{values[0]} / {values[len(values) // 2]} / {values[-1]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"arch": args.arch, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
