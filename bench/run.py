"""qcoll benchmarks: one entry point for every suite.

    python bench/run.py SUITE [--quick] [--json PATH]

The last line printed is `RESULT {json}`; --json also writes the result, with the command,
machine and date, to PATH (e.g. bench/results/<suite>-<machine>.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from rich.progress import Progress  # noqa: E402

import qcoll  # noqa: E402
from suites import group_size, kernels  # noqa: E402

SUITES = {"kernels": kernels, "group_size": group_size}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    info = {"host": platform.node(), "cpu": cpu_model(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "qcoll": qcoll.build_info()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--quick", action="store_true", help="fewer sizes, for a fast look")
    parser.add_argument("--json", metavar="PATH", help="also write the result here")
    args = parser.parse_args()

    suite = SUITES[args.suite]
    with Progress(transient=True) as progress:
        result = suite.run(args.quick, progress)
    for line in suite.table(result):
        print(line)
    record = {
        "suite": args.suite,
        "command": "python " + shlex.join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "quick": args.quick,
        **result,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    print("RESULT " + json.dumps(record))


if __name__ == "__main__":
    main()
