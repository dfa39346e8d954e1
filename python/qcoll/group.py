"""qcoll.Group: a torch.distributed group seen as nodes of node_size consecutive ranks,
with the intra-node and inter-node sub-groups the hierarchical collectives use.

A Group communicates over ProcessGroups of its own (created with the parent's timeout, or
new_group(..., timeout=)), on a worker thread of its own (qcoll._runtime.worker.CallQueue) shared with its
sub-groups: never over the caller's ProcessGroup, so it cannot race the caller's own
collectives or another Group's."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import weakref
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from . import _C
from ._device import on_gpu
from ._process_groups import destroy_remaining, new_process_group
from ._runtime.streams import CudaCalls
from ._runtime.worker import CallQueue
from ._torch_transport import ProcessGroupTransport, SelfTransport, check_gather_paths

BACKENDS = ("nccl", "torch")
_live_groups: "weakref.WeakSet[Group]" = weakref.WeakSet()  # for qcoll.destroy()
_creation_order = itertools.count()


class _Member:
    """A Group's place in its family: open until the Group is closed or dropped."""

    __slots__ = ("open",)

    def __init__(self):
        self.open = True


class _Family:
    """What a Group shares with its sub-groups: the worker thread that runs their CPU calls
    and their CUDA streams. They run while any member is open (alive and not closed): a
    sub-group kept after its parent was dropped goes on calling, and closing one member
    leaves the others working. When the last open member is closed, Group.close() stops
    them; when it is dropped, the worker stops, not at interpreter exit (a call blocked on a
    dead peer must not hold exit up), and calls still running on the GPU keep their memory
    (streams.py)."""

    def __init__(self, name: str, max_threads: int):
        self.calls = CallQueue(name, max_threads)
        self.cuda = CudaCalls()
        self._open = 0
        self._lock = threading.Lock()

    def join(self, group: "Group") -> _Member:
        member = _Member()
        with self._lock:
            self._open += 1
        weakref.finalize(group, self._dropped, member).atexit = False  # no reference to group
        return member

    def leave(self, member: _Member) -> bool:
        """The member no longer takes calls; whether it was the last open one."""
        with self._lock:
            if not member.open:
                return False
            member.open = False
            self._open -= 1
            return self._open == 0

    def _dropped(self, member: _Member) -> None:
        if self.leave(member):
            self.calls.close()
            self.cuda.orphan()


class Group:
    """Ranks 0..size-1 of a ProcessGroup, node k holding ranks [k*node_size, (k+1)*node_size).

    ``intra``: this rank's node (a Group of node_size ranks). ``inter``: the ranks with this
    rank's local index on every node (a Group of num_nodes ranks, one per node).
    """

    def __init__(self, pg, node_size: int, backend: Optional[str], *, timeout: timedelta,
                 _singleton: bool = False, _owned_pg=None, _role: str = "group",
                 _family: Optional[_Family] = None, _host_ranks: int = 1):
        self.pg = pg  # the caller's, or for a sub-group qcoll's own (QCOLL_DEBUG checks, NCCL setup)
        self.backend = backend
        self.node_size = node_size
        self.timeout = timeout
        if _singleton:
            self.rank, self.size, self.global_ranks = 0, 1, [dist.get_rank()]
        else:
            self.rank = dist.get_rank(pg)
            self.size = dist.get_world_size(pg)
            self.global_ranks = dist.get_process_group_ranks(pg)
        self.num_nodes = self.size // node_size
        self.node = self.rank // node_size
        self.local_rank = self.rank % node_size
        # Sub-groups share their parent's worker (CPU calls of the family run in issue order,
        # one at a time) and CUDA streams (GPU calls likewise, on the family's communication
        # stream). Only the call runtime (qcoll._runtime) uses them.
        if _family is None:  # kernels use at most this rank's share of its host's cores
            share = len(os.sched_getaffinity(0)) // max(1, _host_ranks)
            _family = _Family(f"qcoll-group-{self.global_ranks}", share)
        self._member = _family.join(self)
        self._family = _family
        self._calls, self._cuda = _family.calls, _family.cuda
        # The ProcessGroup qcoll communicates over: its own, never the caller's.
        if self.size > 1 and _owned_pg is None:
            _owned_pg = _partition_groups([self.global_ranks], timeout)[0]
        self._owned_pg = _owned_pg
        # gloo's all-gathers of host tensors run on a ProcessGroup of their own (see
        # ProcessGroupTransport); a backend="nccl" group moves no host tensors.
        self._gather_pg = None
        if self.size > 1 and backend != "nccl" and "gloo" in str(dist.get_backend(_owned_pg)):
            self._gather_pg = new_process_group(self.global_ranks, timeout)
        self._role = _role
        label = f"the {_role} (global ranks {self.global_ranks})"
        transport = SelfTransport() if self.size == 1 else ProcessGroupTransport(
            _owned_pg, label, self._gather_pg, node_size)
        local = [p // node_size == self.node for p in range(self.size)]
        self._torch_comm = _C.TorchCommunicator(self.rank, self.size, local, transport)
        self._transport = transport
        self._nccl_comm = None
        self._nccl_release = None  # hands _nccl_comm to _nccl's release if dropped unclosed
        self._nccl_usable = None  # backend=None: whether every member can use NCCL (agreed)
        self._cpu_workspace = None  # grow-only scratch of its CPU calls (_runtime/call.py)
        self._sequence = itertools.count()  # call numbers, stamped into the wire headers
        self._sequence_lock = threading.Lock()
        self._intra: Optional[Group] = None
        self._inter: Optional[Group] = None
        self._closed = False
        self._created = next(_creation_order)
        _live_groups.add(self)  # sub-groups too: one kept after its parent was dropped

    def _next_sequence(self) -> int:
        with self._sequence_lock:
            return next(self._sequence) & 0xFFFFFFFF

    # ---- sub-groups --------------------------------------------------------------------
    @property
    def intra(self) -> "Group":
        if self.num_nodes == 1:  # no stored self-reference: a Group holds no cycle
            return self
        if self._intra is None:
            self._make_subgroups()
        return self._intra

    @property
    def inter(self) -> "Group":
        if self.node_size == 1:
            return self
        if self._inter is None:
            self._make_subgroups()
        return self._inter

    def _make_subgroups(self) -> None:
        """Collective over the group's members: each creates the ProcessGroups of its node
        and of its column (see _partition_groups)."""
        n, m = self.node_size, self.num_nodes
        nodes = [self.global_ranks[k * n:(k + 1) * n] for k in range(m)]
        columns = [self.global_ranks[j::n] for j in range(n)]
        intra = _partition_groups(nodes, self.timeout)[self.node]
        inter = _partition_groups(columns, self.timeout)[self.local_rank]
        family = self._family
        if self._intra is None and self.num_nodes > 1:
            self._intra = _subgroup(intra, nodes[self.node], n, self.backend, self.timeout,
                                    family, "intra-node group")
        if self._inter is None and n > 1:
            self._inter = _subgroup(inter, columns[self.local_rank], 1, self.backend,
                                    self.timeout, family, "inter-node group")

    # ---- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Finish the calls in flight and destroy the NCCL communicators and ProcessGroups
        this Group created (its sub-groups' too: intra, inter, then its own, so every rank
        destroys them in the same order). Destroying an NCCL communicator first lets its
        queued GPU work finish, within the group's timeout (past it, or after an error, the
        communicator is aborted instead). The worker thread and CUDA streams it shares with
        its family stop with the family's last open member (a kept sub-group closed alone
        leaves its sibling working; a parent's calls that go through it then raise): the
        host then waits for the streams and the tensors of calls never waited are released.
        Collective: every member calls it, in the same order relative to other groups. The
        Group cannot be used afterwards."""
        if self._closed:
            return
        closing = [g for g in (self._intra, self._inter, self) if g is not None and not g._closed]
        for g in closing:  # refuses new calls from here on (communicator())
            g._closed = True
        # The family's last open member stops its worker; otherwise the worker runs on for
        # the others once the calls queued so far (this Group's among them) have run.
        last = any([self._family.leave(g._member) for g in closing])
        if last:
            self._calls.close()
        else:
            self._calls.drain()
        try:
            for g in closing:
                g._cpu_workspace = None  # the memory kept for the next call
                release = getattr(g._transport, "release_buffers", None)
                if release is not None:
                    release()
                if g._nccl_comm is not None:
                    from ._nccl import destroy_communicator

                    destroy_communicator(g._nccl_comm)
                    # Only now: had destroy raised, the finalizer would release it.
                    g._nccl_comm = None
                    g._nccl_release.detach()
                for attr in ("_gather_pg", "_owned_pg"):
                    if getattr(g, attr) is not None:
                        dist.destroy_process_group(getattr(g, attr))
                        setattr(g, attr, None)
        finally:
            # Only now, with the communicators' GPU work finished or aborted: the host waits
            # for the family's streams, then the memory of un-waited calls is dropped.
            if last:
                self._cuda.close()

    # ---- transports --------------------------------------------------------------------
    @property
    def gather_paths(self) -> dict:
        """How this group's gloo transport gathers the size bands it chose by measuring or
        took from its cost model (past 256 KB gathered, over nodes of several ranks):
        {(low, high): {"path": "all_to_all" or "ring", "measured_s": {"ring": s,
        "all_to_all": s}}} for gathered
        bytes in (low, high], the agreed (slowest rank's) times ("measured_s" None for a
        band taken from the group's cost model: adopt_gather_paths); the same on every rank
        once no call is in flight."""
        paths = getattr(self._transport, "gather_paths", None)
        return {} if paths is None else paths.describe()

    def adopt_gather_paths(self, paths: dict) -> None:
        """Gather host tensors of each size band in `paths` ({band: "ring" | "all_to_all"},
        CostModel.gather_paths) by that path from now on, without the band's trials: the
        group's cost model then prices the path its all-gathers take (a model loaded from a
        file, or shared with another group of the same ranks, holds its own probe's paths).
        Bands the transport never measures (up to 256 KB gathered, a group within one
        node) are left out. Collective: every rank, at the same point among its calls on the
        group; it runs as one of them (after the calls queued before it, before any after)."""
        paths = check_gather_paths(paths, "adopt_gather_paths: paths")
        adopt = getattr(self._transport, "adopt_gather_paths", None)
        if adopt is not None and paths:
            self._calls.call(lambda: adopt(paths), "adopt the cost model's gather paths")

    def communicator(self, device: torch.device):
        """The C++ communicator for a call on `device`."""
        if self._closed:
            raise RuntimeError(f"{self!r} was closed: create a new group")
        if self._use_nccl(device):
            if self._nccl_comm is None:
                from ._nccl import create_nccl_communicator

                self._hold_nccl_comm(create_nccl_communicator(self, device))
            return self._nccl_comm
        return self._torch_comm

    def _hold_nccl_comm(self, comm) -> None:
        """Dropped without close(), this Group hands `comm` to a release thread (_nccl.py):
        its destroy waits for the other ranks, which the dropping thread must not."""
        from ._nccl import release_communicator

        # Registered before the Group holds it: no drop destroys it on the dropping thread.
        self._nccl_release = weakref.finalize(self, release_communicator, comm)
        self._nccl_release.atexit = False  # at exit it is aborted (_nccl._abort_at_exit)
        self._nccl_comm = comm

    def _use_nccl(self, device: torch.device) -> bool:
        if self.backend == "torch":
            return False
        gpu = on_gpu(device)
        if self.backend == "nccl":
            if not gpu:
                raise ValueError(f"backend='nccl' needs CUDA tensors, got a tensor on {device}")
            return True
        if not gpu or self.size == 1:
            return False
        if self._nccl_usable is None:  # agreed once: one rank alone on the torch transport hangs the rest
            from ._nccl import usable_on_every_rank

            self._nccl_usable = usable_on_every_rank(self, device)
        return self._nccl_usable

    def __repr__(self) -> str:
        return (f"qcoll.Group(rank={self.rank}, size={self.size}, node_size={self.node_size}, "
                f"num_nodes={self.num_nodes}, backend={self.backend!r})")


def _partition_groups(blocks: list, timeout: Optional[timedelta] = None) -> list:
    """ProcessGroups for disjoint blocks of global ranks: this rank's block gets its group
    (None for a block of one rank), every other block None. Collective over each block's
    members only (see _process_groups: qcoll names its groups, so no other rank of the
    world takes part). timeout: None is torch's default."""
    me = dist.get_rank()
    return [new_process_group(b, timeout) if (me in b and len(b) > 1) else None for b in blocks]


def _subgroup(pg, ranks, node_size: int, backend, timeout: Optional[timedelta] = None,
              family: Optional[_Family] = None, role: str = "group") -> Group:
    """A Group over `pg`, a ProcessGroup qcoll created (it is not cloned again); a
    singleton Group for one rank."""
    timeout = timeout if timeout is not None else pg_timeout(pg)
    if len(ranks) == 1:
        return Group(None, 1, backend, timeout=timeout, _singleton=True, _family=family, _role=role)
    return Group(pg, node_size, backend, timeout=timeout, _owned_pg=pg, _family=family, _role=role)


def pg_timeout(pg) -> timedelta:
    """The timeout of a ProcessGroup's backend (what its collectives wait at most)."""
    if pg is not None:
        for device in pg._device_types:
            try:
                return pg._get_backend(device).options._timeout
            except (AttributeError, RuntimeError):
                continue
    return dist.default_pg_timeout


def _host_id() -> str:
    # QCOLL_HOST_ID lets tests give ranks on one machine distinct "hosts".
    return os.environ.get("QCOLL_HOST_ID") or socket.gethostname()


def _local_world_size() -> Optional[int]:
    """torchrun's LOCAL_WORLD_SIZE (the world's ranks on this host), or None when unset."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        return None
    try:
        ranks = int(value)
    except ValueError:
        ranks = 0
    if ranks < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={value!r} is not a positive number of ranks")
    return ranks


def _node_size_error(size: int, node_size) -> ValueError:
    return ValueError(f"node_size must be a positive divisor of the group size {size}, got {node_size!r}")


def _asked_node_size(pg, size: int, node_size) -> Optional[int]:
    """This rank's node size: the one passed, else LOCAL_WORLD_SIZE for the default group
    (None: from the hosts); a value the group cannot take raises ValueError."""
    if node_size is not None:
        if node_size < 1 or size % node_size:
            raise _node_size_error(size, node_size)
        return node_size
    local = _local_world_size() if pg is dist.group.WORLD else None
    if local is not None and size % local:
        raise ValueError(f"LOCAL_WORLD_SIZE={local} does not divide the group size {size}; "
                         "pass node_size explicitly")
    return local


def _gather_hosts(pg, size: int, node_size) -> tuple:
    """(every member's host, the node size they agree on: None for "from the hosts").
    Each rank's node size (or why it has none) is exchanged before anyone raises, so that a
    value wrong or different on some ranks only raises on every rank, instead of leaving
    the others waiting in the sub-groups' creation."""
    try:
        asked, error = _asked_node_size(pg, size, node_size), None
    except ValueError as exc:
        asked, error = None, str(exc)
    infos = [None] * size
    dist.all_gather_object(infos, (_host_id(), asked, error), group=pg)
    errors = [f"rank {r}: {e}" for r, (_, _, e) in enumerate(infos) if e is not None]
    if errors:
        raise ValueError("qcoll.new_group: " + "; ".join(errors))
    if len({ns for _, ns, _ in infos}) > 1:
        per_rank = ", ".join(f"rank {r}: {ns}" for r, (_, ns, _) in enumerate(infos))
        raise ValueError(f"ranks passed different node_size values to qcoll.new_group (or have "
                         f"different LOCAL_WORLD_SIZE) ({per_rank})")
    return [host for host, _, _ in infos], infos[0][1]


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


def new_group(pg=None, *, node_size: Optional[int] = None, backend: Optional[str] = None,
              timeout: Optional[timedelta] = None) -> Group:
    """A qcoll.Group over ProcessGroup ``pg`` (None: the default group).

    node_size: ranks per node; defaults to LOCAL_WORLD_SIZE for the default group, and to
    the number of the group's ranks per host for any other ProcessGroup, or when
    LOCAL_WORLD_SIZE is unset (LOCAL_WORLD_SIZE describes the world, not a sub-group: an
    HSDP replicate group has one rank per host). An explicit value lets one host emulate
    several nodes. backend: "nccl" (qcoll's own NCCL communicators), "torch" (the
    ProcessGroup itself), or None (NCCL for CUDA tensors when every rank can load it,
    agreed at the first GPU call, else torch).
    timeout: how long any exchange may wait for a peer before the call raises (default:
    pg's own timeout); the Group's ProcessGroups are created with it.
    Collective: every rank of pg must call it, in the same order relative to other groups.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("qcoll.new_group needs torch.distributed: call init_process_group first")
    if backend not in (None, *BACKENDS):
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    pg = pg if pg is not None else dist.group.WORLD
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(f"pg must be a torch ProcessGroup or None (the world), got {type(pg).__name__}")
    if timeout is not None and not (isinstance(timeout, timedelta) and timeout > timedelta(0)):
        raise ValueError(f"timeout must be a positive datetime.timedelta or None, got {timeout!r}")
    size = dist.get_world_size(pg)
    if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, int)):
        # Not a number at all: the code's own error, the same on every rank, so raised before
        # any exchange; a number this group cannot take is exchanged first (_gather_hosts).
        raise _node_size_error(size, node_size)
    hosts, node_size = _gather_hosts(pg, size, node_size)
    if node_size is None:
        node_size = _node_size_from_hosts(hosts)
    _check_layout(hosts, node_size)
    # Ranks of the whole world on this host (the group's may be fewer: a sub-group).
    host_ranks = max(hosts.count(_host_id()), _local_world_size() or 1)
    group = Group(pg, node_size, backend, timeout=timeout if timeout is not None else pg_timeout(pg),
                  _host_ranks=host_ranks)
    if 1 < node_size < size:
        group._make_subgroups()
    return group


_default_groups = {}


def destroy() -> None:
    """Close every qcoll.Group of this process (see Group.close), in creation order (a
    sub-group kept after its parent was dropped too), forget
    the Groups made for plain ProcessGroups, and destroy the ProcessGroups of Groups dropped
    without close(). Collective, like Group.close."""
    groups = sorted(_live_groups, key=lambda g: g._created)  # before the cache lets any go
    _default_groups.clear()
    for g in groups:
        g.close()
    destroy_remaining()


def resolve_group(group, node_size: Optional[int] = None) -> Group:
    """A qcoll.Group for `group`: a Group as is; a ProcessGroup or None wrapped once per
    node_size (see new_group), in the one cache qcoll.destroy() clears; a cached Group
    that was closed is made again."""
    if isinstance(group, Group):
        return group
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a qcoll.Group, a torch ProcessGroup or None, got {type(group).__name__}")
    key = (group if group is not None else dist.group.WORLD, node_size)
    cached = _default_groups.get(key)
    if cached is None or cached._closed:  # closed (collectively) on every rank: made again on every rank
        cached = _default_groups[key] = new_group(key[0], node_size=node_size)
    return cached
