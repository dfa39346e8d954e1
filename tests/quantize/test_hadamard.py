"""Hadamard smoothing (quantize / wire kernels / reduce-scatter with hadamard=True), CPU side.

tests/support/reference.py's `hadamard` is the fp32 contract (stage order of quant_math.h); it is
checked here against the Sylvester matrix built in float64, and the kernels are checked bit
for bit against it followed by the plain reference quantizer. The CUDA kernels are checked
against these CPU kernels through tests/support/cuda_cases.py."""

from __future__ import annotations

import math

import pytest
import torch

import qcoll
from tests.support import reference as ref
from tests.support.values import generator, make_values
from tests.support.distributed import run_ranks
from qcoll import _C
from tests.quantize.test_wire import (DTYPES, GARBAGE, chunk_bytes, expected_output, out_spec, partition,
                       ref_chunk, reference_sum, run_encode, run_reduce, wire_code)

F32 = torch.float32
SIZES = [8, 16, 32, 64, 128, 256]


def sylvester(size: int) -> torch.Tensor:
    """The orthonormal Hadamard matrix in float64, by Sylvester's doubling."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(size)


def matrix_hadamard(x: torch.Tensor, size: int) -> torch.Tensor:
    """float64: whole blocks times the matrix, the tail as it is."""
    flat = x.reshape(-1).double().clone()
    whole = flat.numel() // size * size
    flat[:whole] = (flat[:whole].reshape(-1, size) @ sylvester(size)).reshape(-1)
    return flat


def spiky(n: int, dtype=F32, *key) -> torch.Tensor:
    """Gaussian with 1% outliers at 50x: gradient-like."""
    gen = generator("spiky", n, *key)
    x = torch.randn(n, generator=gen)
    x[torch.randint(0, n, (max(1, n // 100),), generator=gen)] *= 50
    return x.to(dtype)


# ---- the reference transform -------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
def test_reference_is_the_orthonormal_hadamard_and_its_own_inverse(size):
    x = spiky(5 * size + 3, F32, size)
    t = ref.hadamard(x, size)
    exact = matrix_hadamard(x, size)
    scale = x.double().abs().max() * math.sqrt(size)
    assert (t.double() - exact).abs().max() <= 2.0**-22 * math.log2(size) * scale
    assert torch.equal(t[5 * size:], x[5 * size:]), "a partial last block stays as it is"
    back = ref.hadamard(t, size)
    assert (back.double() - x.double()).abs().max() <= 2.0**-21 * math.log2(size) * scale


# ---- quantize / dequantize ---------------------------------------------------------------------
QUANT_GRID = [(dt, bits, sym, gs, h, n)
              for dt in DTYPES for bits in (4, 8) for sym in (True, False)
              for gs, h in ((8, 8), (256, 64), (256, 256), (1024, 128), (4096, 256))
              for n in (5, 8 * 37 + 3, 4096 + 40)]


@pytest.mark.parametrize("dtype,bits,symmetric,group_size,size,n", QUANT_GRID)
def test_quantize_matches_reference(dtype, bits, symmetric, group_size, size, n):
    x = make_values(n, dtype, "normal", group_size, gen=generator("hq", dtype, bits, n, size))
    x[::97] *= 30
    for rounding, seed in (("nearest", None), ("stochastic", 12345)):
        q = qcoll.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric,
                           rounding=rounding, seed=seed, hadamard=True, hadamard_size=size)
        assert q.hadamard_size == size
        t = ref.hadamard(x.float(), size)
        r = ref.quantize(t, bits=bits, group_size=group_size, symmetric=symmetric,
                         rounding=rounding, seed=seed)
        ref.assert_same_bytes(q.data, r.data, "codes")
        ref.assert_same_bits(q.scales, r.scales, "scales")
        if not symmetric:
            ref.assert_same_bits(q.offsets, r.offsets, "offsets")
        for out in DTYPES:
            y = qcoll.dequantize(q, dtype=out)
            want = ref.hadamard(ref.dequantize(r, F32), size).to(out).reshape(x.shape)
            ref.assert_same_bits(y, want, f"dequantize to {out}")


@pytest.mark.parametrize("size", SIZES)
def test_round_trip_is_exact_to_fp32_rounding(size):
    """inverse(forward(x)) == x: values whose transform lies on the int8 grid come back
    with every code exact, so dequantize(quantize(x)) is x up to the transforms' rounding."""
    gs, n = 256, 256 * 6
    gen = generator("exact", size)
    codes = torch.randint(-127, 128, (n,), generator=gen).double()
    codes[::gs] = 127  # every group's absmax is exactly 127 codes
    steps = torch.rand(n // gs, generator=gen, dtype=torch.float64).repeat_interleave(gs) + 0.5
    x = matrix_hadamard(codes * steps, size).float()  # x = H (c * s)
    q = qcoll.quantize(x, bits=8, group_size=gs, hadamard=True, hadamard_size=size)
    assert torch.equal(ref.unpack(q.data, n, 8, True), codes.to(torch.int32))
    y = qcoll.dequantize(q)
    tol = 2.0**-21 * math.log2(size) * x.abs().max().item()
    assert (y - x).abs().max().item() <= tol


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("size", [32, 256])
def test_kernels_agree_with_the_matrix_and_the_error_bound(bits, size):
    """Independent of the fp32 reference: the scales are those of the float64 matrix
    transform, and since the transform is orthonormal each block's L2 error is at most
    sqrt(size) * scale / 2."""
    gs, n = 256, 256 * 40 + 24
    x = spiky(n, F32, bits, size)
    q = qcoll.quantize(x, bits=bits, group_size=gs, hadamard=True, hadamard_size=size)
    t = matrix_hadamard(x, size)
    absmax = torch.nn.functional.pad(t.abs(), (0, -n % gs)).reshape(-1, gs).amax(1)
    assert torch.allclose(q.scales.double(), absmax / ref.qmax(bits), rtol=1e-5, atol=0)
    err = (qcoll.dequantize(q).double() - x.double())
    whole = n // size * size
    block_err = err[:whole].reshape(-1, size).norm(dim=1)
    block_scale = q.scales.double().repeat_interleave(gs)[:whole:size]
    assert (block_err <= math.sqrt(size) * block_scale / 2 * (1 + 1e-4)).all()
    tail_scale = q.scales[-1].double()
    assert (err[whole:].abs() <= tail_scale / 2 * (1 + 1e-5)).all()


def test_hadamard_lowers_int4_error_on_outliers():
    x = spiky(1 << 16, F32, "gain")
    plain = qcoll.dequantize(qcoll.quantize(x, bits=4)) - x
    smooth = qcoll.dequantize(qcoll.quantize(x, bits=4, hadamard=True)) - x
    assert smooth.norm() < 0.7 * plain.norm()


def test_default_size_and_the_flag_on_quantized_tensors():
    x = torch.randn(1000)
    assert qcoll.quantize(x).hadamard_size == 0
    assert qcoll.quantize(x, hadamard=True).hadamard_size == qcoll.quantization.DEFAULT_HADAMARD_SIZE
    assert qcoll.quantize(x, group_size=24, hadamard=True).hadamard_size == 8  # largest dividing
    assert qcoll.quantize(x, group_size=96, hadamard=True).hadamard_size == 32
    # hadamard=False leaves the codes exactly as they were
    a, b = qcoll.quantize(x, bits=4), qcoll.quantize(x, bits=4, hadamard=False)
    assert torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("kw,err,match", [
    (dict(hadamard=1), TypeError, "hadamard must be a bool"),
    (dict(hadamard_size=64), ValueError, "needs hadamard=True"),
    (dict(hadamard=True, hadamard_size=4), ValueError, "hadamard_size must be a power of two"),
    (dict(hadamard=True, hadamard_size=512, group_size=1024), ValueError, "from 8 to 256"),
    (dict(hadamard=True, hadamard_size=48), ValueError, "power of two"),
    (dict(hadamard=True, hadamard_size=64, group_size=96), ValueError, "divides group_size 96"),
    (dict(hadamard=True, hadamard_size=True), ValueError, "hadamard_size must be"),
])
def test_quantize_argument_errors(kw, err, match):
    with pytest.raises(err, match=match):
        qcoll.quantize(torch.randn(100), **kw)


def test_dequantize_checks_a_hand_built_flag():
    q = qcoll.quantize(torch.randn(256), hadamard=True)
    bad = qcoll.QuantizedTensor(q.data, q.scales, q.offsets, q.shape, q.dtype, q.bits,
                                q.group_size, hadamard_size=12)
    with pytest.raises(ValueError, match="q.hadamard_size must be"):
        qcoll.dequantize(bad)


def test_kernel_entry_points_check_the_size():
    x = torch.randn(64)
    codes, scales = torch.empty(64, dtype=torch.uint8), torch.empty(2)
    with pytest.raises(ValueError, match="hadamard_size must be 0"):
        _C.quantize(x.data_ptr(), 0, 64, wire_code(8), 32, True, 0, 0, 0, codes.data_ptr(),
                    scales.data_ptr(), 0, 0, 0, 0, hadamard_size=64)
    with pytest.raises(ValueError, match="hadamard_size needs quantized chunks"):
        run_encode(x, 64, 0, 64, 1, 0, 1, 0, 8, hadamard=8)


# ---- wire kernels -----------------------------------------------------------------------------
def ref_chunk_h(x: torch.Tensor, bits: int, group_size: int, size: int) -> torch.Tensor:
    """A chunk of the transformed values (the transform in fp32, then quantized)."""
    return ref_chunk(ref.hadamard(x.float(), size), bits, group_size)


ENCODE_H = [(dt, bits, n, gs, h) for dt in DTYPES for bits in (4, 8)
            for n, gs, h in ((13, 8, 8), (1000, 256, 256), (1000, 24, 8), (9001, 4096, 128))]


@pytest.mark.parametrize("dtype,bits,n,group_size,size", ENCODE_H)
def test_encode_matches_reference(dtype, bits, n, group_size, size):
    node_size, nodes, count = 2, 2, 4
    slice_begin = 3  # blocks count from the slice's start
    pe = slice_begin + n + 5
    x = make_values(count * pe, dtype, "normal", group_size, gen=generator("he", dtype, bits, n))
    x[::101] *= 40
    got, stride = run_encode(x, pe, slice_begin, n, count, node_size, nodes, bits, group_size,
                             hadamard=size)
    want = torch.full_like(got, GARBAGE)
    for k in range(count):
        p = partition(k, node_size, nodes)
        c = ref_chunk_h(x[p * pe + slice_begin:][:n], bits, group_size, size)
        want[k * stride: k * stride + c.numel()] = c
    ref.assert_same_bytes(got, want, "chunks")


def sources_h(outputs, sources, n, bits, group_size, dtype, size, key):
    """Chunks of transformed (size > 0) or plain values, output-major; their fp32 values."""
    cb = chunk_bytes(bits, group_size, dtype, n)
    buf = torch.full((outputs * sources * cb,), GARBAGE, dtype=torch.uint8)
    gen = generator("hr", *key)
    for i in range(outputs * sources):
        x = make_values(n, dtype, "normal", group_size, gen=gen)
        x[::53] *= 20
        c = ref_chunk_h(x, bits, group_size, size) if size else ref_chunk(x, bits, group_size)
        buf[i * cb: i * cb + c.numel()] = c
    return buf, cb, sources * cb


# (in bits, in hadamard, out): the domain rule of wire.h
REDUCE_H = [(ib, ih, out) for ib in (4, 8) for ih in (0, 1)
            for out in ("wire4", "wire8", "wire0", "values")] + [
    (0, 0, "wire4"), (0, 0, "wire8")]  # raw chunks in, Hadamard chunks out: forward


@pytest.mark.parametrize("n,group_size,size", [(1000, 256, 64), (13, 8, 8), (9001, 4096, 256)])
@pytest.mark.parametrize("in_bits,in_h,out_name", REDUCE_H)
def test_reduce_follows_the_domains(in_bits, in_h, out_name, n, group_size, size):
    dtype, sources, outputs, divisor = torch.bfloat16, 3, 2, 3.0
    in_size = size if in_h else 0
    buf, ss, os_ = sources_h(outputs, sources, n, in_bits, group_size, dtype, in_size,
                             (in_bits, in_h, out_name, n))
    out, kind = out_spec(out_name, dtype, n, group_size, outputs, torch.float16)
    out_bits = out[1] if out[0] == "wire" else 0
    out_size = size if out_bits else 0  # quantized outputs are in the Hadamard domain
    got = run_reduce(buf, in_bits, group_size, dtype, n, sources, ss, outputs, os_, divisor, out,
                     in_hadamard=in_size, out_hadamard=out_size)
    sums = reference_sum(buf, outputs, sources, ss, os_, n, in_bits, group_size, dtype, divisor)
    if in_size != out_size:  # one transform between the domains (it is its own inverse)
        sums = [ref.hadamard(s, size) for s in sums]
    want = expected_output(sums, kind, n, group_size, dtype, out[2])
    if out[0] == "values":
        ref.assert_same_bits(got, want)
    else:
        ref.assert_same_bytes(got, want)


def test_reduce_rejects_two_different_sizes():
    buf, ss, os_ = sources_h(1, 1, 256, 8, 256, F32, 64, ("two",))
    wire = torch.empty(chunk_bytes(4, 256, F32, 256), dtype=torch.uint8)
    with pytest.raises(ValueError, match="same hadamard_size"):
        _C.reduce_chunks(buf.data_ptr(), wire_code(8), 256, 0, 256, 1, ss, 1, os_, 1.0, wire.data_ptr(),
                         wire_code(4), wire.numel(), 0, 0, 0, 0, 0, 0, in_hadamard=64, out_hadamard=128)


# ---- reduce-scatter -------------------------------------------------------------------------------
def simulate(inputs, rank, n, node_size, op, intra_bits, inter_bits, group_size, stages, size,
             dtype):
    """What rank `rank` must get: every quantized hop carries transformed values (whole
    blocks counted from each stage's slice), partial sums stay transformed, and the last
    reduce transforms back after dividing (reference transform and quantizer, fp32 sums in
    rank order)."""
    world = len(inputs)
    nodes = world // node_size
    divisor = world if op == "avg" else 1
    out = torch.empty(n, dtype=dtype)

    def hop(vals, bits, transformed):
        """(decoded fp32 values, whether they are in the transformed domain): quantized hops
        carry transformed values, raw hops plain ones."""
        if bits is None:
            return (ref.hadamard(vals, size) if transformed else vals).to(dtype).to(F32), False
        if not transformed:
            vals = ref.hadamard(vals, size)
        return ref.dequantize(ref.quantize(vals, bits=bits, group_size=group_size), F32), True

    def fsum(parts):
        acc = parts[0][0].clone()
        for p, _ in parts[1:]:
            acc = acc + p
        return acc, parts[0][1]

    step = -(-n // stages)
    for b in range(0, n, step):
        e = min(n, b + step)
        src = [x[rank * n + b: rank * n + e].to(F32) for x in inputs]
        if nodes > 1 and node_size > 1:
            got = []
            for m in range(nodes):
                partial, transformed = fsum([hop(c, intra_bits, False)
                                             for c in src[m * node_size:(m + 1) * node_size]])
                got.append(hop(partial, inter_bits, transformed))
        else:
            got = [hop(c, inter_bits if nodes > 1 else intra_bits, False) for c in src]
        acc, transformed = fsum(got)
        if divisor != 1:
            acc = acc / torch.full_like(acc, divisor)
        out[b:e] = (ref.hadamard(acc, size) if transformed else acc).to(dtype)
    return out


def _rs_worker(rank, world, node_size, cases):
    qcoll._runtime.steps.MIN_STAGE_BYTES = 0
    g = qcoll.new_group(node_size=node_size)
    results = []
    for c in cases:
        inputs = [spiky(world * c["n"], c["dtype"], r, c["n"]) for r in range(world)]
        out = torch.empty(c["n"], dtype=c["dtype"])
        qcoll.quantized_reduce_scatter(
            out, inputs[rank], g, op=c["op"], intra_bits=c["intra"], inter_bits=c["inter"],
            group_size=c["gs"], pipeline_stages=c["stages"], hadamard=True,
            hadamard_size=c["size"])
        if c["intra"] is not None or node_size < world:
            want = simulate(inputs, rank, c["n"], node_size, c["op"], c["intra"], c["inter"],
                            c["gs"], c["stages"], c["size"], c["dtype"])
            ref.assert_same_bits(out, want, f"rank {rank}, {c}")
        else:  # one node, its one hop raw: the transport's own reduce-scatter, unchanged
            plain = torch.empty_like(out)
            qcoll.quantized_reduce_scatter(plain, inputs[rank], g, op=c["op"], intra_bits=None,
                                           inter_bits=c["inter"], group_size=c["gs"],
                                           pipeline_stages=c["stages"])
            ref.assert_same_bits(out, plain, "hadamard on a raw hop changes nothing")
        results.append(out)
    return results


RS_CASES = [
    dict(n=1000, dtype=torch.bfloat16, op="avg", intra=8, inter=4, gs=256, stages=1, size=256),
    dict(n=1001, dtype=F32, op="sum", intra=8, inter=4, gs=64, stages=3, size=32),
    dict(n=517, dtype=torch.float16, op="avg", intra=None, inter=4, gs=128, stages=2, size=128),
    dict(n=300, dtype=F32, op="avg", intra=4, inter=None, gs=24, stages=1, size=8),
]


@pytest.mark.parametrize("world,node_size", [(4, 2), (6, 2), (2, 2)])
def test_reduce_scatter_matches_simulation(world, node_size):
    run_ranks(world, _rs_worker, node_size, RS_CASES, timeout=120)


def _rs_error_worker(rank, world):
    g = qcoll.new_group(node_size=2)
    out = torch.empty(8)
    with pytest.raises(ValueError, match="needs a quantized hop"):
        qcoll.quantized_reduce_scatter(out, torch.ones(8 * world), g, intra_bits=None,
                                       inter_bits=None, hadamard=True)
    with pytest.raises(ValueError, match="divides group_size"):
        qcoll.quantized_reduce_scatter(out, torch.ones(8 * world), g, group_size=24,
                                       hadamard=True, hadamard_size=16)
    return True


def test_reduce_scatter_argument_errors():
    run_ranks(4, _rs_error_worker, timeout=60)


def _rs_gain_worker(rank, world):
    g = qcoll.new_group(node_size=2)
    n = 1 << 14
    x = spiky(world * n, F32, "gain", rank)
    exact = torch.empty(n)
    qcoll.quantized_reduce_scatter(exact, x, g, intra_bits=None, inter_bits=None,
                                   hierarchical=False)
    errs = []
    for h in (False, True):
        out = torch.empty(n)
        qcoll.quantized_reduce_scatter(out, x, g, intra_bits=8, inter_bits=4, hadamard=h)
        errs.append(((out - exact).norm() / exact.norm()).item())
    return errs


def test_reduce_scatter_error_falls_with_hadamard():
    """2 nodes x 2, 8/4 bits, gradient-like data: Hadamard lowers the error."""
    for plain, smooth in run_ranks(4, _rs_gain_worker, timeout=60):
        assert smooth < 0.8 * plain, (plain, smooth)


def _rs_mismatch_worker(rank, world):
    g = qcoll.new_group(node_size=2)
    out = torch.empty(256)
    with pytest.raises(ValueError, match="ranks disagree on the call") as e:
        qcoll.quantized_reduce_scatter(out, torch.ones(256 * world), g, hadamard=rank == 0)
    return str(e.value)


def test_reduce_scatter_ranks_disagreeing_on_hadamard_all_raise():
    for msg in run_ranks(4, _rs_mismatch_worker, timeout=60):
        assert "hadamard_size 256" in msg, msg
