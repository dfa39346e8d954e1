"""qcoll.Group: a torch.distributed group seen as nodes of node_size consecutive ranks,
with the intra-node and inter-node sub-groups the hierarchical collectives use."""

from __future__ import annotations

import os
import socket
from typing import Optional

import torch
import torch.distributed as dist

from . import _C
from ._torch_transport import Buffers, ProcessGroupTransport, SelfTransport

BACKENDS = ("nccl", "torch")


class Group:
    """Ranks 0..size-1 of a ProcessGroup, node k holding ranks [k*node_size, (k+1)*node_size).

    ``intra``: this rank's node (a Group of node_size ranks). ``inter``: the ranks with this
    rank's local index on every node (a Group of num_nodes ranks, one per node).
    """

    def __init__(self, pg, node_size: int, backend: Optional[str], *, _singleton: bool = False,
                 _buffers: Optional[Buffers] = None):
        self.pg = pg
        self.backend = backend
        self.node_size = node_size
        if _singleton:
            self.rank, self.size, self.global_ranks = 0, 1, [dist.get_rank()]
        else:
            self.rank = dist.get_rank(pg)
            self.size = dist.get_world_size(pg)
            self.global_ranks = dist.get_process_group_ranks(pg)
        self.num_nodes = self.size // node_size
        self.node = self.rank // node_size
        self.local_rank = self.rank % node_size
        # Sub-groups share their parent's registry: one call's buffers serve every hop.
        self._buffers = _buffers if _buffers is not None else Buffers()
        transport = SelfTransport(self._buffers) if self.size == 1 else ProcessGroupTransport(pg, self._buffers)
        local = [p // node_size == self.node for p in range(self.size)]
        self._torch_comm = _C.TorchCommunicator(self.rank, self.size, local, transport)
        self._nccl_comm = None
        self._cpu_workspace = None  # grow-only scratch of the collectives (collectives._workspace)
        self._intra = self if self.num_nodes == 1 else None
        self._inter = self if node_size == 1 else None

    # ---- sub-groups --------------------------------------------------------------------
    @property
    def intra(self) -> "Group":
        if self._intra is None:
            self._make_subgroups()
        return self._intra

    @property
    def inter(self) -> "Group":
        if self._inter is None:
            self._make_subgroups()
        return self._inter

    def _make_subgroups(self) -> None:
        """Collective over the group's members: every member creates every sub-group of
        the partition, in the same order (see _partition_groups)."""
        n, m = self.node_size, self.num_nodes
        nodes = [self.global_ranks[k * n:(k + 1) * n] for k in range(m)]
        columns = [self.global_ranks[j::n] for j in range(n)]
        intra = _partition_groups(nodes, self.global_ranks)[self.node]
        inter = _partition_groups(columns, self.global_ranks)[self.local_rank]
        if self._intra is None:
            self._intra = _subgroup(intra, nodes[self.node], n, self.backend, self._buffers)
        if self._inter is None:
            self._inter = _subgroup(inter, columns[self.local_rank], 1, self.backend, self._buffers)

    # ---- transports --------------------------------------------------------------------
    def communicator(self, device: torch.device):
        """The C++ communicator for a call on `device`, and the buffer registry it reads."""
        if self._use_nccl(device):
            if self._nccl_comm is None:
                from ._nccl import create_nccl_communicator

                self._nccl_comm = create_nccl_communicator(self, device)
            return self._nccl_comm
        return self._torch_comm

    def _use_nccl(self, device: torch.device) -> bool:
        if self.backend == "torch":
            return False
        if self.backend == "nccl":
            if device.type != "cuda":
                raise ValueError(f"backend='nccl' needs CUDA tensors, got a tensor on {device}")
            return True
        from ._nccl import nccl_available

        return device.type == "cuda" and self.size > 1 and nccl_available()

    def __repr__(self) -> str:
        return (f"qcoll.Group(rank={self.rank}, size={self.size}, node_size={self.node_size}, "
                f"num_nodes={self.num_nodes}, backend={self.backend!r})")


def _partition_groups(blocks: list, members: list) -> list:
    """ProcessGroups for disjoint blocks of ranks (None for a block of one rank).

    When the members are the whole world, every rank creates every block's group in order:
    torch numbers groups by a per-process counter, so ranks must create the same groups in
    the same sequence. A strict sub-group cannot ask non-members to join; each member then
    creates only its own block with group-local synchronization."""
    if len(members) == dist.get_world_size():
        return [dist.new_group(b) if len(b) > 1 else None for b in blocks]
    me = dist.get_rank()
    return [dist.new_group(b, use_local_synchronization=True) if (me in b and len(b) > 1) else None
            for b in blocks]


def _subgroup(pg, ranks, node_size: int, backend, buffers: Optional[Buffers] = None) -> Group:
    if len(ranks) == 1:
        return Group(None, 1, backend, _singleton=True, _buffers=buffers)
    return Group(pg, node_size, backend, _buffers=buffers)


def _host_id() -> str:
    # QCOLL_HOST_ID lets tests give ranks on one machine distinct "hosts".
    return os.environ.get("QCOLL_HOST_ID") or socket.gethostname()


def _gather_hosts(pg, size: int, node_size) -> list:
    """(host, requested node_size) of every member; raises on every rank if the members
    asked for different node sizes (they would build different sub-groups and hang)."""
    infos = [None] * size
    dist.all_gather_object(infos, (_host_id(), node_size), group=pg)
    asked = {ns for _, ns in infos}
    if len(asked) > 1:
        per_rank = ", ".join(f"rank {r}: {ns}" for r, (_, ns) in enumerate(infos))
        raise ValueError(f"ranks passed different node_size values to qcoll.new_group ({per_rank})")
    return [host for host, _ in infos]


def _node_size_from_hosts(hosts: list) -> int:
    """Ranks per host, for a group whose hosts each hold the same number of its ranks."""
    counts = {h: hosts.count(h) for h in hosts}
    sizes = set(counts.values())
    if len(sizes) > 1:
        raise ValueError(f"the group's hosts hold different numbers of its ranks ({counts}); "
                         "pass node_size explicitly")
    return sizes.pop()


def _check_layout(hosts: list, node_size: int) -> None:
    """Ranks of one qcoll node must share a host (node-contiguous rank layout)."""
    for k in range(len(hosts) // node_size):
        block = hosts[k * node_size : (k + 1) * node_size]
        if len(set(block)) > 1:
            raise ValueError(
                f"ranks are not node-contiguous: node {k} (group ranks {k * node_size}.."
                f"{(k + 1) * node_size - 1}) spans hosts {sorted(set(block))}; order the ranks "
                "so that each host's ranks are consecutive, or pass a node_size that matches"
            )


def new_group(pg=None, *, node_size: Optional[int] = None, backend: Optional[str] = None) -> Group:
    """A qcoll.Group over ProcessGroup ``pg`` (None: the default group).

    node_size: ranks per node; defaults to LOCAL_WORLD_SIZE for the default group, and to
    the number of the group's ranks per host for any other ProcessGroup, or when
    LOCAL_WORLD_SIZE is unset (LOCAL_WORLD_SIZE describes the world, not a sub-group: an
    HSDP replicate group has one rank per host). An explicit value lets one host emulate
    several nodes. backend: "nccl" (qcoll's own NCCL communicators), "torch" (the
    ProcessGroup itself), or None (NCCL for CUDA tensors when available, else torch).
    Collective: every rank of pg must call it.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("qcoll.new_group needs torch.distributed: call init_process_group first")
    if backend not in (None, *BACKENDS):
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    pg = pg if pg is not None else dist.group.WORLD
    size = dist.get_world_size(pg)
    if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, int)
                                  or node_size < 1 or size % node_size):
        raise ValueError(f"node_size must be a positive divisor of the group size {size}, got {node_size!r}")
    hosts = _gather_hosts(pg, size, node_size)
    if node_size is None:
        if pg is dist.group.WORLD and "LOCAL_WORLD_SIZE" in os.environ:
            node_size = int(os.environ["LOCAL_WORLD_SIZE"])
            if size % node_size:
                raise ValueError(f"LOCAL_WORLD_SIZE={node_size} does not divide the group size "
                                 f"{size}; pass node_size explicitly")
        else:
            node_size = _node_size_from_hosts(hosts)
    _check_layout(hosts, node_size)
    group = Group(pg, node_size, backend)
    if 1 < node_size < size:
        group._make_subgroups()
    return group


_default_groups = {}


def resolve_group(group) -> Group:
    """A qcoll.Group for `group`: a Group as is; a ProcessGroup or None wrapped once."""
    if isinstance(group, Group):
        return group
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a qcoll.Group, a torch ProcessGroup or None, got {type(group).__name__}")
    key = group if group is not None else dist.group.WORLD
    if key not in _default_groups:
        _default_groups[key] = new_group(key)
    return _default_groups[key]
