"""qcoll.quantized_all_reduce against the independent simulation of
test_collectives_quantized.py: the reduce-scatter half as simulated there (the tensor
padded to a multiple of the world size, or, host tensors from
policy.HOST_TAIL_APART_MIN_BYTES, its whole shards only and the last numel % world
elements summed in fp32 in rank order), then every shard encoded once at the all-gather's
code format and decoded by every rank. Outputs must match bit for bit, be identical on
every rank, and lie within the summed error bounds of the exact mean or sum."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import qcoll
from tests.support import reference as ref
from tests.support.distributed import run_ranks
from tests.collectives.test_round_once import over_half_ulp
from tests.collectives.test_collectives_quantized import (
    DEFAULT_GROUP_SIZE,
    F32,
    _INT_VIEW,
    gradient_like,
    is_baseline,
    pairwise,
    simulate_reduce_scatter,
)


def simulate_all_reduce(inputs, node_size, *, op, bits, inter_bits, group_size, stages,
                        hierarchical, dtype, tail_apart=False):
    """(expected result, per-element error bound vs the exact result). tail_apart: the last
    numel % world elements reduced apart, unquantized (fp32 sums in rank order, rounded once),
    and the rest as a call of its own."""
    world, numel = len(inputs), inputs[0].numel()
    tail = numel % world if tail_apart else 0
    if tail:
        head, head_bound = simulate_all_reduce(
            [x[:numel - tail] for x in inputs], node_size, op=op, bits=bits, inter_bits=inter_bits,
            group_size=group_size, stages=stages, hierarchical=hierarchical, dtype=dtype)
        total = inputs[0][numel - tail:].float()
        for x in inputs[1:]:
            total = total + x[numel - tail:].float()
        if op == "avg":
            total = total / world
        rel, absolute = ref.OUT_ROUNDING[dtype]
        mag = torch.stack([x[numel - tail:].double().abs() for x in inputs]).sum(0) / (world if op == "avg" else 1)
        return (torch.cat([head, total.to(dtype)]),
                torch.cat([head_bound, world * 2.0**-24 * mag + rel * mag + absolute]))
    n = -(-numel // world)
    padded = [torch.cat([x, torch.zeros(world * n - numel, dtype=dtype)]) for x in inputs]
    cross = bits if inter_bits is None else inter_bits
    gather_bits = cross if world // node_size > 1 else bits
    out, bound = [], []
    for r in range(world):
        shard, b = simulate_reduce_scatter(padded, r, n, node_size, op=op, intra_bits=bits,
                                           inter_bits=cross, group_size=group_size, stages=stages,
                                           hierarchical=hierarchical, dtype=dtype)
        if gather_bits is None:
            out.append(shard)
            bound.append(b)
        else:
            q = ref.quantize(shard, bits=gather_bits, group_size=group_size)
            out.append(ref.dequantize(q))
            bound.append(b + ref.error_bound(shard, q, dtype).double())
    return torch.cat(out)[:numel], torch.cat(bound)[:numel]


def _exact(inputs, op):
    total = torch.stack([x.double() for x in inputs]).sum(0)
    return total / len(inputs) if op == "avg" else total


def _transport_all_reduce(inputs, rank, op):
    """Unquantized (bits and inter_bits None) on CPU: the transport's own all-reduce of fp32
    values (a bf16/fp16 tensor's upcast), rounded once to the dtype, the oracle; the bound:
    fp32 sums plus that one rounding."""
    world = len(inputs)
    dtype = inputs[0].dtype
    total = inputs[rank].to(F32, copy=True)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    if op == "avg":
        total = total / torch.full_like(total, world)
    rel, absolute = ref.OUT_ROUNDING[dtype]
    mag = torch.stack([x.double().abs() for x in inputs]).sum(0) / (world if op == "avg" else 1)
    bound = world * 2.0**-24 * mag + rel * mag + absolute
    return total.to(dtype), bound


def _all_reduce_worker(rank, world, node_size, cases):
    qcoll._runtime.steps.MIN_STAGE_BYTES = 0  # every requested stage runs, as simulated
    g = qcoll.new_group(node_size=node_size)
    results = []
    for case in cases:
        dtype, numel, (bits, inter_bits) = case["dtype"], case["numel"], case["bits"]
        # Host tensors from this many bytes reduce their last numel % world elements apart,
        # smaller ones pad: both ways at these sizes.
        qcoll.policy.HOST_TAIL_APART_MIN_BYTES = 0 if case["tail_apart"] else 1 << 40
        inputs = [gradient_like(numel, dtype, "ar", world, r) for r in range(world)]
        unquantized = bits is None and inter_bits is None and world > 1
        # Unquantized: the transport's all-reduce (of fp32 copies for bf16/fp16) or the flat
        # exchange, by dtype, size and number of ranks (policy.unquantized_host_all_reduce):
        # each forced here at every size.
        paths = ("transport", "exchange") if unquantized else (None,)
        for op, path in [(op, path) for op in ("avg", "sum") for path in paths]:
            kw = dict(op=op, bits=bits, inter_bits=inter_bits, group_size=case["group_size"],
                      pipeline_stages=case["stages"], hierarchical=case["hierarchical"])
            what = f"{dtype} numel={numel} world={world}/{node_size} {kw} {path}"
            x = inputs[rank].clone()
            with qcoll.policy.host_all_reduce_path(path):
                qcoll.quantized_all_reduce(x, g, **kw)
            expected, bound = simulate_all_reduce(
                inputs, node_size, dtype=dtype, op=op, bits=bits, inter_bits=inter_bits,
                group_size=case["group_size"] or DEFAULT_GROUP_SIZE, stages=case["stages"],
                hierarchical=False if path == "exchange" else case["hierarchical"],
                tail_apart=case["tail_apart"])
            if path == "transport":
                expected, bound = _transport_all_reduce(inputs, rank, op)
            ref.assert_same_bits(x, expected, what)
            err = (x.double() - _exact(inputs, op)).abs()
            assert bool((err <= bound).all()), f"{what}: error {err.max().item():.3g} above the bound"
            results.append(x)
    return results


AR_CASES = dict(dtype=(F32, torch.float16, torch.bfloat16), numel=(0, 1, 13, 1001),
                bits=((8, None), (8, 4), (4, None), (None, None)), group_size=(8, None),
                stages=(1, 2), hierarchical=(True, False), tail_apart=(False, True))
AR_LAYOUTS = [
    pytest.param(1, 1, id="world1"),
    pytest.param(3, 3, id="1node_x3"),
    pytest.param(4, 2, id="2nodes_x2"),
    pytest.param(6, 2, id="3nodes_x2"),
]


@pytest.mark.parametrize("world,node_size", AR_LAYOUTS)
def test_all_reduce_matches_simulation_and_is_identical_on_all_ranks(world, node_size):
    cases = pairwise(**AR_CASES)
    results = run_ranks(world, _all_reduce_worker, node_size, cases, timeout=120)
    assert len(results[0]) >= 2 * len(cases)
    for r in range(1, world):
        for a, b in zip(results[0], results[r]):
            assert torch.equal(a.view(_INT_VIEW[a.dtype]), b.view(_INT_VIEW[b.dtype])), (
                f"rank {r}'s result differs from rank 0's")


def _unquantized_worker(rank, world, node_size):
    """bits=None is torch's all_reduce up to fp32 summation order; with error feedback the
    same call (the same bytes, bit for bit the same result): it has nothing to keep."""
    g = qcoll.new_group(node_size=node_size)
    for numel in (7, 4099):
        x = gradient_like(numel, F32, "raw", rank)
        theirs = x.clone()
        dist.all_reduce(theirs)
        for hierarchical in (True, False):
            results, traffic = [], []
            for ef in (None, qcoll.ErrorFeedback()):
                mine = x.clone()
                qcoll.quantized_all_reduce(mine, g, op="sum", bits=None, hierarchical=hierarchical)  # signature
                mine = x.clone()
                qcoll.reset_stats()
                qcoll.quantized_all_reduce(mine, g, op="sum", bits=None, hierarchical=hierarchical,
                                           error_feedback=ef)
                torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
                results.append(mine)
                traffic.append(qcoll.stats()["all_reduce"])
                assert ef is None or (ef.nbytes == 0 and "unbound" in repr(ef)), ef
            assert torch.equal(*results) and traffic[0] == traffic[1], traffic
    return True


def test_unquantized_matches_torch():
    assert run_ranks(4, _unquantized_worker, 2) == [True] * 4


def _accounting_worker(rank, world, node_size):
    """One Work for the whole call; its bytes are the two halves' (the same plans as the
    standalone collectives), counted once under stats()["all_reduce"]."""
    g = qcoll.new_group(node_size=node_size)
    numel, n = 5000, 1250
    x = gradient_like(numel, torch.bfloat16, "acct", rank)
    # Once unmeasured: the first call of a signature checks it; the halves below skip it.
    qcoll.quantized_all_reduce(x.clone(), g, bits=8, inter_bits=4)
    qcoll.reset_stats()
    work = qcoll.quantized_all_reduce(x.clone(), g, bits=8, inter_bits=4, async_op=True)
    assert isinstance(work, qcoll.Work)
    work.wait()
    stats = qcoll.stats()
    assert stats["all_reduce"] == {**work.traffic}
    assert stats["all_reduce"]["calls"] == 1
    assert stats["reduce_scatter"]["calls"] == stats["allgather"]["calls"] == 0
    shard = torch.empty(n, dtype=torch.bfloat16)
    for measured in (False, True):  # the standalone reduce-scatter's signature is its own
        qcoll.reset_stats()
        qcoll.quantized_reduce_scatter(shard, x.clone(), g, intra_bits=8, inter_bits=4, pipeline_stages=2)
        qcoll.quantized_allgather(torch.empty(numel, dtype=torch.bfloat16), shard, g, bits=4)
    halves = qcoll.stats()
    for key in ("intra_bytes", "inter_bytes", "header_bytes"):
        assert work.traffic[key] == halves["reduce_scatter"][key] + halves["allgather"][key], key
    assert work.traffic["inter_bytes"] > 0
    return True


def test_one_work_and_bytes_of_both_halves():
    assert run_ranks(4, _accounting_worker, 2) == [True] * 4


# ---- error feedback ---------------------------------------------------------------------
def _ef_worker(rank, world, node_size, collective, kw, steps, numel, tail_apart=False):
    """With error feedback the residuals telescope: over T calls,
    sum_t out_t = sum_t exact_t - (what the last residuals still hold), up to fp32
    rounding. This holds only if the kept residual is exactly what each encode lost.
    tail_apart: the all-reduce reduces its last numel % world elements apart (unquantized)."""
    qcoll._runtime.steps.MIN_STAGE_BYTES = 0
    qcoll.policy.HOST_TAIL_APART_MIN_BYTES = 0 if tail_apart else 1 << 40
    g = qcoll.new_group(node_size=node_size)
    ef = qcoll.ErrorFeedback()
    total_out = torch.zeros(numel if collective == "all_reduce" else numel // world,
                            dtype=torch.float64)
    for t in range(steps):
        x = _ef_input(t, rank, numel)
        if collective == "all_reduce":
            y = x.clone()
            qcoll.quantized_all_reduce(y, g, error_feedback=ef, **kw)
        else:
            y = torch.empty(numel // world)
            qcoll.quantized_reduce_scatter(y, x, g, error_feedback=ef, **kw)
        total_out += y.double()
    residuals = {k: v.clone() for k, v in ef._residuals.items()}
    return total_out, residuals, ef.nbytes


def _ef_input(t, rank, numel):
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * t + rank)) * (1 + t % 3)


def _ef_expected_total(world, numel, steps):
    total = torch.zeros(numel, dtype=torch.float64)
    for t in range(steps):
        for r in range(world):
            total += _ef_input(t, r, numel).double() / world
    return total


@pytest.mark.parametrize("collective,world,node_size,kw,tail_apart", [
    ("all_reduce", 2, 2, dict(bits=4, group_size=8, pipeline_stages=2), False),
    ("all_reduce", 4, 2, dict(bits=8, inter_bits=4, hierarchical=False), False),
    ("reduce_scatter", 4, 2, dict(intra_bits=4, inter_bits=4, hierarchical=False, group_size=8,
                                  pipeline_stages=3), False),
    # 2-hop: the inter-node re-encode's residual too
    ("all_reduce", 4, 2, dict(bits=8, inter_bits=4, group_size=8, pipeline_stages=2), False),
    ("all_reduce", 4, 2, dict(bits=8, inter_bits=4, group_size=8, pipeline_stages=2), True),
    ("reduce_scatter", 6, 2, dict(intra_bits=8, inter_bits=4, group_size=8, pipeline_stages=3), False),
])
def test_error_feedback_residuals_telescope(collective, world, node_size, kw, tail_apart):
    steps, numel = 6, 2 * 999  # with 4 ranks: partitions of 999 (the all-reduce pads to 500, or
    # with the tail apart reduces 4 x 499 and the last 2 elements apart)
    if collective == "reduce_scatter":
        numel = world * 999
    results = run_ranks(world, _ef_worker, node_size, collective, kw, steps, numel, tail_apart)
    # The last numel % world elements apart: unquantized, no residual; the rest whole shards.
    tail = numel % world if tail_apart else 0
    n = -(-(numel - tail) // world)
    exact = _ef_expected_total(world, numel, steps)  # rank r holds partition r of it
    # What the last residuals still hold, as it would reach the result: the mean of the
    # ranks' input residuals (padding dropped), plus each owner's shard residual.
    held = torch.stack([r[1]["input"].double()[:numel] for r in results]).mean(0)
    held = torch.cat([held, torch.zeros(numel - held.numel(), dtype=torch.float64)])
    # 2-hop: rank (node m, local j)'s inter row k went into partition j + k * node_size,
    # summed over the nodes and divided by the world (avg).
    nodes = world // node_size
    inter = torch.zeros(world * n, dtype=torch.float64)
    for r, res in enumerate(results):
        if "inter" in res[1]:
            rows = res[1]["inter"].double().view(nodes, n)
            for k in range(nodes):
                p = r % node_size + k * node_size
                inter[p * n:(p + 1) * n] += rows[k] / world
    held[:world * n] += inter[:numel]
    inter_bytes = 4 * nodes * n if "inter" in results[0][1] else 0
    assert ("inter" in results[0][1]) == (kw.get("hierarchical", True) and nodes > 1)
    if collective == "all_reduce":
        held[:world * n] += torch.cat([r[1]["shard"].double() for r in results])[:numel]
        got = results[0][0]
        assert all(torch.equal(got, r[0]) for r in results)
        # nbytes: input + shard (+ inter) residuals
        assert results[0][2] == 4 * (world * n + n) + inter_bytes
    else:
        got = torch.cat([r[0] for r in results])
        assert results[0][2] == 4 * numel + inter_bytes
    scale = exact.abs().max().item()
    drift = (got + held - exact).abs().max().item()
    assert drift < 1e-5 * scale, f"residuals do not account for the error: {drift:.3g}"
    plain = (got - exact).abs().max().item()
    assert plain > 100 * drift  # the identity is not trivially satisfied


def _tail_boundary_worker(rank, world):
    """At the default threshold (policy.HOST_TAIL_APART_MIN_BYTES) a host all-reduce of a
    size that is not a multiple of the ranks pads just below it and reduces its tail apart
    from it: the input residual holds world * ceil(numel / world) elements, then
    numel - numel % world."""
    g = qcoll.new_group(node_size=2)
    edge = qcoll.policy.HOST_TAIL_APART_MIN_BYTES // 2  # bf16 elements
    sizes = {}
    for numel in (edge - 1, edge + 1):
        ef = qcoll.ErrorFeedback()
        x = gradient_like(numel, torch.bfloat16, "edge", world, rank)
        qcoll.quantized_all_reduce(x, g, bits=8, inter_bits=4, error_feedback=ef)
        sizes[numel] = ef._residuals["input"].numel()
    return sizes, edge


def test_tail_apart_from_the_default_threshold():
    sizes, edge = run_ranks(4, _tail_boundary_worker)[0]
    assert sizes == {edge - 1: edge, edge + 1: edge}  # 4 | edge: padded up, or rounded down


# ---- the unquantized host paths -----------------------------------------------------------
@pytest.mark.parametrize("itemsize,nbytes,ranks,path", [
    (4, 1024, 4, "exchange"), (4, 1 << 20, 4, "exchange"), (4, (1 << 20) + 4, 4, "transport"),
    (4, 1024, 8, "exchange"), (4, 64 << 20, 6, "transport"),
    (4, 1024, 3, "transport"), (4, 1024, 2, "transport"),
    (2, 1024, 4, "exchange"), (2, 64 << 20, 6, "exchange"),
    (2, (1 << 20) - 2, 3, "transport"), (2, 1 << 20, 3, "exchange"), (2, 1 << 20, 2, "exchange"),
])
def test_unquantized_host_path_by_dtype_size_and_ranks(itemsize, nbytes, ranks, path):
    # The rule of policy.unquantized_host_all_reduce, at its edges: from 4 ranks the exchange
    # (two rounds) except fp32 over 1 MB; below, the transport except bf16/fp16 from 1 MB.
    assert qcoll.policy.unquantized_host_all_reduce(itemsize, nbytes // itemsize, ranks) == path
    other = "transport" if path == "exchange" else "exchange"
    with qcoll.policy.host_all_reduce_path(other):  # forced, whatever the rule says
        assert qcoll.policy.unquantized_host_all_reduce(itemsize, nbytes // itemsize, ranks) == other


def _default_path_worker(rank, world, node_size, numel, dtype):
    """Which path a default bits=None call takes (the transport's all-reduce refused or
    counted), and that its result is the fp32 sum rounded once, identical on every rank."""
    import qcoll.all_reduce as module

    taken, plans = [], []
    transport, reduce_scatter = module._transport_all_reduce, module.ReduceScatter

    def counted(*args, **kwargs):
        taken.append("transport")
        return transport(*args, **kwargs)

    def planned(*args, **kwargs):
        step = reduce_scatter(*args, **kwargs)
        plans.append(step.plan)
        return step
    module._transport_all_reduce, module.ReduceScatter = counted, planned
    g = qcoll.new_group(node_size=node_size)
    inputs = [gradient_like(numel, dtype, "path", world, r) for r in range(world)]
    x = inputs[rank].clone()
    qcoll.quantized_all_reduce(x, g, op="sum", bits=None)
    if not taken:  # the exchange: the raw inputs to their owner, one flat hop, summed there
        assert len(plans) == 1 and not plans[0].transport_reduces
        assert not plans[0].two_hop
        expected, _ = simulate_all_reduce(inputs, node_size, op="sum", bits=None, inter_bits=None,
                                          group_size=DEFAULT_GROUP_SIZE, stages=1, hierarchical=False,
                                          dtype=dtype)
        ref.assert_same_bits(x, expected, f"{dtype} numel={numel} world={world}")  # the rank-order sum
    # Summed in fp32 (in the path's order): within the fp32 sums' slack of the exact sum;
    # bf16 rounded once: at most half an ulp past that.
    if dtype == F32:
        slack = world * 2.0**-24 * torch.stack([t.double().abs() for t in inputs]).sum(0)
        assert bool(((x.double() - _exact(inputs, "sum")).abs() <= slack).all())
    else:
        assert over_half_ulp(x, inputs, 1) <= 1
    return (taken[0] if taken else "exchange"), x


@pytest.mark.parametrize("world,node_size,numel,dtype", [
    (4, 2, 1001, F32), (4, 2, (1 << 18) + 1, F32), (3, 3, 1001, F32), (3, 3, 1001, torch.bfloat16),
    (4, 2, 1001, torch.bfloat16),
])
def test_default_unquantized_host_path(world, node_size, numel, dtype):
    results = run_ranks(world, _default_path_worker, node_size, numel, dtype, timeout=120)
    expected = qcoll.policy.unquantized_host_all_reduce(dtype.itemsize, numel, world)
    assert [path for path, _ in results] == [expected] * world
    for _, x in results[1:]:
        assert torch.equal(x, results[0][1])


def _ef_state_worker(rank, world):
    g = qcoll.new_group(node_size=1)
    ef = qcoll.ErrorFeedback()
    with pytest.raises(TypeError, match="error_feedback must be a qcoll.ErrorFeedback"):
        qcoll.quantized_all_reduce(torch.ones(8), g, error_feedback={})
    qcoll.quantized_all_reduce(torch.ones(8), g, error_feedback=ef)
    with pytest.raises(ValueError, match="one ErrorFeedback per tensor"):
        qcoll.quantized_all_reduce(torch.ones(9), g, error_feedback=ef)
    with pytest.raises(ValueError, match="one ErrorFeedback per tensor"):
        qcoll.quantized_reduce_scatter(torch.ones(8), torch.ones(8), g, error_feedback=ef)
    ef.reset()
    assert ef.nbytes == 0
    qcoll.quantized_all_reduce(torch.ones(9), g, error_feedback=ef)
    return True


def test_error_feedback_state_checks():
    assert run_ranks(1, _ef_state_worker) == [True]


# ---- argument checks --------------------------------------------------------------------
def _bad_arguments_worker(rank, world):
    g = qcoll.new_group(node_size=1)
    x = torch.ones(10)
    bad = [
        (TypeError, "tensor must be a torch.Tensor", lambda: qcoll.quantized_all_reduce([1.0], g)),
        (ValueError, "must be contiguous", lambda: qcoll.quantized_all_reduce(torch.ones(4, 4).t(), g)),
        (TypeError, "tensor must have dtype", lambda: qcoll.quantized_all_reduce(torch.ones(4, dtype=torch.int32), g)),
        (ValueError, "op must be one of", lambda: qcoll.quantized_all_reduce(x, g, op="max")),
        (ValueError, "bits must be", lambda: qcoll.quantized_all_reduce(x, g, bits=3)),
        (ValueError, "inter_bits must be", lambda: qcoll.quantized_all_reduce(x, g, inter_bits=2)),
        (ValueError, "group_size must be", lambda: qcoll.quantized_all_reduce(x, g, group_size=7)),
        (ValueError, "pipeline_stages must be", lambda: qcoll.quantized_all_reduce(x, g, pipeline_stages=0)),
        (ValueError, "hierarchical must be", lambda: qcoll.quantized_all_reduce(x, g, hierarchical="yes")),
        (RuntimeError, "leaf tensor that requires grad",
         lambda: qcoll.quantized_all_reduce(torch.ones(3, requires_grad=True), g)),
    ]
    for exc, match, call in bad:
        with pytest.raises(exc, match=match):
            call()
    # Nothing was sent: the group still pairs its ranks' calls.
    y = torch.full((10,), float(rank))
    qcoll.quantized_all_reduce(y, g, bits=None)
    assert torch.equal(y, torch.full((10,), (world - 1) / 2))
    return True


def test_bad_arguments_raise_before_communication_on_every_rank():
    assert run_ranks(2, _bad_arguments_worker) == [True] * 2
