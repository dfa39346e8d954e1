"""Issue 26 item 5: bits=None rounds once. bf16/fp16 inputs reduced across two hops are
summed in fp32 to the end (the inter-node hop carries fp32 partial sums, and the byte
statistics count them), so every output element is within half an ulp of the exact sum
(or mean) of the inputs, up to the fp32 summation error; gloo's own bf16 reduction rounds
at every step and is not."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import qcoll
from tests.support.distributed import run_ranks

MANTISSA = {torch.bfloat16: (7, -126), torch.float16: (10, -14)}  # bits, smallest normal exponent


def half_ulp(exact: torch.Tensor, dtype) -> torch.Tensor:
    """Half the spacing of `dtype` values around each element of `exact` (float64)."""
    m, emin = MANTISSA[dtype]
    e = torch.floor(torch.log2(exact.abs().clamp_min(2.0**emin))).clamp_min(emin)
    return torch.exp2(e - m - 1)


def over_half_ulp(got: torch.Tensor, inputs: list, divisor: int) -> float:
    """The largest |got - exact| in half-ulps beyond the fp32 summation slack (<= 1: met)."""
    exact = torch.stack([x.double() for x in inputs]).sum(0) / divisor
    slack = len(inputs) * 2.0**-24 * torch.stack([x.double().abs() for x in inputs]).sum(0) / divisor
    err = (got.double() - exact).abs() - slack
    return float((err / half_ulp(exact, got.dtype)).max())


def _inputs(world, numel, dtype):
    # Wide magnitudes, so that the partial sums need more bits than the dtype has.
    gen = torch.Generator().manual_seed(numel)
    return [(torch.randn(numel, generator=gen) * torch.exp2(torch.randint(-4, 5, (numel,), generator=gen).float()))
            .to(dtype) for _ in range(world)]


def _worker(rank, world, node_size, dtype, n, ar_numels, tail_apart):
    import sys

    sys.modules["qcoll.all_reduce"]._UPCAST_CHUNK = 1000  # several fp32 parts per call
    # The last numel % world elements apart, or the tensor padded (as below 4 MB): bytes below.
    qcoll.policy.HOST_TAIL_APART_MIN_BYTES = 0 if tail_apart else 1 << 40
    g = qcoll.new_group(node_size=node_size)
    inputs = _inputs(world, world * n, dtype)
    report = {}
    for op, div in (("sum", 1), ("avg", world)):
        out = torch.empty(n, dtype=dtype)
        qcoll.reset_stats()
        qcoll.quantized_reduce_scatter(out, inputs[rank], g, op=op, intra_bits=None, inter_bits=None)
        report[f"rs {op}"] = over_half_ulp(out, [x[rank * n:(rank + 1) * n] for x in inputs], div)
        report[f"rs {op} stats"] = qcoll.stats()["reduce_scatter"]
        for numel in ar_numels:
            xs = _inputs(world, numel, dtype)
            # The transport's all-reduce of fp32 copies and the exchange (which a call takes
            # goes by dtype, size and ranks: policy.unquantized_host_all_reduce): each forced
            # here, as the cost probe forces them (its bytes below tell the path taken).
            for path, forced in (("fp32", "transport"), ("exchange", "exchange")):
                with qcoll.policy.host_all_reduce_path(forced):
                    if path == "exchange":  # its bytes below: a call whose signature is checked
                        qcoll.quantized_all_reduce(xs[rank].clone(), g, op=op, bits=None)
                    x = xs[rank].clone()
                    qcoll.reset_stats()
                    qcoll.quantized_all_reduce(x, g, op=op, bits=None)
                report[f"ar-{path} {numel} {op}"] = over_half_ulp(x, xs, div)
                report[f"ar-{path} {numel} {op} result"] = x
                report[f"ar-{path} {numel} {op} stats"] = qcoll.stats()["all_reduce"]
    # gloo's own bf16 sum, for contrast (not asserted on: it is what qcoll does better).
    theirs = torch.empty(n, dtype=dtype)
    dist.reduce_scatter_tensor(theirs, inputs[rank], op=dist.ReduceOp.SUM)
    report["gloo"] = over_half_ulp(theirs, [x[rank * n:(rank + 1) * n] for x in inputs], 1)
    return report


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world,node_size,tail_apart", [(4, 2, True), (6, 2, True), (6, 2, False)])
def test_bits_none_rounds_once(world, node_size, tail_apart, dtype):
    n = 4099
    # The all-reduce sums fp32 copies, 1000 elements at a time here: one part, and five.
    reports = run_ranks(world, _worker, node_size, dtype, n, (999, 4099, world * 1024), tail_apart, timeout=120)
    nodes = world // node_size
    for rank, rep in enumerate(reports):
        for key, value in rep.items():
            if key.startswith("ar-fp32") and key.endswith("stats"):  # one call, its fp32 bytes
                numel = int(key.split()[1])
                shards = sum(-(-min(1000, numel - b) // world) for b in range(0, numel, 1000))
                # fp32 reduce-scatter + all-gather of each part, and the call header (each
                # of these calls is its signature's first)
                assert value["calls"] == 1 and value["inter_bytes"] == (world - node_size) * (
                    2 * 4 * shards + 32), (key, value)
                continue
            if key.startswith("ar-exchange") and key.endswith("stats"):
                # The raw inputs of the whole shards to their owner (then the shards back):
                # a bf16 ring's payload. Partitions of whole 16-byte slots go as they lie,
                # others in slots with headers (no call check: the signature's second
                # call). The last numel % world elements: all-gathered as fp32 (an
                # all-to-all: each to every peer), or padded into the shards.
                numel = int(key.split()[1])
                tail = numel % world if tail_apart else 0
                payload = -(-(numel - tail) // world) * dtype.itemsize
                sent = payload if payload % 16 == 0 else 32 + -(-payload // 16) * 16
                assert value["calls"] == 1 and value["inter_bytes"] == (world - node_size) * (
                    sent + payload + 4 * tail), (key, value)
                continue
            if key.endswith("result"):  # bit-identical on every rank
                assert torch.equal(value.view(torch.int16), reports[0][key].view(torch.int16)), (rank, key)
                continue
            if key == "gloo" or key.endswith("stats"):
                continue
            assert value <= 1.0, f"rank {rank} {key}: {value:.2f} half-ulps from the exact result"
        # Bytes: the intra-node hop carries the dtype, the inter-node hop fp32 partial sums.
        ru = lambda b: -(-b // 16) * 16
        st = rep["rs sum stats"]
        call = 32 * (world - 1)  # the first call of this signature checks it
        chunk_headers = 32 * (nodes * (node_size - 1) + nodes - 1)
        assert st["intra_bytes"] == (node_size - 1) * nodes * (32 + ru(n * dtype.itemsize)) + \
            (node_size - 1) * 32 + 0, st
        assert st["inter_bytes"] == (nodes - 1) * (32 + ru(4 * n)) + (world - node_size) * 32, st
        assert st["header_bytes"] == call + chunk_headers, st
    if dtype == torch.bfloat16:  # the inputs are wide enough that stepwise rounding shows
        assert max(rep["gloo"] for rep in reports) > 1.0
