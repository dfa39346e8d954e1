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
    now, as seen by qcoll's own CUDA runtime) and ``cuda_device_count``.
    """
    return dict(_static_info())
