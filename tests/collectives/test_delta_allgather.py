"""qcoll.delta_allgather (SDP4Bit's qWD) against an independent simulation on
tests/support/reference.py: for every partition p, the difference d_p = shard_p - old_p in fp32 is
block-quantized (groups counted from the partition's start), and

    new_p = cast(old_p + dq(q(d_p)))    (one fp32 add, rounded once to the dtype)

bit for bit, on every rank alike. The error |new - shard| is bounded by the difference's
quantization step (not the weights'), and does not build up over calls: each call's error
is part of the next difference."""

from __future__ import annotations

import zlib

import pytest
import torch

import qcoll
from tests.support import reference as ref
from tests.support.distributed import run_ranks

F32 = torch.float32
GS = qcoll.DEFAULT_GROUP_SIZE
CALLS = 3  # successive calls on the same full, shards drifting


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _old(world, n, dtype):
    """Last step's full tensor: weight-like values (identical on every rank)."""
    return (torch.randn(world * n, generator=_gen("old", world, n, dtype)) * 0.05).to(dtype)


def _shards(world, n, dtype, call):
    """Every rank's new partition at `call`: a drift of ~1e-3 from the call before's shard
    (rank-specific, with an outlier so groups have different scales)."""
    full = _old(world, n, dtype).to(F32)
    for c in range(call + 1):
        step = torch.randn(world * n, generator=_gen("drift", world, n, dtype, c)) * 1e-3
        step[::97] *= 5
        full = full + step
    return full.to(dtype).chunk(world) if n else [full.to(dtype)] * world


CASES = [(n, dtype, bits) for n in (1, 37, 1000) for dtype in (F32, torch.bfloat16, torch.float16)
         for bits in (4, 8)] + [(0, F32, 4), (300, F32, None), (300, torch.bfloat16, None)]


def _worker(rank, world, node_size):
    group = qcoll.new_group(node_size=node_size)
    out = {}
    for n, dtype, bits in CASES:
        full = _old(world, n, dtype)
        history = []
        for call in range(CALLS):
            shard = _shards(world, n, dtype, call)[rank].clone()
            qcoll.reset_stats()
            if call == 1:  # the async form: returns a Work; the call has run once waited
                work = qcoll.delta_allgather(full, shard, group, bits=bits, async_op=True)
                assert isinstance(work, qcoll.Work)
                work.wait()
                traffic = work.traffic
            else:
                qcoll.delta_allgather(full, shard, group, bits=bits)
                traffic = None
            history.append((full.clone(), qcoll.stats()["allgather"], traffic))
        out[(n, dtype, bits)] = history
    # The bytes are those of an all-gather of the fp32 difference at the same bits.
    if world > 1:
        x = torch.zeros(1000, dtype=F32)
        qcoll.reset_stats()
        qcoll.quantized_allgather(torch.empty(world * 1000, dtype=F32), x, group, bits=4)
        out["plain"] = qcoll.stats()["allgather"]
    return out


def _expected(world, n, dtype, bits):
    """The simulation: (new full after each call, per-element error bound vs the shards)."""
    full = _old(world, n, dtype)
    result = []
    for call in range(CALLS):
        shards = _shards(world, n, dtype, call)
        new, bound = [], []
        for p in range(world):
            old_p = full[p * n:(p + 1) * n]
            if bits is None:
                new.append(shards[p].clone())
                bound.append(torch.zeros(n, dtype=torch.float64))
                continue
            d = shards[p].to(F32) - old_p.to(F32)
            q = ref.quantize(d, bits=bits, group_size=GS)
            new.append((old_p.to(F32) + ref.dequantize(q, F32)).to(dtype))
            rel, absolute = ref.OUT_ROUNDING[dtype]
            # Quantizing d, two fp32 roundings (d itself: not exact when |old| and |shard|
            # differ by more than a factor of 2; old + dequantized d), then full's dtype.
            fp32_rounding = 2.0**-24 * (old_p.double().abs() + shards[p].double().abs() * 2)
            bound.append(ref.error_bound(d, q, F32) + fp32_rounding
                         + rel * shards[p].double().abs() * 2 + absolute)
        full = torch.cat(new)
        result.append((full, torch.cat(bound), torch.cat(shards) if n else full))
    return result


@pytest.mark.parametrize("world,node_size", [(1, 1), (4, 2), (6, 2), (3, 1)])
def test_delta_allgather_matches_simulation_identical_on_all_ranks(world, node_size):
    results = run_ranks(world, _worker, node_size, timeout=120)
    for n, dtype, bits in CASES:
        want = _expected(world, n, dtype, bits)
        for call, (full, bound, shards) in enumerate(want):
            for rank in range(world):
                got, stats, traffic = results[rank][(n, dtype, bits)][call]
                ref.assert_same_bits(got, full, f"n={n} {dtype} bits={bits} call {call} rank {rank}")
                if traffic is not None:
                    assert {k: traffic[k] for k in ("calls", "intra_bytes", "inter_bytes")} == \
                        {k: stats[k] for k in ("calls", "intra_bytes", "inter_bytes")}
                assert stats["calls"] == 1  # one all-gather per call
            err = (full.double() - shards.double()).abs()
            assert bool((err <= bound).all()), f"n={n} {dtype} bits={bits} call {call}: error past the bound"
            if bits == 4 and n == 1000 and world > 1:
                # The bound is the difference's step: far below quantizing the weights.
                direct = ref.dequantize(ref.quantize(shards.to(F32), bits=4, group_size=GS), F32)
                weight_err = (direct.double() - shards.double()).abs().max()
                assert float(err.max()) < float(weight_err) / 5, (float(err.max()), float(weight_err))
    if world > 1:
        plain = results[0]["plain"]
        # A later call: "plain" has the same signature, so neither sends the call check.
        stats = results[0][(1000, F32, 4)][CALLS - 1][1]
        assert stats["inter_bytes"] == plain["inter_bytes"] and stats["intra_bytes"] == plain["intra_bytes"]
        if world // node_size > 1:
            assert stats["inter_bytes"] > 0


def _bad_worker(rank, world):
    group = qcoll.new_group(node_size=1)
    full = torch.zeros(world * 8)
    shard = torch.zeros(8)
    cases = {
        "bits": (dict(full=full, shard=shard, bits=3), "bits"),
        "dtype": (dict(full=full, shard=shard.bfloat16()), "shard dtype"),
        "size": (dict(full=full, shard=torch.zeros(7)), "full.numel()"),
        "overlap": (dict(full=full, shard=full[rank * 8:(rank + 1) * 8]), "share memory"),
        "strided": (dict(full=full, shard=torch.zeros(16)[::2]), "shard must be contiguous"),
        "int": (dict(full=full.int(), shard=shard.int()), "shard"),
        "leaf": (dict(full=torch.zeros(world * 8, requires_grad=True), shard=shard), "full is a leaf"),
        "group_size": (dict(full=full, shard=shard, group_size=12), "group_size"),
    }
    seen = {}
    for name, (kwargs, word) in cases.items():
        full_arg, shard_arg = kwargs.pop("full"), kwargs.pop("shard")
        try:
            qcoll.delta_allgather(full_arg, shard_arg, group, **kwargs)
        except (TypeError, ValueError, RuntimeError) as exc:
            seen[name] = (word in str(exc), str(exc))
        else:
            seen[name] = (False, "no exception")
    # Still usable afterwards: a correct call gathers the differences.
    qcoll.delta_allgather(full, torch.full((8,), float(rank + 1)), group, bits=8)
    return seen, full


def test_delta_allgather_bad_input_raises_on_every_rank():
    results = run_ranks(2, _bad_worker, timeout=60)
    for seen, full in results:
        for name, (named, msg) in seen.items():
            assert named, f"{name}: {msg!r}"
        assert torch.equal(full, torch.tensor([1.0] * 8 + [2.0] * 8))


def _shaped_worker(rank, world):
    """The same calls on 2-D tensors (full world*4 x 5, shard 4 x 5 or a 20-element row)
    and on their flat views."""
    group = qcoll.new_group(node_size=1)
    out = {}
    for bits in (8, None):
        for shard_shape in ((4, 5), (1, 20)):
            results = []
            for shaped in (True, False):
                full = _old(world, 20, F32).view(world * 4, 5)
                shard = _shards(world, 20, F32, 0)[rank].clone().view(shard_shape)
                if not shaped:
                    full, shard = full.view(-1), shard.view(-1)
                qcoll.delta_allgather(full, shard, group, bits=bits)
                results.append(full.reshape(-1).clone())
            out[(bits, shard_shape)] = torch.equal(*results)
    group.close()
    return out


def test_delta_allgather_partitions_the_elements_of_any_shape():
    """full and shard of any shape (contiguous): the partitions are of their elements, as
    for the flat tensors, bit for bit."""
    for out in run_ranks(2, _shaped_worker, timeout=60):
        assert all(out.values()), out
