"""Where a tensor lives, as the core's (kind, index, stream) triple."""

import torch

from . import _C, _vgpu
from .info import _static_info

CPU, CUDA = _C.DEVICE_KINDS["cpu"], _C.DEVICE_KINDS["cuda"]  # the core's DeviceKind codes


def on_gpu(device: torch.device) -> bool:
    """Whether qcoll takes its CUDA branch for tensors on `device` (a CUDA device, or a CPU
    one under the virtual GPU: _vgpu.py)."""
    return device.type == "cuda" or _vgpu.on_device(device)


def device_args(t: torch.Tensor, what: str) -> tuple:
    """(device_kind, device_index, stream handle) for a kernel call on `t`'s device.

    CUDA work is ordered on the caller's current stream, as torch's own ops are.
    """
    if t.device.type == "cpu" and _vgpu.on_device(t.device):
        return CUDA, 0, _vgpu.current_stream().cuda_stream
    if t.device.type == "cpu":
        return CPU, 0, 0
    if t.device.type == "cuda":
        if not _static_info()["cuda"]:
            raise ValueError(
                f"{what} is a CUDA tensor but qcoll was built without CUDA kernels; "
                "rebuild where nvcc is found (QCOLL_CUDA=ON requires it), or pass a CPU tensor"
            )
        return CUDA, t.device.index, torch.cuda.current_stream(t.device).cuda_stream
    raise ValueError(f"{what} must be on a cpu or cuda device, got {t.device}")
