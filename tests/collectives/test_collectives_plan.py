"""The 2-hop data movement of qgZ (ZeRO++ section 3.3.3, Algorithm 2) end to end.

A symbolic model moves labels (source rank, partition, stage slice) through the two
all-to-alls: each rank orders its W = X*Y partitions (X ranks per node, Y nodes) as the
paper's equation (2), [0, X, 2X, ..., (Y-1)X, 1, X+1, ..., YX-1]; the intra-node
all-to-all gives local peer j the j-th run of Y chunks; the receiver sums position m
over its local sources; the inter-node all-to-all gives node m's peer the m-th sum. The
model must deliver partition r, every slice, from every source exactly once to rank r (and
does not without the reordering: the check can fail).

qcoll is then run with bits=None (raw fp32 on the wire) on values that encode
(source, partition, index) exactly, with its transport wrapped to record every
all-to-all: the chunks each rank sends and receives on each hop of each stage must be
exactly the model's, and the outputs exact."""

from __future__ import annotations

import pytest
import torch

import qcoll
from tests.support.distributed import run_ranks

# ---- the symbolic model -------------------------------------------------------------------


def paper_order(X: int, Y: int) -> list:
    """Equation (2) of section 3.3.3, written out: the partition each chunk position carries."""
    order = []
    for j in range(X):          # 0, X, 2X, ..., (Y-1)X, then 1, X+1, ..., and so on
        for m in range(Y):
            order.append(m * X + j)
    return order


def identity_order(X: int, Y: int) -> list:
    return list(range(X * Y))


def simulate(X: int, Y: int, stages: int, order: list):
    """Per (rank, stage): the labels sent and received on each hop, and the final items.

    A label is (frozenset of source ranks, partition, stage); a first-hop label has one
    source. Returns dict with send1, recv1, send2, recv2 keyed by (rank, stage)."""
    W = X * Y
    model = {"send1": {}, "recv1": {}, "send2": {}, "recv2": {}}
    for s in range(stages):
        for r in range(W):
            model["send1"][r, s] = [(frozenset([r]), order[k], s) for k in range(W)]
        for r in range(W):
            node, j = divmod(r, X)
            # Intra all-to-all: local source i sends this rank (local peer j) its j-th run
            # of Y chunks; the run from source i lands at position i.
            recv = []
            for i in range(X):
                src = node * X + i
                recv.extend(model["send1"][src, s][j * Y : (j + 1) * Y])
            model["recv1"][r, s] = recv
            # Reduce position m over the X local sources.
            sums = []
            for m in range(Y):
                parts = [recv[i * Y + m] for i in range(X)]
                assert len({(p, st) for _, p, st in parts}) == 1, (
                    f"rank {r} stage {s}: the intra-node reduce mixes {parts}")
                srcs = frozenset().union(*(a for a, _, _ in parts))
                sums.append((srcs, parts[0][1], s))
            model["send2"][r, s] = sums
        for r in range(W):
            node, j = divmod(r, X)
            # Inter all-to-all among the ranks with local index j: node m sends its m'-th
            # sum to node m'.
            model["recv2"][r, s] = [model["send2"][m * X + j, s][node] for m in range(Y)]
    return model


def misplaced(X: int, Y: int, stages: int, order: list) -> list:
    """What the final reduce on each rank would get wrong (empty: correct placement)."""
    W = X * Y
    try:
        model = simulate(X, Y, stages, order)
    except AssertionError as exc:  # a reduce of different partitions is a misplacement too
        return [str(exc)]
    problems = []
    for r in range(W):
        for s in range(stages):
            items = model["recv2"][r, s]
            if any(p != r or st != s for _, p, st in items):
                problems.append(f"rank {r} stage {s} holds {[(p, st) for _, p, st in items]}")
            srcs = [t for a, _, _ in items for t in a]
            if sorted(srcs) != list(range(W)):
                problems.append(f"rank {r} stage {s} sums sources {sorted(srcs)}")
    return problems


LAYOUTS = [(2, 2), (2, 3), (3, 2), (4, 2), (2, 4), (1, 3), (3, 1)]  # (X ranks per node, Y nodes)


@pytest.mark.parametrize("X,Y", LAYOUTS)
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_model_places_every_partition(X, Y, stages):
    assert paper_order(X, Y) == sorted(paper_order(X, Y), key=lambda p: (p % X, p // X))
    assert sorted(paper_order(X, Y)) == list(range(X * Y))  # a permutation
    assert misplaced(X, Y, stages, paper_order(X, Y)) == []


@pytest.mark.parametrize("X,Y", [(2, 2), (2, 3), (3, 2), (4, 2)])
def test_model_detects_misplacement_without_reordering(X, Y):
    # The paper's figure 8: without the reordering, the 2-hop result is misplaced.
    assert misplaced(X, Y, 1, identity_order(X, Y))


def test_paper_example_2x2():
    # Section 3.3.3: with 2 nodes of 2 GPUs, slices 1 and 2 (0-based) swap.
    assert paper_order(2, 2) == [0, 2, 1, 3]
    assert paper_order(2, 3) == [0, 2, 4, 1, 3, 5]
    assert paper_order(3, 2) == [0, 3, 1, 4, 2, 5]


# ---- qcoll against the model --------------------------------------------------------------
ALIGN = 16


def encode(t: int, p: int, i: int, n: int) -> float:
    """Source t's value for element i of partition p: 2**t in the low byte, 1 + p*n + i
    above it. Sums of one value per source stay exact integers below 2**24, and the low
    byte of a sum over distinct sources is the bitmask of the sources."""
    return float(2**t + 256 * (1 + p * n + i))


def expected_values(label, begin: int, length: int, n: int) -> list:
    srcs, p, _ = label
    return [float(sum(encode(t, p, begin + i, n) for t in srcs)) for i in range(length)]


HEADER = 32  # every slot starts with a wire header (include/qcoll/wire_header.h)


def decode_chunks(raw: torch.Tensor, count: int, length: int) -> list:
    """count slots of a header then `length` raw fp32 values (padded to 16 bytes) -> value lists."""
    stride = HEADER + -(-length * 4 // ALIGN) * ALIGN
    assert raw.numel() == count * stride, f"{raw.numel()} bytes for {count} chunks of {stride}"
    return [raw[k * stride + HEADER : k * stride + HEADER + 4 * length].view(torch.float32).tolist()
            for k in range(count)]


def _recording_worker(rank, world, node_size, n, stages, hierarchical):
    from qcoll import _torch_transport

    log = []
    original = _torch_transport.ProcessGroupTransport.all_to_all

    def recording(self, buffers, send_id, send_off, recv_id, recv_off, nbytes):
        send = buffers.bytes(send_id, send_off, self.size * nbytes).clone()
        original(self, buffers, send_id, send_off, recv_id, recv_off, nbytes)
        recv = buffers.bytes(recv_id, recv_off, self.size * nbytes).clone()
        log.append((self.pg, self.size, nbytes, send, recv))

    _torch_transport.ProcessGroupTransport.all_to_all = recording
    qcoll._runtime.steps.MIN_STAGE_BYTES = 0  # every requested stage, as the model moves them
    try:
        g = qcoll.new_group(node_size=node_size)
        x = torch.tensor([encode(rank, p, i, n) for p in range(world) for i in range(n)])
        out = torch.empty(n)
        qcoll.quantized_reduce_scatter(out, x, g, op="sum", intra_bits=None, inter_bits=None,
                                       pipeline_stages=stages, hierarchical=hierarchical)
    finally:
        _torch_transport.ProcessGroupTransport.all_to_all = original
    # The hops of different stages may overlap (one thread per hop): split the log by the
    # process group each all-to-all ran over; each hop's own stages stay in order.
    hop_of = {g._owned_pg: "1"} if g.num_nodes == 1 or g.node_size == 1 or hierarchical is False else {
        g.intra._owned_pg: "1", g.inter._owned_pg: "2"}
    hops = {}
    for pg, size, nbytes, send, recv in log:
        assert pg in hop_of, "an all-to-all over an unexpected process group"
        hops.setdefault(hop_of[pg], []).append((size, nbytes, send, recv))
    return out, hops


def _check_against_model(results, world, X, n, stages, hierarchical):
    Y = world // X
    two_hop = X > 1 and Y > 1 and hierarchical is not False
    step = -(-n // stages)
    stage_list = [s for s in range(stages) if s * step < n]
    model = simulate(X, Y, stages, paper_order(X, Y)) if two_hop else None
    for r, (out, log) in enumerate(results):
        # The output: partition r summed over every source exactly once.
        want = [float(sum(encode(t, r, i, n) for t in range(world))) for i in range(n)]
        assert out.tolist() == want, f"rank {r}: output {out.tolist()[:6]} != {want[:6]}"
        # Unquantized and flat is the transport's own reduce-scatter: no all-to-all at all.
        hops = ("1", "2") if two_hop else ()
        assert sorted(log) == list(hops), f"rank {r}: all-to-alls on hops {sorted(log)}"
        for hop in hops:
            assert len(log[hop]) == len(stage_list), (
                f"rank {r}: {len(log[hop])} all-to-alls on hop {hop} for stages {stage_list}")
        for k, s in enumerate(stage_list):
            begin, length = s * step, min(n, (s + 1) * step) - s * step
            for hop in hops:
                size, nbytes, send, recv = log[hop][k]
                peers = (X if hop == "1" else Y) if two_hop else world
                assert size == peers, f"rank {r} stage {s} hop {hop}: over {size} ranks"
                for name, raw in (("send", send), ("recv", recv)):
                    labels = model[name + hop][r, s]
                    got = decode_chunks(raw, len(labels), length)
                    for c, (label, values) in enumerate(zip(labels, got)):
                        exp = expected_values(label, begin, length, n)
                        assert values == exp, (
                            f"rank {r} stage {s} hop {hop} {name} chunk {c}: expected sources "
                            f"{sorted(label[0])} partition {label[1]}, got values {values[:4]} "
                            f"(expected {exp[:4]})")


CASES = [  # world, node_size, n, stages, hierarchical
    pytest.param(4, 2, 12, 1, None, id="2x2-s1"),
    pytest.param(4, 2, 10, 4, True, id="2x2-s4-uneven"),
    pytest.param(6, 2, 9, 2, None, id="2x3-s2"),
    pytest.param(6, 2, 7, 4, None, id="2x3-s4"),
    pytest.param(6, 3, 11, 1, True, id="3x2-s1"),
    pytest.param(6, 3, 8, 4, None, id="3x2-s4"),
    pytest.param(8, 4, 6, 2, None, id="4x2-s2"),
    pytest.param(8, 2, 5, 4, None, id="2x4-s4-empty-stage"),  # slices 2,2,1,0
    pytest.param(4, 2, 9, 2, False, id="2x2-flat"),  # the transport's reduce-scatter
    pytest.param(4, 4, 9, 2, None, id="1node"),  # one node: the same
]


@pytest.mark.parametrize("world,node_size,n,stages,hierarchical", CASES)
def test_qcoll_moves_data_as_the_model(world, node_size, n, stages, hierarchical):
    results = run_ranks(world, _recording_worker, node_size, n, stages, hierarchical, timeout=60)
    _check_against_model(results, world, node_size, n, stages, hierarchical)
