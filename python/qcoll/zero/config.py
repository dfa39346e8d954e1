"""ZeroConfig: which ZeRO++ techniques the engine uses, and its mixed-precision policy."""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn as nn

from .._formats import format_name
from ..auto import Auto, check_policy
from ..policy import ALL_GATHER, REDUCE_SCATTER, AllGatherPolicy, ReduceScatterPolicy, check_stages
from ..quantization import check_group_size

_COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """Every technique can be switched on and off independently; one that is off does what
    plain ZeRO-3 does (the transport's own collective in the compute dtype).

    stage: 3 (ZeRO-3: weights sharded, gathered per unit in forward and backward) or 2
        (the sharded-optimizer stage of SDP4Bit: compute-dtype weights whole on every rank,
        gradients reduce-scattered into the fp32 shards, and after each step the updated
        shards all-gathered into every rank's weights). A switch that does not apply to the
        stage is an error (hpz, hpz_group_size with stage 2; qwd with stage 3).

    qwz: forward all-gather of weights block-quantized at ``weight_bits``. Every bits field
        takes 8 / "int8", 4 / "int4" or "fp8_e4m3" (the qwz / qgz switches turn them off).
    qwd: stage 2 only: all-gather the new weights as the quantized difference from the
        last step's (SDP4Bit's qWD, qcoll.delta_allgather at ``weight_bits``) instead of
        the weights themselves; needs qwz=True.
    hpz: after forward, keep a secondary shard of the gathered weights partitioned over
        ``hpz_group_size`` ranks of the node (default: the node size); the backward
        all-gather runs inside that group (no cross-node bytes). None (the default): on for
        stage 3, off for stage 2.
    qgz: gradient reduce-scatter quantized (``grad_intra_bits`` inside the node,
        ``grad_inter_bits`` across), 2-hop and pipelined over ``grad_pipeline_stages``.
    grad_hadamard: quantize the gradients after a Walsh-Hadamard transform of each group
        (SDP4Bit's TLq-HS, ``hadamard=True`` on the reduce-scatter); needs qgz=True.
    compute_dtype: dtype of the gathered weights, activations and gradients; fp32 master
        weights, optimizer state and gradient shards always.
    loss_scale: fp16 only. None: dynamic (start ``initial_loss_scale``, halve on overflow,
        double after ``loss_scale_window`` good steps); a float: static.
    max_grad_norm: clip the global gradient norm (None: no clipping).
    prefetch: issue the next unit's all-gather while the current one computes.
    overlap_publish: stage 2 only: step() returns once the new weights' all-gathers are
        issued, and each unit waits for its own just before its next forward uses it, so
        they overlap the step's return and the forward of the units before it. Until then
        the module's parameters are being written: read them only after
        ``engine.wait_weights()`` (the engine's own checkpoints and steps wait by
        themselves). False (the default): step() returns with the weights in place.
    unit_modules: which modules are ZeRO-3 units (a unit is a module plus every parameter in
        its subtree not claimed by a smaller unit; the root holds the rest). None: each child
        of an nn.ModuleList / nn.Sequential that holds parameters (a transformer's blocks);
        a tuple of module classes; or a callable(module) -> bool. A unit is gathered before
        its module's forward and backward and freed after, so a unit module must be one
        whose parameters are read only inside its own forward (true of any block).

    policy: None, or "auto": each weight all-gather and gradient reduce-scatter runs
        uncompressed or as configured above (and on the path) that the group's cost model
        predicts faster (qcoll.auto); never below the configured formats.

    ``weight_policy`` and ``grad_policy`` are the qcoll.AllGatherPolicy and
    ReduceScatterPolicy these fields compose (what the engine's calls use), wrapped in
    qcoll.auto.Auto with policy="auto".
    """

    qwz: bool = True
    hpz: Optional[bool] = None
    qgz: bool = True
    compute_dtype: torch.dtype = torch.bfloat16
    weight_bits: Union[int, str] = ALL_GATHER.bits
    grad_intra_bits: Union[int, str] = REDUCE_SCATTER.intra_bits
    grad_inter_bits: Union[int, str] = REDUCE_SCATTER.inter_bits
    grad_pipeline_stages: int = REDUCE_SCATTER.pipeline_stages
    hpz_group_size: Optional[int] = None
    prefetch: bool = True
    group_size: Optional[int] = None
    max_grad_norm: Optional[float] = None
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    unit_modules: Union[None, Tuple[type, ...], Callable[[nn.Module], bool]] = None
    stage: int = 3
    qwd: bool = False
    grad_hadamard: bool = False
    overlap_publish: bool = False
    policy: Optional[str] = None

    def __post_init__(self):
        if isinstance(self.stage, bool) or self.stage not in (2, 3):
            raise ValueError(f"stage must be 2 or 3, got {self.stage!r}")
        if self.hpz is None:  # hpZ keeps part of forward's gathered weights: stage 3 only
            object.__setattr__(self, "hpz", self.stage == 3)
        for name in ("qwz", "hpz", "qgz", "prefetch", "qwd", "grad_hadamard", "overlap_publish"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {_COMPUTE_DTYPES}, got {self.compute_dtype}")
        for name in ("weight_bits", "grad_intra_bits", "grad_inter_bits"):
            format_name(getattr(self, name), name)
        check_stages(self.grad_pipeline_stages, "grad_pipeline_stages", allow_none=False)
        if self.hpz_group_size is not None and (isinstance(self.hpz_group_size, bool)
                                                or not isinstance(self.hpz_group_size, int)
                                                or self.hpz_group_size < 1):
            raise ValueError(f"hpz_group_size must be a positive int or None, got {self.hpz_group_size!r}")
        if self.max_grad_norm is not None and not _positive_number(self.max_grad_norm):
            raise ValueError(f"max_grad_norm must be a number > 0 or None, got {self.max_grad_norm!r}")
        if self.loss_scale is not None and not _positive_number(self.loss_scale):
            raise ValueError(f"loss_scale must be a number > 0 or None (dynamic), got {self.loss_scale!r}")
        if not _positive_number(self.initial_loss_scale):
            raise ValueError(f"initial_loss_scale must be a number > 0, got {self.initial_loss_scale!r}")
        if isinstance(self.loss_scale_window, bool) or not isinstance(self.loss_scale_window, int) \
                or self.loss_scale_window < 1:
            raise ValueError(f"loss_scale_window must be a positive int, got {self.loss_scale_window!r}")
        if self.group_size is not None:
            check_group_size(self.group_size, "group_size")
        self._check_stage_switches()
        check_policy(self.policy)
        rule = self.unit_modules
        if isinstance(rule, tuple):
            if not rule or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in rule):
                raise ValueError(f"unit_modules must be None, a non-empty tuple of nn.Module classes or a "
                                 f"callable(module) -> bool, got {rule!r}")
        elif rule is not None and (not callable(rule) or isinstance(rule, type)):
            raise ValueError(f"unit_modules must be None, a non-empty tuple of nn.Module classes or a "
                             f"callable(module) -> bool, got {rule!r}")

    @functools.cached_property
    def weight_policy(self) -> AllGatherPolicy:
        """The weight all-gathers' policy (qwz=False: unquantized)."""
        return self._auto(AllGatherPolicy(bits=self.weight_bits if self.qwz else None, group_size=self.group_size))

    @functools.cached_property
    def grad_policy(self) -> ReduceScatterPolicy:
        """The gradient reduce-scatter's policy (qgz=False: the transport's own)."""
        return self._auto(ReduceScatterPolicy.gradients(self.grad_intra_bits if self.qgz else None,
                                                        self.grad_inter_bits if self.qgz else None,
                                                        self.group_size, self.grad_pipeline_stages,
                                                        hadamard=self.grad_hadamard))

    def _auto(self, policy):
        return policy if self.policy is None else Auto(policy)

    def _check_stage_switches(self) -> None:
        if self.stage == 2:
            if self.hpz:
                raise ValueError("hpz=True does not apply to stage=2: the weights stay whole on every "
                                 "rank, there is no backward all-gather (pass hpz=False or leave it None)")
            if self.hpz_group_size is not None:
                raise ValueError("hpz_group_size does not apply to stage=2 (no hpZ); leave it None")
        elif self.qwd:
            raise ValueError("qwd=True needs stage=2: ZeRO-3 frees the gathered weights between steps, "
                             "so there is no last step's value to take the difference from")
        elif self.overlap_publish:
            raise ValueError("overlap_publish=True needs stage=2: ZeRO-3 publishes no weights after "
                             "step() (each forward gathers them; prefetch overlaps that)")
        if self.qwd and not self.qwz:
            raise ValueError("qwd=True needs qwz=True: the weight difference is what gets quantized "
                             "(at weight_bits); with qwz=False the weights travel unquantized")
        if self.grad_hadamard and not self.qgz:
            raise ValueError("grad_hadamard=True needs qgz=True: the transform smooths what the "
                             "quantized gradient reduce-scatter quantizes")


def _positive_number(value) -> bool:
    """A real number above 0 (numpy's included; not a bool, not a string: they compare, or
    fail, unhelpfully)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0
