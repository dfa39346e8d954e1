"""qcoll: quantized collectives for sharded data-parallel training."""

from ._version import __version__
from .info import build_info
from .quantization import DEFAULT_GROUP_SIZE, QuantizedTensor, dequantize, quantize

__all__ = [
    "__version__",
    "DEFAULT_GROUP_SIZE",
    "QuantizedTensor",
    "build_info",
    "dequantize",
    "quantize",
]
