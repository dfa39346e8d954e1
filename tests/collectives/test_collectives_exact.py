"""Unquantized collectives (bits=None) against torch.distributed and a local computation.

Reduce-scatter data are small integers, so every sum is exact in every dtype and in any
order: the outputs must then be exactly right (torch.equal), which checks the placement
of every element on every path: the transport's own reduce-scatter, the flat 1-hop
all-to-all, and the 2-hop intra/inter path with Algorithm 2's slice reordering, over
1/2/4 pipeline stages. All-gather data are arbitrary bit patterns (NaN and Inf included):
a raw all-gather moves bytes and must reproduce them bit for bit.

Every rank derives every rank's input from a seed, so each rank computes the expected
result locally; torch.distributed's own collectives are run on the same data as a second
oracle (and to check the first)."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

import qcoll
from tests.support.distributed import run_ranks

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
SENTINEL = -768.0  # exactly representable in every dtype, outside the data range


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def small_ints(numel: int, dtype: torch.dtype, *key) -> torch.Tensor:
    """Integers in [-16, 16]: sums of up to 8 of them are exact in fp32, fp16 and bf16."""
    return torch.randint(-16, 17, (numel,), generator=_gen("ints", numel, dtype, *key)).to(dtype)


def random_bits(numel: int, dtype: torch.dtype, *key) -> torch.Tensor:
    """Arbitrary bit patterns of `dtype` (NaN, Inf, subnormals, -0.0 included)."""
    width = 32 if dtype == torch.float32 else 16
    raw = torch.randint(-(2 ** (width - 1)), 2 ** (width - 1), (numel,),
                        generator=_gen("bits", numel, dtype, *key), dtype=torch.int64)
    return raw.to(_INT_VIEW[dtype]).view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(_INT_VIEW[a.dtype]), b.contiguous().view(_INT_VIEW[b.dtype]))


def guarded(n: int, dtype: torch.dtype):
    """A contiguous n-element output inside a buffer with sentinel elements on both sides,
    so a write past either end is caught."""
    buf = torch.full((n + 2,), SENTINEL, dtype=dtype)
    return buf, buf[1 : n + 1]


def check_guards(buf: torch.Tensor, what: str) -> None:
    assert buf[0].item() == SENTINEL and buf[-1].item() == SENTINEL, f"{what}: wrote outside the output"


def _mean(exact_sum: torch.Tensor, world: int, dtype: torch.dtype) -> torch.Tensor:
    # fp32 sum (exact here) divided in fp32 by a tensor (an IEEE quotient, not a reciprocal
    # multiply), then rounded once to the output dtype.
    s = exact_sum.to(torch.float32)
    return (s / torch.full_like(s, world)).to(dtype)


def _exact_worker(rank, world, node_size, dtypes, sizes, stages_list):
    g = qcoll.new_group(node_size=node_size)
    nodes = world // node_size
    assert (g.rank, g.size, g.node_size, g.num_nodes) == (rank, world, node_size, nodes)
    assert g.intra.size == node_size and g.inter.size == nodes
    assert g.intra.rank == rank % node_size and g.inter.rank == rank // node_size
    calls = 0
    for dtype in dtypes:
        for n in sizes:
            inputs = [small_ints(world * n, dtype, world, r) for r in range(world)]
            exact = torch.stack([x.double() for x in inputs]).sum(0)[rank * n : (rank + 1) * n]
            expected = {"sum": exact.to(dtype), "avg": _mean(exact, world, dtype)}
            # The second oracle: torch's own reduce-scatter must agree with the local sum.
            theirs = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(theirs, inputs[rank].clone(), op=dist.ReduceOp.SUM)
            assert torch.equal(theirs, expected["sum"]), "oracle disagrees with torch"

            for hierarchical in (None, True, False):
                two_hop = nodes > 1 and node_size > 1 and hierarchical is not False
                # Unquantized and flat is the transport's own reduce-scatter: stages unused.
                for stages in stages_list if two_hop else stages_list[-1:]:
                    for op in ("sum", "avg"):
                        x = inputs[rank].clone()
                        buf, out = guarded(n, dtype)
                        qcoll.quantized_reduce_scatter(out, x, g, op=op, intra_bits=None,
                                                       inter_bits=None, pipeline_stages=stages,
                                                       hierarchical=hierarchical)
                        calls += 1
                        what = (f"reduce_scatter {dtype} n={n} world={world} node_size={node_size} "
                                f"hierarchical={hierarchical} stages={stages} op={op}")
                        assert out.dtype == dtype, what
                        assert torch.equal(out, expected[op]), (
                            f"{what}: got {out[:8].tolist()}, expected {expected[op][:8].tolist()}")
                        assert torch.equal(x, inputs[rank]), f"{what}: input was modified"
                        check_guards(buf, what)

            # All-gather of arbitrary bit patterns, flat and shaped (world, n) outputs.
            pieces = [random_bits(n, dtype, world, r) for r in range(world)]
            want = torch.cat(pieces)
            theirs = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(theirs, pieces[rank].clone())
            assert same_bits(theirs, want), "oracle disagrees with torch all_gather_into_tensor"
            x = pieces[rank].clone()
            buf, out = guarded(world * n, dtype)
            qcoll.quantized_allgather(out, x, g, bits=None)
            what = f"allgather {dtype} n={n} world={world}"
            assert same_bits(out, want), what
            assert same_bits(x, pieces[rank]), f"{what}: input was modified"
            check_guards(buf, what)
            out2 = torch.empty(world, n, dtype=dtype)
            qcoll.quantized_allgather(out2, x, g, bits=None)
            assert same_bits(out2.reshape(-1), want), f"{what}: (world, n) output"
            calls += 2
    st = qcoll.stats()
    return st["reduce_scatter"]["calls"], st["allgather"]["calls"], calls


SIZES = (0, 1, 7, 13, 1000, 1009)

# (world, node_size): nodes x ranks-per-node of 1x1, 1x2, 2x1, 1x3, 3x1, 2x2, 2x3, 3x2, 4x2, 2x4.
LAYOUTS = [
    pytest.param(1, 1, DTYPES, SIZES, (1, 2, 4), id="world1"),
    pytest.param(2, 2, DTYPES, SIZES, (1, 2, 4), id="1node_x2"),
    pytest.param(2, 1, DTYPES, SIZES, (1, 2, 4), id="2nodes_x1"),
    pytest.param(3, 3, DTYPES, (0, 1, 13, 1009), (1,), id="1node_x3"),
    pytest.param(3, 1, DTYPES, (1, 7, 1000), (1,), id="3nodes_x1"),
    pytest.param(4, 2, DTYPES, SIZES, (1, 2, 4), id="2nodes_x2"),
    pytest.param(6, 3, DTYPES, (1, 7, 13, 1009), (1, 4), id="2nodes_x3"),
    pytest.param(6, 2, DTYPES, (0, 1, 7, 1000), (1, 2), id="3nodes_x2"),
    pytest.param(8, 2, DTYPES, (1, 13, 1009), (1, 2, 4), id="4nodes_x2"),
    pytest.param(8, 4, DTYPES, (7, 1000), (2, 4), id="2nodes_x4"),
]


@pytest.mark.parametrize("world,node_size,dtypes,sizes,stages", LAYOUTS)
def test_unquantized_matches_torch(world, node_size, dtypes, sizes, stages):
    results = run_ranks(world, _exact_worker, node_size, dtypes, sizes, stages, timeout=120)
    for rs_calls, ag_calls, calls in results:
        # Every call was counted once, and stats() splits them by collective.
        assert rs_calls + ag_calls == calls
        assert ag_calls == 2 * len(dtypes) * len(sizes)


# ---- raw bytes: any other dtype, unquantized ----------------------------------------------
RAW_DTYPES = (torch.uint8, torch.int64, torch.bool, torch.float64)


def _raw_worker(rank, world, node_size, sizes):
    g = qcoll.new_group(node_size=node_size)
    for dtype in RAW_DTYPES:
        for n in sizes:
            gen = _gen("raw", n, dtype)
            high = 2 if dtype == torch.bool else 256  # a bool byte is 0 or 1
            every = [torch.randint(0, high, (n * torch.empty(0, dtype=dtype).element_size(),),
                                   generator=gen, dtype=torch.uint8).view(dtype) for _ in range(world)]
            nbytes = world * n * every[0].element_size()
            buf = torch.full((nbytes + 16,), 0xA5, dtype=torch.uint8)  # 8 guard bytes each side
            out = buf[8 : 8 + nbytes].view(dtype)
            qcoll.reset_stats()
            qcoll.quantized_allgather(out, every[rank].clone(), g, bits=None)
            want = torch.cat(every)
            assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), (dtype, n)
            assert bool((buf[:8] == 0xA5).all() and (buf[-8:] == 0xA5).all()), "wrote outside the output"
            stats = qcoll.stats()["allgather"]
            payload = stats["intra_bytes"] + stats["inter_bytes"] - stats["header_bytes"]  # less the call check
            assert payload == (world - 1) * n * every[0].element_size()
            for bits in (8, 4):
                with pytest.raises(TypeError, match="dtype"):
                    qcoll.quantized_allgather(out, every[rank], g, bits=bits)
    return True


@pytest.mark.parametrize("world,node_size", [(1, 1), (4, 2), (6, 2)])
def test_unquantized_allgather_moves_any_dtype_as_raw_bytes(world, node_size):
    """FSDP2 all-gathers uint8 when a group mixes parameter dtypes: bits=None moves any dtype
    exactly (odd byte counts too), counted as raw bytes; quantizing one raises."""
    assert all(run_ranks(world, _raw_worker, node_size, [0, 1, 3, 17, 1000]))


def _strided(numel: int, value: float) -> torch.Tensor:
    """numel elements of `value`: at most one as a view of stride 2 (x[::2][:numel], which
    torch calls contiguous), more as a plain tensor."""
    if numel > 1:
        return torch.full((numel,), value)
    return torch.full((3,), value)[::2][:numel]


def _strided_worker(rank, world):
    """Tensors of at most one element that torch calls contiguous whatever their stride:
    every unquantized call moves them as their one element."""
    g = qcoll.new_group(node_size=1)
    out = {}
    for n in (0, 1):
        full = _strided(world * n, float("nan"))
        qcoll.quantized_allgather(full, _strided(n, float(rank + 1)), g, bits=None)
        out[("allgather", n)] = full.tolist()
        tensor = _strided(n, float(rank + 1))
        qcoll.quantized_all_reduce(tensor, g, op="sum", bits=None)
        out[("all_reduce", n)] = tensor.tolist()
        shard = _strided(n, float("nan"))
        qcoll.quantized_reduce_scatter(shard, _strided(world * n, float(rank + 1)), g, op="sum",
                                       intra_bits=None, inter_bits=None)
        out[("reduce_scatter", n)] = shard.tolist()
    g.close()
    return out


@pytest.mark.parametrize("world", [1, 3])
def test_one_element_tensors_of_any_stride(world):
    total = float(sum(range(1, world + 1)))
    for out in run_ranks(world, _strided_worker, timeout=60):
        assert out[("allgather", 1)] == [float(r + 1) for r in range(world)], out
        assert out[("all_reduce", 1)] == [total] and out[("reduce_scatter", 1)] == [total], out
        assert all(out[(c, 0)] == [] for c in ("allgather", "all_reduce", "reduce_scatter")), out
