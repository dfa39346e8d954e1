"""The cost model of a group: what a collective costs on it, from measured rates.

    model = qcoll.cost_model(group)          # probed at first use, cached per group
    model.predict("reduce_scatter", numel=1 << 22, dtype=torch.float32,
                  policy=qcoll.ReduceScatterPolicy())
    model.save("cluster.json")               # later: qcoll.cost_model(group, path="cluster.json")

Per tier (intra-node, inter-node) a Link: the bytes per second one rank sends to peers of
that tier while every rank of the group sends at once (so a node's shared uplink is
divided among its ranks, as in a real call), and the latency of one exchange (qcoll's own
per-call cost included). Per code format a KernelRate: elements per second encoded and
decoded by one rank while every rank runs the kernel ("raw": copy and fp32 add, what an
unquantized hop costs). The overlap: how much of a pipelined call's overlapping steps the
host hides (a CPU with no spare core for the lanes' second thread hides none). Bytes per
hop come from the core's plans (one algorithm, one place); a prediction is of a repeated
call (the first call of a signature on CPU also exchanges a 32-byte call check with every
peer).

Calibration: the rates above miss what a whole call adds on a real machine (the
transport's own algorithms, processes sharing cores, copies). So the probe also times the
calls themselves, each collective uncompressed (the all-reduce on both of its host paths) and
quantized with its default formats on each path (flat, 2-hop), at two or more sizes (bf16),
and keeps per (collective, kind) the measured points (model's estimate -> measured time): a
prediction runs through them (Calibration), and the line fitted to them stands for a model
loaded without its points. A quantized all-reduce above its last point grows as its halves'
(the reduce-scatter's and the all-gather's) calibrated predictions: CostModel.predict.
Models given without calibration use the rates alone.

The probe is bounded: each measure grows its size by 4x from a small start and stops once a
call takes its target time or the size cap is reached, and a next size is measured only
if its forecast (the size before's time, x 6 for 4x the bytes, per timed call) ends within
`budget_s` (the rates get the first half, the calibration the rest; each measure's first
size always runs).
Every time measured is reduced to the slowest rank's (all-reduce MAX) before it becomes a
rate, so every rank holds the identical model; a model given by the user or loaded from a
file is compared across ranks when it is installed, and a rank that holds another raises
on every rank.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import os
import time
import weakref
from typing import Mapping, NamedTuple, Optional

import torch
import torch.distributed as dist

from . import _C
from ._runtime import call
from ._formats import FORMATS, RAW_CODE, format_code, format_of
from .policy import AllGatherPolicy, AllReducePolicy, ReduceScatterPolicy, host_all_reduce_tail_apart
from ._torch_transport import check_gather_paths, gather_band, measures_gather_path

RAW = "raw"  # the kernel-rate key of unquantized hops (copy to send, fp32 add to reduce)
COLLECTIVES = ("allgather", "reduce_scatter", "all_reduce")
_PROBE_FORMATS = tuple(FORMATS) + (RAW,)
_MIN_STAGE_BYTES = _C.MIN_PIPELINE_STAGE_BYTES
# Probe bounds: sizes (bytes per rank's chunk; elements for kernels) start small and grow 4x
# until one call takes TARGET_S, capped; a next size runs only if its forecast ends within
# the probe's budget (BUDGET_S by default; _cost_probe._fits).
_LATENCY_BYTES = 256
_START_BYTES, _MAX_BYTES = 64 << 10, 16 << 20
_KERNEL_START, _KERNEL_MAX = 1 << 16, 1 << 22
_TARGET_S = 0.05
BUDGET_S = 10.0
_REPEATS = 3
# Calibration: whole calls at total bytes from _CALIBRATION_START, 4x up to _CALIBRATION_MAX,
# until the slower kind's call takes _CALIBRATION_TARGET_S (at least two sizes: a segment
# needs two points). 512 KB, 2, 8, 32 MB: between the auto suite's 1, 4, 16, 64 MB, so that
# the suite checks predictions away from the measured points. From 2 MB, 18 of the suite's
# 19 misses were at 1 MB, predicted from the 2 MB point down without the small calls' fixed
# cost; from 512 KB 5 and 9 (134 and 132 of 144 within 20%, against 125), the probe 7.4-8.1 s
# against 6.7-7.7 (auto-cpu-90c34cf.json, 2026-12-02; on 11-26 the extra point had cost the large sizes
# their budget: auto-cpu-calibration-v6.json, before the sizes went in rounds).
_CALIBRATION_START, _CALIBRATION_MAX = 512 << 10, 32 << 20
_CALIBRATION_TARGET_S = 0.1
_CALIBRATION_REPEATS = 7  # timed calls per size (_cost_probe.typical_time; more for short calls)
_CALIBRATION_DTYPE = torch.bfloat16
# The kinds of call each collective calibrates (CostModel.kind): every path auto weighs.
# The bits=None all-reduce of host tensors takes one of two paths, by dtype, size and number
# of ranks (policy.unquantized_host_all_reduce): its calls on the exchange are calibrated apart
# ("uncompressed exchange"), each path at every size (policy.host_all_reduce_path). As one
# kind, the 1 MB calls (the exchange) were predicted through a 512 KB point of the other
# path, in one auto run at half their time (bench/results/auto-cpu-9ee9638-tm.json).
KINDS = {"allgather": ("uncompressed", "quantized"),
         "reduce_scatter": ("uncompressed", "quantized 2-hop", "quantized flat"),
         "all_reduce": ("uncompressed", "uncompressed exchange", "quantized 2-hop", "quantized flat")}


@dataclasses.dataclass(frozen=True)
class Link:
    """bandwidth: bytes per second one rank sends to that tier's peers (all ranks sending);
    latency: seconds of one exchange that moves no data."""

    bandwidth: float
    latency: float

    def __post_init__(self):
        for name in ("bandwidth", "latency"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
                raise ValueError(f"Link.{name} must be a finite number >= 0, got {v!r}")
        if self.bandwidth == 0:
            raise ValueError("Link.bandwidth must be > 0")


@dataclasses.dataclass(frozen=True)
class KernelRate:
    """Elements per second one rank encodes (quantize; raw: copy) and decodes (dequantize
    and add into fp32; raw: the add)."""

    encode: float
    decode: float

    def __post_init__(self):
        for name in ("encode", "decode"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"KernelRate.{name} must be a finite number > 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted seconds of one call, split into what the links and the kernels take, and
    the bytes one rank's share of each tier's links carries (all-to-all hops: what
    qcoll.stats() counts; ring hops, the transport's all-gather and reduce-scatter: less
    across nodes, the chunks cross once per node)."""

    seconds: float
    intra_s: float
    inter_s: float
    kernel_s: float
    intra_bytes: int
    inter_bytes: int

    @property
    def estimate_s(self) -> float:
        """The rates' own estimate; `seconds` is it calibrated."""
        return self.intra_s + self.inter_s + self.kernel_s


def _finite_positive(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < float("inf")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A measured call's time from the rates' estimate of it.

    points: the probe's measured calls, (estimate, measured seconds) by rising estimate.
    With two or more, a prediction runs through them: linear between neighbours; above the
    last in proportion to the estimate (the last point's measured / estimate carries on);
    below the first along the fitted line's shape, scaled through the first point. A call's
    time is not one line over sizes on a real machine (caches, the transport's algorithms
    switching), and one line fitted to every point missed the largest calls by up to 45%
    (auto suite). Above the points, the last segment's slope (the rule until 12-04) carried
    the noise of two points, amplified by their distance: at 64 MB on 2 x 2 at 1 Gbit/s it
    put the flat quantized reduce-scatter 12% under the 2-hop one, and it took 1.56x its time;
    over eleven auto runs the ratio predicts 1,401 of 1,584 fixed calls within 20% against
    the slope's 1,387, and takes a call no slower in 9 of the 10 cells where the two choose
    differently and the run timed both choices (bench/results/probe-calibration-above-points-cpu.txt).
    Without points: offset + scale x estimate, the line fitted to the points."""

    offset: float
    scale: float
    points: tuple = ()

    def __post_init__(self):
        if isinstance(self.offset, bool) or not isinstance(self.offset, (int, float)) or not 0 <= self.offset < float("inf"):
            raise ValueError(f"Calibration.offset must be a finite number >= 0, got {self.offset!r}")
        if not _finite_positive(self.scale):
            raise ValueError(f"Calibration.scale must be a finite number > 0, got {self.scale!r}")
        points = self.points
        pairs = isinstance(points, (tuple, list)) and all(
            isinstance(p, (tuple, list)) and len(p) == 2 and _finite_positive(p[0]) and _finite_positive(p[1])
            for p in points)
        if not pairs or any(a[0] >= b[0] for a, b in zip(points, points[1:])):
            raise ValueError("Calibration.points must be (estimate, measured) pairs of finite numbers > 0 "
                             f"by strictly rising estimate, got {points!r}")
        object.__setattr__(self, "points", tuple(tuple(p) for p in points))  # a file's lists, as tuples

    @classmethod
    def fit(cls, estimates: list, measured: list) -> "Calibration":
        """The line measured = offset + scale x estimate closest to the points in relative
        terms (least squares of (line - measured) / measured: every size counts alike, as
        the prediction's error does); where that needs a negative offset or slope (noise),
        the best line through the origin. With the points themselves, by rising estimate
        (one size measured twice: their mean), which predictions run through."""
        merged = {}  # equal estimates (one size measured twice): their mean
        for e, m in zip(estimates, measured):
            merged.setdefault(e, []).append(m)
        points = tuple((e, sum(ms) / len(ms)) for e, ms in sorted(merged.items()))
        rows = [(1.0 / m, e / m) for e, m in zip(estimates, measured)]  # (offset, scale) weights
        saa = sum(a * a for a, _ in rows)
        sab = sum(a * b for a, b in rows)
        sbb = sum(b * b for _, b in rows)
        sa, sb = sum(a for a, _ in rows), sum(b for _, b in rows)  # targets: every ratio 1
        det = saa * sbb - sab * sab
        if det > 1e-12 * saa * sbb:
            offset, scale = (sa * sbb - sb * sab) / det, (saa * sb - sab * sa) / det
            if offset >= 0 and scale > 0:
                return cls(offset, scale, points)
        return cls(0.0, sb / sbb, points)

    def line(self, estimate: float) -> float:
        return self.offset + self.scale * estimate

    def apply(self, estimate: float) -> float:
        pts = self.points
        if len(pts) < 2:
            return self.line(estimate)
        e0, m0 = pts[0]
        if estimate <= e0:
            return m0 * self.line(estimate) / self.line(e0)
        e_last, m_last = pts[-1]
        if estimate > e_last:  # above the points: the last point's ratio
            return m_last * estimate / e_last
        k = bisect.bisect_left([e for e, _ in pts], estimate) - 1  # pts[k][0] < estimate <= pts[k+1][0]
        (ea, ma), (eb, mb) = pts[k], pts[k + 1]
        return ma + (mb - ma) / (eb - ea) * (estimate - ea)


def _bands(paths: dict) -> dict:
    """A file's gather_paths (JSON keys are strings) with int bands. The auto suite's records
    before the field kept the transport's trials under this key ({"low-high": {"path": ...,
    "measured_s": ...}}, Group.gather_paths): read as the bands' paths they chose."""
    if isinstance(paths, dict) and all(isinstance(b, str) and "-" in b and isinstance(d, dict) and "path" in d
                                       for b, d in paths.items()):
        return {gather_band(int(b.split("-")[1])): d["path"] for b, d in paths.items()}
    if not isinstance(paths, dict) or not all(isinstance(b, str) and b.isdigit() for b in paths):
        raise ValueError(f"CostModel.gather_paths in a file maps size bands (digits) to paths, got {paths!r}")
    return {int(band): path for band, path in paths.items()}


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Rates of one group (world ranks, node_size per node) on one device type.

    intra / inter: the tiers' Links (None where the group has no such peers);
    kernels: format name (qcoll's, or "raw") -> KernelRate; source: "probe", "user" or the
    file it was loaded from; calibration: "<collective>/<kind>" (CostModel.calibration_key) ->
    Calibration (keys missing: the rates' estimate as it is); overlap: the fraction of the
    shorter of two overlapping pipeline steps (a stage's inter-node hop beside the next
    stage's intra-node hop) that runs hidden, 0 to 1 (the probe measures it: _cost_probe);
    gather_paths: size band (_torch_transport.gather_band) -> GATHER_PATHS' name, the path the
    group's transport measured faster for the all-gathers of that band and takes for them
    (its GatherPaths: the probe's calls meet its bands; a model from a file holds its probe's,
    which a later process's transport measures again); a band not in it: the faster of the
    two by the rates."""

    world: int
    node_size: int
    device: str
    intra: Optional[Link]
    inter: Optional[Link]
    kernels: Mapping[str, KernelRate]
    source: str = "user"
    calibration: Mapping[str, Calibration] = dataclasses.field(default_factory=dict)
    overlap: float = 1.0
    gather_paths: Mapping[int, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for name in ("world", "node_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"CostModel.{name} must be a positive int, got {v!r}")
        if self.world % self.node_size:
            raise ValueError(f"CostModel.world ({self.world}) must be a multiple of node_size ({self.node_size})")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"CostModel.device must be 'cpu' or 'cuda', got {self.device!r}")
        for tier, needed in (("intra", self.node_size > 1), ("inter", self.world > self.node_size)):
            link = getattr(self, tier)
            if needed and not isinstance(link, Link):
                raise ValueError(f"CostModel.{tier} must be a qcoll.cost.Link for a group of "
                                 f"{self.world} ranks, {self.node_size} per node, got {link!r}")
        keys = {f"{c}/{k}" for c, kinds in KINDS.items() for k in kinds}
        for key, cal in self.calibration.items():
            if key not in keys or not isinstance(cal, Calibration):
                raise ValueError(f"CostModel.calibration maps one of {sorted(keys)} to a qcoll.cost.Calibration; "
                                 f"got {key!r}: {cal!r}")
        if isinstance(self.overlap, bool) or not isinstance(self.overlap, (int, float)) or not 0 <= self.overlap <= 1:
            raise ValueError(f"CostModel.overlap must be a number from 0 to 1, got {self.overlap!r}")
        object.__setattr__(self, "overlap", float(self.overlap))  # 1 and 1.0: one fingerprint
        object.__setattr__(self, "gather_paths", check_gather_paths(self.gather_paths, "CostModel.gather_paths"))
        missing = [f for f in _PROBE_FORMATS if not isinstance(self.kernels.get(f), KernelRate)]
        if missing:
            raise ValueError(f"CostModel.kernels needs a KernelRate for every format {list(_PROBE_FORMATS)}; "
                             f"missing or not a KernelRate: {missing}")

    # ---- inspection and files ----------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["kernels"] = {k: dataclasses.asdict(v) for k, v in sorted(self.kernels.items())}
        d["calibration"] = {k: dataclasses.asdict(v) for k, v in sorted(self.calibration.items())}
        d["gather_paths"] = {str(band): path for band, path in self.gather_paths.items()}  # JSON keys
        return d

    @classmethod
    def from_dict(cls, d: dict, source: Optional[str] = None) -> "CostModel":
        try:
            return cls(world=d["world"], node_size=d["node_size"], device=d["device"],
                       intra=None if d["intra"] is None else Link(**d["intra"]),
                       inter=None if d["inter"] is None else Link(**d["inter"]),
                       kernels={k: KernelRate(**v) for k, v in d["kernels"].items()},
                       source=source or d.get("source", "user"),
                       calibration={k: Calibration(**v) for k, v in d.get("calibration", {}).items()},
                       overlap=d.get("overlap", 1.0),  # files from before it: the full overlap they assumed
                       gather_paths=_bands(d.get("gather_paths", {})))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a qcoll cost model ({e}); expected the keys of CostModel.to_dict()") from e

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "CostModel":
        with open(path) as f:
            return cls.from_dict(json.load(f), source=f"file {path}")

    def fingerprint(self) -> str:
        """A digest of the rates and topology (not the source): equal on ranks that agree."""
        d = self.to_dict()
        d.pop("source")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    # ---- prediction --------------------------------------------------------------------
    def predict(self, collective: str, numel: int, dtype: torch.dtype, policy) -> Prediction:
        """Seconds of one call of `collective` ("allgather": numel elements per rank;
        "reduce_scatter": numel output elements per rank; "all_reduce": a tensor of numel)
        in `dtype` with `policy` (the collective's qcoll policy object) on this group."""
        if collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be an int >= 0, got {numel!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        want = {"allgather": AllGatherPolicy, "reduce_scatter": ReduceScatterPolicy,
                "all_reduce": AllReducePolicy}[collective]
        if not isinstance(policy, want):
            raise TypeError(f"policy must be a qcoll.{want.__name__} for {collective!r}, got {type(policy).__name__}")
        p = self.estimate(collective, numel, dtype, policy)
        cal = self.calibration.get(self.calibration_key(collective, numel, dtype, policy))
        if cal is None:
            return p
        seconds = cal.apply(p.estimate_s)
        if collective == "all_reduce" and not policy.unquantized and cal.points and p.estimate_s > cal.points[-1][0]:
            # Above its last point a quantized all-reduce grows as its halves' calibrated
            # predictions do: it is its reduce-scatter then its all-gather (all_reduce.py),
            # and the probe's budget stops its own points first (at 2 MB on 1 Gbit/s links,
            # where its time grows 1.3x past its estimate from 8 MB, as the reduce-scatter's
            # own 8 and 32 MB points show: auto suite, 22-40% under along its last segment,
            # the rule above the points before 12-04).
            seconds = self._above_points_by_halves(numel, dtype, policy, cal.points[-1]) or seconds
        return dataclasses.replace(p, seconds=seconds)

    def _above_points_by_halves(self, numel: int, dtype: torch.dtype, policy: AllReducePolicy,
                                last_point: tuple) -> Optional[float]:
        """A quantized all-reduce of `numel` above its calibration's last point: that point's
        time x the growth of its halves' calibrated predictions from the call of this dtype
        and policy whose estimate is the point's (so the prediction is continuous there,
        whatever the policy: the point was measured with the probe's) to this one. None
        where a half has no calibration or no such call exists."""
        estimate, measured = last_point
        step = self.world  # whole multiples of world: an uneven tail's cost would break monotony
        lo, hi = 1, -(-numel // step)  # in steps; the estimate at hi is above the point's
        if self.estimate("all_reduce", lo * step, dtype, policy).seconds > estimate:
            return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.estimate("all_reduce", mid * step, dtype, policy).seconds <= estimate:
                lo = mid
            else:
                hi = mid
        now, at_point = (self._halves_seconds(n, dtype, policy) for n in (numel, lo * step))
        return None if now is None or at_point is None else measured * now / at_point

    def _halves_seconds(self, numel: int, dtype: torch.dtype, policy: AllReducePolicy) -> Optional[float]:
        """A quantized all-reduce's time as its halves' calibrated predictions (and the
        uneven tail's estimate); None where a half has no calibration."""
        halves = self._all_reduce_halves(numel, dtype, policy)
        rs_cal = self.calibration.get(f"reduce_scatter/{self.kind('reduce_scatter', halves.rs_policy)}")
        ag_cal = self.calibration.get("allgather/" + ("uncompressed" if halves.gather_format is None else "quantized"))
        if rs_cal is None or ag_cal is None:
            return None
        return (rs_cal.apply(_sum(halves.reduce_scatter).estimate_s) + ag_cal.apply(_sum(halves.all_gather).estimate_s)
                + _sum(halves.uneven).estimate_s)

    def calibration_key(self, collective: str, numel: int, dtype: torch.dtype, policy) -> str:
        """"<collective>/<kind>" of the calibration a call's prediction runs through: its
        kind, the bits=None all-reduce of host tensors by the path it takes
        (see KINDS)."""
        kind = self.kind(collective, policy)
        if (collective == "all_reduce" and policy.unquantized
                and policy.route(dtype.itemsize, numel, self.world, self._host_transport).path == "exchange"):
            kind = "uncompressed exchange"
        return f"{collective}/{kind}"

    @property
    def _host_transport(self) -> bool:
        """Whether the group's calls run over a transport with its own all-reduce on host
        tensors (gloo: call.has_transport_all_reduce), the route's host_transport."""
        return self.device == "cpu" and self.world > 1

    def kind(self, collective: str, policy) -> str:
        """The call's kind, which its calibration is by: "uncompressed", "quantized" (an
        all-gather), or "quantized 2-hop" / "quantized flat" (the path the core's plan takes
        on this group; it does not depend on the size)."""
        if policy.unquantized:
            return "uncompressed"
        if collective == "allgather":
            return "quantized"
        rs = policy.reduce_scatter() if collective == "all_reduce" else policy
        two_hop = self._rs_plan(1 << 24, torch.float32, rs).two_hop
        return "quantized 2-hop" if two_hop else "quantized flat"

    def estimate(self, collective: str, numel: int, dtype: torch.dtype, policy) -> Prediction:
        """The rates' estimate alone (no calibration); predict's arguments, unchecked."""
        if collective == "allgather":
            parts = self._all_gather(numel, dtype, policy.bits, policy.group_size)
        elif collective == "reduce_scatter":
            parts = self._reduce_scatter(numel, dtype, policy)
        else:
            parts = self._all_reduce(numel, dtype, policy)
        return _sum(parts)

    def _exchange(self, intra_bytes: float, inter_bytes: float) -> tuple:
        """(intra_s, inter_s) of one exchange; one latency: the slower tier's it touches."""
        intra_s = intra_bytes / self.intra.bandwidth if intra_bytes else 0.0
        inter_s = inter_bytes / self.inter.bandwidth if inter_bytes else 0.0
        lat = max([t.latency for t, b in ((self.intra, intra_bytes), (self.inter, inter_bytes)) if b] or [0.0])
        return (intra_s + lat, inter_s) if intra_s >= inter_s else (intra_s, inter_s + lat)

    def _peers(self) -> tuple:
        """(intra, inter) peers of one rank in an exchange over the whole group."""
        return self.node_size - 1, self.world - self.node_size

    def _ring(self, chunk: int) -> tuple:
        """(intra, inter) bytes one rank's link carries in the transport's ring all-gather or
        reduce-scatter of one `chunk` per rank: every chunk passes every ring edge but one,
        and a node-contiguous ring has one cross-node edge per node, shared by its ranks."""
        hops = (self.world - 1) * chunk
        if self.world == self.node_size:
            return hops, 0
        if self.node_size == 1:
            return 0, hops
        return hops * (self.node_size - 1) / self.node_size, hops / self.node_size

    def _kernel(self, fmt: Optional[str], encode: float, decode: float) -> float:
        rate = self.kernels[fmt or RAW]
        return encode / rate.encode + decode / rate.decode

    def _all_gather(self, n: int, dtype, bits, group_size, ring: bool = False) -> list:
        """ring: the transport's own all-reduce's gather half (gloo's ring whatever the size)."""
        headers = self.device == "cpu"
        wire = format_code(bits, "bits")
        plan = _C.plan_all_gather(self.world, n, _dtype_code(dtype), wire, group_size, headers)
        fmt = format_of(wire)
        # Both go through the transport's all-gather: raw values, or the encoded slots; on
        # CPU (gloo) an all-to-all, or past a size over nodes of several ranks the path the
        # transport measured faster for the size band (gather_paths; unknown: the faster at
        # the rates), else a ring.
        # Quantized: encode mine, decode all.
        kernel = 0.0 if fmt is None else self._kernel(fmt, n, self.world * n)
        sent = n * dtype.itemsize if fmt is None else plan.chunk  # what the transport is handed
        by_ring = self._ring(plan.chunk)
        by_all_to_all = tuple(peers * plan.chunk for peers in self._peers())
        if ring or self.device != "cpu":
            paths = [by_ring]
        elif measures_gather_path(self.world, self.node_size, self.world * sent):
            # The band's measured path where known: by the rates' faster, a 1 MB all-gather on
            # 3 x 2 at 1 Gbit/s took the ring (8 MB and up did) where the transport had
            # measured the all-to-all faster, and its time interpolated between a 512 KB
            # point of one path and a 2 MB point of the other: 24-33% under in every auto run.
            # (A band's measured path can make the estimate fall with the size where the
            # all-to-all's band is followed by a ring band: a synthetic 1 Gbit/s model does
            # so even on 2 x 2; the probes' models on 2 x 2 and 3 x 2 so far rise with it.)
            known = self.gather_paths.get(gather_band(self.world * sent))
            paths = {None: [by_ring, by_all_to_all], "ring": [by_ring], "all_to_all": [by_all_to_all]}[known]
        else:
            paths = [by_all_to_all]
        intra, inter = min(paths, key=lambda p: sum(self._exchange(*p)))  # a tie: the ring
        return [(*self._exchange(intra, inter), kernel, intra, inter)]

    def _rs_plan(self, n: int, dtype, p: ReduceScatterPolicy, raw_exchange: bool = False):
        hier = -1 if p.hierarchical is None else int(p.hierarchical)
        return _C.plan_reduce_scatter(self.world, self.node_size, n, _dtype_code(dtype), p.intra_code,
                                      p.inter_code, p.group_size, p.pipeline_stages, hier,
                                      self.device == "cpu", _MIN_STAGE_BYTES, p.hadamard_block, raw_exchange)

    def _reduce_scatter(self, n: int, dtype, p: ReduceScatterPolicy, raw_exchange: bool = False,
                        copies_input: bool = True) -> list:
        """One entry per stage, each (hop1 parts, hop2 parts) folded by _pipeline. copies_input:
        a host transport's own reduce-scatter copies its input first (ProcessGroupTransport);
        False for an all-reduce that is gloo's own, in place."""
        plan = self._rs_plan(n, dtype, p, raw_exchange)
        first, second = format_of(plan.first_format), format_of(plan.second_format)
        nodes = self.world // self.node_size
        hops = []
        for s in range(plan.stages):
            length = plan.slice_len(s)
            if plan.two_hop:  # intra all-to-all of world slots, then inter of `nodes` slots
                b1 = (self.node_size - 1) * nodes * plan.first_chunk(s)
                b2 = (nodes - 1) * plan.second_chunk(s)
                hop1 = (*self._exchange(b1, 0), self._kernel(first, self.world * length, self.world * length), b1, 0)
                hop2 = (*self._exchange(0, b2), self._kernel(second, nodes * length, nodes * length), 0, b2)
            elif plan.transport_reduces:  # raw: the transport's own (ring) reduce-scatter, which adds
                bi, be = self._ring(plan.first_chunk(s))
                copied = 0  # elements of fp32 the copy moves: the raw rate's unit (as the padding's below)
                if self.device == "cpu":  # gloo's is its all-reduce (of a copy of the input)
                    bi, be = 2 * bi, 2 * be
                    copied = self.world * length * dtype.itemsize / 4 if copies_input else 0
                hop1 = (*self._exchange(bi, be), self._kernel(first, copied, self.world * length), bi, be)
            else:  # one all-to-all over the group: quantized, or the raw exchange
                intra_peers, inter_peers = self._peers()
                bi, be = intra_peers * plan.first_chunk(s), inter_peers * plan.first_chunk(s)
                encoded = 0 if plan.sends_input else self.world * length
                hop1 = (*self._exchange(bi, be), self._kernel(first, encoded, self.world * length), bi, be)
            hops.append((hop1, hop2 if plan.two_hop else (0.0, 0.0, 0.0, 0, 0)))
        return _pipeline(hops, self.overlap)

    def _all_reduce(self, numel: int, dtype, p: AllReducePolicy) -> list:
        halves = self._all_reduce_halves(numel, dtype, p)
        return halves.reduce_scatter + halves.all_gather + halves.uneven

    def _all_reduce_halves(self, numel: int, dtype, p: AllReducePolicy) -> "_AllReduceHalves":
        """An all-reduce's parts as all_reduce.py runs it."""
        route = p.route(dtype.itemsize, numel, self.world, self._host_transport)  # as all_reduce.py runs it
        rs, raw_exchange = p.reduce_scatter(), route.raw_exchange
        if route.hierarchical != rs.hierarchical:
            rs = dataclasses.replace(rs, hierarchical=route.hierarchical)
        uneven = []  # what a numel that is not a multiple of world adds (as all_reduce.py does it)
        transport = route.path == "transport"  # gloo's own all-reduce (its gather half a ring)
        if transport:
            dtype = torch.float32  # its all-reduce of fp32 values
        if numel % self.world and not transport:
            if self.device == "cpu" and host_all_reduce_tail_apart(numel * dtype.itemsize):
                # the last elements by an all-gather of fp32 copies, summed where they land
                uneven = self._all_gather(numel % self.world, torch.float32, None, p.group_size)
                numel -= numel % self.world
            else:  # the tensor copied into a padded buffer and back (the raw rate: fp32 copies)
                uneven = [(0.0, 0.0, self._kernel(None, 2 * numel * dtype.itemsize / 4, 0), 0, 0)]
        n = -(-numel // self.world)
        parts = self._reduce_scatter(n, dtype, rs, raw_exchange, copies_input=not transport)
        gather = format_of(self._rs_plan(n, dtype, rs, raw_exchange).second_format)
        return _AllReduceHalves(parts, self._all_gather(n, dtype, gather, p.group_size, ring=transport), uneven,
                                rs, gather)


class _AllReduceHalves(NamedTuple):
    """An all-reduce's parts (each a list of _sum's tuples) and what its halves run with."""

    reduce_scatter: list
    all_gather: list
    uneven: list  # what a numel that is not a multiple of world adds
    rs_policy: ReduceScatterPolicy
    gather_format: Optional[str]


def _pipeline(hops: list, overlap: float) -> list:
    """Stage s's first hop overlaps stage s-1's second: per step the slower of the two, and
    the part of the faster one the host does not hide (1 - overlap of it); two steps of `a`
    seconds each take (2 - overlap) x a (_cost_probe._overlap measures it so)."""
    out = [hops[0][0]]
    shown = 1.0 - overlap
    for s in range(1, len(hops)):
        first, second = hops[s][0], hops[s - 1][1]
        slower, faster = (first, second) if _seconds(first) >= _seconds(second) else (second, first)
        out.append(slower)
        out.append((faster[0] * shown, faster[1] * shown, faster[2] * shown, faster[3], faster[4]))  # its bytes travel
    out.append(hops[-1][1])
    return out


def _seconds(part: tuple) -> float:
    return part[0] + part[1] + part[2]


def _sum(parts: list) -> Prediction:
    intra_s, inter_s, kernel_s = (sum(p[i] for p in parts) for i in range(3))
    return Prediction(seconds=intra_s + inter_s + kernel_s, intra_s=intra_s, inter_s=inter_s,
                      kernel_s=kernel_s, intra_bytes=int(sum(p[3] for p in parts)),
                      inter_bytes=int(sum(p[4] for p in parts)))


def _dtype_code(dtype: torch.dtype) -> int:
    from ._dtypes import dtype_code
    return dtype_code(dtype, "dtype")


# ---- the model of a group: given, loaded, or probed once; agreed by every rank ----------
# The default ProcessGroup (a new init_process_group starts afresh) -> {(the group's ranks,
# node size, backend): {device type: CostModel}}. Keyed by the ranks, not the Group: FSDP2
# makes a ProcessGroup of the same ranks for every module it shards with hpZ, and a probe
# per module made startup grow with depth (31 s for 2 blocks, 65 s for 6).
_MODELS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _cache_of(g) -> dict:
    per_world = _MODELS.setdefault(dist.distributed_c10d._get_default_group(), {})
    return per_world.setdefault((tuple(g.global_ranks), g.node_size, g.backend), {})
ENV_FILE = "QCOLL_COST_MODEL"  # a file an earlier probe wrote (CostModel.save), used at first use


def cost_model(group=None, *, device="cpu", model=None, path: Optional[str] = None,
               budget_s: Optional[float] = None) -> CostModel:
    """The CostModel of `group` (a qcoll.Group, a ProcessGroup or None: the world) for calls
    on `device` ("cpu", "cuda" or a torch.device). Collective the first time (and whenever
    `model` or `path` is given): every rank of the group must call it.

    model: a CostModel (or its to_dict()) to use instead of measuring; path: a file written
    by CostModel.save to load instead; neither: the cached model, else the file named by
    $QCOLL_COST_MODEL, else a probe bounded by budget_s seconds (default BUDGET_S).
    A model given or loaded must match the group (world, node_size, device) and be the
    same on every rank, and every rank must have one or every rank probe: otherwise (a
    file that did not load on some rank included) every rank raises ValueError."""
    from .group import resolve_group

    dev = _check_device(device)
    if model is not None and path is not None:
        raise ValueError("pass model= or path=, not both")
    if model is not None and not isinstance(model, (CostModel, dict)):
        raise TypeError(f"model must be a qcoll.CostModel, its to_dict() or None, got {type(model).__name__}")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a file path or None, got {type(path).__name__}")
    if budget_s is not None and (isinstance(budget_s, bool) or not isinstance(budget_s, (int, float))
                                 or not 0 < budget_s <= 600):
        raise ValueError(f"budget_s must be a number of seconds in (0, 600] or None, got {budget_s!r}")
    g = resolve_group(group)
    cache = _cache_of(g)
    if model is None and path is None and dev.type in cache:
        return cache[dev.type]
    # Where this rank's model comes from, or why it has none, goes to every rank before
    # anyone raises or probes: a file missing on one node, or $QCOLL_COST_MODEL set on some
    # ranks only, would otherwise leave the others waiting in an exchange of their own.
    given, error = None, None
    try:
        if isinstance(model, CostModel):
            given = model
        elif model is not None:
            given = CostModel.from_dict(model)
        elif path is not None:
            given = CostModel.load(os.fspath(path))
        elif os.environ.get(ENV_FILE):
            given = CostModel.load(os.environ[ENV_FILE])
    except (OSError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    views = _every_rank(g, _view(given, error, g, dev))
    if given is None and error is None and all(v == views[0] for v in views):  # every rank probes
        from ._cost_probe import probe
        with call.uncounted():  # the probe's calls are not the user's traffic
            given = probe(g, dev, BUDGET_S if budget_s is None else float(budget_s))
        views = _every_rank(g, _view(given, None, g, dev))
    if any(v[0] != views[0][0] for v in views) or views[0][0] in ("does not fit", "no model"):
        lines = "\n".join(f"  rank {r}: {v[1]}: {v[2]}, digest {v[0]}" for r, v in enumerate(views))
        raise ValueError(f"qcoll.cost_model: the ranks' cost models disagree or do not fit the group of "
                         f"{g.size} ranks, {g.node_size} per node, on {dev.type}:\n{lines}")
    cache[dev.type] = given
    _transport_follows(g, dev, given)
    return given


def model_for_calls(group, device: torch.device) -> CostModel:
    """cost_model(group, device=device) for deciding calls, the group's transport set to
    gather by the model's paths (_transport_follows). Only where every rank of the group
    reaches it at the same point between its calls (policy="auto" at a call description's
    first, agreed, meeting): unlike cost_model's cached answer, it changes the group."""
    model = cost_model(group, device=device)
    from .group import resolve_group

    _transport_follows(resolve_group(group), torch.device(device), model)
    return model


def _transport_follows(g, dev: torch.device, model: CostModel) -> None:
    """The group's host all-gathers take the paths the model prices (model.gather_paths,
    from the probe's group: a model shared with another group of the same ranks, or loaded
    from a file, would otherwise price paths that group's transport times again and may
    choose otherwise)."""
    if dev.type == "cpu":
        g.adopt_gather_paths(model.gather_paths)


def _check_device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or a torch.device of those, got {device!r}")
    return dev


def _view(model: Optional[CostModel], error: Optional[str], g, dev: torch.device) -> tuple:
    """(digest, source, detail) of a rank's model: its fingerprint where it fits the group;
    "no model" with why (a file that did not load), or "will probe" when none was asked for."""
    if error is not None:
        return "no model", "not loaded", error
    if model is None:
        return "will probe", "probe", "no model given, loaded or in $" + ENV_FILE
    fits = (model.world, model.node_size, model.device) == (g.size, g.node_size, dev.type)
    return (model.fingerprint() if fits else "does not fit", model.source,
            f"world {model.world}, node_size {model.node_size}, {model.device}")


def _every_rank(g, mine: tuple) -> list:
    """Every rank's `mine`, in rank order (after the group's queued calls)."""
    if g.size == 1:
        return [mine]
    call.drain(g)
    views = [None] * g.size
    dist.all_gather_object(views, mine, group=g.pg)
    return views