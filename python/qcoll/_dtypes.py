"""torch dtype <-> core dtype code (include/qcoll/dtype.h)."""

import torch

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ALLOWED = "float32, float16 or bfloat16"
# Unquantized all-gathers move any other element type as raw bytes (FSDP2 hands uint8 when
# parameters of several dtypes share a group); never quantized or reduced.
BYTES_CODE = 3


def dtype_code(dtype: torch.dtype, what: str) -> int:
    """The core's code for a floating dtype; TypeError naming `what` otherwise."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"{what} must have dtype {ALLOWED}, got {dtype}") from None
