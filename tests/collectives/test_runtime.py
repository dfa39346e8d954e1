"""The call runtime (python/qcoll/_runtime): the one place that reads a Group's private
state; per-call buffers handed through the core to the transport with each exchange, by
the buffer ids the core exports; the plan reporting each hop's encodes."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import qcoll
from qcoll import _C
from tests.support.distributed import run_ranks

PACKAGE = pathlib.Path(qcoll.__file__).resolve().parent
F32 = _C.DTYPES["float32"]
INT8, INT4, RAW = _C.FORMATS["int8"]["code"], _C.FORMATS["int4"]["code"], _C.RAW_FORMAT


def _group_private_attributes() -> set:
    """Names of Group's private attributes and methods, read from group.py's source."""
    tree = ast.parse((PACKAGE / "group.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Group")
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")
             and not n.name.startswith("__")}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                names.add(node.attr)
    return names


def test_only_the_runtime_reads_a_groups_private_state():
    private = _group_private_attributes()
    assert {"_calls", "_cuda", "_cpu_workspace", "_next_sequence", "_torch_comm"} <= private
    assert "_buffers" not in private, "a per-group buffer registry is back"
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("_runtime/") or rel == "group.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            # An object's own attributes (self._x) are its own; any other receiver's private
            # attribute named like Group's is a Group's (or a look-alike: rename it).
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                offenders.append(f"{rel}:{node.lineno}: .{node.attr}")
    assert not offenders, "outside qcoll._runtime:\n" + "\n".join(offenders)


def test_call_buffers_are_indexed_by_the_cores_buffer_ids():
    from qcoll._runtime.buffers import CallBuffers

    assert sorted(_C.BUFFERS) == ["input", "output", "workspace"]
    assert sorted(_C.BUFFERS.values()) == list(range(3))
    a = torch.arange(4, dtype=torch.float32)
    b = torch.zeros(8, dtype=torch.float32)
    w = torch.zeros(64, dtype=torch.uint8)
    buffers = CallBuffers(a, b, w)
    for name, t in (("input", a), ("output", b), ("workspace", w)):
        assert buffers.pointers[_C.BUFFERS[name]] == t.data_ptr()
    assert torch.equal(buffers.typed(_C.BUFFERS["input"], 4, 2, F32), a[1:3])
    buffers.bytes(_C.BUFFERS["output"], 8, 4).copy_(torch.tensor([1.5]).view(torch.uint8))
    assert b[2].item() == 1.5  # a view of the output itself, not a copy


def test_byte_exchanges_travel_as_the_widest_aligned_word():
    """pair(): whole buffers of one floating dtype as they are (torch's own call's element
    type, no view made); otherwise int64 words where both ranges are whole, 8-byte aligned
    words, else int32, else bytes; views over the call's own memory (whole 1-D buffers
    without a slice). Gloo's copies of many 1-byte elements ran 3-5x slower
    (bench/results/probe-gloo-byte-dtype-cpu.txt)."""
    from qcoll._runtime.buffers import CallBuffers

    IN, OUT, WS = (_C.BUFFERS[k] for k in ("input", "output", "workspace"))
    x = torch.arange(8, dtype=torch.bfloat16)
    out = torch.zeros(32, dtype=torch.bfloat16)
    w = torch.zeros(256, dtype=torch.uint8)
    b = CallBuffers(x, out, w)
    send, recv = b.pair(IN, 0, 16, OUT, 0, 64, 16)
    assert send is x and recv is out  # the tensors themselves
    # Whole byte tensors (FSDP2's mixed-dtype groups): int64 words over the same memory.
    xb, outb = x.view(torch.uint8), out.view(torch.uint8)
    send, recv = CallBuffers(xb, outb, w).pair(IN, 0, 16, OUT, 0, 64, 16)
    assert (send.dtype, recv.dtype, send.numel(), recv.numel()) == (torch.int64, torch.int64, 2, 8)
    assert send.data_ptr() == x.data_ptr() and recv.data_ptr() == out.data_ptr()
    # A range of the output at a 4-byte (not 8-byte) offset: int32, over the same memory.
    send, recv = b.pair(IN, 0, 16, OUT, 4, 16, 16)
    assert send.dtype == recv.dtype == torch.int32 and recv.numel() == 4
    recv.copy_(send)
    assert torch.equal(out[2:10], x)
    grid = CallBuffers(torch.ones(2, 4), torch.zeros(4, 4), w)  # 2-D buffers: flat views
    send, recv = grid.pair(IN, 0, 32, OUT, 0, 64, 32)
    assert send.dtype == torch.int64 and send.dim() == recv.dim() == 1
    # Workspace slots: words at aligned offsets; an odd offset or length: bytes.
    send, recv = b.pair(WS, 16, 32, WS, 64, 128, 32)
    assert (send.dtype, recv.dtype) == (torch.int64, torch.int64)
    assert send.data_ptr() == w.data_ptr() + 16 and recv.numel() == 16
    for args in ((WS, 1, 32, WS, 64, 128, 32), (WS, 0, 30, WS, 64, 120, 30)):
        send, recv = b.pair(*args)
        assert send.dtype == recv.dtype == torch.uint8
    # bf16 buffers of an odd length (6 bytes): no word holds them, bf16 does; as byte
    # tensors, bytes of the same memory.
    odd_in, odd_out = torch.ones(3, dtype=torch.bfloat16), torch.zeros(6, dtype=torch.bfloat16)
    send, recv = CallBuffers(odd_in, odd_out, w).pair(IN, 0, 6, OUT, 0, 12, 6)
    assert send is odd_in and recv is odd_out
    send, recv = CallBuffers(odd_in.view(torch.uint8), odd_out.view(torch.uint8), w).pair(IN, 0, 6, OUT, 0, 12, 6)
    assert (send.dtype, send.numel(), recv.numel()) == (torch.uint8, 6, 12)
    assert send.data_ptr() == odd_in.data_ptr()
    # An all-to-all of 4 pieces of 6 bytes: 24 bytes in all, but a piece is not whole words;
    # a piece of 6 bytes is 3 bf16 elements, of 5 bytes not even that.
    a2a_in, a2a_out = torch.ones(12, dtype=torch.bfloat16), torch.zeros(12, dtype=torch.bfloat16)
    send, recv = CallBuffers(a2a_in, a2a_out, w).pair(IN, 0, 24, OUT, 0, 24, 6)
    assert send is a2a_in and recv is a2a_out
    send, recv = CallBuffers(a2a_in.view(torch.uint8), a2a_out.view(torch.uint8), w).pair(IN, 0, 24, OUT, 0, 24, 6)
    assert send.dtype == recv.dtype == torch.uint8
    b5 = torch.ones(20, dtype=torch.uint8)
    send, recv = CallBuffers(b5, torch.zeros(20, dtype=torch.uint8), w).pair(IN, 0, 20, OUT, 0, 20, 5)
    assert send.dtype == recv.dtype == torch.uint8
    # Whole buffers of different dtypes (a byte tensor and bf16) that fit no word: both bytes.
    send, recv = CallBuffers(torch.ones(3, dtype=torch.uint8), odd_out, w).pair(IN, 0, 3, OUT, 0, 12, 3)
    assert (send.dtype, recv.dtype, recv.numel()) == (torch.uint8, torch.uint8, 12)


def test_a_call_on_a_device_qcoll_does_not_run_on_is_refused_by_name():
    """The runtime's CPU shortcut (no device_args for a plain CPU tensor) still sends any
    other device to device_args' error, before any exchange."""
    from qcoll._runtime import call

    class Group:  # only what run() reads before the device check
        _calls = None

        def communicator(self, device):
            return None

    with pytest.raises(ValueError, match="input must be on a cpu or cuda device, got meta"):
        meta = torch.empty(4, device="meta")
        call.run("quantized_allgather", Group(), meta, meta, 0, lambda ctx, ws: None, False)


def _transport_worker(rank, world):
    """Every exchange the torch transport makes gets the core call's own CallBuffers, and
    addresses the call's tensors by the core's ids."""
    from qcoll import _torch_transport as tt
    from qcoll._runtime.buffers import CallBuffers

    seen = []
    original = tt.ProcessGroupTransport.all_gather

    def recording(self, buffers, send_id, send_off, recv_id, recv_off, nbytes):
        seen.append((buffers, send_id, recv_id, buffers.bytes(send_id, send_off, nbytes).clone()))
        return original(self, buffers, send_id, send_off, recv_id, recv_off, nbytes)

    tt.ProcessGroupTransport.all_gather = recording
    try:
        g = qcoll.new_group(node_size=world)
        x = torch.full((4,), float(rank + 1))
        outs = []
        for k in range(2):  # two calls, one async
            out = torch.empty(world * 4)
            work = qcoll.quantized_allgather(out, x * (k + 1), g, bits=None, async_op=bool(k))
            if work is not None:
                work.wait()
            outs.append(out)
    finally:
        tt.ProcessGroupTransport.all_gather = original
    # The first call's first exchange is the call check (workspace -> workspace); the
    # transport's own all-gather of each call moves input -> output.
    payload = [(b, s, r, data) for b, s, r, data in seen if s == _C.BUFFERS["input"]]
    assert len(payload) == 2
    assert all(isinstance(b, CallBuffers) for b, *_ in seen)
    assert payload[0][0] is not payload[1][0], "two calls shared one buffers object"
    assert all(r == _C.BUFFERS["output"] for _, _, r, _ in payload)
    assert torch.equal(payload[1][3].view(torch.float32), torch.full((4,), 2.0 * (rank + 1)))
    assert not hasattr(g, "_buffers")
    return [o.tolist() for o in outs]


def test_the_transport_gets_each_calls_own_buffers_through_the_core():
    world = 2
    results = run_ranks(world, _transport_worker)
    for outs in results:
        for k, out in enumerate(outs):
            assert out == [float((r + 1) * (k + 1)) for r in range(world) for _ in range(4)]


def test_plan_reports_the_encodes_error_feedback_compensates():
    def plan(intra, inter, hierarchical=-1, world=4, node_size=2):
        return _C.plan_reduce_scatter(world, node_size, 1000, F32, intra, inter, 128, 1, hierarchical)

    # (intra, inter, hierarchical) -> (two_hop, first hop quantized, partial sums re-encoded)
    cases = {
        (INT8, INT4, -1): (True, True, True),
        (INT8, RAW, -1): (True, True, False),
        (RAW, INT4, -1): (True, False, True),
        (RAW, RAW, -1): (True, False, False),
        (INT8, INT4, 0): (False, True, False),  # one hop across nodes: inter_bits' format
        (RAW, INT4, 0): (False, True, False),
        (INT8, RAW, 0): (False, False, False),
    }
    for (intra, inter, hier), (two_hop, encodes_input, reencodes) in cases.items():
        p = plan(intra, inter, hier)
        assert (p.two_hop, p.encodes_input, p.reencodes_partial_sums) == (two_hop, encodes_input, reencodes), \
            (intra, inter, hier)
        assert (p.nodes, p.n) == (2, 1000)
    # One node: the one hop is the intra-node format.
    p = plan(INT8, RAW, world=2, node_size=2)
    assert (p.two_hop, p.encodes_input, p.reencodes_partial_sums) == (False, True, False)


def test_raw_exchange_plan_sends_the_input_as_it_lies_when_partitions_fill_whole_slots():
    """The all-reduce's bf16/fp16 bits=None exchange: never the transport's reduce-scatter;
    partitions of whole 16-byte slots go straight from the input (one stage, no headers, no
    send slots), others are copied into slots like any encode."""
    bf16 = _C.DTYPES["bfloat16"]

    def plan(n, raw_exchange, stages=4, hierarchical=0):
        return _C.plan_reduce_scatter(4, 2, n, bf16, RAW, RAW, 128, stages, hierarchical, True, 0, 0, raw_exchange)

    baseline = plan(1024, False)
    assert baseline.transport_reduces and not baseline.sends_input
    whole = plan(1024, True)  # 2048 bytes a partition
    assert not whole.transport_reduces and whole.sends_input
    assert (whole.stages, whole.header, whole.first_chunk(0)) == (1, 0, 2048)
    assert whole.workspace_bytes == 5 * 32 + 4 * 2048  # the call check, then receive slots only
    odd = plan(1001, True)  # 2002 bytes: not whole slots
    assert not odd.transport_reduces and not odd.sends_input
    assert (odd.stages, odd.header) == (4, 32)
    assert odd.first_chunk(0) == 32 + 512  # header + 251 elements' 502 bytes padded to 16
    # Two hops are never the transport's, with or without the option.
    assert not plan(1024, True, hierarchical=1).transport_reduces


def test_call_kinds_are_read_from_the_core():
    assert sorted(_C.CALL_KINDS) == ["all-gather", "all-reduce", "reduce-scatter"]
    assert len(set(_C.CALL_KINDS.values())) == 3 and 0 not in _C.CALL_KINDS.values()
