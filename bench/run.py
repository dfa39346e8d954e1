"""qcoll benchmarks: one entry point for every suite.

    python bench/run.py SUITE [--quick] [--json PATH] [--plot PATH] [--device DEV]

Suites:
  kernels      GB/s of every qcoll kernel next to the copy bandwidth of the same run
  group_size   error / scale-overhead trade-off behind the default group size
  collectives  qcoll's all-reduce / all-gather / reduce-scatter vs torch.distributed's, local ranks
  cluster      the collectives on an emulated cluster (network namespaces, tc-throttled
               links between nodes); needs root and `ip`/`tc`
  zero         a ZeRO-3 training step (small GPT, qcoll.zero.ZeroEngine, 2 nodes x 2 gloo
               ranks) per configuration: all off, qwZ, hpZ, qgZ alone, all on; --link GBIT
               runs it on the cluster suite's emulated cluster at that link rate; --ddp:
               DDP steps, default all-reduce vs qcoll.ddp's hook; --stage2: stage 2 with and
               without overlap_publish
  error_feedback  int4 gradients with and without qcoll.ErrorFeedback (DDP, convergence
               test's GPT)
  gate         the speed regression gate CI runs: each kernel's ratio to copy and each
               collective's ratio to torch's same call, against the floors in bench/gate.json
               (exit 1 when a ratio stays below 0.75 of its floor); --update rewrites the floors
  sizes        qcoll's unquantized collectives (bits=None) vs torch's same call, 1 KB to
               64 MB, 2 x 2 and 3 x 2 gloo ranks, 2 threads / 1 thread / torchrun's
               OMP_NUM_THREADS=1: ratio, min / median / max and stalled calls (issue 26)
  auto         policy="auto" and the cost model on the emulated cluster (2 x 2, 3 x 2; unthrottled,
               10 and 1 Gbit/s): predicted vs measured, auto vs the uncompressed and the
               quantized call, and the ZeRO-3 step with auto vs ZeRO-3 and ZeRO++; needs root
  project      the cost model projected to 16 .. 1,024 GPUs (8 per node; 100 / 200 / 400 Gbit/s per
               node): ZeRO-3 vs ZeRO++ steps and collective times, next to the papers' figures
  fidelity     issue 12's bar: final loss vs an fp32 reference and cross-node bytes of
               ZeRO-3, ZeRO++ (+ Hadamard) and SDP4Bit (stage 2, qWD) on the convergence
               test's language model

The last line printed is `RESULT {json}`; --json also writes the result, with the command,
machine and date, to PATH (e.g. bench/results/<suite>-<machine>.json); --plot writes a PNG
chart (matplotlib, Agg backend); `--replot RESULT --plot PATH` redraws a result's chart without
running the suite. A long run shows a progress bar on a terminal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from rich.progress import Progress  # noqa: E402

import qcoll  # noqa: E402
from suites import (auto, cluster, collectives, error_feedback, fidelity, gate, group_size, kernels,  # noqa: E402
                    project, sizes, zero)  # noqa: E402
from timing import cpuinfo_field, parse_sizes  # noqa: E402

# Each suite module provides run(quick, progress, **options) -> dict, table(result) -> lines,
# and plot(result, path). Options a suite does not take are refused (see OPTIONS).
SUITES = {
    "kernels": kernels,
    "group_size": group_size,
    "collectives": collectives,
    "cluster": cluster,
    "zero": zero,
    "error_feedback": error_feedback,
    "fidelity": fidelity,
    "gate": gate,
    "sizes": sizes,
    "auto": auto,
    "project": project,
}
OPTIONS = {  # suite -> the options of this command line it understands
    "kernels": {"sizes", "device"},
    "group_size": set(),
    "collectives": {"sizes", "device", "pipeline_only", "overlap_only", "all_reduce_only"},
    "cluster": {"sizes", "pipeline_only", "overlap_only", "all_reduce_only"},
    "zero": {"link", "tiny", "dtype", "ddp", "stage2"},
    "error_feedback": set(),
    "fidelity": {"tiny"},
    "gate": {"update", "slow", "gate_parts"},
    "sizes": {"sizes"},
    "auto": {"sizes"},
    "project": set(),
}


def cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def tcp_congestion_control() -> str:
    """The host's TCP congestion control ("" where unknown). It sets how often gloo's calls
    stall on loopback: bbr's 4-packet window floor with delayed ACKs stalls messages just past
    4 segments (bench/results/probe-stalls-1mb-bbr-cpu.txt); cubic does not."""
    try:
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            return f.read().strip()
    except OSError:
        return ""


def loopback_quickack() -> Optional[bool]:
    """Whether the route gloo's loopback sockets take (local 127.0.0.1) has `quickack 1`, which
    turns TCP's delayed ACKs off there and with them the stalls above, torch's included
    (None where `ip` cannot tell)."""
    try:
        route = subprocess.run(["ip", "route", "show", "table", "local", "127.0.0.1"],
                               capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return "quickack 1" in route


def machine() -> dict:
    info = {"host": platform.node(), "cpu": cpu_model(), "cpus": os.cpu_count(),
            "kernel": platform.release(), "tcp_congestion_control": tcp_congestion_control(),
            "loopback_quickack": loopback_quickack(),
            "torch": torch.__version__, "qcoll": qcoll.build_info()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def replot(parser, suite, args) -> None:
    if not args.plot:
        parser.error("--replot needs --plot PATH")
    with open(args.replot) as f:
        record = json.load(f)
    if record.get("suite") != args.suite:
        parser.error(f"{args.replot} holds a {record.get('suite')!r} result, not {args.suite!r}")
    suite.plot(record, args.plot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--quick", action="store_true", help="fewer sizes, for a fast look")
    parser.add_argument("--json", metavar="PATH", help="also write the result here")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG chart of the result here")
    parser.add_argument("--replot", metavar="RESULT", help="redraw the chart (--plot PATH) of a result "
                        "file this suite wrote with --json, instead of running the suite")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                        help="kernels: devices to measure (auto: CPU, and CUDA when present); "
                             "collectives: cpu = gloo ranks (default), cuda = NCCL ranks on GPU 0")
    # Hidden: comma-separated byte sizes (64K, 4M, 1G suffixes) instead of the suite's ladder
    # (the smoke test uses it).
    parser.add_argument("--sizes", type=parse_sizes, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--link", type=float, metavar="GBIT", default=None,
                        help="zero: run on an emulated cluster (network namespaces, tc) with links "
                             "throttled to GBIT Gbit/s; needs root")
    parser.add_argument("--pipeline-only", action="store_true", default=None,
                        help="collectives, cluster: only the pipeline_stages rows (where "
                             "pipelining the 2-hop reduce-scatter pays)")
    parser.add_argument("--overlap-only", action="store_true", default=None,
                        help="collectives, cluster: only the async_op overlap rows (an all-gather beside "
                             "a matmul in the caller)")
    parser.add_argument("--all-reduce-only", action="store_true", default=None,
                        help="collectives, cluster: only the all-reduce rows (qcoll.quantized_all_reduce "
                             "vs torch's all_reduce)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                        help="zero: compute (and unquantized wire) dtype, default bf16; fp32 where "
                             "bf16 matrix products are slow (CPUs without AVX-512 BF16)")
    parser.add_argument("--ddp", action="store_true", default=None,
                        help="zero: DistributedDataParallel steps instead, DDP's default all-reduce "
                             "vs qcoll.ddp's quantized hook")
    parser.add_argument("--stage2", action="store_true", default=None,
                        help="zero: SDP4Bit's stage 2, step() waiting for the new weights vs "
                             "ZeroConfig(overlap_publish=True)")
    # Hidden: the zero / fidelity suite on a tiny model or few rows, 3 steps (the smoke tests).
    parser.add_argument("--tiny", action="store_true", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--update", action="store_true", default=None,
                        help="gate: measure and write the floors (bench/gate.json) instead of checking")
    parser.add_argument("--gate-parts", default=None, metavar="PARTS",
                        help="gate: kernels,collectives,sizes (default all three)")
    # Hidden: the gate's own test slows qcoll.NAME down on purpose.
    parser.add_argument("--slow", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.link is not None and args.link == int(args.link):
        args.link = int(args.link)

    options = {k: getattr(args, k) for k in ("sizes", "device", "link", "tiny", "pipeline_only", "overlap_only",
                                             "all_reduce_only", "dtype", "ddp", "stage2", "update", "slow", "gate_parts")
               if getattr(args, k) is not None}
    unknown = set(options) - OPTIONS[args.suite]
    if unknown:
        parser.error(f"suite {args.suite!r} does not take --{', --'.join(sorted(unknown))}")

    suite = SUITES[args.suite]
    if args.replot:
        replot(parser, suite, args)
        return
    load_before = os.getloadavg()
    try:
        with Progress(transient=True) as progress:
            result = suite.run(args.quick, progress, **options)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM/SIGHUP during the cluster suite
        sys.exit(f"interrupted ({e or 'SIGINT'}); nothing was written")
    for line in suite.table(result):
        print(line)
    record = {
        "suite": args.suite,
        "command": "python " + shlex.join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        # Other jobs on a shared machine skew timings: the 1-minute load before and after.
        "loadavg_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "quick": args.quick,
        **result,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    if args.plot:
        suite.plot(record, args.plot)
    print("RESULT " + json.dumps(record), flush=True)
    if result.get("failed"):
        sys.exit(1)


if __name__ == "__main__":
    main()
