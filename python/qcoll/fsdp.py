"""qcoll inside PyTorch FSDP2: ZeRO++ on ``fully_shard``.

FSDP2 lets a module swap its all-gather and reduce-scatter for objects with the
signatures of ``torch.distributed.fsdp._fully_shard._fsdp_api.AllGather`` / ``ReduceScatter``
(torch >= 2.9). The three ZeRO++ techniques map onto it:

    qwZ  QuantizedAllGather        the parameter all-gather, block-quantized
    hpZ  reshard_after_forward=<n> FSDP2 keeps a secondary shard over n ranks after forward,
                                   so the backward all-gather runs inside the node
    qgZ  QuantizedReduceScatter    the gradient reduce-scatter, 2-hop and quantized

``use_qcoll(module)`` sets both comms on every FSDPModule of a tree.

HSDP (replicas of a sharded model): ``fully_shard`` on the shard dimension of a 2-D mesh and
``use_qcoll(module, replicate_group=mesh.get_group("replicate"), replicate_bits=8)``: the
replicas' all-reduce of the reduce-scattered gradients is qcoll.quantized_all_reduce,
through FSDP2's ``set_all_reduce_hook`` (QuantizedReplicaAllReduce).
``count_default_collectives(module)`` keeps FSDP2's own collectives (same numerics) but counts
their bytes in ``qcoll.stats()`` under qcoll's rule, to compare against.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.distributed as dist

from ._dtypes import DTYPE_CODES
from ._formats import format_name
from ._runtime.call import account
from .all_reduce import quantized_all_reduce
from .all_gather import quantized_allgather
from .reduce_scatter import quantized_reduce_scatter
from .error_feedback import ErrorFeedback
from .group import Group, pg_timeout, resolve_group
from .policy import (ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, AllGatherPolicy, AllReducePolicy,
                     ReduceScatterPolicy, check_stages, off_defaults, take_policy)

MIN_TORCH = "2.9"

try:  # FSDP2's comm extension points (torch >= 2.9)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    _API_ERROR = None if hasattr(FSDPModule, "set_custom_all_gather") else "no set_custom_all_gather"
except ImportError as e:  # pragma: no cover - exercised only on old torch
    FSDPModule = AllGather = ReduceScatter = DefaultAllGather = DefaultReduceScatter = object
    _API_ERROR = str(e)


def _require_api() -> None:
    if _API_ERROR is not None:
        raise RuntimeError(
            f"qcoll.fsdp needs PyTorch >= {MIN_TORCH} (FSDP2's set_custom_all_gather / "
            f"set_custom_reduce_scatter); this is torch {torch.__version__} ({_API_ERROR})")


# ---- the qcoll.Group behind a ProcessGroup FSDP2 hands over ------------------------------

def _check_node_size(node_size) -> Optional[int]:
    if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, int)
                                  or node_size < 1):
        raise ValueError(f"node_size must be a positive int (ranks per node) or None, got {node_size!r}")
    return node_size


def node_size_within(ranks: list, node_size: int) -> int:
    """Ranks per node among the global `ranks` of a group, when the world is cut into nodes
    of `node_size` consecutive ranks: FSDP2 also hands sub-groups (the post-forward group of
    reshard_after_forward=<int>, an HSDP shard or replicate group)."""
    nodes = [r // node_size for r in ranks]
    runs = []  # (node, length) of consecutive members on one node
    for n in nodes:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    lengths = {length for _, length in runs}
    if len({n for n, _ in runs}) != len(runs) or len(lengths) != 1:
        raise ValueError(f"node_size={node_size}: the group of global ranks {ranks} does not hold "
                         "the same number of consecutive ranks on each node")
    return lengths.pop()


def qcoll_group(pg, node_size: Optional[int] = None, *, share_same_ranks: bool = False) -> Group:
    """The qcoll.Group for a ProcessGroup FSDP2 passes, created once (collectively, on the
    first call every member makes). node_size: ranks per node of the whole world (None:
    LOCAL_WORLD_SIZE for the world, ranks per host for sub-groups; see qcoll.new_group).

    share_same_ranks (the all-gather's groups): ProcessGroups of the same ranks and timeout
    share one Group. FSDP2 makes a ProcessGroup for every module sharded with
    reshard_after_forward=<int>, and a Group apiece cost a worker thread, its own
    ProcessGroups and, on GPUs, NCCL communicators per module; FSDP2 issues their calls in
    one order on every rank, which a shared Group needs. The reduce-scatter's group stays
    its own: set_separate_reduce_scatter_group makes one of the shard group's ranks so that
    reduce-scatters overlap the all-gathers, which one Group (one worker, one stream) would
    run one after the other."""
    if not share_same_ranks:
        return _resolve(pg, node_size, pg)
    with _lock:
        first = _first_pgs_of.get(pg)
        if first is None or (first is not pg and not _alive(first)):
            same = (tuple(dist.get_process_group_ranks(pg)), pg_timeout(pg))
            first = _first_pgs.get(same)
            if first is None or not _alive(first):  # destroyed (collectively): this one is the first now
                first = _first_pgs[same] = pg
            _first_pgs_of[pg] = first
    return _resolve(pg, node_size, first)


def _resolve(pg, node_size: Optional[int], wrapped) -> Group:
    """resolve_group(wrapped) with `pg`'s ranks per node (`wrapped` has the same ranks)."""
    if node_size is None:
        return resolve_group(wrapped)
    key = (pg, node_size)
    if key not in _group_node_sizes:  # per group, not per call
        _group_node_sizes[key] = node_size_within(dist.get_process_group_ranks(pg), node_size)
    return resolve_group(wrapped, node_size=_group_node_sizes[key])


_lock = threading.Lock()
_group_node_sizes: dict = {}  # (ProcessGroup, node_size) -> its ranks per node
_first_pgs_of: dict = {}  # ProcessGroup -> the first one of its ranks and timeout
_first_pgs: dict = {}  # (global ranks, timeout) -> the first such ProcessGroup seen


def _alive(pg) -> bool:
    """Whether a ProcessGroup is still registered (dist.destroy_process_group forgets it)."""
    try:
        dist.get_process_group_ranks(pg)
        return True
    except (KeyError, ValueError, RuntimeError):
        return False


# ---- async handles FSDP2 waits on ----------------------------------------------------------

class _QcollWork(dist.Work):
    """FSDP2 waits only on torch.distributed Work objects; this one wraps qcoll's."""

    def __init__(self, work):
        super().__init__()
        self._work = work

    def wait(self, timeout=None) -> bool:
        return self._work.wait()

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _as_dist_work(work):
    return None if work is None else _QcollWork(work)


# ---- the comms -----------------------------------------------------------------------------

class _Allocating:
    """Plain allocation: FSDP2 frees these buffers itself; qcoll keeps its own workspace."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class QuantizedAllGather(_Allocating, AllGather):
    """FSDP2 parameter all-gather through qcoll.quantized_allgather (qwZ).

    bits: 8 / "int8", 4 / "int4" or "fp8_e4m3" quantizes the parameters on the wire (every
    rank, this one included,
    decodes the same bytes: the unsharded parameters are bit-identical across ranks);
    None: qcoll's unquantized path (the transport's own all-gather). FSDP2 hands uint8 when
    parameters of several dtypes share a group: those bytes are never quantized.
    policy: a qcoll.AllGatherPolicy instead of bits and group_size.
    """

    def __init__(self, bits=ALL_GATHER.bits, group_size: Optional[int] = None,
                 node_size: Optional[int] = None, *, policy: Optional[AllGatherPolicy] = None):
        _require_api()
        self.policy = take_policy(policy, AllGatherPolicy(bits, group_size), ALL_GATHER)
        self.node_size = _check_node_size(node_size)

    bits = property(lambda self: self.policy.bits)
    group_size = property(lambda self: self.policy.group_size)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 async_op: bool = False):
        kwargs = self.policy.kwargs()
        if input_tensor.dtype not in DTYPE_CODES:
            kwargs["bits"] = None  # bytes of mixed-dtype groups travel exactly
        work = quantized_allgather(output_tensor, input_tensor,
                                   qcoll_group(group, self.node_size, share_same_ranks=True),
                                   async_op=async_op, **kwargs)
        return _as_dist_work(work)

    def __repr__(self) -> str:
        return f"QuantizedAllGather(bits={self.bits}, group_size={self.group_size}, node_size={self.node_size})"


def _reduce_op(op, ranks: int):
    """(qcoll op, factor applied to the output) for the ReduceOp FSDP2 passes over `ranks`
    ranks: AVG, SUM, or PREMUL_SUM(f) (its gradient divide factor), computed as f * SUM in
    fp32."""
    kind = getattr(op, "op", op)  # a ReduceOp object (PREMUL_SUM) or a RedOpType
    if kind == dist.ReduceOp.AVG:
        return "avg", None
    if kind == dist.ReduceOp.SUM:
        return "sum", None
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = float(op.factor)
        return ("avg", None) if factor * ranks == 1.0 else ("sum", factor)
    raise ValueError(f"op must be ReduceOp.AVG, SUM or PREMUL_SUM for a gradient reduce-scatter, got {op!r}")


class QuantizedReduceScatter(_Allocating, ReduceScatter):
    """FSDP2 gradient reduce-scatter through qcoll.quantized_reduce_scatter (qgZ).

    A group that spans nodes takes the 2-hop path: intra_bits inside the node, fp32 reduce,
    inter_bits across nodes (each 8 / "int8", 4 / "int4", "fp8_e4m3" or None), pipelined
    over pipeline_stages slices. With both bits None the
    call is qcoll's baseline: the transport's own reduce-scatter.
    policy: a qcoll.ReduceScatterPolicy instead of the other keywords but node_size.
    """

    def __init__(self, intra_bits=REDUCE_SCATTER.intra_bits, inter_bits=REDUCE_SCATTER.inter_bits,
                 pipeline_stages: int = REDUCE_SCATTER.pipeline_stages, group_size: Optional[int] = None,
                 node_size: Optional[int] = None, *, policy: Optional[ReduceScatterPolicy] = None):
        _require_api()
        loose = ReduceScatterPolicy.gradients(intra_bits, inter_bits, group_size, pipeline_stages)
        self.policy = take_policy(policy, loose, REDUCE_SCATTER, keywords=dict(
            intra_bits=intra_bits, inter_bits=inter_bits, pipeline_stages=pipeline_stages,
            group_size=loose.group_size))  # normalized: None is the default block
        self.node_size = _check_node_size(node_size)

    intra_bits = property(lambda self: self.policy.intra_bits)
    inter_bits = property(lambda self: self.policy.inter_bits)
    pipeline_stages = property(lambda self: self.policy.pipeline_stages)
    group_size = property(lambda self: self.policy.group_size)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        g = qcoll_group(group, self.node_size)
        qop, factor = _reduce_op(op, g.size)
        work = quantized_reduce_scatter(
            output_tensor, input_tensor, g, op=qop, async_op=async_op and factor is None,
            **self.policy.kwargs())
        if factor is not None:
            output_tensor.mul_(factor)
        return _as_dist_work(work)

    def __repr__(self) -> str:
        return (f"QuantizedReduceScatter(intra_bits={self.intra_bits}, inter_bits={self.inter_bits}, "
                f"pipeline_stages={self.pipeline_stages}, group_size={self.group_size}, "
                f"node_size={self.node_size})")


class QuantizedReplicaAllReduce:
    """FSDP2 all-reduce hook (``FSDPModule.set_all_reduce_hook``) for HSDP: averages the
    reduce-scattered gradient shard over the replicas with qcoll.quantized_all_reduce (bits
    inside a node, `inter_bits or bits` across; an HSDP replicate group usually has one rank
    per node: one hop at `inter_bits or bits`). Every replica decodes the same bytes, so the
    replicas' shards stay bit-identical. error_feedback: an ErrorFeedback of this hook's own
    (one hook per FSDPModule: FSDP2 hands each module's shard, always the same size).

    The module must be sharded over the shard dimension only (``fully_shard(mesh=
    mesh["shard"])``): with a 2-D mesh FSDP2 all-reduces itself and calls the hook after.
    policy: a qcoll.AllReducePolicy instead of bits, inter_bits, pipeline_stages and
    group_size."""

    def __init__(self, replicate_group, bits=ALL_REDUCE.bits, inter_bits=ALL_REDUCE.inter_bits,
                 pipeline_stages: int = ALL_REDUCE.pipeline_stages, group_size: Optional[int] = None,
                 error_feedback: bool = True, node_size: Optional[int] = None, *,
                 policy: Optional[AllReducePolicy] = None):
        _require_api()
        if not isinstance(replicate_group, (Group, dist.ProcessGroup)):
            raise TypeError("replicate_group must be a qcoll.Group or a torch ProcessGroup (e.g. "
                            f"mesh.get_group('replicate')), got {type(replicate_group).__name__}")
        loose = AllReducePolicy(bits, inter_bits, group_size, pipeline_stages)
        self.policy = take_policy(policy, loose, ALL_REDUCE)
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be True or False, got {error_feedback!r}")
        self.replicate_group = replicate_group
        self.node_size = _check_node_size(node_size)
        self.error_feedback = ErrorFeedback() if error_feedback and not self.policy.unquantized else None

    bits = property(lambda self: self.policy.bits)
    inter_bits = property(lambda self: self.policy.inter_bits)
    pipeline_stages = property(lambda self: self.policy.pipeline_stages)
    group_size = property(lambda self: self.policy.group_size)

    def __call__(self, reduce_output: torch.Tensor) -> None:
        g = (self.replicate_group if isinstance(self.replicate_group, Group)
             else qcoll_group(self.replicate_group, self.node_size))
        quantized_all_reduce(reduce_output, g, op="avg", error_feedback=self.error_feedback,
                             **self.policy.kwargs())

    def __repr__(self) -> str:
        return (f"QuantizedReplicaAllReduce(bits={self.bits}, inter_bits={self.inter_bits}, "
                f"error_feedback={self.error_feedback is not None}, node_size={self.node_size})")


def _check_not_native_hsdp(m) -> None:
    for param_group in m._get_fsdp_state()._fsdp_param_groups:
        if getattr(param_group, "_is_hsdp", False):
            raise ValueError(
                "replicate_group: this module was sharded on a 2-D mesh, so FSDP2 all-reduces the "
                "replicas itself (and would call qcoll's hook after it). Shard over the shard "
                "dimension only (fully_shard(..., mesh=mesh['shard'])) and pass "
                "replicate_group=mesh.get_group('replicate')")


def _check_node_layout(modules: list, node_size: Optional[int], replicate_group=None) -> None:
    """node_size against every group FSDP2 will hand the comms: each shard group and hpZ's
    post-forward groups, of every rank (read from the meshes, which hold all of them, so
    every rank raises alike), and this rank's replicas' ProcessGroup; here, not at the
    first forward. A qcoll.Group as replicate_group has its own node size."""
    if node_size is None:
        return
    layouts = set()
    try:  # FSDP2's private state: on a torch that moved it, qcoll_group checks at the first call
        for m in modules:
            for param_group in m._get_fsdp_state()._fsdp_param_groups:
                for info in (param_group.mesh_info, param_group.post_forward_mesh_info):
                    dim = getattr(info, "shard_mesh_dim", None)
                    if dim is not None:  # one row per group along the shard dimension
                        ranks = info.mesh.mesh.movedim(dim, -1)
                        layouts.update(tuple(row) for row in ranks.reshape(-1, ranks.shape[-1]).tolist())
    except AttributeError:
        pass
    if isinstance(replicate_group, dist.ProcessGroup):
        layouts.add(tuple(dist.get_process_group_ranks(replicate_group)))
    for ranks in sorted(layouts):
        node_size_within(list(ranks), node_size)


def _fsdp_modules(module: torch.nn.Module) -> list:
    _require_api()
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    found = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not found:
        raise ValueError("module holds no FSDPModule: apply torch.distributed.fsdp.fully_shard first")
    return found


def use_qcoll(module: torch.nn.Module, *, weight_bits=ALL_GATHER.bits,
              grad_intra_bits=REDUCE_SCATTER.intra_bits, grad_inter_bits=REDUCE_SCATTER.inter_bits,
              grad_pipeline_stages: int = REDUCE_SCATTER.pipeline_stages, node_size: Optional[int] = None,
              replicate_group=None, replicate_bits=ALL_REDUCE.bits,
              replicate_inter_bits=ALL_REDUCE.inter_bits, replicate_error_feedback: bool = True,
              weight_policy: Optional[AllGatherPolicy] = None,
              grad_policy: Optional[ReduceScatterPolicy] = None,
              replicate_policy: Optional[AllReducePolicy] = None) -> torch.nn.Module:
    """Set qcoll's all-gather and reduce-scatter on every FSDPModule in `module`'s tree
    (FSDP2's setters act on one module only). Bits: 8 / "int8", 4 / "int4", "fp8_e4m3", or
    None, which leaves that collective unquantized.
    hpZ is FSDP2's own reshard_after_forward=<ranks per node>.

    replicate_group (HSDP): the ProcessGroup of this rank's replicas (a 2-D mesh's
    mesh.get_group("replicate"), the module sharded over mesh["shard"]); each FSDPModule then
    averages its gradient shard over it with qcoll.quantized_all_reduce at replicate_bits /
    replicate_inter_bits, with error feedback (QuantizedReplicaAllReduce); a replicate_*
    setting other than its default without replicate_group is a TypeError (it would act on
    nothing).
    weight_policy / grad_policy / replicate_policy: a qcoll.AllGatherPolicy /
    ReduceScatterPolicy / AllReducePolicy instead of the weight_* / grad_* / replicate_*
    bits (and grad_pipeline_stages, which the replicas' all-reduce also takes). Returns
    `module`."""
    for name, bits in (("weight_bits", weight_bits), ("grad_intra_bits", grad_intra_bits),
                       ("grad_inter_bits", grad_inter_bits), ("replicate_bits", replicate_bits),
                       ("replicate_inter_bits", replicate_inter_bits)):
        format_name(bits, name, allow_none=True)  # named as the caller wrote it, not as the policy's field
    check_stages(grad_pipeline_stages, "grad_pipeline_stages")
    if not isinstance(replicate_error_feedback, bool):
        raise TypeError(f"replicate_error_feedback must be True or False, got {replicate_error_feedback!r}")
    if replicate_group is None:
        # The replicas' settings act only through replicate_group: without it they would be
        # ignored, and FSDP2's own HSDP all-reduce (if any) would run unquantized.
        given = off_defaults(dict(bits=replicate_bits, inter_bits=replicate_inter_bits), ALL_REDUCE, "replicate_")
        given += [name for name, value, default in (("replicate_error_feedback", replicate_error_feedback, True),
                                                     ("replicate_policy", replicate_policy, None)) if value != default]
        if given:
            raise TypeError(f"{', '.join(given)}: act only with replicate_group= (the replicas' ProcessGroup "
                            "or qcoll.Group, e.g. mesh.get_group('replicate')); pass it, or leave "
                            f"{'them' if len(given) > 1 else 'it'} at the default")
    all_gather = QuantizedAllGather(node_size=node_size, policy=take_policy(
        weight_policy, AllGatherPolicy(weight_bits), ALL_GATHER, "weight_policy", "weight_"))
    loose = ReduceScatterPolicy.gradients(grad_intra_bits, grad_inter_bits, pipeline_stages=grad_pipeline_stages)
    reduce_scatter = QuantizedReduceScatter(node_size=node_size, policy=take_policy(
        grad_policy, loose, REDUCE_SCATTER, "grad_policy", "grad_", keywords=dict(
            intra_bits=grad_intra_bits, inter_bits=grad_inter_bits, pipeline_stages=grad_pipeline_stages)))
    hook_args = None
    if replicate_group is not None:
        # The replicas' all-reduce runs at the gradients' pipeline stages, unless replicate_policy
        # says otherwise (grad_pipeline_stages is the reduce-scatter's keyword, never a conflict here).
        loose = AllReducePolicy(replicate_bits, replicate_inter_bits, pipeline_stages=grad_pipeline_stages)
        hook_args = dict(replicate_group=replicate_group, error_feedback=replicate_error_feedback,
                         node_size=node_size, policy=take_policy(
                             replicate_policy, loose, ALL_REDUCE, "replicate_policy", "replicate_",
                             keywords=dict(bits=replicate_bits, inter_bits=replicate_inter_bits)))
        QuantizedReplicaAllReduce(**hook_args)  # the arguments are checked before any change
    modules = _fsdp_modules(module)
    if hook_args is not None:
        for m in modules:
            _check_not_native_hsdp(m)
    _check_node_layout(modules, node_size, replicate_group)
    for m in modules:
        m.set_custom_all_gather(all_gather)
        m.set_custom_reduce_scatter(reduce_scatter)
        if hook_args is not None:
            m.set_all_reduce_hook(QuantizedReplicaAllReduce(**hook_args))  # its own error feedback
    return module


# ---- FSDP2's default collectives, counted ----------------------------------------------------

class _Counted:
    """Wraps FSDP2's default comm: same call, its bytes counted in qcoll.stats()."""

    collective = ""

    def __init__(self, default, node_size: Optional[int] = None):
        _require_api()
        self.node_size = _check_node_size(node_size)
        self._default = default

    def allocate(self, size, *, dtype, device):
        return self._default.allocate(size, dtype=dtype, device=device)

    def _account(self, group, bytes_per_peer: int) -> None:
        account(qcoll_group(group, self.node_size), self.collective, bytes_per_peer)


class CountedAllGather(_Counted, AllGather):
    """FSDP2's default all-gather, unchanged; its bytes go to qcoll.stats()["allgather"]."""

    collective = "allgather"

    def __init__(self, node_size: Optional[int] = None):
        super().__init__(DefaultAllGather(), node_size)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        self._account(group, input_tensor.numel() * input_tensor.element_size())
        return self._default(output_tensor=output_tensor, input_tensor=input_tensor, group=group,
                             async_op=async_op)


class CountedReduceScatter(_Counted, ReduceScatter):
    """FSDP2's default reduce-scatter, unchanged; its bytes go to qcoll.stats()["reduce_scatter"]."""

    collective = "reduce_scatter"

    def __init__(self, node_size: Optional[int] = None):
        super().__init__(DefaultReduceScatter(), node_size)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self._account(group, output_tensor.numel() * output_tensor.element_size())
        return self._default(output_tensor=output_tensor, input_tensor=input_tensor, group=group,
                             op=op, async_op=async_op)


def count_default_collectives(module: torch.nn.Module, *, node_size: Optional[int] = None) -> torch.nn.Module:
    """Keep FSDP2's own collectives on every FSDPModule of `module` but count their bytes in
    qcoll.stats() under qcoll's rule (bytes this rank must deliver to each peer, split into
    peers on its node and on other nodes): the baseline for use_qcoll's figures."""
    all_gather, reduce_scatter = CountedAllGather(node_size), CountedReduceScatter(node_size)
    for m in _fsdp_modules(module):
        m.set_custom_all_gather(all_gather)
        m.set_custom_reduce_scatter(reduce_scatter)
    return module


__all__ = ["QuantizedAllGather", "QuantizedReduceScatter", "QuantizedReplicaAllReduce", "use_qcoll", "CountedAllGather",
           "CountedReduceScatter", "count_default_collectives", "qcoll_group", "MIN_TORCH"]
