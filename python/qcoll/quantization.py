"""Block quantization of tensors: qcoll.quantize / qcoll.dequantize.

Groups are consecutive runs of ``group_size`` elements of ``x.reshape(-1)``; each group
gets one float32 scale (and, asymmetric, one float32 offset = the group minimum).
Code formats: int8, int4 and fp8_e4m3 (_formats.py). The byte layout is described in
include/qcoll/quant_spec.h.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import _C
from ._device import device_args
from ._dtypes import dtype_code
from ._formats import FORMATS, format_name

# Chosen from the error/overhead table in README.md ("Choosing the default group size").
DEFAULT_GROUP_SIZE = 256
GROUP_SIZE_MULTIPLE = _C.GROUP_SIZE_MULTIPLE
MAX_GROUP_SIZE = _C.MAX_GROUP_SIZE
ROUNDING_MODES = dict(_C.ROUNDINGS)  # name -> the core's Rounding code
# Hadamard smoothing (hadamard=True): blocks of this many elements, or of the largest power
# of two dividing group_size when that is smaller. Chosen from the int4 error table in
# README.md ("Hadamard smoothing"): the error on outlier-heavy data falls with the block
# size up to the largest the kernels take.
DEFAULT_HADAMARD_SIZE = 256
MIN_HADAMARD_SIZE = _C.MIN_HADAMARD_SIZE
MAX_HADAMARD_SIZE = _C.MAX_HADAMARD_SIZE
_SEED_LIMIT = 1 << 64


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """A block-quantized tensor.

    data:     uint8 codes, ceil(numel * bits / 8) bytes (int4: element 2k in the low nibble;
              fp8_e4m3: one OCP E4M3FN byte per element).
    scales:   float32, one per group.
    offsets:  float32 group minima (asymmetric), or None (symmetric).
    shape, dtype: the original tensor's.
    format:   the code format, "int8", "int4" or "fp8_e4m3" (8 and 4 are read as int8 and
              int4); ``bits`` is the width of one code.
    hadamard_size: 0, or the block size of the Hadamard transform the codes were taken
              after (the scales are of the transformed values).
    """

    data: torch.Tensor
    scales: torch.Tensor
    offsets: Optional[torch.Tensor]
    shape: torch.Size
    dtype: torch.dtype
    format: str
    group_size: int
    hadamard_size: int = 0  # codes of Hadamard-smoothed values (0: off); dequantize inverts

    def __post_init__(self):
        # A hand-built tensor may give the shape as a tuple or list, and the format as 8 or 4.
        if not isinstance(self.shape, torch.Size):
            object.__setattr__(self, "shape", torch.Size(self.shape))
        try:
            object.__setattr__(self, "format", format_name(self.format))
        except ValueError:
            pass  # reported by dequantize (_check_quantized), naming the field

    @property
    def bits(self) -> int:
        """Bits per code."""
        return FORMATS[self.format]["bits"]

    @property
    def symmetric(self) -> bool:
        return self.offsets is None

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        """Bytes of codes + scales (+ offsets): what a transfer of this tensor costs."""
        extra = 0 if self.offsets is None else self.offsets.numel() * 4
        return self.data.numel() + self.scales.numel() * 4 + extra

    @property
    def device(self) -> torch.device:
        return self.data.device


def num_groups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


def code_bytes(numel: int, fmt: str) -> int:
    return -(-numel * FORMATS[fmt]["bits"] // 8)


def check_group_size(group_size, name: str = "group_size") -> int:
    if group_size is None:
        return DEFAULT_GROUP_SIZE
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size <= 0
        or group_size % GROUP_SIZE_MULTIPLE
        or group_size > MAX_GROUP_SIZE
    ):
        raise ValueError(
            f"{name} must be a positive multiple of {GROUP_SIZE_MULTIPLE} up to "
            f"{MAX_GROUP_SIZE} (or None for the default {DEFAULT_GROUP_SIZE}), got {group_size!r}"
        )
    return group_size


def check_hadamard(hadamard, hadamard_size, group_size: int) -> int:
    """The Hadamard block size for the kernels (0: off) from the public pair of arguments:
    hadamard=True takes hadamard_size, or by default the largest power of two dividing
    group_size up to DEFAULT_HADAMARD_SIZE; hadamard_size needs hadamard=True."""
    if not isinstance(hadamard, bool):
        raise TypeError(f"hadamard must be a bool, got {hadamard!r}")
    if not hadamard:
        if hadamard_size is not None:
            raise ValueError(f"hadamard_size={hadamard_size!r} needs hadamard=True")
        return 0
    if hadamard_size is None:
        return min(DEFAULT_HADAMARD_SIZE, group_size & -group_size)
    if (
        isinstance(hadamard_size, bool)
        or not isinstance(hadamard_size, int)
        or not MIN_HADAMARD_SIZE <= hadamard_size <= MAX_HADAMARD_SIZE
        or hadamard_size & (hadamard_size - 1)
        or group_size % hadamard_size
    ):
        raise ValueError(
            f"hadamard_size must be a power of two from {MIN_HADAMARD_SIZE} to "
            f"{MAX_HADAMARD_SIZE} that divides group_size {group_size} (or None for the "
            f"default), got {hadamard_size!r}"
        )
    return hadamard_size


def _check_rounding(rounding) -> int:
    if not isinstance(rounding, str) or rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {sorted(ROUNDING_MODES)}, got {rounding!r}")
    return ROUNDING_MODES[rounding]


def _check_seed(seed, stochastic: bool) -> int:
    if seed is None:
        # Drawn from torch's default generator, so torch.manual_seed governs it.
        return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64)) if stochastic else 0
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"seed must be None or an int in [0, 2**64), got {seed!r}")
    return seed


def quantize(
    x: torch.Tensor,
    *,
    bits=8,
    group_size: Optional[int] = None,
    symmetric: bool = True,
    rounding: str = "nearest",
    seed: Optional[int] = None,
    out: Optional[QuantizedTensor] = None,
    hadamard: bool = False,
    hadamard_size: Optional[int] = None,
) -> QuantizedTensor:
    """Block-quantize ``x`` (float32/float16/bfloat16, CPU or CUDA, any shape and strides).

    ``bits``: the code format, 8 / "int8" (default), 4 / "int4" or "fp8_e4m3".
    Integer symmetric: scale = absmax / (2**(bits-1) - 1), codes in [-qmax, qmax].
    Integer asymmetric: scale = (max - min) / (2**bits - 1), offset = min, codes in
    [0, 2**bits - 1]. Either way |x - dequantize(quantize(x))| <= scale / 2 per element
    (up to fp32 rounding). Every format: where the largest code would decode to an fp32
    overflow (groups within a step of FLT_MAX: 127 * fl(FLT_MAX / 127) is inf), the scale
    is the largest float below the quotient at which it does not (one or two floats down),
    so a group with a finite scale dequantizes finite into fp32.
    fp8_e4m3 (symmetric only): scale = absmax / 448, codes = OCP E4M3FN bytes of x / scale
    rounded to nearest even (saturating at +-448), so |x - dequantize(quantize(x))| <=
    |x| / 16 + scale / 1024 (half an E4M3 ulp; the second term is the subnormal spacing).
    An all-zero group gets scale 0; a group holding NaN or Inf gets a NaN scale and zero
    codes, so all of its elements dequantize to NaN (every format). ``rounding="stochastic"`` is unbiased and reproducible:
    element i's draw depends only on (seed, i), on CPU and CUDA alike.

    ``out``: a QuantizedTensor whose buffers are reused (same numel, bits, group_size,
    symmetry and device), which saves the allocation (and, for large CPU tensors, the page
    faults of fresh memory) on repeated calls. The result shares them.

    ``hadamard=True`` smooths outliers first (SDP4Bit's TLq-HS): each block of
    ``hadamard_size`` consecutive elements (a power of two from 8 to 256 dividing
    group_size; default: the largest such up to 256) goes through the orthonormal
    Walsh-Hadamard transform before it is quantized, fused into the kernel; dequantize
    applies the inverse. A tail shorter than a block stays untransformed. The bound above
    then holds for the transformed values (the scales are theirs), and the round trip's
    error is that error rotated back (the same RMS).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    code = dtype_code(x.dtype, "x")
    fmt = format_name(bits, "bits")
    group_size = check_group_size(group_size)
    hadamard_size = check_hadamard(hadamard, hadamard_size, group_size)
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool, got {symmetric!r}")
    if not symmetric and not FORMATS[fmt]["asymmetric"]:
        raise ValueError(f"bits={bits!r}: {fmt} codes are symmetric only (symmetric=True)")
    rounding_code = _check_rounding(rounding)
    seed = _check_seed(seed, stochastic=rounding_code == ROUNDING_MODES["stochastic"])
    kind, index, stream = device_args(x, "x")

    flat = x.contiguous().view(-1)  # logical row-major order, whatever x's strides
    n = flat.numel()
    if out is None:
        groups = num_groups(n, group_size)
        data = torch.empty(code_bytes(n, fmt), dtype=torch.uint8, device=x.device)
        scales = torch.empty(groups, dtype=torch.float32, device=x.device)
        offsets = None if symmetric else torch.empty(groups, dtype=torch.float32, device=x.device)
    else:
        _check_out_buffers(out, n, fmt, group_size, symmetric, x.device)
        data, scales, offsets = out.data, out.scales, out.offsets
    _C.quantize(
        flat.data_ptr(), code, n, FORMATS[fmt]["code"], group_size, symmetric, rounding_code, seed, 0,
        data.data_ptr(), scales.data_ptr(), 0 if offsets is None else offsets.data_ptr(),
        kind, index, stream, hadamard_size=hadamard_size,
    )
    return QuantizedTensor(data, scales, offsets, x.shape, x.dtype, fmt, group_size, hadamard_size)


def _check_out_buffers(out, n: int, fmt: str, group_size: int, symmetric: bool, device) -> None:
    _check_quantized(out, "out")
    want = (n, fmt, group_size, symmetric, device)
    got = (out.numel, out.format, out.group_size, out.symmetric, out.device)
    if got != want:
        raise ValueError(
            "out must match the call: (numel, format, group_size, symmetric, device) = "
            f"{want}, got {got}"
        )


def _check_quantized(q: QuantizedTensor, name: str = "q") -> None:
    """A hand-built QuantizedTensor must describe buffers large enough for the kernel."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"{name} must be a qcoll.QuantizedTensor, got {type(q).__name__}")
    fmt = format_name(q.format, f"{name}.format")
    check_group_size(q.group_size, f"{name}.group_size")
    if q.offsets is not None and not FORMATS[fmt]["asymmetric"]:
        raise ValueError(f"{name}.offsets must be None: {fmt} codes are symmetric only")
    if q.hadamard_size:
        try:
            check_hadamard(True, q.hadamard_size, q.group_size)
        except ValueError as e:
            raise ValueError(f"{name}.{e}") from None
    n = q.numel
    expect = {f"{name}.data": (q.data, torch.uint8, code_bytes(n, fmt)),
              f"{name}.scales": (q.scales, torch.float32, num_groups(n, q.group_size))}
    if q.offsets is not None:
        expect[f"{name}.offsets"] = (q.offsets, torch.float32, num_groups(n, q.group_size))
    for field, (t, dtype, count) in expect.items():
        if t.dtype != dtype or t.numel() != count or not t.is_contiguous():
            raise ValueError(
                f"{field} must be a contiguous {dtype} tensor of {count} elements for shape "
                f"{tuple(q.shape)}, got {t.dtype} with {t.numel()} elements"
            )
        if t.device != q.data.device:
            raise ValueError(f"{field} is on {t.device} but {name}.data is on {q.data.device}")


def dequantize(
    q: QuantizedTensor,
    *,
    dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Back to floating point: a tensor of q's shape in ``dtype`` (default: q.dtype).
    Codes of Hadamard-smoothed values (q.hadamard_size) are transformed back, in the kernel.

    With ``out`` (contiguous, q.numel elements, on q's device) the result is written there
    and ``out`` is returned; its dtype is the output dtype.
    """
    _check_quantized(q)
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if dtype is None:
        dtype = out.dtype if out is not None else q.dtype
    code = dtype_code(dtype, "dtype")
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    else:
        if out.dtype != dtype:
            raise ValueError(f"out has dtype {out.dtype} but dtype={dtype} was requested")
        if out.numel() != q.numel or not out.is_contiguous() or out.device != q.device:
            raise ValueError(
                f"out must be a contiguous tensor of {q.numel} elements on {q.device}, got "
                f"{out.numel()} elements on {out.device} (contiguous={out.is_contiguous()})"
            )
    kind, index, stream = device_args(out, "out")
    _C.dequantize(
        q.data.data_ptr(), q.scales.data_ptr(), 0 if q.offsets is None else q.offsets.data_ptr(),
        q.numel, FORMATS[q.format]["code"], q.group_size, q.symmetric, out.data_ptr(), code, kind,
        index, stream, hadamard_size=q.hadamard_size,
    )
    return out
