"""qcoll's own NCCL communicators (raw ncclComm_t), created per qcoll.Group on first use.

The root's ncclUniqueId travels through the group's ProcessGroup; NCCL itself is the
libnccl.so.2 torch already loaded (or QCOLL_NCCL_PATH), resolved at run time by the core."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from . import _C
from .info import _static_info


@functools.lru_cache(maxsize=None)
def nccl_version() -> str:
    """Version of the NCCL library qcoll would use, "" if none can be loaded."""
    if not _static_info()["cuda"]:
        return ""
    return _C.nccl_version()


def nccl_available() -> bool:
    return bool(nccl_version())


def create_nccl_communicator(group, device: torch.device):
    if not _static_info()["cuda"]:
        raise ValueError("backend='nccl' needs qcoll built with CUDA kernels")
    if not nccl_available():
        raise RuntimeError("backend='nccl': no NCCL library could be loaded (set QCOLL_NCCL_PATH "
                           "to libnccl.so.2, or import torch's CUDA build first)")
    uid = [_C.nccl_unique_id() if group.rank == 0 else None]
    if group.size > 1:
        root = group.global_ranks[0]
        dist.broadcast_object_list(uid, src=root, group=group.pg)
    local = [p // group.node_size == group.node for p in range(group.size)]
    return _C.NcclCommunicator(uid[0], group.rank, group.size, local, device.index or 0)
