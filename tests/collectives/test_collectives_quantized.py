"""Quantized collectives against an independent simulation built on tests/support/reference.py.

The simulation follows the contract, not the C++: what travels is block-quantized per
wire chunk (symmetric, nearest rounding, groups counted from the start of each pipeline
stage's slice), the receiver dequantizes to fp32 and sums sources in rank order in fp32,
divides by the world size for "avg", and rounds once to the output dtype. Every step is
deterministic, so outputs must match the simulation bit for bit:

  all-gather:          out[r] = dq(q(input_r))
  1-hop reduce-scatter: out = cast(sum_src dq(q(slice of input_src)) / W)
  2-hop reduce-scatter: partial_node = sum over the node's ranks (local order) of
                        dq(q_intra(slice)); out = cast(sum over nodes (node order) of
                        dq(q_inter(partial_node)) / W)

bits=None on a hop means the values travel in the input dtype (a cast, no quantization).
On top of the exact match, outputs must lie within the quantization error bound of the
exact (float64) mean or sum."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

import qcoll
from tests.support import reference as ref
from tests.support.distributed import run_ranks

F32 = torch.float32
DEFAULT_GROUP_SIZE = qcoll.DEFAULT_GROUP_SIZE  # what group_size=None means
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


# ---- data ---------------------------------------------------------------------------------
def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def gradient_like(numel: int, dtype: torch.dtype, *key) -> torch.Tensor:
    """randn scaled by 2**e, e varying every 24 elements (so it changes inside groups and
    slices), with some exact zeros."""
    gen = _gen("grad", numel, dtype, *key)
    runs = max(1, -(-numel // 24))
    e = torch.randint(-6, 7, (runs,), generator=gen).to(F32).repeat_interleave(24)[:numel]
    x = torch.randn(numel, generator=gen) * torch.exp2(e)
    x = torch.where(torch.rand(numel, generator=gen) < 0.05, torch.zeros_like(x), x)
    return x.to(dtype)


# ---- the simulation -----------------------------------------------------------------------
def wire(x32: torch.Tensor, bits, dtype: torch.dtype, group_size: int) -> torch.Tensor:
    """What the receiver of chunk x32 (fp32 values) decodes, as fp32."""
    if bits is None:
        return x32.to(dtype).to(F32)
    return ref.dequantize(ref.quantize(x32, bits=bits, group_size=group_size), F32)


def wire_error(x32: torch.Tensor, bits, dtype: torch.dtype, group_size: int) -> torch.Tensor:
    """Allowed |x - wire(x)| per element (float64)."""
    if bits is None:
        rel, absolute = ref.OUT_ROUNDING[dtype]
        return rel * x32.double().abs() + absolute
    return ref.error_bound(x32, ref.quantize(x32, bits=bits, group_size=group_size), F32)


def fsum(chunks):
    """Sum in list order, fp32, one rounding per add."""
    acc = chunks[0].clone()
    for c in chunks[1:]:
        acc = acc + c
    return acc


def finish(acc: torch.Tensor, divisor: int, dtype: torch.dtype) -> torch.Tensor:
    if divisor != 1:
        acc = acc / torch.full_like(acc, divisor)  # the IEEE quotient, elementwise
    return acc.to(dtype)


def slices(n: int, stages: int):
    step = -(-n // stages) if n else 0
    for s in range(stages):
        b = s * step
        if b < n:
            yield b, min(n, b + step)


def simulate_reduce_scatter(inputs, rank, n, node_size, *, op, intra_bits, inter_bits,
                            group_size, stages, hierarchical, dtype):
    """(expected output of `rank`, per-element error bound vs the exact result)."""
    world = len(inputs)
    nodes = world // node_size
    two_hop = nodes > 1 and node_size > 1 and hierarchical is not False
    divisor = world if op == "avg" else 1
    out = torch.empty(n, dtype=dtype)
    bound = torch.zeros(n, dtype=torch.float64)
    base = rank * n
    for b, e in slices(n, stages):
        src = [x[base + b : base + e].to(F32) for x in inputs]
        if not two_hop:
            bits = inter_bits if nodes > 1 else intra_bits
            got = [wire(c, bits, dtype, group_size) for c in src]
            err = sum(wire_error(c, bits, dtype, group_size) for c in src)
            mag = sum(c.double().abs() for c in src)
        else:
            sent, err, mag = [], 0, 0
            for m in range(nodes):
                local = src[m * node_size : (m + 1) * node_size]
                partial = fsum([wire(c, intra_bits, dtype, group_size) for c in local])
                # An unquantized inter-node hop carries the fp32 partial sums (issue 26).
                cross = F32 if inter_bits is None else dtype
                sent.append(wire(partial, inter_bits, cross, group_size))
                err = err + sum(wire_error(c, intra_bits, dtype, group_size) for c in local)
                err = err + wire_error(partial, inter_bits, cross, group_size)
                mag = mag + sum(c.double().abs() for c in local) + partial.double().abs()
            got = sent
        out[b:e] = finish(fsum(got), divisor, dtype)
        # Quantization errors add up; fp32 sums cost a few ulps of the magnitudes summed.
        rel, absolute = ref.OUT_ROUNDING[dtype]
        exact = sum(c.double() for c in src) / divisor
        bound[b:e] = (err + 2.0**-20 * mag) / divisor + rel * (exact.abs() + err / divisor) + absolute
    return out, bound


def is_baseline(world, node_size, intra_bits, inter_bits, hierarchical) -> bool:
    """Unquantized and flat: the contract hands this case to the transport."""
    nodes = world // node_size
    two_hop = nodes > 1 and node_size > 1 and hierarchical is not False
    bits = inter_bits if nodes > 1 else intra_bits
    return not two_hop and bits is None


def exact_result(inputs, rank, n, op):
    exact = torch.stack([x[rank * n : (rank + 1) * n].double() for x in inputs]).sum(0)
    return exact / len(inputs) if op == "avg" else exact


def assert_bits(actual, expected, what):
    ref.assert_same_bits(actual, expected, what)


# ---- workers ------------------------------------------------------------------------------
RS_CONFIGS = (  # (intra_bits, inter_bits); every spelling of a format
    (8, 4), (8, 8), (4, 4), (None, 4), (8, None), ("fp8_e4m3", 4), ("int8", "fp8_e4m3"))


def pairwise(**axes) -> list:
    """A deterministic subset of the product of `axes` (name -> values) in which every pair
    of values of any two axes occurs in some case (greedy covering array): each value
    meets each other one without running the whole product."""
    import itertools
    import random

    names = list(axes)
    product = list(itertools.product(*axes.values()))
    random.Random(0).shuffle(product)
    uncovered = {(i, a, j, b) for i, j in itertools.combinations(range(len(names)), 2)
                 for a in range(len(axes[names[i]])) for b in range(len(axes[names[j]]))}
    index = [{v: k for k, v in enumerate(vals)} for vals in axes.values()]

    def pairs(case):
        ids = [index[i][v] for i, v in enumerate(case)]
        return {(i, ids[i], j, ids[j]) for i, j in itertools.combinations(range(len(names)), 2)}

    chosen = []
    while uncovered:
        best = max(product, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(dict(zip(names, best)))
        uncovered -= pairs(best)
    return chosen


def _reduce_scatter_worker(rank, world, node_size, cases):
    qcoll._runtime.steps.MIN_STAGE_BYTES = 0  # run every requested stage, as the model does
    g = qcoll.new_group(node_size=node_size)
    checked = 0
    inputs_cache = {}
    for case in cases:
        dtype, n, gs, stages = case["dtype"], case["n"], case["group_size"], case["stages"]
        hierarchical = case["hierarchical"]
        intra_bits, inter_bits = case["bits"]
        key = (dtype, n)
        if key not in inputs_cache:
            inputs_cache[key] = [gradient_like(world * n, dtype, world, r) for r in range(world)]
        inputs = inputs_cache[key]
        outs = {}
        for op in ("sum", "avg"):
            kw = dict(op=op, intra_bits=intra_bits, inter_bits=inter_bits, group_size=gs,
                      pipeline_stages=stages, hierarchical=hierarchical)
            what = f"{dtype} n={n} world={world}/{node_size} {kw}"
            x = inputs[rank].clone()
            out = torch.full((n,), float("nan"), dtype=dtype)
            qcoll.quantized_reduce_scatter(out, x, g, **kw)
            expected, bound = simulate_reduce_scatter(
                inputs, rank, n, node_size, dtype=dtype, op=op, intra_bits=intra_bits,
                inter_bits=inter_bits, group_size=gs or DEFAULT_GROUP_SIZE, stages=stages,
                hierarchical=hierarchical)
            if is_baseline(world, node_size, intra_bits, inter_bits, hierarchical):
                # The transport's own reduce-scatter: its summation order is its own, so
                # torch's result is the oracle.
                expected = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(expected, inputs[rank].clone(), op=dist.ReduceOp.SUM)
                if op == "avg":
                    expected = expected / torch.full_like(expected, world)
                # It may round in the dtype after every add: world roundings of the
                # magnitudes summed, and one more for the division.
                rel, absolute = ref.OUT_ROUNDING[dtype]
                rel = max(rel, 2.0**-24)  # fp32 adds round too
                mag = torch.stack([x[rank * n : (rank + 1) * n].double().abs() for x in inputs]).sum(0)
                bound = (world + 1) * (rel * mag / (world if op == "avg" else 1) + absolute)
            assert_bits(out, expected, what)
            assert torch.equal(x, inputs[rank]), f"{what}: input modified"
            err = (out.double() - exact_result(inputs, rank, n, op)).abs()
            assert bool((err <= bound).all()), f"{what}: error {err.max().item():.3g} above the bound"
            outs[op] = out
            checked += 1
        if dtype == F32:  # avg is the same fp32 sum, divided by the world size
            s_ = outs["sum"]
            assert_bits(outs["avg"], s_ / torch.full_like(s_, world), f"avg vs sum/{world}")
    return checked


def _allgather_worker(rank, world, node_size, dtypes, sizes, bits_list, group_sizes):
    g = qcoll.new_group(node_size=node_size)
    outs = []
    for dtype in dtypes:
        for n in sizes:
            pieces = [gradient_like(n, dtype, "ag", world, r) for r in range(world)]
            for bits in bits_list:
                for gs in group_sizes:
                    q = [ref.quantize(p, bits=bits, group_size=gs or DEFAULT_GROUP_SIZE)
                         for p in pieces]
                    expected = torch.cat([ref.dequantize(qq) for qq in q])
                    x = pieces[rank].clone()
                    out = torch.full((world * n,), float("nan"), dtype=dtype)
                    qcoll.quantized_allgather(out, x, g, bits=bits, group_size=gs)
                    what = f"allgather {dtype} n={n} world={world} bits={bits} group_size={gs}"
                    assert_bits(out, expected, what)
                    assert torch.equal(x, pieces[rank]), f"{what}: input modified"
                    for r in range(world):
                        ref.assert_within_bound(pieces[r], out[r * n : (r + 1) * n], q[r])
                    outs.append(out)
    return outs


# ---- tests --------------------------------------------------------------------------------
HALF = (torch.float16, torch.bfloat16)
ALL_DTYPES = (F32, *HALF)
RS_LAYOUTS = [  # world, node_size, axes of the cases (pairwise-covered)
    pytest.param(1, 1, dict(dtype=ALL_DTYPES, n=(1, 13, 300), bits=RS_CONFIGS[:3],
                            group_size=(8, None), stages=(1, 4), hierarchical=(None,)),
                 id="world1"),
    pytest.param(2, 2, dict(dtype=ALL_DTYPES, n=(7, 300), bits=RS_CONFIGS[:4],
                            group_size=(8, None), stages=(1, 2), hierarchical=(None, True)),
                 id="1node_x2"),
    pytest.param(2, 1, dict(dtype=ALL_DTYPES, n=(13, 300), bits=RS_CONFIGS,
                            group_size=(8, None), stages=(1, 4), hierarchical=(None,)),
                 id="2nodes_x1"),
    pytest.param(3, 1, dict(dtype=ALL_DTYPES, n=(0, 7, 300), bits=RS_CONFIGS[:3],
                            group_size=(8, None), stages=(1, 2), hierarchical=(None,)),
                 id="3nodes_x1"),
    pytest.param(4, 2, dict(dtype=ALL_DTYPES, n=(0, 1, 13, 300), bits=RS_CONFIGS,
                            group_size=(8, 256, None), stages=(1, 2, 4),
                            hierarchical=(None, True, False)),
                 id="2nodes_x2"),
    pytest.param(6, 3, dict(dtype=ALL_DTYPES, n=(7, 1009), bits=RS_CONFIGS,
                            group_size=(8, None), stages=(1, 4), hierarchical=(True, False)),
                 id="2nodes_x3"),
    pytest.param(6, 2, dict(dtype=ALL_DTYPES, n=(13, 300), bits=RS_CONFIGS,
                            group_size=(8, None), stages=(2, 4), hierarchical=(None, False)),
                 id="3nodes_x2"),
    pytest.param(8, 2, dict(dtype=ALL_DTYPES, n=(13, 1009), bits=RS_CONFIGS,
                            group_size=(8, None), stages=(1, 4), hierarchical=(None, False)),
                 id="4nodes_x2"),
    pytest.param(8, 4, dict(dtype=(F32, torch.float16), n=(7, 300), bits=RS_CONFIGS[:3],
                            group_size=(None,), stages=(1, 2), hierarchical=(None,)),
                 id="2nodes_x4"),
    # Groups larger than the CPU kernels' 2048-element blocks, within and across slices.
    pytest.param(4, 2, dict(dtype=(F32, torch.bfloat16), n=(5000,),
                            bits=((8, 4), (4, 8), ("fp8_e4m3", "fp8_e4m3")),
                            group_size=(4096,), stages=(1, 2), hierarchical=(None, False)),
                 id="2nodes_x2-big-groups"),
]


@pytest.mark.parametrize("world,node_size,axes", RS_LAYOUTS)
def test_reduce_scatter_matches_simulation(world, node_size, axes):
    cases = pairwise(**axes)
    checked = run_ranks(world, _reduce_scatter_worker, node_size, cases, timeout=120)
    assert checked == [2 * len(cases)] * world


AG_LAYOUTS = [
    pytest.param(1, 1, (F32,), (1, 300), id="world1"),
    pytest.param(3, 3, (F32, torch.float16, torch.bfloat16), (0, 1, 7, 13, 1009), id="world3"),
    pytest.param(2, 1, (F32,), (5000,), id="world2-n5000"),  # 4096-element groups below
    pytest.param(4, 2, (F32, torch.bfloat16), (13, 300), id="2nodes_x2"),
    pytest.param(6, 2, (torch.float16,), (7, 1009), id="3nodes_x2"),
]


@pytest.mark.parametrize("world,node_size,dtypes,sizes", AG_LAYOUTS)
def test_allgather_matches_simulation_and_is_identical_on_all_ranks(world, node_size, dtypes, sizes):
    group_sizes = (8, 256, None) if max(sizes) < 5000 else (4096, None)
    bits_list = (8, 4, "fp8_e4m3")
    results = run_ranks(world, _allgather_worker, node_size, dtypes, sizes, bits_list, group_sizes,
                        timeout=120)
    assert len(results[0]) == len(dtypes) * len(sizes) * len(bits_list) * len(group_sizes)
    for r in range(1, world):
        for a, b in zip(results[0], results[r]):
            assert torch.equal(a.view(_INT_VIEW[a.dtype]), b.view(_INT_VIEW[b.dtype])), (
                f"rank {r}'s all-gather output differs from rank 0's")


def _paths_differ_worker(rank, world, node_size):
    """The paths really are different computations: the 2-hop int8/int4 result, the flat
    1-hop int4 one and the unquantized one are not all equal (guards the simulation's
    path selection against a degenerate library that ignores the bits)."""
    g = qcoll.new_group(node_size=node_size)
    n = 300
    x = gradient_like(world * n, F32, "differ", rank)
    res = {}
    for name, kw in {"two_hop": dict(intra_bits=8, inter_bits=4),
                     "flat4": dict(intra_bits=8, inter_bits=4, hierarchical=False),
                     "flat8_intra4": dict(intra_bits=4, inter_bits=8, hierarchical=False),
                     "raw": dict(intra_bits=None, inter_bits=None)}.items():
        out = torch.empty(n)
        qcoll.quantized_reduce_scatter(out, x, g, op="sum", **kw)
        res[name] = out
    theirs = torch.empty(n)
    dist.reduce_scatter_tensor(theirs, x.clone(), op=dist.ReduceOp.SUM)
    assert not torch.equal(res["two_hop"], res["flat4"])
    assert not torch.equal(res["flat4"], res["flat8_intra4"])  # flat 1-hop uses inter_bits
    assert not torch.equal(res["raw"], res["flat8_intra4"])
    assert torch.allclose(res["raw"], theirs, rtol=1e-5, atol=1e-5)
    return True


def test_paths_are_distinct():
    assert run_ranks(4, _paths_differ_worker, 2) == [True] * 4


def _nonfinite_worker(rank, world, node_size, cases):
    """An Inf or NaN in one rank's input poisons its whole quantization group on the way
    (scale NaN), so the destination sees NaN there, as the simulation says, and nothing
    else is touched."""
    g = qcoll.new_group(node_size=node_size)
    n = 40
    for dtype, intra_bits, inter_bits, hierarchical in cases:
        inputs = [gradient_like(world * n, dtype, "nonfinite", world, r) for r in range(world)]
        inputs[1][2 * n + 5] = float("inf")   # partition 2, group 0 (group_size 8)
        inputs[0][2 * n + 17] = float("nan")  # partition 2, group 2
        inputs[world - 1][0 * n + 33] = float("-inf")  # partition 0, group 4
        out = torch.empty(n, dtype=dtype)
        kw = dict(op="avg", intra_bits=intra_bits, inter_bits=inter_bits, group_size=8,
                  pipeline_stages=1, hierarchical=hierarchical)
        qcoll.quantized_reduce_scatter(out, inputs[rank].clone(), g, **kw)
        expected, _ = simulate_reduce_scatter(inputs, rank, n, node_size, dtype=dtype, op="avg",
                                              intra_bits=intra_bits, inter_bits=inter_bits,
                                              group_size=8, stages=1, hierarchical=hierarchical)
        assert_bits(out, expected, f"nonfinite {dtype} {kw}")
        poisoned = {2: [range(0, 8), range(16, 24)], 0: [range(32, 40)]}.get(rank, [])
        bad = torch.zeros(n, dtype=torch.bool)
        for rg in poisoned:
            bad[list(rg)] = True
        assert bool(torch.isnan(out[bad]).all()), f"rank {rank}: poisoned groups must be NaN"
        assert bool(torch.isfinite(out[~bad]).all()), f"rank {rank}: only those groups"
    return True


def test_nonfinite_inputs_poison_their_groups():
    cases = [(F32, 8, 4, None), (torch.float16, 8, 8, False), (torch.bfloat16, 4, 4, True),
             (torch.float16, "fp8_e4m3", "fp8_e4m3", None)]
    assert run_ranks(4, _nonfinite_worker, 2, cases, timeout=60) == [True] * 4
