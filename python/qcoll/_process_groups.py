"""The torch ProcessGroups qcoll communicates over, created and named by qcoll.

A ProcessGroup's name is its key prefix in the job's store, where its backend's rendezvous
(gloo: each rank's listening addresses) stays after the group is destroyed. torch 2.13
names a group made with new_group(..., use_local_synchronization=True) by a hash of its
ranks and of the number of groups this process has alive: a group re-created after
qcoll.destroy() gets its predecessor's name, reads the stale addresses and fails to connect
(or meets another group's listener). Groups made by every rank of the world get a
per-process counter instead, which never repeats, but that needs the whole world to take
part, which a strict sub-group (an HSDP replicate group, a sub-ProcessGroup) cannot ask.

So qcoll names its groups itself: ``qcoll-<hash of the ranks>-<n>``, n counting the groups
this process has created over exactly those ranks in the current world. A group's creation
is collective over its members, so every member counts the same n without any exchange,
non-members take no part, and no name is used twice while the world's store lives. Like
torch's own counter, the count restarts with a new default group (a re-initialized world
comes with a fresh store, and a replaced process must agree with the survivors).

torch offers no public way to name a group (new_group's group_desc is only a label and
pg_tag only deduplicates), so this goes through the helper behind new_group
(_new_process_group_helper), then records the rank map as new_group does.

Members only, so never split: where the world was initialized with a device_id, the helper
would derive an NCCL backend by ncclCommSplit of the world's communicator, which every rank
of the world must join (torch's use_local_synchronization path hangs there, PR #129965).
qcoll's groups are created with the world's device binding hidden for the call, so their
NCCL communicators are initialized by their members alone."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import threading
import weakref
from datetime import timedelta
from typing import Optional

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_PREFIX = "qcoll-"
_lock = threading.Lock()
_world_ref = None  # weakref to the default group the counts belong to
_counts: dict = {}  # tuple(ranks) -> groups created over them in that world


def _helper_fits() -> bool:
    """Whether this torch's _new_process_group_helper takes what new_process_group passes
    (checked once: a private function may change with a torch release)."""
    helper = getattr(c10d, "_new_process_group_helper", None)
    if helper is None or not all(hasattr(c10d, a) for a in ("_world", "_get_default_timeout")):
        return False
    params = inspect.signature(helper).parameters
    return list(params)[:6] == ["group_size", "group_rank", "global_ranks_in_group", "backend",
                                "store", "group_name"] and {"timeout", "group_desc"} <= set(params)


_NAMED = _helper_fits()


def _next_name(ranks: list) -> str:
    global _world_ref
    world = c10d._get_default_group()
    with _lock:
        if _world_ref is None or _world_ref() is not world:
            _world_ref = weakref.ref(world)
            _counts.clear()
        key = tuple(ranks)
        n = _counts.get(key, 0)
        _counts[key] = n + 1
    digest = hashlib.sha1(",".join(map(str, ranks)).encode(), usedforsecurity=False).hexdigest()
    return f"{_PREFIX}{digest[:20]}-{n}"


def new_process_group(ranks: list, timeout: Optional[timedelta] = None):
    """A ProcessGroup over the global `ranks` (this rank and at least one other), group rank
    i being ranks[i], with `timeout` (None: torch's default for the world's backend).
    Collective over `ranks` only: every member calls it, in the same order relative to its
    other groups over the same ranks; no other rank does."""
    me = dist.get_rank()
    if me not in ranks or len(ranks) < 2:
        raise ValueError(f"ranks must hold this rank ({me}) and at least one other, got {ranks}")
    if not _NAMED:  # another torch: its own naming (groups then cannot be re-created after destroy())
        return dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
    world = c10d._get_default_group()
    backend_name, store = c10d._world.pg_map[world]
    backend = dist.Backend(backend_name)
    timeout = timeout if timeout is not None else c10d._get_default_timeout(backend)
    name = _next_name(ranks)
    with _members_only(world):
        pg, _ = c10d._new_process_group_helper(len(ranks), ranks.index(me), ranks, backend, store,
                                               name, timeout=timeout, group_desc=f"qcoll {ranks}")
    c10d._world.pg_group_ranks[pg] = {g: r for r, g in enumerate(ranks)}
    return pg


@contextlib.contextmanager
def _members_only(world):
    """The world's bound device hidden, so the helper takes no split source (see above)."""
    bound = world.bound_device_id
    if bound is None:
        yield
        return
    with _lock:
        world.bound_device_id = None
        try:
            yield
        finally:
            world.bound_device_id = bound


def destroy_remaining() -> None:
    """Destroy every ProcessGroup qcoll created that is still registered, in creation order:
    those of Groups dropped without close() (their finalizer stops only the worker thread)."""
    for pg, name in list(c10d._world.pg_names.items()):
        if name.startswith(_PREFIX):
            dist.destroy_process_group(pg)
