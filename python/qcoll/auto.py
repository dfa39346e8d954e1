"""policy="auto": the group's cost model chooses each call's policy.

A call made with policy="auto" (qcoll.quantized_allgather, quantized_reduce_scatter,
quantized_all_reduce, delta_allgather; the FSDP2 comm objects, the DDP hook state and
ZeroConfig through their policy=) is run with the candidate its qcoll.cost_model predicts
fastest (unless that is the configured call by a small margin: below), from:
- the uncompressed call (the input dtype on the wire; exact, or rounded once);
- the quantized call the caller configured (its formats, group size, Hadamard), on each
  path the configuration leaves open: flat or 2-hop (reduce-scatter with hierarchical=None,
  all-reduce unless hierarchical=False) and 1 or the configured pipeline stages.
Auto never quantizes below what the caller asked for: every candidate's hops use the
caller's formats or none; the flat path encodes once at the cross-node format, which the
2-hop path applies to every element as well (after an intra-node encode of its own).
The configured call (its own path and stages) is kept unless it is predicted more than
KEEP_MARGIN slower than the fastest candidate: the model's predictions spread by about that
much from run to run, so a smaller predicted gain is no evidence, and switching on it
flips between near-equal calls and loses as often as it wins. The probe calibrates the
model on whole calls of every kind weighed here (uncompressed, flat, 2-hop: qcoll.cost).

The choice depends only on the call's description (kind, sizes, dtype, the configured
policy), the group's shape and its cost model, which every rank holds identically
(cost_model agrees it across ranks), so every rank chooses the same. The first time a
rank meets a description, the ranks compare it (before any other exchange) and raise
ValueError on every rank when they differ. qcoll.stats()["auto"] counts calls per choice;
QCOLL_LOG=policy prints each distinct decision once, with the predicted times.
Error feedback residuals are kept pending while a call runs uncompressed (an exact call
delivers none of them) and compensated at the next quantized call.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
import weakref

import torch
import torch.distributed as dist

from . import _log
from ._runtime import call
from .cost import model_for_calls
from .group import resolve_group
from .policy import AllGatherPolicy, AllReducePolicy, ReduceScatterPolicy

AUTO = "auto"
UNCOMPRESSED = "uncompressed"
# Another candidate replaces the configured call only when the configured one is predicted
# more than this fraction slower than it (the auto suite's predictions spread about 10-20%
# from the measured times).
KEEP_MARGIN = 0.10
_COUNTS: dict = collections.defaultdict(collections.Counter)  # kind -> Counter(choice label)
_DECISIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Group -> {description: choice}
_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Auto:
    """policy="auto" around the configured policy (`base`): the plug-ins hold one, the
    functional API receives base's keywords plus policy="auto"; base's fields read through."""

    base: object

    def kwargs(self) -> dict:
        return dict(self.base.kwargs(), policy=AUTO)

    def __getattr__(self, name):
        if name == "base":  # not yet set (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)


def check_policy(policy, name: str = "policy") -> None:
    """The functional API's policy= argument: None (the configured call) or "auto"."""
    if policy is not None and policy != AUTO:
        raise ValueError(f"{name} must be None or 'auto', got {policy!r}")


def counts() -> dict:
    """{kind: {choice: calls}} since the last reset (qcoll.stats()["auto"])."""
    with _LOCK:
        return {kind: dict(c) for kind, c in _COUNTS.items()}


def reset_counts() -> None:
    with _LOCK:
        _COUNTS.clear()


# ---- entry points: check, choose, call back with the chosen policy's keywords --------------
def all_gather(call, output, input, group, policy, *, bits, group_size, async_op):
    from ._runtime.args import check_pair as _check_pair, ranks_in as _ranks_in

    check_policy(policy)
    configured = AllGatherPolicy(bits=bits, group_size=group_size)
    size = _ranks_in(group)
    n = input.numel() if isinstance(input, torch.Tensor) else 0
    _check_pair(output, input, size * n, n, "quantized_allgather", raw_bytes_ok=configured.bits is None)
    g = resolve_group(group)
    chosen = configured
    if configured.bits is not None and g.size > 1:
        chosen = _decide("allgather", g, input.device, n, input.dtype, configured,
                         lambda: [dataclasses.replace(configured, bits=None), configured])
    return call(output, input, g, async_op=async_op, **chosen.kwargs())


def delta_all_gather(call, full, shard, group, policy, *, bits, group_size, async_op):
    from ._runtime.args import check_pair as _check_pair, ranks_in as _ranks_in

    check_policy(policy)
    configured = AllGatherPolicy(bits=bits, group_size=group_size)
    size = _ranks_in(group)
    n = shard.numel() if isinstance(shard, torch.Tensor) else 0
    _check_pair(full, shard, size * n, n, "delta_allgather", names=("full", "shard"))
    g = resolve_group(group)
    chosen = configured
    if configured.bits is not None and g.size > 1:  # the new values themselves, or their differences
        chosen = _decide("delta_allgather", g, shard.device, n, shard.dtype, configured,
                         lambda: [dataclasses.replace(configured, bits=None), configured])
    return call(full, shard, g, async_op=async_op, **chosen.kwargs())


def reduce_scatter(call, output, input, group, policy, *, async_op, error_feedback, op, **fields):
    from ._runtime.args import check_op as _check_op, check_pair as _check_pair, ranks_in as _ranks_in

    check_policy(policy)
    configured = ReduceScatterPolicy(**fields)
    size = _ranks_in(group)
    n = output.numel() if isinstance(output, torch.Tensor) else 0
    _check_pair(output, input, n, size * n, "quantized_reduce_scatter")
    _check_op(op)
    g = resolve_group(group)
    chosen = configured
    if not configured.unquantized and g.size > 1:
        def candidates():
            raw = dataclasses.replace(configured, intra_bits=None, inter_bits=None, pipeline_stages=1,
                                      hierarchical=False, hadamard=False, hadamard_size=None)
            paths = [configured.hierarchical] if configured.hierarchical is not None else [None, False]
            return [raw] + [dataclasses.replace(configured, hierarchical=h, pipeline_stages=s)
                            for h in paths for s in _stages(configured.pipeline_stages)]
        chosen = _decide("reduce_scatter", g, input.device, n, input.dtype, configured, candidates)
    return call(output, input, g, op=op, error_feedback=error_feedback, async_op=async_op, **chosen.kwargs())


def all_reduce(call, tensor, group, policy, *, op, error_feedback, async_op, **fields):
    from ._runtime.args import check_in_place
    from ._runtime.args import check_op as _check_op, ranks_in as _ranks_in

    check_policy(policy)
    configured = AllReducePolicy(**fields)
    _ranks_in(group)
    check_in_place(tensor, "quantized_all_reduce")
    _check_op(op)
    g = resolve_group(group)
    chosen = configured
    if not (configured.bits is None and configured.inter_bits is None) and g.size > 1:
        def candidates():
            raw = dataclasses.replace(configured, bits=None, inter_bits=None, pipeline_stages=1)
            paths = [False] if configured.hierarchical is False else [True, False]
            return [raw] + [dataclasses.replace(configured, hierarchical=h, pipeline_stages=s)
                            for h in paths for s in _stages(configured.pipeline_stages)]
        chosen = _decide("all_reduce", g, tensor.device, tensor.numel(), tensor.dtype, configured, candidates)
    return call(tensor, g, op=op, error_feedback=error_feedback, async_op=async_op, **chosen.kwargs())


def _stages(configured: int) -> list:
    return sorted({1, configured})


# ---- the decision -----------------------------------------------------------------------
_MODEL_KIND = {"allgather": "allgather", "delta_allgather": "allgather",
               "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce"}


def label(kind: str, policy, model) -> str:
    """A choice's name in stats() and the log: "uncompressed", or "quantized" with the path
    (flat / 2-hop) and the pipeline stages requested, for a reduce-scatter or all-reduce
    (the core's plan runs fewer where slices would be under MIN_PIPELINE_STAGE_BYTES: then
    the candidates of 1 and 2 stages are one call, predicted alike, and the first is taken)."""
    name = model.kind(_MODEL_KIND[kind], policy)
    stages = getattr(policy, "pipeline_stages", 1)
    return name if name in (UNCOMPRESSED, "quantized") or stages == 1 else f"{name}, {stages} stages"


def choose(times: list, configured: int) -> int:
    """The index of the candidate to run: the fastest predicted (the first of equals), or
    the configured one (index `configured`; None: none of them) while it is predicted at
    most KEEP_MARGIN slower than the fastest."""
    best = min(range(len(times)), key=lambda i: (times[i], i))
    if configured is not None and times[configured] <= times[best] * (1 + KEEP_MARGIN):
        return configured
    return best


def _decide(kind: str, g, device, numel: int, dtype, configured, make_candidates):
    """The candidate to run by the group's cost model (choose: the fastest, unless the
    configured call is within KEEP_MARGIN of it). The first time a description is met the
    ranks compare it, before any other exchange; the choice is then a function of agreed
    inputs only, kept for the later calls. Counted per choice. make_candidates() builds the
    candidate policies, only when a description is new (tens of us a call otherwise)."""
    description = (kind, numel, str(dtype), device.type, repr(configured))
    decisions = _DECISIONS.setdefault(g, {})
    if description not in decisions:
        _agree(g, description, device)
        candidates = make_candidates()
        model = model_for_calls(g, device)
        times = [model.predict(_MODEL_KIND[kind], numel, dtype, c).seconds for c in candidates]
        options = [(label(kind, c, model), t) for c, t in zip(candidates, times)]
        mine = label(kind, configured, model)  # the configured call's own path and stages
        index = next((i for i, (name, _) in enumerate(options) if name == mine), None)
        if index is None:  # the candidates always hold it: a change broke that
            raise AssertionError(f"qcoll auto: the configured call {mine!r} is not among the candidates "
                                 f"{[name for name, _ in options]}")
        best = choose(times, index)
        decisions[description] = (candidates[best], options[best][0], options)
        _explain(kind, g, numel, dtype, configured, options, best)
    chosen, name, _ = decisions[description]
    with _LOCK:
        _COUNTS[kind][name] += 1
    return chosen


def _agree(g, description: tuple, device) -> None:
    """ValueError on every rank unless every rank describes the call the same way. The
    digests travel in a qcoll all-gather of 32 bytes, whose call check also meets a rank
    that made another call instead (one without policy="auto": every rank raises there)."""
    if g.size == 1:
        return
    from .all_gather import quantized_allgather

    digest = hashlib.sha256(repr(description).encode()).digest()
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device)
    every = torch.empty(g.size * len(digest), dtype=torch.uint8, device=device)
    quantized_allgather(every, mine, g, bits=None)
    if all(bytes(every[r * len(digest):(r + 1) * len(digest)].cpu().tolist()) == digest for r in range(g.size)):
        return
    views = [None] * g.size  # every rank is here: name what each one described
    call.drain(g)
    dist.all_gather_object(views, description, group=g.pg)
    lines = "\n".join(f"  rank {r}: {v}" for r, v in enumerate(views))
    raise ValueError(f"qcoll policy='auto': ranks disagree on the call:\n{lines}")


def _explain(kind, g, numel, dtype, configured, options, best) -> None:
    if g.rank != 0 or not _log.enabled("policy"):
        return
    predicted = "; ".join(f"{name} {t * 1e3:.2f} ms" for name, t in options)
    _log.emit(f"qcoll policy auto: {kind} of {numel} {dtype} elements on {g.size} ranks "
              f"({g.node_size} per node), configured {configured}: chose {options[best][0]} "
              f"(predicted {predicted})")


def decisions(group=None) -> dict:
    """The group's decisions so far: {(kind, numel, dtype, device, configured policy):
    {"choice": name, "predicted_s": {candidate name: seconds}}}."""
    g = resolve_group(group)
    return {d: {"choice": name, "predicted_s": dict(options)}
            for d, (_, name, options) in _DECISIONS.get(g, {}).items()}
