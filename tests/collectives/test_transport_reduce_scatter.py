"""The gloo transport's reduce-scatter (the flat bits=None call): gloo's own algorithm, an
all-reduce of a copy of the input, run in a buffer the transport keeps up to a size limit
(ProcessGroupTransport._reduce_scatter_by_all_reduce). Its results are torch's reduce-scatter's
bit for bit, for every dtype and op, kept buffer or not; the input is left as it was; the
buffer is reused from call to call, not kept past the limit, and dropped when the group closes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import qcoll
from qcoll import _torch_transport as tt
from tests.support.distributed import run_ranks


def _worker(rank, world, sizes, keep_bytes):
    tt._KEEP_BUFFER_BYTES = keep_bytes
    cls = tt.ProcessGroupTransport
    original = cls._reduce_scatter_by_all_reduce
    seen = []

    def recorded(self, recv, send, reduce):
        seen.append(self)
        return original(self, recv, send, reduce)
    cls._reduce_scatter_by_all_reduce = recorded
    g = qcoll.new_group()  # one node: the flat call, the transport's reduce-scatter
    out = []
    try:
        for numel in sizes:
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                gen = torch.Generator().manual_seed(1000 * rank + numel)
                x = torch.randn(world * numel, generator=gen).to(dtype)
                before = x.clone()
                theirs = torch.empty(numel, dtype=dtype)
                dist.reduce_scatter_tensor(theirs, x.clone(), op=dist.ReduceOp.SUM)
                for op in ("sum", "avg"):
                    mine = torch.full((numel,), float("nan"), dtype=dtype)
                    calls = len(seen)
                    qcoll.quantized_reduce_scatter(mine, x, g, op=op, intra_bits=None, inter_bits=None)
                    want = theirs if op == "sum" else theirs / world  # gloo has no AVG: summed, divided
                    kept = seen[-1]._reduced
                    out.append((numel, str(dtype), op, len(seen) - calls, torch.equal(mine, want),
                                torch.equal(x, before), None if kept is None else (kept.data_ptr(), kept.numel())))
    finally:
        cls._reduce_scatter_by_all_reduce = original
    g.close()
    released = seen[-1]._reduced is None and seen[-1]._replicas is None and g._cpu_workspace is None
    return out, released


@pytest.mark.parametrize("world", [3, 4])
def test_reduce_scatter_is_gloos_bit_for_bit_in_a_kept_buffer(world):
    small, large = 1001, 12_289  # odd sizes; the large fp32 input is over the limit below
    keep = world * large * 2  # the large call's bf16/fp16 input is kept, its fp32 one is not
    results = run_ranks(world, _worker, [small, large], keep, timeout=120)
    for out, released in results:
        assert released, "a closed group must drop the buffers it kept for the next call"
        buffers = set()
        for numel, dtype, op, calls, equal, unchanged, kept in out:
            what = (numel, dtype, op)
            assert calls == 1, what  # by the transport's all-reduce (else this test proves nothing)
            assert equal, what
            assert unchanged, what
            assert kept is not None, what
            buffers.add(kept)
        # One buffer for the small calls (grown once for the large bf16/fp16 ones); the
        # large fp32 input, over the limit, in a buffer of its own that is not kept.
        want = {(world * small * 4,), (world * large * 2,)}
        assert {(n,) for _, n in buffers} == want, buffers
        first_kept = [k for n, d, *_, k in out if n == small]
        assert len(set(first_kept)) == 1, "the kept buffer must be reused, not allocated per call"
