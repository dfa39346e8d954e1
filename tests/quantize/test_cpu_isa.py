"""The CPU kernels' ISA paths (baseline, avx2, avx512; src/cpu/isa.h) give the same bytes.

Each path the CPU has is forced in turn and compared bit for bit with the baseline path on
quantize (every format, symmetric and not, nearest and stochastic, Hadamard), dequantize and
the wire encode; the inputs include values a few ulps from rounding ties, where the
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
            for kw in ({}, {"rounding": "stochastic", "seed": 3}, {"hadamard": True}):
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


def _fp8_values(codes: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """torch's decode of E4M3 bytes times scale (one fp32 rounding), in dtype; NaN bytes as the
    canonical NaN qcoll stores (all mantissa bits set, like CUDA)."""
    v = codes.view(torch.float8_e4m3fn).to(torch.float32) * scale
    v = v.to(dtype)
    nan = torch.tensor(0x7FFFFFFF if dtype == torch.float32 else 0x7FFF, dtype=torch.int32)
    bits = v.view(torch.int32 if dtype == torch.float32 else torch.int16)
    return torch.where(torch.isnan(v), nan.to(bits.dtype), bits)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_fp8_byte_decodes_like_torch(path, dtype, restore_isa):
    assert _C.set_cpu_isa(path)
    # Every byte three times (vector loops) and five more (the scalar tail), NaN bytes included.
    codes = torch.cat([torch.arange(256).repeat(3), torch.arange(5)]).to(torch.uint8)
    n = codes.numel()
    q = qcoll.QuantizedTensor(data=codes, scales=torch.tensor([0.75]), offsets=None, shape=(n,),
                              dtype=dtype, format="fp8_e4m3", group_size=-(-n // 8) * 8)
    got = qcoll.dequantize(q)
    assert torch.equal(got.view(torch.int32 if dtype == torch.float32 else torch.int16),
                       _fp8_values(codes, 0.75, dtype))
    # The wire decode (reduce_chunks, one source): every finite byte, scale 1 (absmax 448).
    x = torch.cat([torch.tensor([448.0]), codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn).float()])
    chunk = ref_chunk(x, ref.FP8, 1024)
    y = run_reduce(chunk, ref.FP8, 1024, torch.float32, x.numel(), 1, 0, 1, 0, 1.0,
                   ("values", torch.float32, x.numel()))
    assert torch.equal(y, x)
    assert torch.equal(y, decode_chunk(chunk, ref.FP8, 1024, torch.float32, x.numel()))


def test_set_cpu_isa_refuses_unknown_paths(restore_isa):
    with pytest.raises(ValueError):
        _C.set_cpu_isa("sse9")
    assert qcoll.build_info()["cpu_isa"] in ("baseline", "avx2", "avx512")
