"""What this build of qcoll can do."""

import functools

from . import _C


@functools.lru_cache(maxsize=None)
def _static_info() -> dict:
    return _C.build_info()


def build_info() -> dict:
    """Capabilities of this build and machine.

    Keys: ``version``, ``cuda`` (CUDA kernels compiled in), ``cuda_archs`` (SM versions),
    ``cuda_runtime``, ``openmp``, ``openmp_threads``, ``cuda_available`` (a usable GPU right
    now, as seen by qcoll's own CUDA runtime), ``cuda_device_count`` and ``nccl`` (the
    version of the NCCL library the raw-NCCL backend would use, "" when none loads).
    """
    from ._nccl import nccl_version

    return dict(_static_info(), nccl=nccl_version())
