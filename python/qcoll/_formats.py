"""Code formats: the one parser of every bit-width argument (``bits``, ``intra_bits``,
``inter_bits``, ``weight_bits``, ``grad_*_bits``, ...).

A bit-width argument accepts 8 / "int8", 4 / "int4", "fp8_e4m3", and (where unquantized is
allowed) None. The table of formats and their codes comes from the core (_C.FORMATS,
include/qcoll/quant_spec.h); nothing here tests a bit count."""

from __future__ import annotations

from typing import Optional

from . import _C

# name -> {"code", "bits" (per code), "float", "qmax", "asymmetric" (offered)}
FORMATS = {name: dict(info) for name, info in _C.FORMATS.items()}
RAW_CODE = _C.RAW_FORMAT  # a wire hop that carries the values unquantized (None)
_NAMES = {info["code"]: name for name, info in FORMATS.items()}  # code -> name
# The integer spellings of the integer formats (bits=8 stays int8).
_INT_SPELLINGS = {info["bits"]: name for name, info in FORMATS.items() if not info["float"]}


def _allowed(allow_none: bool) -> str:
    spellings = [f"{bits} / {name!r}" for bits, name in sorted(_INT_SPELLINGS.items(), reverse=True)]
    spellings += [repr(name) for name, info in FORMATS.items() if info["float"]]
    if allow_none:
        spellings.append("None (no quantization)")
    return ", ".join(spellings[:-1]) + " or " + spellings[-1]


def format_name(value, name: str = "bits", allow_none: bool = False) -> Optional[str]:
    """The canonical name ("int8", "int4", "fp8_e4m3") of a bit-width argument; None
    stays None where allowed. ValueError naming the argument otherwise."""
    if value is None and allow_none:
        return None
    if isinstance(value, str) and value in FORMATS:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value in _INT_SPELLINGS:
        return _INT_SPELLINGS[value]
    raise ValueError(f"{name} must be {_allowed(allow_none)}, got {value!r}")


def format_code(value, name: str = "bits", allow_none: bool = True) -> int:
    """The core's code of a bit-width argument (RAW_CODE for None)."""
    fmt = format_name(value, name, allow_none)
    return RAW_CODE if fmt is None else FORMATS[fmt]["code"]


def format_of(code: int) -> Optional[str]:
    """The canonical name of a core format code, as a plan reports a hop's (None: raw)."""
    return None if code == RAW_CODE else _NAMES[code]
