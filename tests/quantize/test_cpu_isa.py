"""The CPU kernels' ISA paths (baseline, avx2, avx512; src/cpu/isa.h) give the same bytes.

Each path the CPU has is forced in turn and compared bit for bit with the baseline path on
quantize (every format, symmetric and not, nearest and stochastic, Hadamard of every size),
dequantize and the wire encode; the inputs include values a few ulps from rounding ties, where the
reciprocal fast path must hand over to division (checked against torch's own division).
fp8 decodes by its bit assembly on the AVX-512 path and by a table on the others: every
E4M3 byte is checked on every path against torch's float8_e4m3fn."""

import pytest
import torch

import qcoll
from qcoll import _C
from tests.quantize.test_wire import decode_chunk, ref_chunk, run_reduce
from tests.support import reference as ref

_ALL = ("baseline", "avx2", "avx512")
PATHS = _ALL[: _ALL.index(_C.cpu_isa_best()) + 1]  # every path this CPU has
# Every transform size: the paths hold a block in registers differently (AVX-512 whole,
# AVX2 and baseline in runs of 64 and then across runs).
HADAMARD = [{"hadamard": True, "hadamard_size": size} for size in (8, 16, 32, 64, 128, 256)]


@pytest.fixture
def restore_isa():
    before = _C.cpu_isa()
    yield
    _C.set_cpu_isa(before)


def _near_ties(n: int, gen: torch.Generator) -> torch.Tensor:
    """Groups of 256 whose absmax is 127 * s, other values (k + 0.5) * s nudged by 0-3 ulps."""
    s = torch.exp(torch.randn(n // 256, 1, generator=gen) * 4)
    k = torch.randint(-127, 127, (n // 256, 256), generator=gen).float()
    x = (k + 0.5) * s
    nudge = torch.randint(-3, 4, x.shape, generator=gen)
    x = torch.nextafter(x, x + torch.sign(nudge.float()) * torch.inf)
    for _ in range(2):
        x = torch.where(nudge.abs() > 1, torch.nextafter(x, x + torch.sign(nudge.float()) * torch.inf), x)
    x[:, 0] = 127 * s[:, 0]
    return x.reshape(-1)


def _inputs():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1 << 16, generator=gen) * torch.exp(torch.randn(1 << 16, generator=gen))
    x[100:356] = x[100:356] * 1e-39  # tiny scales: the reciprocal is not normal
    x[5000:5010] = 1e-7  # fp8's subnormal grid
    return [x, _near_ties(1 << 16, gen)]


def _results(x, dtype):
    out = []
    xs = x.to(dtype)
    for bits in (8, 4, "fp8_e4m3"):
        for sym in (True, False) if bits != "fp8_e4m3" else (True,):
            for kw in ({}, {"rounding": "stochastic", "seed": 3}, *HADAMARD):
                q = qcoll.quantize(xs, bits=bits, symmetric=sym, **kw)
                out += [q.data.clone(), q.scales.clone(), qcoll.dequantize(q)]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_isa_path_is_bit_identical(dtype, restore_isa):
    assert _C.cpu_isa() in ("baseline", "avx2", "avx512")
    for x in _inputs():
        assert _C.set_cpu_isa("baseline")
        want = _results(x, dtype)
        for path in PATHS[1:]:
            assert _C.set_cpu_isa(path)
            got = _results(x, dtype)
            for w, g in zip(want, got):
                assert torch.equal(w.view(torch.uint8), g.view(torch.uint8)), path


def test_near_ties_match_division(restore_isa):
    x = _near_ties(1 << 16, torch.Generator().manual_seed(1))
    q = qcoll.quantize(x, bits=8)
    g = x.view(-1, 256)
    s = q.scales.view(-1, 1)
    want = torch.round(g / s).clamp(-127, 127).to(torch.int8).view(torch.uint8).reshape(-1)
    assert torch.equal(q.data, want)


def _fp8_bits(codes: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The bits of torch's decode of E4M3 bytes times scale (one fp32 rounding), in dtype; NaN
    as the canonical NaN qcoll stores (all mantissa bits set, like CUDA)."""
    v = (codes.view(torch.float8_e4m3fn).to(torch.float32) * torch.tensor(scale)).to(dtype)
    return _canonical_bits(v)


def _canonical_bits(v: torch.Tensor) -> torch.Tensor:
    """v's bits as integers (so -0 differs from +0), every NaN as the canonical one."""
    wide = v.dtype == torch.float32
    bits = v.view(torch.int32 if wide else torch.int16)
    nan = torch.tensor(0x7FFFFFFF if wide else 0x7FFF, dtype=bits.dtype)
    return torch.where(torch.isnan(v), nan, bits)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [0.7, 0.0, 3e-39, float("inf"), float("nan")])
def test_every_fp8_byte_dequantizes_like_torch(path, dtype, scale, restore_isa):
    assert _C.set_cpu_isa(path)
    # Every byte three times (vector loops) and five more (the scalar tail), NaN bytes included.
    codes = torch.cat([torch.arange(256).repeat(3), torch.arange(5)]).to(torch.uint8)
    n = codes.numel()
    q = qcoll.QuantizedTensor(data=codes, scales=torch.tensor([scale]), offsets=None, shape=(n,),
                              dtype=dtype, format="fp8_e4m3", group_size=-(-n // 8) * 8)
    assert torch.equal(_canonical_bits(qcoll.dequantize(q)), _fp8_bits(codes, scale, dtype))


@pytest.mark.parametrize("path", PATHS)
def test_every_fp8_byte_in_the_wire_sum_like_torch(path, restore_isa):
    """reduce_chunks over two fp8 chunks (the first decoded, the second decoded and added):
    every finite byte in each (the second at a scale that rounds), summed in fp32."""
    assert _C.set_cpu_isa(path)
    codes = torch.arange(256).to(torch.uint8)
    values = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn).float()
    x1 = torch.cat([torch.tensor([448.0]), values])  # absmax 448: scale 1, codes = the bytes
    x2 = -0.3 * x1.flip(0)  # a scale with rounding, the bytes in another order
    chunks = [ref_chunk(x, ref.FP8, 1024) for x in (x1, x2)]
    n, size = x1.numel(), chunks[0].numel()
    y = run_reduce(torch.cat(chunks), ref.FP8, 1024, torch.float32, n, 2, size, 1, 0, 1.0,
                   ("values", torch.float32, n))
    want = decode_chunk(chunks[0], ref.FP8, 1024, torch.float32, n) + decode_chunk(
        chunks[1], ref.FP8, 1024, torch.float32, n)
    assert torch.equal(_canonical_bits(y), _canonical_bits(want))
    assert torch.equal(decode_chunk(chunks[0], ref.FP8, 1024, torch.float32, n), x1)


def test_set_cpu_isa_refuses_unknown_paths(restore_isa):
    with pytest.raises(ValueError):
        _C.set_cpu_isa("sse9")
    assert qcoll.build_info()["cpu_isa"] in ("baseline", "avx2", "avx512")
