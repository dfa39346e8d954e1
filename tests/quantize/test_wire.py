"""The wire kernels (include/qcoll/wire.h), CPU side, against the pure-torch reference:
encode_chunks gives exactly the bytes of quantize (codes, scales, zero padding) of the
right slices, swizzled or not; reduce_chunks sums the decoded sources in order in fp32,
divides, and re-encodes that sum exactly as quantize would (or writes it as values)."""

from __future__ import annotations

import pytest
import torch

from tests.support import reference as ref
from tests.support.values import generator, make_values
from qcoll import _C

CPU = (0, 0, 0)  # device kind, index, stream
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
TOPOLOGIES = [(0, 1, 1), (0, 1, 3), (2, 2, 4), (2, 3, 6), (4, 2, 8), (3, 1, 3)]  # (node_size, nodes, count)
GARBAGE = 0xA5  # output buffers start filled with it: padding must come back zero


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# A hop's format in these tests: 8, 4 or "fp8_e4m3" (codes), 0 (raw values).
def wire_code(bits) -> int:
    """The core's format code (_C.FORMATS, _C.RAW_FORMAT) of a test's hop spelling."""
    return _C.RAW_FORMAT if bits == 0 else _C.FORMATS[ref.format_name(bits)]["code"]


def code_len(n: int, bits) -> int:
    return -(-n * ref.width(bits) // 8)


def chunk_bytes(bits, group_size: int, dtype: torch.dtype, n: int) -> int:
    """The layout of wire.h, written out independently."""
    if bits == 0:
        return round_up(n * torch.finfo(dtype).bits // 8, 16)
    return round_up(code_len(n, bits), 16) + round_up(-(-n // group_size) * 4, 16)


def partition(k: int, node_size: int, nodes: int) -> int:
    return (k % nodes) * node_size + k // nodes if node_size else k


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def ref_chunk(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """The bytes of one chunk holding the flat values x (quantized from x's own dtype)."""
    n = x.numel()
    out = torch.zeros(chunk_bytes(bits, group_size, x.dtype, n), dtype=torch.uint8)
    if bits == 0:
        raw = as_bytes(x)
        out[: raw.numel()] = raw
        return out
    q = ref.quantize(x, bits=bits, group_size=group_size, symmetric=True)
    so = round_up(code_len(n, bits), 16)
    out[: q.data.numel()] = q.data
    out[so : so + 4 * q.scales.numel()] = as_bytes(q.scales)
    return out


def decode_chunk(chunk: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype, n: int):
    """fp32 values of a chunk (raw chunks hold `dtype` values)."""
    if bits == 0:
        return chunk[: n * torch.finfo(dtype).bits // 8].view(dtype).to(torch.float32)
    so = round_up(code_len(n, bits), 16)
    groups = -(-n // group_size)
    scales = chunk[so : so + 4 * groups].view(torch.float32)
    return ref.dequantize_parts(chunk[: code_len(n, bits)], scales, None, (n,), bits, group_size,
                                torch.float32)


# ---- encode -----------------------------------------------------------------------------------
def run_encode(x, partition_elems, slice_begin, n, count, node_size, nodes, bits, group_size,
               stride=None, device=CPU, out=None, lib=_C, hadamard=0):
    """lib: the module whose kernels run (qcoll._C, or the CUDA emulator's); hadamard: the
    chunks' hadamard_size."""
    stride = stride if stride is not None else _C.wire_chunk_bytes(wire_code(bits), group_size,
                                                                   CODE[x.dtype], n)
    if out is None:
        out = torch.full((count * stride,), GARBAGE, dtype=torch.uint8, device=x.device)
    lib.encode_chunks(x.data_ptr(), CODE[x.dtype], partition_elems, slice_begin, n, count,
                     node_size, nodes, wire_code(bits), group_size, out.data_ptr(), stride, *device,
                     hadamard_size=hadamard)
    return out, stride


def expected_encode(x, partition_elems, slice_begin, n, count, node_size, nodes, bits,
                    group_size, stride):
    out = torch.full((count * stride,), GARBAGE, dtype=torch.uint8)
    flat = x.reshape(-1).cpu()
    for k in range(count):
        p = partition(k, node_size, nodes)
        src = flat[p * partition_elems + slice_begin : p * partition_elems + slice_begin + n]
        c = ref_chunk(src, bits, group_size)
        out[k * stride : k * stride + c.numel()] = c
    return out


# (n, group_size): odd lengths x small, odd-multiple and default groups, plus groups larger
# than the CPU's stack block (2048) in a run of several of them.
SIZES = [(n, gs) for n in (1, 7, 13, 1000) for gs in (8, 24, 256)] + [(9001, 4096)]
ENCODE_GRID = [(bits, n, gs) for bits in (4, 8, ref.FP8) for n, gs in SIZES] + [
    (0, n, 8) for n in (1, 7, 13, 1000, 9001)]  # raw chunks: group_size plays no part


@pytest.mark.parametrize("slice_begin", [0, 3])
@pytest.mark.parametrize("bits,n,group_size", ENCODE_GRID)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_matches_reference(dtype, bits, n, group_size, slice_begin):
    for node_size, nodes, count in TOPOLOGIES if n < 9001 else TOPOLOGIES[2:3]:
        partition_elems = slice_begin + n + 5
        x = make_values(count * partition_elems, dtype, "normal", group_size,
                        gen=generator("enc", dtype, bits, n, group_size, count))
        args = (partition_elems, slice_begin, n, count, node_size, nodes, bits, group_size)
        got, stride = run_encode(x, *args)
        assert stride == chunk_bytes(bits, group_size, dtype, n)
        ref.assert_same_bytes(got, expected_encode(x, *args, stride),
                              f"chunks ({node_size}x{nodes})")


def test_encode_equals_qcoll_quantize_and_wide_stride():
    import qcoll

    n, gs, count = 1001, 24, 4
    x = make_values(count * n, torch.bfloat16, "wide", gs)
    x[5] = float("nan")
    stride = chunk_bytes(4, gs, x.dtype, n) + 48  # slack between chunks stays untouched
    got, _ = run_encode(x, n, 0, n, count, 2, 2, 4, gs, stride=stride)
    for k in range(count):
        q = qcoll.quantize(x[partition(k, 2, 2) * n :][:n], bits=4, group_size=gs)
        c = got[k * stride :]
        ref.assert_same_bytes(c[: q.data.numel()], q.data)
        so = round_up(q.data.numel(), 16)
        ref.assert_same_bytes(c[so : so + 4 * q.scales.numel()], as_bytes(q.scales), "scales")
        cb = chunk_bytes(4, gs, x.dtype, n)
        assert (c[q.data.numel() : so] == 0).all() and (c[so + 4 * q.scales.numel() : cb] == 0).all()
        assert (c[cb:stride] == GARBAGE).all()


# ---- reduce -----------------------------------------------------------------------------------
def make_sources(outputs, sources, n, bits, group_size, dtype, source_major, slack, seed,
                 nan_at=None):
    """Chunks of reference-quantized values; returns (buffer, source_stride, output_stride)."""
    cb = chunk_bytes(bits, group_size, dtype, n) + slack
    if source_major:
        source_stride, output_stride = outputs * cb, cb
    else:
        source_stride, output_stride = cb, sources * cb
    buf = torch.full((outputs * sources * cb,), GARBAGE, dtype=torch.uint8)
    gen = generator("red", seed)
    for o in range(outputs):
        for s in range(sources):
            x = make_values(n, dtype, "normal", group_size, gen=gen)
            if nan_at is not None and (o, s) == nan_at[:2]:
                x[nan_at[2]] = float("nan")
            c = ref_chunk(x, bits, group_size)
            at = o * output_stride + s * source_stride
            buf[at : at + c.numel()] = c
    return buf, source_stride, output_stride


def reference_sum(buf, outputs, sources, source_stride, output_stride, n, bits, group_size,
                  dtype, divisor):
    sums = []
    for o in range(outputs):
        acc = None
        for s in range(sources):
            at = o * output_stride + s * source_stride
            y = decode_chunk(buf[at:], bits, group_size, dtype, n)
            acc = y if acc is None else acc + y  # fp32, in source order
        if divisor != 1.0:
            acc = acc / torch.full_like(acc, divisor)  # the IEEE quotient per element
        sums.append(acc)
    return sums


def run_reduce(buf, in_bits, group_size, dtype, n, sources, source_stride, outputs,
               output_stride, divisor, out, device=CPU, out_wire=None, out_values=None, lib=_C,
               in_hadamard=0, out_hadamard=0):
    """out: ("wire", bits, stride) or ("values", dtype, stride in elements); lib as in
    run_encode; in/out_hadamard: the chunks' hadamard_size."""
    dev = buf.device
    if out[0] == "wire":
        _, out_bits, stride = out
        if out_wire is None:
            out_wire = torch.full((outputs * stride,), GARBAGE, dtype=torch.uint8, device=dev)
        lib.reduce_chunks(buf.data_ptr(), wire_code(in_bits), group_size, CODE[dtype], n, sources,
                         source_stride, outputs, output_stride, divisor, out_wire.data_ptr(),
                         wire_code(out_bits), stride, 0, 0, 0, *device, in_hadamard=in_hadamard,
                         out_hadamard=out_hadamard)
        return out_wire
    _, out_dtype, stride = out
    if out_values is None:
        out_values = torch.full((outputs * stride,), 7.0, dtype=out_dtype, device=dev)
    lib.reduce_chunks(buf.data_ptr(), wire_code(in_bits), group_size, CODE[dtype], n, sources,
                     source_stride, outputs, output_stride, divisor, 0, 0, 0, out_values.data_ptr(),
                     CODE[out_dtype], stride, *device, in_hadamard=in_hadamard)
    return out_values


# (sources, outputs, divisor, raw dtype, source-major layout, slack bytes between chunks)
REDUCE_CASES = [
    (1, 1, 1.0, torch.float32, False, 0),
    (3, 2, 1.0, torch.float16, True, 16),
    (4, 3, 4.0, torch.bfloat16, False, 32),
    (2, 1, 3.0, torch.float32, True, 0),
    (8, 2, 8.0, torch.float16, False, 0),
]
OUTS = ["wire4", "wire8", "wire" + ref.FP8, "wire0", "values"]


def expected_output(sums, out, n, group_size, dtype, out_stride):
    """The bytes (wire) or values the reduce must write."""
    kind, what = out
    if kind == "values":
        res = torch.full((len(sums) * out_stride,), 7.0, dtype=what)
        for o, s in enumerate(sums):
            res[o * out_stride : o * out_stride + n] = s.to(what)
        return res
    res = torch.full((len(sums) * out_stride,), GARBAGE, dtype=torch.uint8)
    for o, s in enumerate(sums):
        c = ref_chunk(s if what else s.to(dtype), what, group_size)  # raw: the raw dtype
        res[o * out_stride : o * out_stride + c.numel()] = c
    return res


def out_spec(out_name, case_dtype, n, group_size, outputs, values_dtype):
    if out_name == "values":
        stride = n + (3 if outputs > 1 else 0)
        return ("values", values_dtype, stride), ("values", values_dtype)
    bits = out_name[4:] if out_name[4:] == ref.FP8 else int(out_name[4:])
    stride = chunk_bytes(bits, group_size, case_dtype, n) + (16 if outputs > 1 else 0)
    return ("wire", bits, stride), ("wire", bits)


@pytest.mark.parametrize("n,group_size", SIZES)
@pytest.mark.parametrize("out_name", OUTS)
@pytest.mark.parametrize("in_bits", [4, 8, ref.FP8, 0])
def test_reduce_matches_reference(in_bits, out_name, n, group_size):
    for i, (sources, outputs, divisor, dtype, source_major, slack) in enumerate(REDUCE_CASES):
        buf, ss, os_ = make_sources(outputs, sources, n, in_bits, group_size, dtype,
                                    source_major, slack, (in_bits, n, group_size, i))
        values_dtype = DTYPES[i % 3]
        out, exp_kind = out_spec(out_name, dtype, n, group_size, outputs, values_dtype)
        got = run_reduce(buf, in_bits, group_size, dtype, n, sources, ss, outputs, os_,
                         divisor, out)
        sums = reference_sum(buf, outputs, sources, ss, os_, n, in_bits, group_size, dtype,
                             divisor)
        exp = expected_output(sums, exp_kind, n, group_size, dtype, out[2])
        what = f"case {i} ({sources} sources, {outputs} outputs, /{divisor})"
        if out[0] == "values":
            ref.assert_same_bits(got, exp, what)
        else:
            ref.assert_same_bytes(got, exp, what)


@pytest.mark.parametrize("out_name", OUTS)
@pytest.mark.parametrize("in_bits", [4, 8, ref.FP8, 0])
def test_reduce_non_finite_stays_non_finite(in_bits, out_name):
    n, gs, sources, outputs = 100, 24, 3, 2
    dtype = torch.float16
    buf, ss, os_ = make_sources(outputs, sources, n, in_bits, gs, dtype, False, 0, "nan",
                                nan_at=(1, 2, 30))  # output 1, source 2, element 30 (group 1)
    out, _ = out_spec(out_name, dtype, n, gs, outputs, torch.float32)
    got = run_reduce(buf, in_bits, gs, dtype, n, sources, ss, outputs, os_, 3.0, out)
    for o in range(outputs):
        if out[0] == "values":
            v = got[o * out[2] :][:n]
        else:
            v = decode_chunk(got[o * out[2] :], out[1], gs, dtype, n)
        bad = ~torch.isfinite(v)
        if o == 0:
            assert not bad.any()
        elif in_bits == 0 and (out[0] == "values" or out[1] == 0):
            assert bad[30] and bad.sum() == 1  # raw all the way: only that element
        else:
            # A quantized hop gives its group a NaN scale: the whole group decodes to NaN.
            assert bad[24:48].all() and bad.sum() == 24


# Powers of two divide as a multiply by their exact inverse (quant_math.h: Divisor); the
# others, and the largest powers, must still give the IEEE quotient bit for bit.
@pytest.mark.parametrize("divisor", [2.0, 4.0, 0.5, 2.0**-126, 2.0**64, 2.0**126, 2.0**127,
                                     3.0, 5.0, 6.0, 7.0, 1.5, 1.0 + 2.0**-23])
def test_reduce_divides_exactly(divisor):
    """Quotients that are subnormal, overflow, or round: the same bits as torch's division
    of the fp32 sum (a tensor divide: IEEE per element) for a divisor given as fp32."""
    n, sources = 96, 2
    gen = generator("divide", str(divisor))
    tiny = torch.rand(n // 3, generator=gen) * 2.0**-127  # subnormal sums and quotients
    big = (torch.rand(n // 3, generator=gen) + 1.0) * 2.0**126  # sums near the top of fp32
    mid = torch.randn(n // 3, generator=gen)
    x0 = torch.cat([tiny, big, mid]).float()
    x0[[1, 40, 80]] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    x1 = torch.cat([tiny * 0.75, -big * 0.5, mid * 3.0]).float()
    cb = chunk_bytes(0, 256, torch.float32, n)
    buf = torch.cat([ref_chunk(x0, 0, 256), ref_chunk(x1, 0, 256)])
    got = run_reduce(buf, 0, 256, torch.float32, n, sources, cb, 1, 2 * cb, divisor,
                     ("values", torch.float32, n))
    total = x0 + x1
    exp = total / torch.full_like(total, divisor)
    ref.assert_same_bits(got, exp, f"/{divisor}")
    if divisor < 2.0**-100:  # quotients past the largest float
        assert (exp[n // 3 : 2 * n // 3].isinf()).all()
    if 1.0 <= divisor <= 8.0:  # the case the inverse must get right: rounded subnormal quotients
        sub = exp[: n // 3]
        assert ((sub != 0) & (sub.abs() < torch.finfo(torch.float32).tiny)).sum() > n // 6


def test_reduce_single_source_is_decode():
    n, gs = 1000, 256
    x = make_values(n, torch.float32, "normal", gs)
    c = ref_chunk(x, 8, gs)
    y = run_reduce(c, 8, gs, torch.float32, n, 1, 0, 1, 0, 1.0, ("values", torch.float32, n))
    ref.assert_same_bits(y, decode_chunk(c, 8, gs, torch.float32, n))
    # Re-encoding the decoded values gives the same chunk back.
    w = run_reduce(c, 8, gs, torch.float32, n, 1, 0, 1, 0, 1.0, ("wire", 8, c.numel()))
    ref.assert_same_bytes(w, c)


def test_len_zero_is_a_no_op():
    _C.encode_chunks(0, 0, 0, 0, 0, 4, 2, 2, wire_code(8), 256, 0, 0, *CPU)
    _C.reduce_chunks(0, wire_code(8), 256, 0, 0, 2, 0, 2, 0, 2.0, 0, 0, 0, 16, 0, 0, *CPU)


# ---- argument errors --------------------------------------------------------------------------
def test_wire_chunk_bytes_checks_the_format():
    for bits in (8, 4, ref.FP8):
        assert _C.wire_chunk_bytes(wire_code(bits), 256, 0, 1000) == chunk_bytes(
            bits, 256, torch.float32, 1000)
    raw = _C.RAW_FORMAT
    assert _C.wire_chunk_bytes(raw, 12345, 2, 3) == 16  # raw: group_size unused
    assert _C.wire_chunk_bytes(raw, 256, 3, 17) == 32  # raw bytes (dtype code 3): 17 bytes, padded
    for code, gs, dtype in [(-1, 256, 0), (4, 256, 0), (8, 256, 0), (0, 12, 0), (1, 0, 0),
                            (0, 2**25, 0), (raw, 256, 4), (0, 256, 3), (1, 256, 3), (2, 256, 3),
                            (0, 256, -1)]:
        with pytest.raises(ValueError):
            _C.wire_chunk_bytes(code, gs, dtype, 10)


def _encode_kwargs(x, out, **over):
    kw = dict(input=x.data_ptr(), dtype=0, partition_elems=64, slice_begin=0, len=64, count=4,
              node_size=2, nodes=2, format=wire_code(8), group_size=32, output=out.data_ptr(), chunk_stride=96,
              device_kind=0, device_index=0, stream=0)
    kw.update(over)
    return kw


@pytest.mark.parametrize("over,match", [
    (dict(format=5), "format"),
    (dict(group_size=20), "group_size"),
    (dict(dtype=7), "dtype"),
    (dict(len=-1), "len"),
    (dict(count=0), "count"),
    (dict(node_size=-1), "node_size"),
    (dict(nodes=0), "nodes"),
    (dict(node_size=3), "node_size"),  # 3 x 2 != 4 partitions
    (dict(slice_begin=1), "slice"),
    (dict(partition_elems=63), "slice"),
    (dict(input=0), "null"),
    (dict(output=0), "null"),
    (dict(chunk_stride=79), "stride"),
    (dict(chunk_stride=98), "stride"),
    (dict(output="misaligned"), "aligned"),
    (dict(device_kind=5), "device"),
])
def test_encode_argument_errors(over, match):
    x = torch.zeros(4 * 64)
    out = torch.zeros(4 * 100, dtype=torch.uint8)
    if over.get("output") == "misaligned":
        over["output"] = out.data_ptr() + 2
    _C.encode_chunks(**_encode_kwargs(x, out))  # the base call is valid
    with pytest.raises(ValueError, match=match):
        _C.encode_chunks(**_encode_kwargs(x, out, **over))


def _reduce_kwargs(buf, out, **over):
    cb = chunk_bytes(8, 32, torch.float32, 64)  # 64 + 16
    kw = dict(input=buf.data_ptr(), in_format=wire_code(8), group_size=32, raw_dtype=0, len=64, sources=2,
              source_stride=cb, outputs=2, output_in_stride=2 * cb, divisor=2.0,
              out_wire=out.data_ptr(), out_format=wire_code(4), out_chunk_stride=cb, out_values=0,
              out_dtype=0, out_values_stride=0, device_kind=0, device_index=0, stream=0)
    kw.update(over)
    return kw


@pytest.mark.parametrize("over,match", [
    (dict(in_format=5), "format"),
    (dict(out_format=-1), "format"),
    (dict(group_size=4), "group_size"),
    (dict(raw_dtype=3), "dtype"),
    (dict(len=-5), "len"),
    (dict(sources=0), "sources"),
    (dict(outputs=0), "outputs"),
    (dict(divisor=0.0), "divisor"),
    (dict(divisor=-2.0), "divisor"),
    (dict(divisor=float("nan")), "divisor"),
    (dict(divisor=float("inf")), "divisor"),
    (dict(out_values="values"), "exactly one"),
    (dict(out_wire=0), "exactly one"),
    (dict(out_wire=0, out_values="values", out_dtype=9, out_values_stride=64), "dtype"),
    (dict(out_wire=0, out_values="values", out_values_stride=63), "out_values_stride"),
    (dict(input=0), "null"),
    (dict(source_stride=79), "stride"),
    (dict(output_in_stride=79), "stride"),
    (dict(out_chunk_stride=47), "stride"),
    (dict(source_stride=82, output_in_stride=164), "stride"),
    (dict(input="misaligned"), "aligned"),
    (dict(device_kind=2), "device"),
])
def test_reduce_argument_errors(over, match):
    buf = torch.zeros(1024, dtype=torch.uint8)
    out = torch.zeros(1024, dtype=torch.uint8)
    values = torch.zeros(256)
    if over.get("out_values") == "values":
        over["out_values"] = values.data_ptr()
        over.setdefault("out_values_stride", 64)
    if over.get("input") == "misaligned":
        over["input"] = buf.data_ptr() + 1
    _C.reduce_chunks(**_reduce_kwargs(buf, out))  # the base call is valid
    with pytest.raises(ValueError, match=match):
        _C.reduce_chunks(**_reduce_kwargs(buf, out, **over))
