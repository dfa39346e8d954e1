"""Error feedback of the 2-hop reduce-scatter's inter-node re-encode (the "inter" residual of
qcoll.ErrorFeedback): after each call, rank r's residual for node k is exactly the partial
sum it re-encoded for node k (plus the old residual) minus what node k decodes, checked
against an independent simulation (reference quantizer and transform, fp32 sums in rank
order); and it makes the running sum over steps track the exact one.
"""

from __future__ import annotations

import pytest
import torch

import qcoll
from tests.support import reference as ref
from tests.support.distributed import run_ranks

F32 = torch.float32


def _input(t, rank, numel, dtype):
    gen = torch.Generator().manual_seed(1000 * t + rank)
    x = torch.randn(numel, generator=gen) * (1 + t % 3)
    x[torch.randint(0, numel, (numel // 100 + 1,), generator=gen)] *= 30  # outliers
    return x.to(dtype)


def _decoded(vals, bits, gs, size):
    """What a receiver decodes of one chunk of fp32 values (the sender transforms first
    when size): fp32, in the chunk's domain."""
    if size:
        vals = ref.hadamard(vals, size)
    return ref.dequantize(ref.quantize(vals, bits=bits, group_size=gs), F32)


def expected_inter_residual(sends, old, rank, node_size, n, c):
    """Rank `rank`'s new "inter" residual (nodes x n): sends[i] is what rank i's first hop
    encodes (its input, plus its old "input" residual when compensated), old the rank's
    previous inter residual. Stage slices are chunks of their own (groups and Hadamard
    blocks count from the slice's start)."""
    world = len(sends)
    nodes, m, j = world // node_size, rank // node_size, rank % node_size
    size = c.get("size", 0)
    new = torch.empty(nodes * n)
    step = -(-n // c["stages"])
    for k in range(nodes):
        p = j + k * node_size  # the partition node k's local peer j owns
        for b in range(0, n, step):
            e = min(n, b + step)
            partial = None
            for i in range(m * node_size, (m + 1) * node_size):  # local rank order
                x = sends[i][p * n + b: p * n + e].to(F32)
                y = x if c["intra"] is None else _decoded(x, c["intra"], c["gs"], size)
                partial = y if partial is None else partial + y
            if size and c["intra"] is None:  # raw first hop: the reduce transforms forward
                partial = ref.hadamard(partial, size)
            v = partial + old[k * n + b: k * n + e]
            new[k * n + b: k * n + e] = v - ref.dequantize(
                ref.quantize(v, bits=c["inter"], group_size=c["gs"]), F32)
    return new


CASES = [
    dict(n=1000, dtype=torch.bfloat16, intra=8, inter=4, gs=64, stages=2),
    dict(n=517, dtype=F32, intra=None, inter=4, gs=24, stages=3),
    dict(n=700, dtype=torch.float16, intra=4, inter="fp8_e4m3", gs=128, stages=1),
    dict(n=1000, dtype=F32, intra=8, inter=4, gs=256, stages=2, size=64),
    dict(n=300, dtype=torch.bfloat16, intra=None, inter=8, gs=32, stages=1, size=32),
]


def _identity_worker(rank, world, node_size, steps):
    import torch.distributed as dist

    qcoll._runtime.steps.MIN_STAGE_BYTES = 0
    g = qcoll.new_group(node_size=node_size)
    for ci, c in enumerate(CASES):
        n = c["n"]
        ef = qcoll.ErrorFeedback()
        size = c.get("size", 0)
        for t in range(steps):
            inputs = [_input(t + 10 * ci, r, world * n, c["dtype"]) for r in range(world)]
            old_in = ef._residuals.get("input", torch.zeros(world * n))
            gathered = [torch.empty(world * n) for _ in range(world)]
            dist.all_gather(gathered, old_in)  # every rank's first-hop residual before the call
            sends = [x if c["intra"] is None else (x.float() + res).to(c["dtype"])
                     for x, res in zip(inputs, gathered)]
            old = ef._residuals.get("inter", torch.zeros((world // node_size) * n)).clone()
            out = torch.empty(n, dtype=c["dtype"])
            qcoll.quantized_reduce_scatter(out, inputs[rank], g, intra_bits=c["intra"],
                                           inter_bits=c["inter"], group_size=c["gs"],
                                           pipeline_stages=c["stages"], error_feedback=ef,
                                           hadamard=bool(size), hadamard_size=size or None)
            want = expected_inter_residual(sends, old, rank, node_size, n, c)
            ref.assert_same_bits(ef._residuals["inter"], want, f"rank {rank} step {t} case {c}")
            assert want.abs().max() > 0
        expected_bytes = 4 * (world // node_size) * n + (0 if c["intra"] is None else 4 * world * n)
        assert ef.nbytes == expected_bytes
    return True


@pytest.mark.parametrize("world,node_size", [(4, 2), (6, 2)])
def test_inter_residual_is_exactly_what_the_inter_encode_lost(world, node_size):
    assert run_ranks(world, _identity_worker, node_size, 2, timeout=180) == [True] * world


def _effect_worker(rank, world, node_size, steps, collective, use_ef):
    """Running sums over `steps` calls of one constant input: (after 1 step, after all)."""
    g = qcoll.new_group(node_size=node_size)
    n = 4096
    numel = world * n
    x = _input(0, rank, numel, F32)
    ef = qcoll.ErrorFeedback() if use_ef else None
    total = torch.zeros(numel if collective == "all_reduce" else n, dtype=torch.float64)
    sums = []
    for _ in range(steps):
        if collective == "all_reduce":
            y = x.clone()
            qcoll.quantized_all_reduce(y, g, bits=None, inter_bits=4, error_feedback=ef)
        else:  # raw first hop: only the inter-node encode loses anything
            y = torch.empty(n)
            qcoll.quantized_reduce_scatter(y, x, g, intra_bits=None, inter_bits=4,
                                           error_feedback=ef)
        total += y.double()
        sums.append(total.clone())
    return sums[0], sums[-1]


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_reduce"])
def test_inter_feedback_keeps_the_running_sum_on_track(collective):
    world, node_size, steps = 4, 2, 16
    exact_mean = sum(_input(0, r, world * 4096, F32).double() for r in range(world)) / world
    errors = {}
    for use_ef in (False, True):
        results = run_ranks(world, _effect_worker, node_size, steps, collective, use_ef)
        if collective == "all_reduce":
            first, last = results[0]
            exact = exact_mean
        else:
            first = torch.cat([r[0] for r in results])
            last = torch.cat([r[1] for r in results])
            exact = exact_mean
        errors[use_ef] = ((first - exact).abs().max().item(),
                          (last - steps * exact).abs().max().item())
    (one, plain), (_, fed) = errors[False], errors[True]
    assert plain > 0.5 * steps * one  # without feedback the same error adds up ~K times
    assert fed < 3 * one, errors      # with it the running sum's error stays bounded
    assert fed < plain / 4, errors


def _bad_worker(rank, world):
    g = qcoll.new_group(node_size=2)
    ef = qcoll.ErrorFeedback()
    out = torch.empty(8)
    with pytest.raises(TypeError, match="error_feedback must be a qcoll.ErrorFeedback"):
        qcoll.quantized_reduce_scatter(out, torch.ones(8 * world), g, intra_bits=None,
                                       error_feedback=object())
    with pytest.raises(ValueError, match="group size"):  # sizes: checked before binding
        qcoll.quantized_reduce_scatter(out, torch.ones(8 * world + 1), g, error_feedback=ef)
    assert ef.nbytes == 0 and "unbound" in repr(ef)
    qcoll.quantized_reduce_scatter(out, torch.ones(8 * world), g, intra_bits=None,
                                   error_feedback=ef)  # binds, with only the inter residual
    assert set(ef._residuals) == {"inter"} and ef.nbytes == 4 * 8 * (world // 2)
    with pytest.raises(ValueError, match="one ErrorFeedback per tensor"):
        qcoll.quantized_reduce_scatter(torch.empty(4), torch.ones(4 * world), g, error_feedback=ef)
    return True


def test_bad_error_feedback_raises_before_communication_on_every_rank():
    assert run_ranks(4, _bad_worker) == [True] * 4


def test_bind_takes_ranks_and_group_size_is_a_deprecated_alias():
    x = torch.ones(8)
    ef = qcoll.ErrorFeedback().bind("quantized_all_reduce", x, ranks=4)
    assert "over 4 ranks" in repr(ef)
    with pytest.warns(DeprecationWarning, match=r"bind\(group_size=\) is deprecated: pass ranks="):
        assert qcoll.ErrorFeedback().bind("quantized_all_reduce", x, group_size=4)._binding == ef._binding
    with pytest.raises(ValueError, match="over 2 ranks"):
        ef.bind("quantized_all_reduce", x, 2)
    with pytest.raises(TypeError, match="not both ranks and group_size"), pytest.warns(DeprecationWarning):
        qcoll.ErrorFeedback().bind("quantized_all_reduce", x, 4, group_size=4)
