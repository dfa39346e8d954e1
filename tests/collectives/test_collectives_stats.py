"""qcoll.stats(): bytes each rank must deliver to each peer, against hand-computed volumes.

The wire layout (include/qcoll/wire.h): a quantized chunk of L elements is its codes
(ceil(L * bits / 8) bytes) padded to 16, then one fp32 scale per group padded to 16; a raw
chunk is L * itemsize bytes padded to 16. On CPU every chunk that qcoll's own exchanges
move (not the transport's own all-gather / reduce-scatter) starts with a 32-byte header
(include/qcoll/wire_header.h), and the first call of each distinct signature on a group
all-gathers a 32-byte call header (the cross-rank check; later calls with that signature
skip it), both counted in intra/inter bytes and again in header_bytes.
Peers on this rank's node count as intra, the others as inter. Per call:
  baseline all-gather of S bytes per rank:  S per peer
  baseline reduce-scatter (n outputs):      n * itemsize per peer
  quantized all-gather:                     one chunk of n per peer
  flat 1-hop reduce-scatter:                per stage, one chunk of the slice per peer
  2-hop reduce-scatter:                     per stage, `nodes` chunks (intra format) per
                                            local peer, one chunk (inter format; fp32
                                            partial sums when unquantized) per node
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import qcoll
from tests.support.distributed import run_ranks

BF16, F32, F16 = torch.bfloat16, torch.float32, torch.float16


def ru(x: int) -> int:
    return -(-x // 16) * 16


HEADER = 32  # per chunk
CALL = 32  # per call and peer


def qchunk(length: int, bits: int, group_size: int = 256) -> int:
    return HEADER + ru(-(-length * bits // 8)) + ru(4 * -(-length // group_size))


def rawchunk(length: int, dtype: torch.dtype) -> int:
    return HEADER + ru(length * dtype.itemsize)


def chunk(length: int, bits, dtype: torch.dtype, group_size: int = 256) -> int:
    return rawchunk(length, dtype) if bits is None else qchunk(length, bits, group_size)


def slices(n: int, stages: int) -> list:
    step = -(-n // stages) if n else 0
    return [min(n, (s + 1) * step) - s * step for s in range(stages) if s * step < n]


def expected_reduce_scatter(world, ns, n, dtype, intra_bits, inter_bits, group_size, stages,
                            hierarchical):
    """(intra_bytes, inter_bytes) of one reduce-scatter, from the contract."""
    intra, inter = _payload_reduce_scatter(world, ns, n, dtype, intra_bits, inter_bits, group_size,
                                           stages, hierarchical)
    return intra + CALL * (ns - 1), inter + CALL * (world - ns)


def _payload_reduce_scatter(world, ns, n, dtype, intra_bits, inter_bits, group_size, stages,
                            hierarchical):
    nodes = world // ns
    local, remote = ns - 1, world - ns
    two_hop = nodes > 1 and ns > 1 and hierarchical is not False
    if two_hop:
        intra = sum(local * nodes * chunk(L, intra_bits, dtype, group_size) for L in slices(n, stages))
        cross = F32 if inter_bits is None else dtype  # unquantized: the fp32 partial sums
        inter = sum((nodes - 1) * chunk(L, inter_bits, cross, group_size) for L in slices(n, stages))
        return intra, inter
    bits = inter_bits if nodes > 1 else intra_bits
    if bits is None:  # the transport's own reduce-scatter: output bytes per peer
        return local * n * dtype.itemsize, remote * n * dtype.itemsize
    per_peer = sum(qchunk(L, bits, group_size) for L in slices(n, stages))
    return local * per_peer, remote * per_peer


def expected_allgather(world, ns, n, dtype, bits, group_size):
    per_peer = n * dtype.itemsize if bits is None else (qchunk(n, bits, group_size) if n else 0)
    return (ns - 1) * (CALL + per_peer), (world - ns) * (CALL + per_peer)


def _zero():
    return {"calls": 0, "intra_bytes": 0, "inter_bytes": 0, "header_bytes": 0}


def _headers(world, ns, n, intra_bits, inter_bits, stages, hierarchical, allgather=False):
    """Header bytes of one call: the call header and one header per chunk sent to a peer."""
    return CALL * (world - 1) + _chunk_headers(world, ns, n, intra_bits, inter_bits, stages,
                                               hierarchical, allgather)


def _chunk_headers(world, ns, n, intra_bits, inter_bits, stages, hierarchical, allgather):
    nodes = world // ns
    if allgather:
        return 0 if intra_bits is None or n == 0 else HEADER * (world - 1)
    two_hop = nodes > 1 and ns > 1 and hierarchical is not False
    count = len(slices(n, stages))
    if two_hop:
        return HEADER * count * (nodes * (ns - 1) + nodes - 1)
    bits = inter_bits if nodes > 1 else intra_bits
    return 0 if bits is None else HEADER * count * (world - 1)


def _signature(world, ns, n, dtype, kw) -> tuple:
    """What the call check compares (wire_header.h's CallHeader less the call number)."""
    from qcoll._dtypes import DTYPE_CODES
    from qcoll._formats import format_code as _check_bits

    gs = kw.get("group_size") or qcoll.DEFAULT_GROUP_SIZE
    hier = {None: -1, True: 1, False: 0}[kw.get("hierarchical")]
    p = qcoll._C.plan_reduce_scatter(world, ns, n, DTYPE_CODES[dtype], _check_bits(kw.get("intra_bits", 8), ""),
                                     _check_bits(kw.get("inter_bits", 4), ""), gs,
                                     kw.get("pipeline_stages") or 1, hier, True, 0)
    raw = qcoll._C.RAW_FORMAT
    second = p.second_format if p.two_hop else raw
    quantized = p.first_format != raw or second != raw
    return (n, dtype, p.two_hop, p.stages, p.first_format, second, gs if quantized else 0,
            kw.get("op", "avg"))


def _stats_worker(rank, world, ns, rs_cases, ag_cases):
    qcoll._runtime.steps.MIN_STAGE_BYTES = 0  # every requested stage, as counted below
    g = qcoll.new_group(node_size=ns)
    report, seen = [], set()
    for case in rs_cases:
        n, dtype = case["n"], case["dtype"]
        qcoll.reset_stats()
        assert qcoll.stats() == {"allgather": _zero(), "reduce_scatter": _zero(), "all_reduce": _zero(), "auto": {}}, "reset"
        out = torch.empty(n, dtype=dtype)
        x = torch.ones(world * n, dtype=dtype)
        kw = {k: v for k, v in case.items() if k not in ("n", "dtype")}
        # A signature the group checked before (another spelling of the same plan) is not
        # checked again: count the call headers of first calls only.
        checks = int(_signature(world, ns, n, dtype, kw) not in seen)
        seen.add(_signature(world, ns, n, dtype, kw))
        qcoll.quantized_reduce_scatter(out, x, g, **kw)
        qcoll.quantized_reduce_scatter(out, x, g, **kw)
        intra, inter = expected_reduce_scatter(
            world, ns, n, dtype, kw.get("intra_bits", 8), kw.get("inter_bits", 4),
            kw.get("group_size") or qcoll.DEFAULT_GROUP_SIZE, kw.get("pipeline_stages") or 1, kw.get("hierarchical"))
        headers = _headers(world, ns, n, kw.get("intra_bits", 8), kw.get("inter_bits", 4),
                           kw.get("pipeline_stages") or 1, kw.get("hierarchical"))
        want = {"allgather": _zero(),
                # The second call of the same signature skips the call check.
                "reduce_scatter": {"calls": 2, "intra_bytes": 2 * intra - (2 - checks) * CALL * (ns - 1),
                                   "inter_bytes": 2 * inter - (2 - checks) * CALL * (world - ns),
                                   "header_bytes": 2 * headers - (2 - checks) * CALL * (world - 1)},
                "all_reduce": _zero(), "auto": {}}
        got = qcoll.stats()
        assert got == want, f"reduce_scatter {case}: stats {got}, expected {want}"
        report.append(("rs", case, got["reduce_scatter"]))
    for case in ag_cases:
        n, dtype, bits = case["n"], case["dtype"], case["bits"]
        gs = case.get("group_size")
        sub = case.get("sub")  # all-gather over g.intra (hpZ) or g.inter
        grp = {None: g, "intra": g.intra, "inter": g.inter}[sub]
        qcoll.reset_stats()
        out = torch.empty(grp.size * n, dtype=dtype)
        qcoll.quantized_allgather(out, torch.ones(n, dtype=dtype), grp, bits=bits, group_size=gs)
        gw, gns = {None: (world, ns), "intra": (ns, ns), "inter": (world // ns, 1)}[sub]
        intra, inter = expected_allgather(gw, gns, n, dtype, bits, gs or qcoll.DEFAULT_GROUP_SIZE)
        headers = _headers(gw, gns, n, bits, bits, 1, None, allgather=True)
        want = {"allgather": {"calls": 1, "intra_bytes": intra, "inter_bytes": inter,
                              "header_bytes": headers},
                "reduce_scatter": _zero(), "all_reduce": _zero(), "auto": {}}
        got = qcoll.stats()
        assert got == want, f"allgather {case}: stats {got}, expected {want}"
        report.append(("ag", case, got["allgather"]))
    qcoll.reset_stats()
    assert qcoll.stats() == {"allgather": _zero(), "reduce_scatter": _zero(), "all_reduce": _zero(), "auto": {}}
    return report


RS_CASES = [
    dict(n=1000, dtype=BF16, intra_bits=None, inter_bits=None, hierarchical=False),  # baseline
    dict(n=1000, dtype=BF16, intra_bits=None, inter_bits=None),  # 2-hop raw where layered
    dict(n=1000, dtype=BF16),  # int8 / int4 defaults
    dict(n=1000, dtype=F32, intra_bits=8, inter_bits=4, pipeline_stages=4),
    dict(n=1001, dtype=F16, intra_bits=4, inter_bits=8, pipeline_stages=3, group_size=8),
    dict(n=1000, dtype=BF16, intra_bits=8, inter_bits=4, hierarchical=False),  # flat, int4
    dict(n=7, dtype=F32, intra_bits=8, inter_bits=8, hierarchical=True, pipeline_stages=4),
    dict(n=5, dtype=F32, intra_bits=8, inter_bits=None, pipeline_stages=4),  # slices 2,2,1
    dict(n=0, dtype=F32),
    dict(n=0, dtype=BF16, intra_bits=None, inter_bits=None, hierarchical=False),
]
AG_CASES = [
    dict(n=1000, dtype=BF16, bits=None),  # baseline: S = 2000 bytes per peer
    dict(n=1000, dtype=F32, bits=8),
    dict(n=1001, dtype=F16, bits=4, group_size=64),
    dict(n=0, dtype=F32, bits=8),
    dict(n=1000, dtype=BF16, bits=8, sub="intra"),  # hpZ: inside the node only
    dict(n=13, dtype=F32, bits=None, sub="intra"),
    dict(n=1000, dtype=BF16, bits=8, sub="inter"),
]


@pytest.mark.parametrize("world,ns", [(1, 1), (2, 2), (2, 1), (4, 2), (6, 2), (6, 3)])
def test_stats_match_hand_computed_volumes(world, ns):
    reports = run_ranks(world, _stats_worker, ns, RS_CASES, AG_CASES, timeout=60)
    assert all(rep == reports[0] for rep in reports), "every rank delivers the same volume"
    if world == 4 and ns == 2:
        assert qcoll.DEFAULT_GROUP_SIZE == 256, "the spot values below assume group_size 256"
        # Spot values computed by hand (world 4 = 2 nodes x 2, n = 1000, group 256).
        by = {(kind, repr(case)): st for kind, case, st in reports[0]}
        # Baseline bf16: 2000 bytes to each peer (1 local, 2 remote), twice. The first call
        # also sends its 32-byte call header to each of its 3 peers (96 bytes), the second not.
        assert by["rs", repr(RS_CASES[0])] == {"calls": 2, "intra_bytes": 4032, "inter_bytes": 8064,
                                               "header_bytes": 96}
        # 2-hop int8/int4: int8 chunk 32 + 1008 + 16 = 1056, two per local peer; int4 chunk
        # 32 + 512 + 16 = 560 to the one remote peer; 3 chunk headers a call.
        assert by["rs", repr(RS_CASES[2])] == {"calls": 2, "intra_bytes": 4256, "inter_bytes": 1184,
                                               "header_bytes": 288}
        # Flat 1-hop at int4 crosses nodes from every rank: 560 to each of 3 peers.
        assert by["rs", repr(RS_CASES[5])] == {"calls": 2, "intra_bytes": 1152, "inter_bytes": 2304,
                                               "header_bytes": 288}
        # Baseline all-gather: S = 2000 bytes per peer.
        assert by["ag", repr(AG_CASES[0])] == {"calls": 1, "intra_bytes": 2032, "inter_bytes": 4064,
                                               "header_bytes": 96}
        # hpZ: the all-gather inside the node sends nothing across nodes.
        assert by["ag", repr(AG_CASES[4])] == {"calls": 1, "intra_bytes": 1088, "inter_bytes": 0,
                                               "header_bytes": 64}


def _ratio_worker(rank, world, ns, n):
    g = qcoll.new_group(node_size=ns)
    x = torch.randn(world * n).to(BF16)
    out = torch.empty(n, dtype=BF16)
    res = {}
    for name, kw in {"baseline": dict(intra_bits=None, inter_bits=None, hierarchical=False),
                     "two_hop": dict(intra_bits=8, inter_bits=4),
                     "flat_int4": dict(intra_bits=8, inter_bits=4, hierarchical=False)}.items():
        qcoll.reset_stats()
        qcoll.quantized_reduce_scatter(out, x, g, **kw)
        res[name] = qcoll.stats()["reduce_scatter"]
    return res


@pytest.mark.parametrize("world,ns", [(4, 2), (8, 4)])
def test_cross_node_volume_ratio(world, ns):
    """2-hop int4 vs flat bf16 across nodes: 4x from the bits, ns x from the hierarchy."""
    n, gs = 4096, qcoll.DEFAULT_GROUP_SIZE
    assert gs == 256, "the hand-computed numbers below assume the default group size 256"
    nodes = world // ns
    res = run_ranks(world, _ratio_worker, ns, n)[0]
    # Payload only: the call header and each chunk's header are accounted for apart.
    base = res["baseline"]["inter_bytes"] - (world - ns) * CALL
    two = res["two_hop"]["inter_bytes"] - (nodes - 1) * HEADER - (world - ns) * CALL
    flat4 = res["flat_int4"]["inter_bytes"] - (world - ns) * (HEADER + CALL)
    assert base == (world - ns) * n * 2  # bf16 output bytes to each remote peer
    assert two == (nodes - 1) * (n // 2 + 4 * (n // gs))  # one int4 chunk per remote node
    assert flat4 == (world - ns) * (n // 2 + 4 * (n // gs))
    ratio = Fraction(two, base)
    # bytes per element 1/2 + 4/gs vs 2, and one peer per node instead of ns
    assert ratio == Fraction(1, 2 * ns) * (Fraction(1, 2) + Fraction(4, gs))
    assert ratio == Fraction(33, 128 * ns)  # (1/2 + 1/64) / (2 * ns)
    if (world, ns) == (4, 2):
        assert (base, two) == (16384, 2112) and float(ratio) == 0.12890625
    assert Fraction(two, flat4) == Fraction(1, ns)
    # Intra bytes: 2-hop sends nodes int8 chunks to each local peer.
    assert res["two_hop"]["intra_bytes"] == (ns - 1) * (CALL + nodes * (HEADER + n + 4 * (n // gs)))
    assert res["baseline"]["intra_bytes"] == (ns - 1) * (CALL + n * 2)
