"""Quantization policy: one frozen object per kind of call, one set of defaults.

    AllGatherPolicy       the weight all-gather (qwZ; delta_allgather's qWD)
    ReduceScatterPolicy   the gradient reduce-scatter (qgZ)
    AllReducePolicy       the gradient all-reduce (DDP, HSDP replicas)

Every entry point composes these: the functional API builds one from its keywords (the
field names ARE its keyword names), the FSDP2 comm objects and the DDP hook state take one
as ``policy=`` instead of their loose keywords, ZeroConfig derives ``weight_policy`` and
``grad_policy`` from its fields. A policy says how values are encoded; the layout of each
hop (which format crosses nodes, stages, slices) is the core's plan's to report.

Fields are validated here (ValueError / TypeError naming the field); ``group_size`` (the
quantization block) and ``pipeline_stages`` are normalized (None -> the default block,
None -> 1 stage); bit-width fields keep the caller's spelling (8 stays 8, not "int8").

Default decisions (entry points that documented different defaults before the policies):
- ReduceScatterPolicy.pipeline_stages = 2: what FSDP2's QuantizedReduceScatter, use_qcoll,
  ZeroConfig and the all-reduce document (the plan drops stages that would not pay, so 2
  costs nothing on small tensors). qcoll.quantized_reduce_scatter keeps its documented
  ``pipeline_stages=None`` (one stage): groups start at each slice, so a second stage can
  change the bits of a large call, and callers may rely on them.
- AllReducePolicy.inter_bits = None (`bits` across nodes too): what quantized_all_reduce,
  QuantizedReplicaAllReduce and use_qcoll(replicate_inter_bits=) document. The DDP hook
  state keeps its documented int4 across nodes (DDP_ALL_REDUCE).
- delta_allgather keeps its documented int4 (DELTA_ALL_GATHER): weight differences are
  small, SDP4Bit's qWD sends them at 4 bits.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import NamedTuple, Optional, Union

from ._formats import RAW_CODE, format_code, format_name
from .quantization import check_group_size, check_hadamard

Bits = Union[int, str, None]  # 8 / "int8", 4 / "int4", "fp8_e4m3" or None (unquantized)


def check_stages(pipeline_stages, name: str = "pipeline_stages", allow_none: bool = True) -> int:
    """A positive stage count; None (where allowed) is one stage."""
    stages = 1 if pipeline_stages is None and allow_none else pipeline_stages
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        allowed = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"{name} must be {allowed}, got {pipeline_stages!r}")
    return stages


def check_hierarchical(hierarchical) -> None:
    if not (hierarchical is None or isinstance(hierarchical, bool)):
        raise ValueError(f"hierarchical must be True, False or None, got {hierarchical!r}")


def _normalize(policy, name: str, value) -> None:
    object.__setattr__(policy, name, value)  # frozen: __post_init__ is the one writer


@functools.lru_cache(maxsize=256, typed=True)  # typed: 8 and 8.0, 1 and True stay apart
def _built(cls, *args):
    return cls(*args)


def cached(cls, *args) -> "_Policy":
    """cls(*args), one frozen object per distinct arguments: the functional API builds its
    call's policy on every call, and the checks in __post_init__ then run once per spelling.
    An argument that cannot be a key (a list, say) goes to the constructor, which names it."""
    try:
        return _built(cls, *args)
    except TypeError:
        return cls(*args)


class _Policy:
    def kwargs(self) -> dict:
        """The functional API's keyword arguments for this policy."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class AllGatherPolicy(_Policy):
    """bits: the code format on the wire (None: the transport's own all-gather, exact);
    group_size: elements per quantization block (None: qcoll.DEFAULT_GROUP_SIZE)."""

    bits: Bits = 8
    group_size: Optional[int] = None

    def __post_init__(self):
        format_code(self.bits, "bits")
        _normalize(self, "group_size", check_group_size(self.group_size))

    @functools.cached_property  # frozen: written once into the instance's __dict__
    def code(self) -> int:
        """The core's format code (RAW_CODE when unquantized)."""
        return format_code(self.bits, "bits")

    @property
    def unquantized(self) -> bool:
        return self.code == RAW_CODE


@dataclasses.dataclass(frozen=True)
class ReduceScatterPolicy(_Policy):
    """intra_bits: the intra-node hop's format (also the one hop of a one-node group);
    inter_bits: the inter-node hop's (also the one hop of a group spanning nodes);
    group_size: elements per quantization block; pipeline_stages: slices the 2-hop path
    overlaps (None: 1); hierarchical: None/True 2-hop when the group spans nodes of several
    ranks, False one hop; hadamard / hadamard_size: Hadamard-smoothed codes (SDP4Bit)."""

    intra_bits: Bits = 8
    inter_bits: Bits = 4
    group_size: Optional[int] = None
    pipeline_stages: Optional[int] = 2
    hierarchical: Optional[bool] = None
    hadamard: bool = False
    hadamard_size: Optional[int] = None

    def __post_init__(self):
        format_code(self.intra_bits, "intra_bits")
        format_code(self.inter_bits, "inter_bits")
        _normalize(self, "group_size", check_group_size(self.group_size))
        if self.hadamard_block and self.unquantized:
            raise ValueError("hadamard=True needs a quantized hop (intra_bits or inter_bits not None)")
        _normalize(self, "pipeline_stages", check_stages(self.pipeline_stages))
        check_hierarchical(self.hierarchical)

    @classmethod
    def transport(cls) -> "ReduceScatterPolicy":
        """Unquantized in one hop: the transport's own reduce-scatter (the baseline)."""
        return cls(intra_bits=None, inter_bits=None, pipeline_stages=1, hierarchical=False)

    @classmethod
    def gradients(cls, intra_bits: Bits = 8, inter_bits: Bits = 4, group_size: Optional[int] = None,
                  pipeline_stages: Optional[int] = 2, hadamard: bool = False) -> "ReduceScatterPolicy":
        """A plug-in's gradient reduce-scatter (FSDP2's, the ZeRO engine's) from its switches:
        both bits None is the baseline it replaces, the transport's own (transport())."""
        if intra_bits is None and inter_bits is None and not hadamard:
            return cls.transport()
        return cls(intra_bits, inter_bits, group_size, pipeline_stages, hadamard=hadamard)

    @functools.cached_property
    def intra_code(self) -> int:
        return format_code(self.intra_bits, "intra_bits")

    @functools.cached_property
    def inter_code(self) -> int:
        return format_code(self.inter_bits, "inter_bits")

    @property
    def unquantized(self) -> bool:
        return self.intra_code == RAW_CODE and self.inter_code == RAW_CODE

    @property
    def hadamard_block(self) -> int:
        """The Hadamard block the kernels take (0: off)."""
        return check_hadamard(self.hadamard, self.hadamard_size, self.group_size)


@dataclasses.dataclass(frozen=True)
class AllReducePolicy(_Policy):
    """bits: the format inside a node; inter_bits: across nodes (None: bits), both for the
    reduce-scatter half and the all-gather of the reduced shards; group_size,
    pipeline_stages, hierarchical: as ReduceScatterPolicy's (hierarchical True by default)."""

    bits: Bits = 8
    inter_bits: Bits = None
    group_size: Optional[int] = None
    pipeline_stages: Optional[int] = 2
    hierarchical: Optional[bool] = True

    def __post_init__(self):
        format_code(self.bits, "bits")
        format_code(self.inter_bits, "inter_bits")
        _normalize(self, "group_size", check_group_size(self.group_size))
        _normalize(self, "pipeline_stages", check_stages(self.pipeline_stages))
        check_hierarchical(self.hierarchical)

    @functools.cached_property
    def unquantized(self) -> bool:
        return self.reduce_scatter().unquantized

    @property
    def cross_bits(self):
        """The format across nodes: inter_bits, or bits when inter_bits is None."""
        return self.bits if self.inter_bits is None else self.inter_bits

    def raw_exchange(self, itemsize: int) -> bool:
        """Whether the reduce-scatter half, when flat, exchanges the raw inputs and sums them
        in fp32 (the plan's raw_exchange) rather than being the transport's own: unquantized
        bf16/fp16, so that the all-reduce rounds once. (A host call on the "exchange" path of
        unquantized_host_all_reduce exchanges the raw inputs whatever its dtype: see route.)"""
        return self.unquantized and itemsize != 4

    def route(self, itemsize: int, numel: int, ranks: int, host_transport: bool) -> "AllReduceRoute":
        """The way a call of `numel` elements of `itemsize` bytes over `ranks` ranks runs,
        for all_reduce.py and the cost model alike. host_transport: the call's values are
        host tensors and the group's transport has its own all-reduce (gloo). Then a
        bits=None call takes a path of unquantized_host_all_reduce; every other call runs
        the two halves as configured."""
        if self.unquantized and host_transport:
            if unquantized_host_all_reduce(itemsize, numel, ranks) == "transport":
                return AllReduceRoute("transport", self.hierarchical, False)
            return AllReduceRoute("exchange", False, True)  # the raw inputs straight to their owner, fp32 too
        return AllReduceRoute("halves", self.hierarchical, self.raw_exchange(itemsize))

    def reduce_scatter(self) -> ReduceScatterPolicy:
        """The policy of the reduce-scatter half (the all-gather half crosses nodes in the
        format its plan crosses them with)."""
        return cached(ReduceScatterPolicy, self.bits, self.cross_bits, self.group_size,
                      self.pipeline_stages, self.hierarchical)


class AllReduceRoute(NamedTuple):
    """AllReducePolicy.route's answer. path: "transport" (the transport's own all-reduce,
    of fp32 copies for bf16/fp16), "exchange" (the flat reduce-scatter of the raw inputs,
    then the all-gather) or "halves" (the reduce-scatter and all-gather halves as
    configured); hierarchical and raw_exchange: what the reduce-scatter half is planned
    with on the last two."""

    path: str
    hierarchical: Optional[bool]
    raw_exchange: bool


# A bits=None all-reduce of host tensors over a transport with its own all-reduce (gloo)
# sums in fp32 and rounds once on one of two paths:
# - "exchange": the flat reduce-scatter that sends the raw inputs to their owner (the plan's
#   raw_exchange: an all-to-all, the bytes of a ring's reduce half), summed there in fp32,
#   then the all-gather of the rounded shards: two rounds of exchanges whatever the number
#   of ranks;
# - "transport": the transport's own all-reduce (gloo's ring: 2 (ranks - 1) rounds), of the
#   tensor itself for fp32, of fp32 copies (twice the bytes) for bf16/fp16.
# From EXCHANGE_MIN_RANKS ranks the exchange, except fp32 tensors of more than
# FP32_EXCHANGE_MAX_BYTES (a ring's rounds then cost less than the exchange's extra passes
# over the values); on 2-3 ranks (where it measured no faster) the transport, except
# bf16/fp16 from UNQUANTIZED_EXCHANGE_MIN_BYTES (half the bytes of the fp32 copies). Against
# torch's same call, 2-core VM, one thread per rank
# (bench/results/probe-host-all-reduce-paths-cpu.txt): fp32 at 1 KB-256 KB on nodes of 2
# ranks the exchange 0.81-0.91x on 4 ranks, 0.53-0.69x on 6, 0.51-0.57x on 8, the
# transport 0.92-1.12x (4 ranks on one node or one per node: 0.83-0.99x against
# 0.89-1.08x); at 1 MB as close as the runs' spread on 4 ranks, ahead on 6 and 8; from 2 MB
# the ring ahead on 4 and 6 (fp32 at 4 MB 1.09-1.49x against 1.03-1.04x). bf16 below 1 MB 0.79-0.98x on 4 ranks,
# 0.54-0.68x on 6, against 0.92-1.13x; on 3 ranks the exchange the slower (fp32 1.0-1.78x,
# bf16 0.88-1.40x, against 0.82-1.23x). At 4-64 MB bf16 the exchange 0.9-1.4x, the fp32
# copies' all-reduce 1.7-2.2x (bench/results/probe-bf16-all-reduce-cpu.txt).
EXCHANGE_MIN_RANKS = 4
FP32_EXCHANGE_MAX_BYTES = 1 << 20
UNQUANTIZED_EXCHANGE_MIN_BYTES = 1 << 20

HOST_ALL_REDUCE_PATHS = ("transport", "exchange")
_forced_host_path: contextvars.ContextVar = contextvars.ContextVar("qcoll_host_all_reduce_path", default=None)


def unquantized_host_all_reduce(itemsize: int, numel: int, ranks: int) -> str:
    """The path of a bits=None all-reduce of host tensors over `ranks` ranks: "transport" or
    "exchange" (above)."""
    forced = _forced_host_path.get()
    if forced is not None:
        return forced
    nbytes = numel * itemsize
    if ranks >= EXCHANGE_MIN_RANKS:
        return "transport" if itemsize == 4 and nbytes > FP32_EXCHANGE_MAX_BYTES else "exchange"
    return "exchange" if itemsize != 4 and nbytes >= UNQUANTIZED_EXCHANGE_MIN_BYTES else "transport"


@contextlib.contextmanager
def host_all_reduce_path(path: Optional[str]):
    """Within it, in this context (a context variable: threads started inside do not see
    it), every bits=None all-reduce of host values takes `path` whatever its size, dtype and
    number of ranks, and the cost model prices that path (None: by the rule above). For the cost
    probe, which times both paths at every size it calibrates so that a prediction near
    the switch runs through points of its own path, and for tests: policy="auto" keeps
    its decisions by call description, not by this path. A call with no such paths (a
    quantized one, a GPU tensor's, a one-rank group's: no host transport) is not forced."""
    if path is not None and path not in HOST_ALL_REDUCE_PATHS:
        raise ValueError(f"path must be one of {HOST_ALL_REDUCE_PATHS} or None, got {path!r}")
    token = _forced_host_path.set(path)
    try:
        yield
    finally:
        _forced_host_path.reset(token)


# An all-reduce of host tensors whose numel is not a multiple of the group size either pads
# (the tensor copied into a padded buffer and back: two passes over it) or, from this size,
# reduces the prefix that is in place and its last numel % size elements apart: every rank's
# fp32 copies all-gathered and summed in rank order on every rank (unquantized; the same
# fp32 sum on every rank, rounded once), one exchange round more. On 6 ranks (3 x 2, 2
# cores) the quantized bf16 all-reduce took, padded / apart, 6.8 / 9.6 ms at 256 KB,
# 9.0 / 10.7 at 1 MB, 24.9 / 22.8 at 4 MB, 91 / 77 at 16 MB and 322 / 260 at 64 MB (a
# multiple of 6 elements: 252); the bits=None one 8.6 / 10.1 at 1 MB, 11.6 / 12.1 at 2 MB,
# 19.9 / 17.6 at 4 MB, 324 / 258 at 64 MB (bench/results/probe-all-reduce-tail-cpu.txt).
# (On a GPU the copies cost microseconds and an exchange more: it always pads.)
HOST_TAIL_APART_MIN_BYTES = 4 << 20


def host_all_reduce_tail_apart(nbytes: int) -> bool:
    """Whether an all-reduce of `nbytes` of host tensors reduces its last numel % size
    elements apart (above) rather than padding."""
    return nbytes >= HOST_TAIL_APART_MIN_BYTES


def off_defaults(keywords: dict, defaults: _Policy, prefix: str = "") -> list:
    """prefix + field of each {field: value as passed} that differs from `defaults`' field;
    bits compare by their canonical name (8 and "int8" are one setting)."""
    def canonical(field: str, value):
        return format_name(value, prefix + field, allow_none=True) if field.endswith("bits") else value
    return [prefix + field for field, value in keywords.items()
            if canonical(field, value) != canonical(field, getattr(defaults, field))]


def take_policy(policy, loose: _Policy, defaults: _Policy, name: str = "policy",
                prefix: str = "", *, keywords: Optional[dict] = None) -> _Policy:
    """A plug-in's policy: `policy` as given, else `loose` (built from its loose keywords,
    spelled prefix + field). Both (a loose keyword off its default, `defaults`) is an error.
    keywords: {field: value as passed} of the loose keywords the caller takes, where `loose`
    has fields they do not set (ReduceScatterPolicy.gradients' transport() with both bits
    None; stages taken from another keyword); None: every field of `loose`. Either way
    against `defaults`' fields.
    policy="auto": `loose` wrapped in qcoll.auto.Auto (the cost model chooses per call); an
    Auto around this kind of policy (what an earlier take_policy made of "auto") as it is."""
    from .auto import Auto

    if policy is None:
        return loose
    if isinstance(policy, str) and policy == "auto":
        return Auto(loose)
    cls = type(defaults)
    # An Auto around this kind of policy: what an earlier take_policy made of "auto" (use_qcoll
    # takes its keywords, then hands the result to the comm objects, which take it again).
    inner = policy.base if isinstance(policy, Auto) else policy
    if not isinstance(inner, cls):
        raise TypeError(f"{name} must be a qcoll.{cls.__name__}, 'auto' or None, got {type(policy).__name__}")
    if keywords is None:
        keywords = {f.name: getattr(loose, f.name) for f in dataclasses.fields(cls)}
    changed = off_defaults(keywords, defaults, prefix)
    if changed:
        raise TypeError(f"pass either {name}= or {', '.join(changed)}, not both")
    return policy


ALL_GATHER = AllGatherPolicy()
REDUCE_SCATTER = ReduceScatterPolicy()
ALL_REDUCE = AllReducePolicy()
DELTA_ALL_GATHER = AllGatherPolicy(bits=4)  # delta_allgather's documented default
DDP_ALL_REDUCE = AllReducePolicy(inter_bits=4)  # the DDP hook state's documented default

__all__ = ["AllGatherPolicy", "ReduceScatterPolicy", "AllReducePolicy"]
