"""`group_size` suite: the error / overhead trade-off behind qcoll.DEFAULT_GROUP_SIZE.

For each group size and code format (int8, int4, fp8_e4m3): relative RMS error and max
error (in units of the tensor's RMS) of a round trip on two inputs (Gaussian, and Gaussian
with 0.1% outliers of 50x, the shape of real gradients), and the scale overhead in bytes
per element.

`hadamard_rows`: the same round trips at int4 and int8 with Hadamard smoothing (SDP4Bit's
TLq-HS) at every block size up to the group size (0: without), the table behind
qcoll.quantization.DEFAULT_HADAMARD_SIZE."""

from __future__ import annotations

import torch

import qcoll
from qcoll._formats import FORMATS

GROUP_SIZES = [32, 64, 128, 256, 512, 1024, 4096]
HADAMARD_GROUP_SIZES = [64, 256, 1024]
HADAMARD_SIZES = [0, 16, 32, 64, 128, 256]


def _inputs(n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    gauss = torch.randn(n, generator=g)
    spiky = gauss.clone()
    idx = torch.randint(0, n, (n // 1000,), generator=g)
    spiky[idx] *= 50
    return {"gaussian": gauss, "outliers": spiky}


def run(quick: bool, progress) -> dict:
    n = (1 << 20) if quick else (1 << 24)
    inputs = _inputs(n)
    rows = []
    task = progress.add_task("group sizes", total=len(GROUP_SIZES))
    for gs in GROUP_SIZES:
        for fmt, info in FORMATS.items():
            bits = info["bits"]
            for name, x in inputs.items():
                y = qcoll.dequantize(qcoll.quantize(x, bits=fmt, group_size=gs))
                err = (y - x).float()
                rms = x.pow(2).mean().sqrt()
                rows.append(dict(group_size=gs, format=fmt, bits=bits, input=name,
                                 rel_rms_error=(err.pow(2).mean().sqrt() / rms).item(),
                                 max_error_rms=(err.abs().max() / rms).item(),
                                 overhead=4 * 8 / (gs * bits)))  # scale bits per code bit
        progress.advance(task)
    hadamard_rows = []
    task = progress.add_task("hadamard sizes", total=len(HADAMARD_GROUP_SIZES))
    for gs in HADAMARD_GROUP_SIZES:
        for bits in (4, 8):
            for h in (h for h in HADAMARD_SIZES if h <= gs):
                for name, x in inputs.items():
                    hadamard_rows.append(dict(group_size=gs, bits=bits, hadamard_size=h,
                                              input=name, rel_rms_error=_rel_error(x, bits, gs, h)))
        progress.advance(task)
    return {"rows": rows, "hadamard_rows": hadamard_rows, "numel": n}


def _rel_error(x, bits: int, group_size: int, hadamard_size: int) -> float:
    """Relative RMS error of a round trip (hadamard_size 0: without smoothing)."""
    kw = dict(hadamard=True, hadamard_size=hadamard_size) if hadamard_size else {}
    y = qcoll.dequantize(qcoll.quantize(x, bits=bits, group_size=group_size, **kw))
    return ((y - x).float().pow(2).mean().sqrt() / x.pow(2).mean().sqrt()).item()


def table(result: dict) -> list:
    lines = [f"{'group':>6} {'format':>8} {'overhead':>9} {'gaussian':>10} {'outliers':>10}"
             f" {'max gauss':>10} {'max outl':>10}   (relative RMS error; max error / RMS)"]
    by_key = {}
    for r in result["rows"]:
        by_key.setdefault((r["group_size"], r["format"]), {})[r["input"]] = r
    for (gs, fmt), d in by_key.items():
        g, o = d["gaussian"], d["outliers"]
        lines.append(f"{gs:6d} {fmt:>8} {g['overhead']:9.2%} {g['rel_rms_error']:10.2e} "
                     f"{o['rel_rms_error']:10.2e} {g['max_error_rms']:10.2e} {o['max_error_rms']:10.2e}")
    lines.append("")
    lines.append(f"{'group':>6} {'bits':>4} {'hadamard':>9} {'gaussian':>10} {'outliers':>10}   "
                 "(relative RMS error; hadamard 0: without)")
    by_key = {}
    for r in result.get("hadamard_rows", []):
        by_key.setdefault((r["group_size"], r["bits"], r["hadamard_size"]), {})[r["input"]] = r
    for (gs, bits, h), d in by_key.items():
        lines.append(f"{gs:6d} {bits:4d} {h:9d} {d['gaussian']['rel_rms_error']:10.2e} "
                     f"{d['outliers']['rel_rms_error']:10.2e}")
    return lines


def plot(result: dict, path: str) -> None:
    from plotting import group_size_chart

    group_size_chart(result, path)
