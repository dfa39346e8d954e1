"""qcoll: quantized collectives for sharded data-parallel training."""

from . import _vgpu

_vgpu.install()  # QCOLL_VIRTUAL_GPU=1 (tests): before any module imports _C

from ._version import __version__
from ._runtime.worker import CommunicationError, Work
from .all_reduce import quantized_all_reduce
from .cost import CostModel, cost_model
from .all_gather import quantized_allgather
from .delta import delta_allgather
from .error_feedback import ErrorFeedback
from .group import Group, destroy, new_group
from .info import build_info
from .policy import AllGatherPolicy, AllReducePolicy, ReduceScatterPolicy
from .quantization import DEFAULT_GROUP_SIZE, QuantizedTensor, dequantize, quantize
from .reduce_scatter import quantized_reduce_scatter
from .stats import reset_stats, stats

__all__ = [
    "__version__",
    "AllGatherPolicy",
    "AllReducePolicy",
    "CommunicationError",
    "CostModel",
    "DEFAULT_GROUP_SIZE",
    "ErrorFeedback",
    "Group",
    "QuantizedTensor",
    "ReduceScatterPolicy",
    "Work",
    "build_info",
    "cost_model",
    "delta_allgather",
    "dequantize",
    "destroy",
    "new_group",
    "quantize",
    "quantized_all_reduce",
    "quantized_allgather",
    "quantized_reduce_scatter",
    "reset_stats",
    "stats",
]
