"""qcoll.cost_model: predictions (positive, monotone in size, the bytes qcoll.stats()
counts), argument checks, files, and the probe on 4 gloo ranks as 2 nodes x 2: bounded in
time, identical on every rank, cached; a rank holding another model raises on every rank."""

from __future__ import annotations

import dataclasses

import json
import os
import time

import pytest
import torch

import qcoll
from tests.support.distributed import run_ranks
from qcoll import AllGatherPolicy, AllReducePolicy, ReduceScatterPolicy
from qcoll.cost import _PROBE_FORMATS, Calibration, CostModel, KernelRate, Link

NODE_SIZE = 2
GBIT = 1e9 / 8  # bytes per second


def synthetic(world=4, node_size=NODE_SIZE, inter_gbit=1.0, intra_gbit=50.0, kernel=1e9, latency=1e-4,
              raw_kernel=4e9):
    """A model with the given rates (kernel: elements/s of the quantizing kernels; raw_kernel:
    of copy and add)."""
    inter = Link(inter_gbit * GBIT, latency) if world > node_size else None
    rates = {f: KernelRate(raw_kernel if f == "raw" else kernel, raw_kernel if f == "raw" else kernel)
             for f in _PROBE_FORMATS}
    return CostModel(world, node_size, "cpu", Link(intra_gbit * GBIT, latency), inter, rates)


POLICIES = [("allgather", AllGatherPolicy(bits=None)), ("allgather", AllGatherPolicy(bits=4)),
            ("reduce_scatter", ReduceScatterPolicy.transport()), ("reduce_scatter", ReduceScatterPolicy()),
            ("reduce_scatter", ReduceScatterPolicy(hierarchical=False)),
            ("all_reduce", AllReducePolicy(bits=None)), ("all_reduce", AllReducePolicy(inter_bits=4))]


@pytest.mark.parametrize("world", [4, 6])
def test_predictions_positive_and_monotone(world):
    m = synthetic(world)
    for collective, policy in POLICIES:
        times = [m.predict(collective, n, torch.bfloat16, policy).seconds for n in (1, 1 << 10, 1 << 16, 1 << 22)]
        assert all(t > 0 for t in times), (collective, policy)
        assert times == sorted(times), (collective, policy, times)


def test_quantizing_pays_only_on_a_slow_link():
    n = 16 << 20  # 64 MB of fp32 per all-gather input... per rank
    slow, fast = synthetic(inter_gbit=1.0), synthetic(inter_gbit=5000.0, intra_gbit=5000.0, kernel=2e8)
    for collective, raw, quantized in (("allgather", AllGatherPolicy(bits=None), AllGatherPolicy()),
                                       ("reduce_scatter", ReduceScatterPolicy.transport(), ReduceScatterPolicy()),
                                       ("all_reduce", AllReducePolicy(bits=None), AllReducePolicy())):
        assert slow.predict(collective, n, torch.float32, quantized).seconds < \
            slow.predict(collective, n, torch.float32, raw).seconds / 2
        assert fast.predict(collective, n, torch.float32, raw).seconds < \
            fast.predict(collective, n, torch.float32, quantized).seconds


def test_predicted_raw_all_gather_by_hand():
    m = synthetic(inter_gbit=1.0, intra_gbit=8.0, latency=1e-3)
    raw = AllGatherPolicy(bits=None)
    # Up to its limit the transport's all-to-all over 2 nodes x 2: each rank's 4000-byte
    # chunk (raw: no slot headers) to its one local and two remote peers.
    p = m.predict("allgather", 1000, torch.float32, raw)
    assert (p.intra_bytes, p.inter_bytes) == (4000, 8000)
    assert p.kernel_s == 0
    assert p.seconds == pytest.approx(4000 / (8 * GBIT) + 8000 / GBIT + 1e-3)
    # Past it the ring: each chunk passes 3 edges; per node one edge of its two crosses nodes.
    n = 1 << 16  # 1 MB gathered
    p = m.predict("allgather", n, torch.float32, raw)
    assert (p.intra_bytes, p.inter_bytes) == (6 * n, 6 * n)
    assert p.seconds == pytest.approx(6 * n / (8 * GBIT) + 6 * n / GBIT + 1e-3)


def test_unquantized_all_reduce_predicted_on_the_path_it_takes():
    """A bits=None host all-reduce is predicted on the path it takes
    (policy.unquantized_host_all_reduce). The transport's: of fp32 copies for bf16
    (predicted as the fp32 call). The raw exchange (from 4 ranks bf16 at every size, fp32 to
    1 MB): an all-to-all of the raw partitions (sent as they lie: no headers, no copy)
    summed at the owner, then the transport's all-gather."""
    from qcoll.policy import host_all_reduce_path

    raw = AllReducePolicy(bits=None)
    for world in (4, 2):  # 2 x 2 and 1 x 2
        m = synthetic(world=world)
        predict = lambda numel, dtype: m.predict("all_reduce", numel, dtype, raw)  # noqa: E731
        with host_all_reduce_path("transport"):
            assert predict(1 << 18, torch.bfloat16) == predict(1 << 18, torch.float32)
            transport = {n: predict(n, torch.float32) for n in (1 << 18, (1 << 18) + world)}
            transport["bf16"] = predict(1 << 18, torch.bfloat16)
        with host_all_reduce_path("exchange"):
            exchange = {n: predict(n, torch.float32) for n in transport if n != "bf16"}
            exchange["bf16"] = predict(1 << 18, torch.bfloat16)
        for n in transport:  # fp32 at its edge (1 MB) and past it, bf16 at 512 KB
            itemsize, numel = (2, 1 << 18) if n == "bf16" else (4, n)
            path = qcoll.policy.unquantized_host_all_reduce(itemsize, numel, world)
            dtype = torch.bfloat16 if n == "bf16" else torch.float32
            assert predict(numel, dtype) == (transport if path == "transport" else exchange)[n]
            assert exchange[n] != transport[n]
    m = synthetic()
    p = m.predict("all_reduce", 1 << 20, torch.bfloat16, raw)  # 2 MB: 512 KB partitions
    part = (1 << 18) * 2
    # all-to-all: 1 local peer, 2 remote; ring all-gather: 3 edges, half of them cross nodes
    assert (p.intra_bytes, p.inter_bytes) == (part + 3 * part // 2, 2 * part + 3 * part // 2)
    assert p.kernel_s == pytest.approx(4 * (1 << 18) / 4e9)  # the fp32 add of 4 sources, no encode
    # fp32 at 1 MB takes the same exchange: its raw 256 KB partitions, not the transport's
    # reduce-scatter (gloo's all-reduce of a copy)
    p = m.predict("all_reduce", 1 << 18, torch.float32, raw)
    part = (1 << 16) * 4
    assert (p.intra_bytes, p.inter_bytes) == (part + 3 * part // 2, 2 * part + 3 * part // 2)
    assert p.kernel_s == pytest.approx(4 * (1 << 16) / 4e9)


def test_transport_all_reduce_gathers_by_its_ring(monkeypatch):
    """The transport's own all-reduce (its path of policy.unquantized_host_all_reduce) is
    gloo's, its gather half a ring whatever size the transport's all-gather takes the
    all-to-all up to; past that size the all-gather is the faster of the two paths by the rates (the transport measures
    which), on this 1 Gbit/s link the ring with its fewer bytes across nodes."""
    from qcoll import _torch_transport

    m = synthetic()
    n = 1 << 14  # 64 KB of fp32
    predicted = {}
    for limit in (0, 1 << 40):
        monkeypatch.setattr(_torch_transport, "ALL_TO_ALL_GATHER_SPANNING_MAX_BYTES", limit)
        with qcoll.policy.host_all_reduce_path("transport"):
            ar = m.predict("all_reduce", n, torch.float32, AllReducePolicy(bits=None))
        ag = m.predict("allgather", n // 4, torch.float32, AllGatherPolicy(bits=None))
        predicted[limit] = ((ar.intra_bytes, ar.inter_bytes), (ag.intra_bytes, ag.inter_bytes))
    assert predicted[0][0] == predicted[1 << 40][0]  # the all-reduce: the ring either way
    assert predicted[0][1] == (3 * n // 2, 3 * n // 2)  # the all-gather: the faster (ring) past it,
    assert predicted[1 << 40][1] == (n, 2 * n)  # the all-to-all within it
    # Past it with a node's links slower than the links between nodes: the all-to-all, the
    # faster there by the rates.
    monkeypatch.setattr(_torch_transport, "ALL_TO_ALL_GATHER_SPANNING_MAX_BYTES", 0)
    ag = synthetic(inter_gbit=50.0, intra_gbit=1.0).predict("allgather", n // 4, torch.float32,
                                                           AllGatherPolicy(bits=None))
    assert (ag.intra_bytes, ag.inter_bytes) == (n, 2 * n)


def test_bits_none_all_reduce_tail_predicted_apart():
    """From 4 MB a bf16 size that is not a multiple of the group size: the whole shards by
    the exchange, the last numel % size elements by an all-gather of their fp32 values."""
    m = synthetic()
    raw = AllReducePolicy(bits=None)
    whole = m.predict("all_reduce", 2 << 20, torch.bfloat16, raw)
    tail = m.predict("allgather", 3, torch.float32, AllGatherPolicy(bits=None))
    both = m.predict("all_reduce", (2 << 20) + 3, torch.bfloat16, raw)
    assert (both.intra_bytes, both.inter_bytes) == (whole.intra_bytes + tail.intra_bytes,
                                                    whole.inter_bytes + tail.inter_bytes)
    assert both.seconds == pytest.approx(whole.seconds + tail.seconds)


def test_quantized_all_reduce_uneven_sizes_priced_as_run():
    """A quantized all-reduce of host tensors whose numel is not a multiple of the group
    size: from policy.HOST_TAIL_APART_MIN_BYTES its whole shards and the last elements by an
    all-gather of fp32 copies; below it the tensor copied into a padded buffer and back (two
    raw copies of it; the probe's raw rate is of fp32 elements, so bf16 ones at half its
    time) around the padded call."""
    m = synthetic()
    q = AllReducePolicy(bits=8)
    copy_s = 1 / m.kernels["raw"].encode  # one element copied
    small = 1000  # 2 KB of bf16: padded to 1000 (250 per rank), 998 + 2 would be its tail
    padded = m.predict("all_reduce", small - 2, torch.bfloat16, q)
    whole = m.predict("all_reduce", small, torch.bfloat16, q)
    assert padded.seconds == pytest.approx(whole.seconds + 2 * (small - 2) * copy_s / 2)
    assert (padded.intra_bytes, padded.inter_bytes) == (whole.intra_bytes, whole.inter_bytes)
    big = 2 << 20  # 4 MB of bf16
    tail = m.predict("allgather", 3, torch.float32, AllGatherPolicy(bits=None))
    whole = m.predict("all_reduce", big, torch.bfloat16, q)
    both = m.predict("all_reduce", big + 3, torch.bfloat16, q)
    assert both.seconds == pytest.approx(whole.seconds + tail.seconds)
    assert (both.inter_bytes, both.intra_bytes) == (whole.inter_bytes + tail.inter_bytes,
                                                    whole.intra_bytes + tail.intra_bytes)
    # On a GPU always padded: copies cost microseconds there, an exchange more.
    gpu = dataclasses.replace(m, device="cuda")
    assert gpu.predict("all_reduce", big + 3, torch.bfloat16, q).seconds == pytest.approx(
        gpu.predict("all_reduce", big + 4, torch.bfloat16, q).seconds + 2 * (big + 3) * copy_s / 2)


def test_calibration_line_and_fallback():
    # Points on a line (measured = 2 ms + 3 x estimate): that line.
    c = Calibration.fit([0.001, 0.002, 0.004], [0.005, 0.008, 0.014])
    assert (c.offset, c.scale) == (pytest.approx(0.002), pytest.approx(3.0))
    # Off the line, the fit minimizes relative errors: a noisy middle point moves it less
    # than the two ends hold it.
    c = Calibration.fit([0.001, 0.002, 0.004], [0.005, 0.010, 0.014])
    for e, m in zip([0.001, 0.004], [0.005, 0.014]):
        assert abs(c.line(e) / m - 1) < 0.1
    # A falling line (noise) or one below the origin: the best line through the origin,
    # scale = sum(e/m) / sum((e/m)^2).
    for measured in ([0.010, 0.008], [0.001, 0.012]):
        c = Calibration.fit([0.001, 0.004], measured)
        b = [0.001 / measured[0], 0.004 / measured[1]]
        assert (c.offset, c.scale) == (0.0, pytest.approx(sum(b) / sum(x * x for x in b)))


def test_calibration_runs_through_its_points():
    # The probe's points (estimate -> measured): a bend at 4 ms that no single line fits.
    est, meas = [0.001, 0.004, 0.016], [0.006, 0.012, 0.060]
    c = Calibration.fit(est, meas)
    assert c.points == tuple(zip(est, meas))
    for e, m in zip(est, meas):  # through every point
        assert c.apply(e) == pytest.approx(m)
    assert c.apply(0.0025) == pytest.approx(0.009)  # linear between neighbours
    assert c.apply(0.010) == pytest.approx(0.036)
    # Above: in proportion to the estimate, through the last point (measured / estimate 3.75),
    # whatever the last segment's slope (4.0 here).
    assert c.apply(0.032) == pytest.approx(0.060 * 2)
    flat = Calibration.fit([0.002, 0.008, 0.032], [0.002, 0.030, 0.0305])  # a slow middle point
    assert flat.apply(0.128) == pytest.approx(0.0305 * 4)  # not the nearly flat last segment
    # Below the first point: the fitted line's shape, scaled through the first point.
    assert c.apply(0.0005) == pytest.approx(0.006 * c.line(0.0005) / c.line(0.001))
    # A falling last segment (noise): above it, still the last point's ratio.
    c = Calibration.fit([0.001, 0.002], [0.010, 0.008])
    assert c.apply(0.004) == pytest.approx(0.016)
    # One size measured twice: one point, their mean. A single point: the line.
    c = Calibration.fit([0.001, 0.001], [0.004, 0.006])
    assert c.points == ((0.001, 0.005),) and c.apply(0.002) == pytest.approx(c.line(0.002))
    # Kept through a file (JSON lists come back as tuples).
    c = Calibration.fit(est, meas)
    m = synthetic()
    model = CostModel(m.world, m.node_size, m.device, m.intra, m.inter, m.kernels,
                      calibration={"allgather/uncompressed": c})
    again = CostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again.calibration["allgather/uncompressed"] == c and again.fingerprint() == model.fingerprint()
    for bad in ([(0.002, 0.01), (0.001, 0.02)], [(0.001, 0.0)], [(0.001,)], [(0.001, float("nan"))],
                [(0.001, 0.002, 0.003)], [0.001]):
        with pytest.raises(ValueError, match="Calibration.points"):
            Calibration(0.0, 1.0, bad)


def test_typical_time_is_the_mean_of_the_middle_calls():
    # A bimodal short call (modes 4 and 9 ms) with two stalls: the fastest fifth and the
    # slowest quarter dropped, the rest averaged, in any order; stalls of any length alike.
    from qcoll._cost_probe import typical_time

    times = [9, 4, 45, 9, 4, 9, 4, 9, 45, 4, 9]
    assert typical_time(times) == pytest.approx((4 + 4 + 9 + 9 + 9 + 9) / 6)
    assert typical_time([450 if t == 45 else t for t in times]) == pytest.approx(typical_time(times))
    assert typical_time([5, 1, 2, 3, 4, 40, 50]) == pytest.approx((2 + 3 + 4 + 5) / 4)  # 7: 1, 40 and 50 dropped
    assert typical_time([3.0, 1.0, 100.0]) == 3.0  # under five (long calls): the median


def _scripted_estimates(collective, group, model, calls, nbytes):
    """The scripted calibrations' estimates: 0.1 ns per byte (growing as the bytes do)."""
    return [nbytes * 1e-10] * len(calls)


# The scripted calibrations below start at 2 MB (the probe's own start is smaller:
# test_calibration_default_sizes), so that their sizes read 2, 8, 32 MB.
SCRIPTED_START = 2 << 20


def _calibrate_scripted(monkeypatch, slower, estimates=None):
    """The calibration over scripted points of 1 ns per byte, x slower(collective, bytes,
    how many times that size was measured so far, this one included), every rank's values
    its own: (the points asked for as (collective, bytes, repeats), the calibration)."""
    from qcoll import _cost_probe

    seen = []

    def times(collective, group, calls, nbytes, device, repeats):
        seen.append((collective, nbytes, repeats))
        count = sum(1 for c, b, _ in seen if (c, b) == (collective, nbytes))
        t = nbytes * 1e-9 * slower(collective, nbytes, count)
        return [t] * len(calls)

    monkeypatch.setattr(_cost_probe, "_calibration_times", times)
    monkeypatch.setattr(_cost_probe, "_estimates", estimates or _scripted_estimates)
    monkeypatch.setattr(_cost_probe, "agreed_max", lambda group, values, device: values)
    monkeypatch.setattr(_cost_probe.cm, "_CALIBRATION_START", SCRIPTED_START)
    return seen, _cost_probe._calibration(None, synthetic(), torch.device("cpu"), time.monotonic() + 60)


def test_calibration_measures_a_jump_again_and_keeps_the_faster(monkeypatch):
    # Scripted points: time = 1 ns per byte, except the first 8 MB measurement of the
    # all-gather, 10x (a burst of other load): measured again, the faster (second) kept; the
    # reduce-scatter's 8 MB at 7x, then 9x: the faster (first) kept. A real jump (the
    # all-reduce's 8 MB at 2x per byte) is measured again too, and stays.
    def slower(collective, nbytes, count):
        if collective == "allgather" and nbytes == 8 << 20 and count == 1:
            return 10
        if collective == "reduce_scatter" and nbytes == 8 << 20:
            return 7 if count == 1 else 9
        return 2 if collective == "all_reduce" and nbytes >= 8 << 20 else 1

    seen, cal = _calibrate_scripted(monkeypatch, slower)
    seen = [(c, b) for c, b, _ in seen]
    mb = 1 << 20
    sizes = [2 * mb, 8 * mb, 32 * mb]  # 4x from 2 MB, the next (128 MB) past the cap
    # In rounds: every collective measures a size before any measures the next; a jump twice.
    assert seen == ([(c, sizes[0]) for c in ("allgather", "reduce_scatter", "all_reduce")]
                    + [(c, sizes[1]) for c in ("allgather", "allgather", "reduce_scatter", "reduce_scatter",
                                               "all_reduce", "all_reduce")]
                    + [(c, sizes[2]) for c in ("allgather", "reduce_scatter", "all_reduce")])
    assert [m for _, m in cal["allgather/uncompressed"].points] == pytest.approx([b * 1e-9 for b in sizes])
    assert [m for _, m in cal["reduce_scatter/uncompressed"].points] == pytest.approx(
        [b * 1e-9 * (7 if b == 8 * mb else 1) for b in sizes])
    assert [m for _, m in cal["all_reduce/uncompressed"].points] == pytest.approx(
        [b * 1e-9 * (2 if b >= 8 * mb else 1) for b in sizes])


def _fixed_cost(nbytes):
    """A call of 5 ms + 2.5 ns per byte (2 MB: 10.2 ms, 8 MB: 26 ms, 32 MB: 89 ms): its time
    grows 2.5x from 2 to 8 MB and 3.4x from 8 to 32, not the bytes' 4x."""
    return 5e-3 + 2.5e-9 * nbytes


def _fixed_cost_estimates(collective, group, model, calls, nbytes):
    return [_fixed_cost(nbytes) / 10] * len(calls)


def test_calibration_measures_again_a_point_grown_past_its_estimate(monkeypatch):
    # Estimates with a fixed cost (2.5x from 2 to 8 MB). The all-gather's first 8 MB point
    # grows 4x from its 2 MB one (1.0x per byte: no jump against the bytes, 1.6x past its
    # estimate's growth: past _JUMP): measured again, the faster (second, as its estimate)
    # kept. The reduce-scatter's 8 MB grows 1.4x past its estimate's (within _JUMP): once.
    mb = 1 << 20

    def slower(collective, nbytes, count):  # x 1 ns per byte
        t = _fixed_cost(nbytes)
        if nbytes == 8 * mb and collective == "allgather" and count == 1:
            t = 4 * _fixed_cost(2 * mb)
        elif nbytes == 8 * mb and collective == "reduce_scatter":
            t *= 1.4
        return t / (nbytes * 1e-9)

    seen, cal = _calibrate_scripted(monkeypatch, slower, _fixed_cost_estimates)
    at_8mb = [c for c, b, _ in seen if b == 8 * mb]
    assert at_8mb.count("allgather") == 2 and at_8mb.count("reduce_scatter") == 1, seen
    assert [m for _, m in cal["allgather/uncompressed"].points][:2] == pytest.approx(
        [_fixed_cost(2 * mb), _fixed_cost(8 * mb)])
    assert [m for _, m in cal["reduce_scatter/uncompressed"].points][:2] == pytest.approx(
        [_fixed_cost(2 * mb), 1.4 * _fixed_cost(8 * mb)])


def test_calibration_measures_a_disturbed_size_before_again(monkeypatch):
    # Scripted points, 1 ns per byte, except at 2 MB: the all-gather's first measurement
    # at 5x per byte (the host busy at the probe's start), its second at 1x: measured again
    # once the 8 MB point shows it, the faster kept. The reduce-scatter's 2 MB at 2x per byte
    # (fixed cost, within _SLOWER_BEFORE): not measured again. The all-reduce's 2 MB at 3x
    # both times (a real fixed cost past the threshold): measured again, and stays.
    def slower(collective, nbytes, count):
        if nbytes != 2 << 20:
            return 1
        return {"allgather": 5 if count == 1 else 1, "reduce_scatter": 2, "all_reduce": 3}[collective]

    seen, cal = _calibrate_scripted(monkeypatch, slower)
    seen = [(c, b) for c, b, _ in seen]
    mb = 1 << 20
    assert seen[3:8] == [("allgather", 8 * mb), ("allgather", 2 * mb), ("reduce_scatter", 8 * mb),
                         ("all_reduce", 8 * mb), ("all_reduce", 2 * mb)], seen
    assert [m for _, m in cal["allgather/uncompressed"].points][:2] == pytest.approx([2e-9 * mb, 8e-9 * mb])
    assert [m for _, m in cal["reduce_scatter/uncompressed"].points][:2] == pytest.approx([4e-9 * mb, 8e-9 * mb])
    assert [m for _, m in cal["all_reduce/uncompressed"].points][:2] == pytest.approx([6e-9 * mb, 8e-9 * mb])


def test_calibration_compares_a_size_with_the_size_before_corrected(monkeypatch):
    # The all-gather's 2 MB first at 5x per byte (disturbed), then 1x; its 8 MB at 1.6x per
    # byte both times (a real jump, past _JUMP only against the corrected 2 MB): the 2 MB
    # point measured again (with its own 11 timed calls: the first size's calls are short),
    # then the 8 MB one (7: forecast past _SHORT_CALL_S), both kept as measured the second time.
    def slower(collective, nbytes, count):
        if collective == "allgather" and nbytes == 2 << 20:
            return 5 if count == 1 else 1
        return 1.6 if collective == "allgather" and nbytes == 8 << 20 else 1

    seen, cal = _calibrate_scripted(monkeypatch, slower)
    mb = 1 << 20
    assert [x for x in seen if x[0] == "allgather"][:4] == [
        ("allgather", 2 * mb, 11), ("allgather", 8 * mb, 7), ("allgather", 2 * mb, 11), ("allgather", 8 * mb, 7)]
    assert [m for _, m in cal["allgather/uncompressed"].points][:2] == pytest.approx([2e-9 * mb, 1.6 * 8e-9 * mb])


def test_calibration_stops_at_the_budget_with_one_point(monkeypatch):
    # The budget spent before the calibration begins: each collective measures its first
    # size once (no second size, no measuring again) and each kind keeps that one point,
    # through which a prediction scales the estimate.
    from qcoll import _cost_probe

    seen = []

    def times(collective, group, calls, nbytes, device, repeats):
        seen.append((collective, nbytes))
        return [nbytes * 1e-9 * (1 + i) for i in range(len(calls))]

    monkeypatch.setattr(_cost_probe, "_calibration_times", times)
    monkeypatch.setattr(_cost_probe, "_estimates", _scripted_estimates)
    monkeypatch.setattr(_cost_probe, "agreed_max", lambda group, values, device: values)
    monkeypatch.setattr(_cost_probe.cm, "_CALIBRATION_START", SCRIPTED_START)
    cal = _cost_probe._calibration(None, synthetic(), torch.device("cpu"), time.monotonic() - 1)
    first = 2 << 20
    assert seen == [("allgather", first), ("reduce_scatter", first), ("all_reduce", first)]
    assert len(cal) == 2 + 3 + 4  # the all-reduce's bits=None call on both host paths
    for c in cal.values():
        (e, m), = c.points
        assert c.apply(4 * e) == pytest.approx(4 * m)


class _Clock:
    """A monotonic clock that the scripted calibration calls advance."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


def _scripted_calibration(monkeypatch, budget, slower=lambda collective, nbytes: 1, start=SCRIPTED_START,
                          estimates=_scripted_estimates):
    """The calibration over scripted calls of 10 ns per byte (2 MB: 21 ms, 8 MB: 84 ms,
    32 MB: 336 ms; x slower(collective, bytes)), each size's warm-up and timed calls
    advancing a fake clock, the model's estimates from `estimates` (as _cost_probe's):
    (calls measured as (collective, bytes, repeats), calibration, seconds the clock advanced)."""
    from qcoll import _cost_probe

    clock = _Clock()
    seen = []

    def times(collective, group, calls, nbytes, device, repeats):
        t = nbytes * 1e-8 * slower(collective, nbytes)
        clock.now += len(calls) * (repeats + 1) * t
        seen.append((collective, nbytes, repeats))
        return [t] * len(calls)

    with monkeypatch.context() as mp:
        mp.setattr(_cost_probe, "_calibration_times", times)
        mp.setattr(_cost_probe, "_estimates", estimates)
        mp.setattr(_cost_probe, "agreed_max", lambda group, values, device: values)
        mp.setattr(_cost_probe.time, "monotonic", clock.monotonic)
        mp.setattr(_cost_probe.cm, "_CALIBRATION_START", start)
        start = clock.now
        cal = _cost_probe._calibration(None, synthetic(), torch.device("cpu"), start + budget)
    return seen, cal, clock.now - start


def test_calibration_rounds_end_within_the_budget(monkeypatch):
    # Whatever the budget: sizes in rounds (every collective measures a size before any
    # measures the next), the first size always measured, no later one started that ends
    # past the deadline, and a larger budget never fewer points.
    order = ("allgather", "reduce_scatter", "all_reduce")
    points = []
    for budget in (0.5, 2.0, 4.0, 6.0, 9.0, 60.0):
        seen, cal, elapsed = _scripted_calibration(monkeypatch, budget)
        assert [c for c, b, _ in seen if b == 2 << 20] == list(order)
        if len(seen) > 3:  # past the first round, within the budget
            assert elapsed <= budget, (budget, elapsed, seen)
        for i, (_, b, _) in enumerate(seen):  # a size's calls all come before the next size's
            assert all(bb <= b for _, bb, _ in seen[:i]), seen
        sizes = {c: [b for cc, b, _ in seen if cc == c] for c in order}
        for c in order:
            assert sizes[c] == [(2 << 20) * 4 ** i for i in range(len(sizes[c]))], sizes  # 2, 8, 32 MB
            assert all(len(v.points) == len(sizes[c]) for k, v in cal.items() if k.startswith(c + "/"))
        # 11 timed calls per kind at the first size (nothing measured yet: taken as short), 7 at
        # 8 MB (forecast 4 x 21 ms, past _SHORT_CALL_S) or 3 where 7 would not fit (below), 3
        # at 32 MB (4 x 84 ms >= _LONG_CALL_S).
        assert all(r in {2 << 20: (11,), 8 << 20: (7, 3), 32 << 20: (3,)}[b] for _, b, r in seen)
        points.append(len(seen))
    assert sizes == {c: [2 << 20, 8 << 20, 32 << 20] for c in order}  # 60 s: every size
    assert points == sorted(points) and points[0] == 3 and len(set(points)) >= 3, points


@pytest.mark.parametrize("budget, sizes", [(13.0, (3, 2, 2)), (18.0, (3, 3, 2))])
def test_calibration_forecast_counts_the_timed_calls(monkeypatch, budget, sizes):
    # By hand, the scripted calls' clock (2, 3 and 4 kinds: the all-reduce's bits=None call
    # on both host paths): the first round (11 timed calls a kind) ends at 2.26 s, the
    # second (7) at 8.30 s; at 32 MB each kind times 3 calls, not 7, so the forecast is the
    # 8 MB step's time x 6 x 4/8: the all-gather's 1.34 s -> 4.03 (ends at 12.33), the
    # reduce-scatter's 2.01 s -> 6.04 (after the all-gather's 2.68 s: ends at 17.03), the
    # all-reduce's 2.68 s -> 8.05 (after the reduce-scatter's 4.03 s: ends at 23.07).
    # Counting 8 calls (x 6 alone) would leave the all-gather out at 13 s.
    seen, _, elapsed = _scripted_calibration(monkeypatch, budget)
    got = tuple(len([b for c, b, _ in seen if c == collective])
                for collective in ("allgather", "reduce_scatter", "all_reduce"))
    assert got == sizes and elapsed <= budget, (got, elapsed)


@pytest.mark.parametrize("estimates, repeats", [(_fixed_cost_estimates, 7), (_scripted_estimates, 3)])
def test_calibration_forecast_grows_with_the_estimate(monkeypatch, estimates, repeats):
    # Calls of 5 ms + 2.5 ns per byte (_fixed_cost), within an 11 s budget. By hand: the
    # first two rounds (11, then 7 timed calls a kind) end at 2.98 s and the all-gather's and
    # reduce-scatter's 32 MB steps at 6.54 s. The all-reduce's 32 MB step with 7 timed calls
    # (2.85 s), forecast from its 8 MB one (0.83 s) x 1.5, x the estimate's growth (3.4x):
    # 4.27 s, ends at 10.8; x the bytes' (estimates that grow as the bytes do): 4.99 s, past
    # the budget, so it times 3 calls a kind (forecast 2.50 s).
    def slower(collective, nbytes):
        return _fixed_cost(nbytes) / (nbytes * 1e-8)

    seen, _, elapsed = _scripted_calibration(monkeypatch, 11.0, slower, estimates=estimates)
    got = tuple(len([b for c, b, _ in seen if c == collective])
                for collective in ("allgather", "reduce_scatter", "all_reduce"))
    assert got == (3, 3, 3) and elapsed <= 11.0, (got, elapsed)
    assert seen[-1] == ("all_reduce", 32 << 20, repeats), seen


def test_calibration_takes_fewer_calls_before_leaving_a_size_out(monkeypatch):
    # By hand (the scripted clock): the first round ends at 2.265 s. The all-gather's 8 MB
    # step, forecast from its 2 MB one (0.503 s x 4 x 1.5), takes 2.01 s with 7 timed calls a
    # kind (8/12 of the calls), past a 4 s budget; with 3 (4/12) 1.01 s: measured so (0.67 s,
    # ends at 2.94). The reduce-scatter's with 3 (1.51 s) and the all-reduce's (2.01 s) end
    # past 4 s: left out, as is the all-gather's 32 MB (4.03 s). Before, the all-gather kept
    # one point too, and its 8 MB predictions ran along the line through 2 MB.
    seen, cal, elapsed = _scripted_calibration(monkeypatch, 4.0)
    first, second = 2 << 20, 8 << 20
    assert seen == [("allgather", first, 11), ("reduce_scatter", first, 11), ("all_reduce", first, 11),
                    ("allgather", second, 3)], seen
    assert elapsed <= 4.0 and len(cal["allgather/uncompressed"].points) == 2
    assert len(cal["reduce_scatter/uncompressed"].points) == 1


def test_calibration_default_sizes(monkeypatch):
    # The probe's own sizes: 4x from 512 KB to the cap, in rounds; with time for them all,
    # every collective measures 512 KB, 2, 8 and 32 MB (between the auto suite's 1, 4, 16
    # and 64 MB, so that it checks predictions away from the points). The 512 KB point holds
    # the small calls' fixed cost: from 2 MB, 18 of the auto suite's 19 misses were at 1 MB.
    from qcoll import cost as cm

    seen, cal, _ = _scripted_calibration(monkeypatch, 120.0, start=cm._CALIBRATION_START)
    sizes = [512 << 10, 2 << 20, 8 << 20, 32 << 20]
    for c in ("allgather", "reduce_scatter", "all_reduce"):
        assert [b for cc, b, _ in seen if cc == c] == sizes, seen
    assert all(len(v.points) == len(sizes) for v in cal.values())


def test_calibration_measures_again_only_within_the_budget(monkeypatch):
    # The all-reduce's 8 MB calls at 10x per byte (a jump): its step (4 kinds) takes 26.8 s
    # and ends at 32.5 s; measured again (another 26.8 s) within a 70 s budget, not within 40 s.
    def slower(collective, nbytes):
        return 10 if (collective, nbytes) == ("all_reduce", 8 << 20) else 1

    for budget, times in ((70.0, 2), (40.0, 1)):
        seen, _, elapsed = _scripted_calibration(monkeypatch, budget, slower)
        assert [c for c, b, _ in seen if b == 8 << 20].count("all_reduce") == times, seen
        assert elapsed <= budget


def test_all_gather_priced_by_the_band_path_the_transport_took():
    # 3 x 2 at 1 Gbit/s across: by these rates the ring is the faster at every size here;
    # where the model holds a band's measured path it prices that one, whichever is faster.
    from qcoll._torch_transport import gather_band

    m = synthetic(6, 2, inter_gbit=1.0, latency=2e-3)
    policy = AllGatherPolicy(bits=None)
    for numel in (1 << 16, 1 << 18, 1 << 20):  # 768 KB to 12 MB of bf16 gathered
        band = gather_band(6 * numel * 2)
        free = m.estimate("allgather", numel, torch.bfloat16, policy).seconds
        ring, a2a = (dataclasses.replace(m, gather_paths={band: p}).estimate("allgather", numel, torch.bfloat16, policy)
                     for p in ("ring", "all_to_all"))
        assert free == min(ring.seconds, a2a.seconds) and ring.seconds != a2a.seconds
        assert (ring.intra_bytes, ring.inter_bytes) != (a2a.intra_bytes, a2a.inter_bytes)
        other = dataclasses.replace(m, gather_paths={band + 1: "ring", band - 1: "all_to_all"})
        assert other.estimate("allgather", numel, torch.bfloat16, policy).seconds == free  # other bands: free


def test_gather_paths_checked_and_kept_in_files():
    m = dataclasses.replace(synthetic(6, 2), gather_paths={11: "ring", 10: "all_to_all"})
    d = json.loads(json.dumps(m.to_dict()))
    assert d["gather_paths"] == {"10": "all_to_all", "11": "ring"}
    again = CostModel.from_dict(d)
    assert again.gather_paths == {10: "all_to_all", 11: "ring"} and again.fingerprint() == m.fingerprint()
    assert dataclasses.replace(m, gather_paths={11: "all_to_all"}).fingerprint() != m.fingerprint()
    d.pop("gather_paths")  # a file from before: no band's path known
    assert CostModel.from_dict(d).gather_paths == {}
    for bad in ({0: "ring"}, {"10": "ring"}, {10: "tree"}, {True: "ring"}):
        with pytest.raises(ValueError, match="gather_paths"):
            dataclasses.replace(m, gather_paths=bad)
    with pytest.raises(ValueError, match="gather_paths"):
        CostModel.from_dict(dict(d, gather_paths={"10": "ring", "262144-1048576": {"path": "ring"}}))
    # The auto suite's records before the field: the transport's trials under this key.
    trials = {"262144-1048576": {"path": "all_to_all", "measured_s": {"ring": 0.01, "all_to_all": 0.007}},
              "1048576-4194304": {"path": "ring", "measured_s": {"ring": 0.016, "all_to_all": 0.027}}}
    assert CostModel.from_dict(dict(d, gather_paths=trials)).gather_paths == {10: "all_to_all", 11: "ring"}


# The model's paths for four size bands past the limit ((256 KB, 1 MB] ... (16 MB, 64 MB]),
# and one within it (band 5, up to 1 KB gathered), which no transport measures: left out.
MODEL_PATHS = {5: "ring", 10: "ring", 11: "all_to_all", 12: "ring", 13: "all_to_all"}


def _follows_model(rank, world):
    """A group given a model with gather paths, then a sibling group of the same ranks (the
    cached model, through policy="auto"), then a group without a model: per gather, how it
    was posted and whether it landed; the trial gathers run; each group's gather_paths."""
    from qcoll import _torch_transport as tt
    from tests.collectives.test_transport_all_gather import _recording

    trials, seen = [], []
    real_timed = tt._timed
    tt._timed = lambda gather, by_all_to_all: (trials.append(by_all_to_all), real_timed(gather, by_all_to_all))[1]
    restore = _recording(seen)
    out = {}
    try:
        g = qcoll.new_group(node_size=NODE_SIZE)
        qcoll.cost_model(g, model=dataclasses.replace(synthetic(world), gather_paths=MODEL_PATHS))
        limit = tt.ALL_TO_ALL_GATHER_SPANNING_MAX_BYTES
        for numel in (limit // 4 // world + 5, 4 * limit // 4 // world + 3):  # bands 10 and 11, fp32
            base = torch.arange(world * numel, dtype=torch.float32)
            full = torch.full((world * numel,), float("nan"))
            before = len(seen)
            qcoll.quantized_allgather(full, base[rank * numel:(rank + 1) * numel].clone(), g, bits=None)
            through = sorted({how for _, b, how in seen[before:] if b >= numel * 4})
            out[tt.gather_band(world * numel * 4)] = (through, torch.equal(full, base))
        out["trials_given"] = list(trials)
        sibling = qcoll.new_group(node_size=NODE_SIZE)
        x = torch.randn(1 << 18)  # 1 MB a rank of fp32: 4-6 MB gathered uncompressed, 1-1.5 MB as int8
        qcoll.quantized_allgather(torch.empty(world * x.numel()), x, sibling, bits=8, policy="auto")
        out["trials_sibling"] = list(trials)
        fresh = qcoll.new_group(node_size=NODE_SIZE)  # no model: its first gather of a band measures
        qcoll.quantized_allgather(torch.empty(world * x.numel()), x, fresh, bits=None)
        out["trials_fresh"] = list(trials)
        band = out["fresh_band"] = tt.gather_band(world * x.numel() * 4)
        out["paths"] = [grp.gather_paths for grp in (g, sibling, fresh)]
        # A band the group measured, switched by a model given later that holds the other path.
        measured = fresh.gather_paths[tt.band_bounds(band)]["path"]
        other = "ring" if measured == "all_to_all" else "all_to_all"
        qcoll.cost_model(fresh, model=dataclasses.replace(synthetic(world), gather_paths={band: other}))
        numel = x.numel()  # past 1 MB gathered: the all-to-all as pairs
        base = torch.arange(world * numel, dtype=torch.float32)
        full = torch.full((world * numel,), float("nan"))
        before = len(seen)
        qcoll.quantized_allgather(full, base[rank * numel:(rank + 1) * numel].clone(), fresh, bits=None)
        through = sorted({how for _, b, how in seen[before:] if b >= numel * 4})
        out["switched"] = (other, through, torch.equal(full, base), fresh.gather_paths[tt.band_bounds(band)],
                           len(trials) == len(out["trials_fresh"]))
        try:
            g.adopt_gather_paths({10: "tree"})
        except ValueError as exc:
            out["bad"] = str(exc)
        for grp in (g, sibling, fresh):
            grp.close()
    finally:
        restore()
        tt._timed = real_timed
    return out


@pytest.mark.parametrize("world", [4, 6])  # 2 x 2 and 3 x 2
def test_transport_gathers_by_the_models_paths(world):
    """A group's host all-gathers take the paths its cost model prices (the model's bands,
    untimed), so that a model given, loaded, or shared by a sibling group is one with what
    runs; a group without one still measures."""
    from qcoll._torch_transport import band_bounds

    results = run_ranks(world, _follows_model, timeout=180)
    for out in results:
        assert out[10] == ([], True), out[10]  # the ring, up to 1 MB gathered gloo's own (not recorded)
        assert out[11] == (["pairs"], True), out[11]  # the all-to-all, past 1 MB as pairs
        assert out["trials_given"] == [] and out["trials_sibling"] == [], out
        assert out["trials_fresh"] == [False, True, True, False], out["trials_fresh"]
        given, sibling, fresh = out["paths"]
        expected = {band_bounds(b): {"path": p, "measured_s": None} for b, p in MODEL_PATHS.items() if b >= 10}
        assert given == expected and sibling == expected, (given, sibling)
        ((bounds, chosen),) = fresh.items()
        assert bounds == band_bounds(out["fresh_band"]) and chosen["measured_s"] is not None, fresh
    assert all(out["paths"] == results[0]["paths"] for out in results)  # agreed: the same on every rank
    for out in results:
        other, through, landed, shown, no_trials = out["switched"]
        # Past 1 MB gathered: the all-to-all as pairs, the ring as send/recv steps.
        assert through == (["pairs"] if other == "all_to_all" else ["ring"]) and landed and no_trials, out["switched"]
        assert shown == {"path": other, "measured_s": None}, shown
    assert "adopt_gather_paths: paths" in results[0].get("bad", ""), results[0].get("bad")



def test_calibration_applies_per_collective_and_kind():
    cal = {"allgather/uncompressed": Calibration(0.001, 2.0), "all_reduce/quantized 2-hop": Calibration(0.0, 0.5),
           "reduce_scatter/quantized flat": Calibration(0.002, 1.5)}
    m = synthetic()
    calibrated = CostModel(m.world, m.node_size, m.device, m.intra, m.inter, m.kernels, calibration=cal)
    for collective, policy in POLICIES:
        raw = m.predict(collective, 1 << 16, torch.bfloat16, policy)
        p = calibrated.predict(collective, 1 << 16, torch.bfloat16, policy)
        key = f"{collective}/{m.kind(collective, policy)}"
        want = raw.seconds if key not in cal else cal[key].offset + cal[key].scale * raw.seconds
        assert p.seconds == pytest.approx(want) and p.estimate_s == raw.seconds, (collective, policy)
        assert (p.intra_bytes, p.inter_bytes, p.kernel_s) == (raw.intra_bytes, raw.inter_bytes, raw.kernel_s)
    # The kinds by hand: the default reduce-scatter and all-reduce take 2 hops on 2 x 2.
    assert [m.kind(c, p) for c, p in POLICIES] == [
        "uncompressed", "quantized", "uncompressed", "quantized 2-hop", "quantized flat", "uncompressed",
        "quantized 2-hop"]
    assert calibrated.fingerprint() != m.fingerprint()
    assert CostModel.from_dict(calibrated.to_dict()).to_dict() == calibrated.to_dict()
    with pytest.raises(ValueError, match="CostModel.calibration"):
        CostModel(m.world, m.node_size, m.device, m.intra, m.inter, m.kernels,
                  calibration={"broadcast/quantized": Calibration(0.0, 1.0)})
    with pytest.raises(ValueError, match="Calibration.scale"):
        Calibration(0.0, 0.0)
    with pytest.raises(ValueError, match="Calibration.offset"):
        Calibration(-1.0, 1.0)


def test_quantized_all_reduce_above_its_points_grows_as_its_halves():
    # A quantized all-reduce is its reduce-scatter then its all-gather. The probe's budget
    # stops its own points first (2 MB on 1 Gbit/s links), so above its last point it grows
    # as its halves' calibrated predictions do, from the call of the same dtype and policy
    # whose estimate is the point's (so the prediction is continuous there); within its
    # points, they alone. Here the reduce-scatter's calls take 1x their estimate at 2 MB and
    # 2x at 64 MB (its points go further: the suite's 1 Gbit/s runs climb so from 8 MB), the
    # all-gather's 1 ms + 1.3x, the all-reduce's two points 1.1x: by its own last point a
    # 64 MB call would be predicted at 1.1x its estimate, by its halves at more.
    m = synthetic(inter_gbit=1.0)
    bf16, q = torch.bfloat16, AllReducePolicy()
    sizes, big = [1 << 18, 1 << 20], 1 << 25  # 512 KB, 2 MB and 64 MB of bf16, numel as predict takes it
    rs_estimates = [m.estimate("reduce_scatter", n // m.world, bf16, q.reduce_scatter()).seconds
                    for n in (sizes[-1], big)]
    halves = {"reduce_scatter/quantized 2-hop": Calibration.fit(rs_estimates, [rs_estimates[0], 2 * rs_estimates[1]]),
              "allgather/quantized": Calibration(1e-3, 1.3)}
    estimates = [m.estimate("all_reduce", n, bf16, q).seconds for n in sizes]
    own = Calibration.fit(estimates, [1.1 * e for e in estimates])
    model = CostModel(m.world, m.node_size, m.device, m.intra, m.inter, m.kernels,
                      calibration=dict(halves, **{"all_reduce/quantized 2-hop": own}))

    def by_halves(numel, dtype, policy=q, calibration=halves):  # from the public estimates
        n = -(-numel // m.world)
        rs = m.estimate("reduce_scatter", n, dtype, policy.reduce_scatter()).seconds
        ag = m.estimate("allgather", n, dtype, AllGatherPolicy(bits=policy.cross_bits, group_size=policy.group_size))
        return (calibration["reduce_scatter/" + m.kind("reduce_scatter", policy.reduce_scatter())].apply(rs)
                + calibration["allgather/quantized"].apply(ag.seconds))

    # bf16 and the probe's policy: from the last point's own call.
    want = 1.1 * estimates[-1] * by_halves(big, bf16) / by_halves(sizes[-1], bf16)
    got = model.predict("all_reduce", big, bf16, q).seconds
    assert got == pytest.approx(want, rel=1e-6)
    assert got > 1.2 * own.apply(m.estimate("all_reduce", big, bf16, q).seconds)  # not its own points
    for numel in (sizes[0], 1 << 19, sizes[-1]):  # within the points: through them
        assert model.predict("all_reduce", numel, bf16, q).seconds == pytest.approx(
            1.1 * m.estimate("all_reduce", numel, bf16, q).seconds)
    # Another dtype or policy (fp32; int4 across nodes, the DDP hook's default; a smaller
    # block; the flat path): continuous across the last point and rising past it, and the
    # int4 call predicted below the int8 one of its size.
    flat = AllReducePolicy(hierarchical=False)
    both = dict(halves, **{"all_reduce/quantized 2-hop": own, "all_reduce/quantized flat": own,
                           "reduce_scatter/quantized flat": halves["reduce_scatter/quantized 2-hop"]})
    model = dataclasses.replace(model, calibration=both)
    for dtype, policy in ((torch.float32, q), (bf16, AllReducePolicy(inter_bits=4)),
                          (bf16, AllReducePolicy(group_size=64)), (bf16, flat)):
        step = m.world
        n = step  # the largest whole call at or below the point's estimate
        while m.estimate("all_reduce", 2 * n, dtype, policy).seconds <= estimates[-1]:
            n *= 2
        lo, hi = n, 2 * n
        while hi - lo > step:
            mid = (lo + hi) // (2 * step) * step
            lo, hi = (mid, hi) if m.estimate("all_reduce", mid, dtype, policy).seconds <= estimates[-1] else (lo, mid)
        below, above = (model.predict("all_reduce", k, dtype, policy).seconds for k in (lo, hi))
        assert below == pytest.approx(1.1 * m.estimate("all_reduce", lo, dtype, policy).seconds)
        assert above == pytest.approx(1.1 * estimates[-1] * by_halves(hi, dtype, policy, both)
                                      / by_halves(lo, dtype, policy, both), rel=1e-6)
        assert below <= above <= below * 1.001, (dtype, policy)
        times = [model.predict("all_reduce", k, dtype, policy).seconds for k in sorted((hi, 4 * hi, 64 * hi, big + 3))]
        assert times == sorted(times), (dtype, policy, times)  # big + 3: an uneven numel
    assert model.predict("all_reduce", big, bf16, AllReducePolicy(inter_bits=4)).seconds < \
        model.predict("all_reduce", big, bf16, q).seconds
    gpu = dataclasses.replace(model, device="cuda")
    assert gpu.predict("all_reduce", big, bf16, q).seconds > \
        1.2 * own.apply(gpu.estimate("all_reduce", big, bf16, q).seconds)
    # Not for a model without a half's calibration, or the bits=None all-reduce (not the
    # halves' kinds).
    for missing in ("reduce_scatter/quantized 2-hop", "allgather/quantized"):
        other = dataclasses.replace(model, calibration={k: v for k, v in both.items() if k != missing})
        assert other.predict("all_reduce", big, bf16, q).seconds == pytest.approx(
            own.apply(m.estimate("all_reduce", big, bf16, q).seconds))
    bits_none = AllReducePolicy(bits=None)
    exchange = Calibration.fit(estimates, [2 * e for e in estimates])
    plain = dataclasses.replace(model, calibration=dict(halves, **{"all_reduce/uncompressed exchange": exchange}))
    assert plain.predict("all_reduce", big, bf16, bits_none).seconds == pytest.approx(
        exchange.apply(m.estimate("all_reduce", big, bf16, bits_none).seconds))


def test_pipeline_overlap_hides_the_shorter_hop():
    # A 2-hop reduce-scatter of 8M fp32 outputs per rank runs 2 stages (16 MB slices per
    # partition). Stage 1's intra-node hop beside stage 0's inter-node hop: overlap 0 costs
    # their sum (the one-stage call, the second stage's two exchanges' latencies and its
    # slots' headers: under 1e-5 of the call), 1 the
    # slower of the two, and the time between is linear in the overlap; the bytes do not change with it.
    n, latency = 8 << 20, 1e-4
    base = synthetic(latency=latency)
    two, one = ReduceScatterPolicy(pipeline_stages=2, hierarchical=True), ReduceScatterPolicy(
        pipeline_stages=1, hierarchical=True)
    assert base._rs_plan(n, torch.float32, two).stages == 2
    at = {f: dataclasses.replace(base, overlap=f).estimate("reduce_scatter", n, torch.float32, two)
          for f in (0.0, 0.5, 1.0)}
    single = dataclasses.replace(base, overlap=0.0).estimate("reduce_scatter", n, torch.float32, one)
    assert at[0.0].seconds == pytest.approx(single.seconds + 2 * latency, rel=1e-5)
    assert at[1.0].seconds < at[0.5].seconds < at[0.0].seconds
    assert at[0.5].seconds == pytest.approx((at[0.0].seconds + at[1.0].seconds) / 2, rel=1e-9)
    hidden = at[0.0].seconds - at[1.0].seconds  # the faster hop of the pair: under half the call
    assert 0 < hidden < at[0.0].seconds / 2
    assert len({(p.intra_bytes, p.inter_bytes) for p in at.values()}) == 1
    # One stage has nothing to overlap.
    assert dataclasses.replace(base, overlap=1.0).estimate("reduce_scatter", n, torch.float32, one) == single


@pytest.mark.parametrize("ratio", [1.0, 1.2, 1.5, 1.9, 2.0, 3.0, 0.9])
def test_probe_overlap_is_what_the_pipeline_prices(ratio):
    # The probe times two steps of work at once against one (b / a); the overlap it keeps
    # must make the pipeline price two overlapping steps of a seconds at b (within [a, 2a]).
    from qcoll._cost_probe import overlap_from
    from qcoll.cost import _pipeline

    step = (0.25, 0.25, 0.5, 100, 40)  # 1 s: intra, inter, kernel seconds; intra, inter bytes
    parts = _pipeline([(step, step), (step, step)], overlap_from(ratio))
    overlapped = sum(p[0] + p[1] + p[2] for p in parts) - 2.0  # less stage 0's first hop and stage 1's second
    assert overlapped == pytest.approx(min(max(ratio, 1.0), 2.0))


def test_pipeline_keeps_both_hops_of_equal_time():
    # Two overlapping hops of the same time (here an intra-node and an inter-node one): one
    # is the step, the other the part shown, each with its own bytes.
    from qcoll.cost import _pipeline

    intra, inter = (0.5, 0.0, 0.5, 100, 0), (0.0, 0.5, 0.5, 0, 40)
    for overlap in (0.0, 0.5, 1.0):
        parts = _pipeline([(intra, inter), (intra, inter)], overlap)
        assert (sum(p[3] for p in parts), sum(p[4] for p in parts)) == (200, 80)
        assert sum(p[0] + p[1] + p[2] for p in parts) == pytest.approx(4.0 - overlap)


def _measured_overlap(rank, world, device):
    from qcoll import _C, _cost_probe

    torch.set_num_threads(1)  # one core per thread (torchrun's default)
    _C.set_openmp_threads(1)
    g = qcoll.new_group(node_size=1)
    try:
        return _cost_probe._overlap(g, torch.device(device))
    finally:
        g.close()


def test_probe_measures_the_overlap_a_spare_core_gives():
    # One rank, two threads of one core each: where the machine has two cores, the second
    # thread's work hides under the first's (0.95-0.97 here). A GPU's lanes are streams: 1,
    # nothing timed.
    # Another process busy meanwhile takes the spare core (0.47 once, in a CI run on a busy
    # machine): up to three measurements, one of them with the core spare.
    if len(os.sched_getaffinity(0)) >= 2:
        overlaps = []
        while len(overlaps) < 3 and not any(o > 0.5 for o in overlaps):
            overlaps += run_ranks(1, _measured_overlap, "cpu")
        assert max(overlaps) > 0.5, overlaps
    assert run_ranks(1, _measured_overlap, "cuda") == [1.0]


def test_bits_none_all_reduce_calibrated_by_its_host_path():
    # A bits=None all-reduce of host tensors takes the exchange or the transport's all-reduce
    # by dtype, size and ranks (on 2 ranks bf16 from 1 MB the exchange, below it the
    # transport's all-reduce of fp32 copies; on 4 fp32 to 1 MB the exchange, past it the
    # transport's): each runs through its own points, so a 1 MB prediction is not scaled
    # from a 512 KB point of the other path.
    from qcoll.policy import UNQUANTIZED_EXCHANGE_MIN_BYTES, host_all_reduce_path

    m, pair = synthetic(), synthetic(world=2)
    bits_none, quantized = AllReducePolicy(bits=None), AllReducePolicy()
    small, large = UNQUANTIZED_EXCHANGE_MIN_BYTES // 2 - 1, UNQUANTIZED_EXCHANGE_MIN_BYTES // 2  # bf16 numel
    key = lambda numel, dtype=torch.bfloat16, policy=bits_none, model=m: model.calibration_key(  # noqa: E731
        "all_reduce", numel, dtype, policy)
    assert key(small, model=pair) == "all_reduce/uncompressed"
    assert key(large, model=pair) == "all_reduce/uncompressed exchange"
    assert key(small) == key(large) == "all_reduce/uncompressed exchange"
    assert key(1 << 18, torch.float32) == "all_reduce/uncompressed exchange"
    assert key((1 << 18) + 4, torch.float32) == key(1 << 24, torch.float32) == "all_reduce/uncompressed"
    small, large = (1 << 18) + 4, 1 << 18  # fp32 numel: the transport's, the exchange
    key = lambda numel, dtype=torch.float32, policy=bits_none, model=m: model.calibration_key(  # noqa: E731
        "all_reduce", numel, dtype, policy)
    assert key(large, policy=quantized) == "all_reduce/quantized 2-hop"
    gpu = CostModel(m.world, m.node_size, "cuda", m.intra, m.inter, m.kernels)
    assert key(large, model=gpu) == "all_reduce/uncompressed"  # no host paths on a GPU
    with host_all_reduce_path("exchange"):
        assert key(small) == "all_reduce/uncompressed exchange"
    with host_all_reduce_path("transport"):
        assert key(large) == "all_reduce/uncompressed"
    assert key(large) == "all_reduce/uncompressed exchange"  # the context left: by size again
    with pytest.raises(ValueError, match="path must be one of"):
        with host_all_reduce_path("ring"):
            pass

    # Predictions run through each path's own points: 2x and 5x the estimate.
    cal = {"all_reduce/uncompressed": Calibration(0.0, 2.0), "all_reduce/uncompressed exchange": Calibration(0.0, 5.0)}
    calibrated = CostModel(m.world, m.node_size, m.device, m.intra, m.inter, m.kernels, calibration=cal)
    for numel, scale in ((small, 2.0), (large, 5.0)):
        raw = m.predict("all_reduce", numel, torch.float32, bits_none).seconds
        assert calibrated.predict("all_reduce", numel, torch.float32, bits_none).seconds == pytest.approx(scale * raw)


def test_checks():
    m = synthetic()
    with pytest.raises(ValueError, match="Link.bandwidth"):
        Link(-1.0, 0.0)
    with pytest.raises(ValueError, match="KernelRate.encode"):
        KernelRate(0, 1)
    with pytest.raises(ValueError, match="missing"):
        CostModel(4, 2, "cpu", Link(1, 0), Link(1, 0), {"int8": KernelRate(1, 1)})
    with pytest.raises(ValueError, match="CostModel.inter"):
        CostModel(4, 2, "cpu", Link(1, 0), None, m.kernels)
    with pytest.raises(ValueError, match="multiple of node_size"):
        CostModel(5, 2, "cpu", Link(1, 0), Link(1, 0), m.kernels)
    with pytest.raises(ValueError, match="collective must be"):
        m.predict("broadcast", 10, torch.float32, AllGatherPolicy())
    with pytest.raises(TypeError, match="ReduceScatterPolicy"):
        m.predict("reduce_scatter", 10, torch.float32, AllGatherPolicy())
    with pytest.raises(ValueError, match="numel"):
        m.predict("allgather", -1, torch.float32, AllGatherPolicy())
    with pytest.raises(ValueError, match="dtype"):
        m.predict("allgather", 1, torch.int32, AllGatherPolicy())
    # cost_model's own arguments are checked before any group is resolved (no process group here)
    with pytest.raises(ValueError, match="device"):
        qcoll.cost_model(device="tpu")
    with pytest.raises(ValueError, match="not both"):
        qcoll.cost_model(model=m, path="x.json")
    with pytest.raises(TypeError, match="model must be"):
        qcoll.cost_model(model=3)
    with pytest.raises(ValueError, match="budget_s"):
        qcoll.cost_model(budget_s=0)
    with pytest.raises(ValueError, match="not a qcoll cost model"):
        CostModel.from_dict({"world": 4})
    for overlap in (-0.1, 1.5, True, "1", float("nan")):
        with pytest.raises(ValueError, match="CostModel.overlap must be a number from 0 to 1"):
            dataclasses.replace(m, overlap=overlap)


def test_file_round_trip(tmp_path):
    m = synthetic()
    path = tmp_path / "model.json"
    m.save(str(path))
    back = CostModel.load(str(path))
    assert back.fingerprint() == m.fingerprint() and back.source == f"file {path}"
    assert back.to_dict() == dict(m.to_dict(), source=back.source)
    d = dataclasses.replace(m, overlap=0.25).to_dict()
    assert CostModel.from_dict(d).overlap == 0.25
    d.pop("overlap")  # a file written before the field: the full overlap its predictions assumed
    assert CostModel.from_dict(d).overlap == 1.0


# ---- on ranks ----------------------------------------------------------------------------
def _probe(rank, world, budget):
    g = qcoll.new_group(node_size=NODE_SIZE)
    qcoll.reset_stats()
    t0 = time.perf_counter()
    m = qcoll.cost_model(g, budget_s=budget)
    elapsed = time.perf_counter() - t0
    probe_stats = qcoll.stats()  # the probe's calls are not the user's traffic
    sibling = qcoll.new_group(node_size=NODE_SIZE)  # another ProcessGroup of the same ranks
    t1 = time.perf_counter()
    # Cached: no probe, no communication; by ranks, so for FSDP2's per-module hpZ groups too.
    again = qcoll.cost_model(g) is m and qcoll.cost_model(sibling) is m
    cached_s = time.perf_counter() - t1
    sibling.close()
    # The all-to-all hops' predicted bytes are the bytes qcoll.stats() counts for a repeated
    # call (the first of a signature also exchanges the call check).
    counted = {}
    x = torch.randn(world * 3000)
    for hierarchical in (None, False):
        policy = ReduceScatterPolicy(pipeline_stages=1, hierarchical=hierarchical)
        qcoll.quantized_reduce_scatter(torch.empty(3000), x, g, **policy.kwargs())
        qcoll.reset_stats()
        qcoll.quantized_reduce_scatter(torch.empty(3000), x, g, **policy.kwargs())
        s = qcoll.stats()["reduce_scatter"]
        p = m.predict("reduce_scatter", 3000, torch.float32, policy)
        counted[hierarchical] = ((s["intra_bytes"], s["inter_bytes"]), (p.intra_bytes, p.inter_bytes))
    # The model holds the all-gather path the transport chose for each band the probe met.
    from qcoll._torch_transport import gather_band

    chosen = {gather_band(high): d["path"] for (_, high), d in g.gather_paths.items()}
    out = (m.to_dict(), elapsed, again, cached_s, counted, probe_stats, chosen)
    g.close()
    return out


def test_probe_bounded_agreed_cached():
    budget = 1.0
    results = run_ranks(4, _probe, budget, timeout=180)
    first = results[0][0]
    assert first["source"] == "probe" and first["world"] == 4 and first["node_size"] == NODE_SIZE
    for model, elapsed, same, cached_s, counted, probe_stats, chosen in results:
        assert model == first  # every rank holds identical numbers
        # 2 x 2 spans nodes: its 512 KB calibration calls (past 256 KB gathered) meet a band
        assert chosen and model["gather_paths"] == {str(b): p for b, p in chosen.items()}, (chosen, model)
        assert all(not any(c.values()) for c in probe_stats.values()), probe_stats
        # Bounded: a next size only where its forecast ends within the budget; the first
        # sizes always run (the rates' smallest, one calibration size per collective: about
        # 1 s on 2 x 2 loopback), so slack for those on a loaded machine.
        assert elapsed < budget + 6.0, elapsed
        assert same and cached_s < 0.05
        for bits, (stats_bytes, predicted) in counted.items():
            assert stats_bytes == predicted, (bits, stats_bytes, predicted)
    assert first["inter"]["bandwidth"] > 0 and first["intra"]["latency"] > 0
    # 4 ranks with a second thread each: where the machine has no core for every thread,
    # little of a pipeline stage hides under another.
    assert 0 <= first["overlap"] <= 1
    if len(os.sched_getaffinity(0)) <= 4:
        assert first["overlap"] < 0.5, first["overlap"]
    # Every collective's kinds calibrated from whole calls, the all-reduce's bits=None call
    # on both host paths.
    assert sorted(first["calibration"]) == sorted(
        ["allgather/uncompressed", "allgather/quantized", "all_reduce/uncompressed exchange"]
        + [f"{c}/{k}" for c in ("reduce_scatter", "all_reduce") for k in ("uncompressed", "quantized 2-hop", "quantized flat")])


def _probe_with_a_fast_clock(rank, world, budget):
    # Rank 0's clock runs at twice the speed: it finds the budget spent before the others
    # do. Which sizes run is agreed (the latest rank's view), so no rank is left waiting in
    # a call the others skipped, and every rank ends with the same model.
    import types
    from qcoll import _cost_probe

    if rank == 0:
        t0 = time.monotonic()
        _cost_probe.time = types.SimpleNamespace(monotonic=lambda: 2 * time.monotonic() - t0,
                                                 perf_counter=time.perf_counter)
    g = qcoll.new_group(node_size=NODE_SIZE)
    try:
        return qcoll.cost_model(g, budget_s=budget).to_dict()
    finally:
        _cost_probe.time = time
        g.close()


def test_probe_sizes_agreed_when_clocks_disagree():
    models = run_ranks(4, _probe_with_a_fast_clock, 3.0, timeout=180)
    assert all(m == models[0] for m in models)
    assert models[0]["source"] == "probe" and len(models[0]["calibration"]) == 9


def _disagree(rank, world, models, path):
    import os

    g = qcoll.new_group(node_size=NODE_SIZE)
    os.environ["QCOLL_COST_MODEL"] = path  # the file an earlier probe wrote, at first use
    from_env = qcoll.cost_model(g).source
    del os.environ["QCOLL_COST_MODEL"]
    out = [from_env]
    for case in ("model", "file", "world", "missing file", "env on one rank"):
        try:
            if case == "model":
                qcoll.cost_model(g, model=models[rank])
            elif case == "file":
                qcoll.cost_model(g, path=path if rank != 2 else path + ".other")
            elif case == "world":
                qcoll.cost_model(g, model=synthetic(world=2 * world))
            elif case == "missing file":  # on one node's disk only
                qcoll.cost_model(g, path=path if rank != 3 else path + ".missing")
            else:  # rank 0 would load it, the others probe (a group of other nodes: g's
                # model, cached by ranks and node size, does not serve it)
                g2 = qcoll.new_group(node_size=1)
                if rank == 0:
                    os.environ["QCOLL_COST_MODEL"] = path + ".node1"
                try:
                    qcoll.cost_model(g2)
                finally:
                    os.environ.pop("QCOLL_COST_MODEL", None)
                    g2.close()
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    g.close()
    return out


def test_a_rank_that_disagrees_raises_on_every_rank(tmp_path):
    base = synthetic()
    other = synthetic(inter_gbit=2.0)
    path = str(tmp_path / "m.json")
    base.save(path)
    other.save(path + ".other")
    synthetic(node_size=1).save(path + ".node1")
    results = run_ranks(4, _disagree, [base, other, base, base], path, timeout=120)
    for rank, (from_env, *messages) in enumerate(results):
        assert from_env == f"file {path}"
        for message in messages:
            assert "cost models disagree or do not fit" in message, (rank, message)
        assert "rank 1: user" in messages[0]
        assert f"rank 2: file {path}.other" in messages[1]
        assert "world 8" in messages[2]
        assert "rank 3: not loaded: FileNotFoundError" in messages[3], messages[3]
        assert f"rank 0: file {path}.node1" in messages[4] and "rank 1: probe" in messages[4], messages[4]
