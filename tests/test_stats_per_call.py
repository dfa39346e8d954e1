"""qcoll.stats.allgather_traffic / reduce_scatter_traffic: what one call will add to
qcoll.stats(), read from its plan without running it (the ZeRO engine counts its bytes this
way). Checked against the counters' real deltas over each kind of call: raw and quantized
all-gathers, the baseline, flat quantized and 2-hop pipelined reduce-scatters, odd sizes,
one node (world 2) and 2 nodes x 2 (world 4)."""

from __future__ import annotations

import functools

import pytest
import torch

from distributed import run_ranks

CALLS = [  # (kind, numel per rank, dtype, options)
    ("allgather", 1000, torch.bfloat16, dict(bits=8)),
    ("allgather", 777, torch.float32, dict(bits=4, group_size=64)),
    ("allgather", 513, torch.float16, dict(bits=None)),
    ("allgather", 0, torch.bfloat16, dict(bits=8)),
    ("reduce_scatter", 1000, torch.bfloat16, dict(intra_bits=8, inter_bits=4, pipeline_stages=3)),
    ("reduce_scatter", 301, torch.float32, dict(intra_bits=None, inter_bits=None, hierarchical=False)),
    ("reduce_scatter", 301, torch.float32, dict(intra_bits=8, inter_bits=8, hierarchical=False)),
    ("reduce_scatter", 4099, torch.float16, dict(intra_bits=4, inter_bits=4, group_size=128)),
]


def _worker(rank, world, node_size):
    import qcoll
    from qcoll.stats import allgather_traffic, reduce_scatter_traffic

    group = qcoll.new_group(node_size=node_size)
    out = []
    for kind, n, dtype, options in CALLS:
        if kind == "allgather":
            predicted = allgather_traffic(n, dtype, group, **options)
            args = (torch.empty(world * n, dtype=dtype), torch.ones(n, dtype=dtype))
            call = qcoll.quantized_allgather
        else:
            predicted = reduce_scatter_traffic(n, dtype, group, **options)
            args = (torch.empty(n, dtype=dtype), torch.ones(world * n, dtype=dtype))
            call = qcoll.quantized_reduce_scatter
        before = qcoll.stats()[kind]
        call(*args, group, **options)
        after = qcoll.stats()[kind]
        out.append((predicted, {k: after[k] - before[k] for k in after}))
    return out


@functools.lru_cache(maxsize=None)
def _runs(world, node_size):
    return run_ranks(world, _worker, node_size, timeout=120)


@pytest.mark.parametrize("world,node_size", [(2, 2), (4, 2)])
def test_prediction_equals_the_counters_delta(world, node_size):
    for rank, result in enumerate(_runs(world, node_size)):
        for (kind, n, dtype, options), (predicted, delta) in zip(CALLS, result):
            assert predicted == delta, (rank, kind, n, dtype, options)
        assert any(p["inter_bytes"] for p, _ in result) == (world > node_size)
