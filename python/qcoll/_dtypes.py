"""torch dtype <-> core dtype code: the table is the core's (_C.DTYPES, include/qcoll/dtype.h)."""

import torch

from . import _C

# The floating dtypes the kernels quantize, reduce and convert.
DTYPE_CODES = {getattr(torch, name): code for name, code in _C.DTYPES.items() if name != "bytes"}
ALLOWED = "float32, float16 or bfloat16"
# Unquantized all-gathers move any other element type as raw bytes (FSDP2 hands uint8 when
# parameters of several dtypes share a group); never quantized or reduced.
BYTES_CODE = _C.DTYPES["bytes"]


def dtype_code(dtype: torch.dtype, what: str, arg: str = "") -> int:
    """The core's code for a floating dtype; TypeError naming `what` (and `arg`, joined only
    then: callers on a collective's path pass the call and the argument apart) otherwise."""
    try:
        return DTYPE_CODES[dtype]
    except (KeyError, TypeError):  # TypeError: unhashable
        name = f"{what}: {arg}" if arg else what
        if not isinstance(dtype, torch.dtype):  # e.g. the string "float32"
            raise TypeError(f"{name} must be a torch.dtype ({ALLOWED}), got {dtype!r}") from None
        raise TypeError(f"{name} must have dtype {ALLOWED}, got {dtype}") from None
