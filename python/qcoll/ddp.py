"""qcoll inside DistributedDataParallel: the gradient all-reduce as a DDP comm hook.

    state = qcoll.ddp.QuantizedHookState(group=None, bits=8, inter_bits=4, error_feedback=True)
    ddp_model.register_comm_hook(state, qcoll.ddp.quantized_allreduce_hook)

``counted_allreduce_hook`` is DDP's default hook (torch's allreduce_hook, same numerics)
with its bytes counted in ``qcoll.stats()["all_reduce"]`` under qcoll's rule: the baseline.

Each gradient bucket goes through qcoll.quantized_all_reduce (op "avg", issued async_op=True;
DDP waits on the returned Future): int8 inside the node, int4 across nodes by default, the
result bit-identical on every rank, so the replicas stay in sync. error_feedback=True keeps
one qcoll.ErrorFeedback per bucket wherever a hop is quantized (memory: 4 bytes per
gradient element, plus 4 per element / world size, plus across nodes of several ranks
4 per element / node size: see qcoll.error_feedback).
"""

from typing import Optional  # no `from __future__ import annotations`: DDP checks the hooks'
#                               annotations as objects (torch.futures.Future[torch.Tensor])

import torch
import torch.distributed as dist

from ._runtime.call import account
from .all_reduce import quantized_all_reduce
from .error_feedback import ErrorFeedback
from .group import Group, resolve_group
from .policy import DDP_ALL_REDUCE, AllReducePolicy, take_policy


# A bucket's parameters change once when DDP rebuilds its buckets (after the first iteration,
# with static_graph after the second); once more allows for a layout that also changes when
# DDP first reorders it. Beyond that the state serves two models.
_LAYOUT_CHANGES = 2


class QuantizedHookState:
    """What quantized_allreduce_hook needs across steps: the qcoll.Group (created here,
    collectively, from `group`: a qcoll.Group, a ProcessGroup or None for the world), the
    code formats (or `policy`, a qcoll.AllReducePolicy, instead of bits, inter_bits,
    group_size and pipeline_stages), and one ErrorFeedback per bucket.

    DDP rebuilds its buckets once (after the first iteration; with static_graph=True after
    the second), so residuals kept for a bucket belong to its layout (its parameters, numel,
    dtype and device): a bucket whose layout changed starts with no residuals."""

    def __init__(self, group=None, bits=DDP_ALL_REDUCE.bits, inter_bits=DDP_ALL_REDUCE.inter_bits,
                 error_feedback: bool = True, *, group_size: Optional[int] = None,
                 pipeline_stages: int = DDP_ALL_REDUCE.pipeline_stages,
                 policy: Optional[AllReducePolicy] = None):
        loose = AllReducePolicy(bits, inter_bits, group_size, pipeline_stages)
        self.policy = take_policy(policy, loose, DDP_ALL_REDUCE)
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be True or False, got {error_feedback!r}")
        if group is not None and not isinstance(group, (Group, dist.ProcessGroup)):
            raise TypeError(f"group must be a qcoll.Group, a torch ProcessGroup or None, got {type(group).__name__}")
        self.error_feedback = error_feedback and not self.policy.unquantized  # any hop quantized
        self.group = resolve_group(group)
        self.process_group = self.group.pg  # the caller's (the counted default hook uses it)
        self.iteration = 0
        self._feedback: dict = {}  # bucket index -> (its layout, ErrorFeedback)

    bits = property(lambda self: self.policy.bits)
    inter_bits = property(lambda self: self.policy.inter_bits)
    group_size = property(lambda self: self.policy.group_size)
    pipeline_stages = property(lambda self: self.policy.pipeline_stages)

    def feedback_for(self, bucket) -> Optional[ErrorFeedback]:
        if not self.error_feedback:
            return None
        buffer = bucket.buffer()
        layout = (tuple(id(p) for p in bucket.parameters()), buffer.numel(), buffer.dtype, buffer.device)
        held = self._feedback.get(bucket.index())
        if held is None or held[0] != layout:  # new, or DDP rebuilt its buckets
            changes = 0 if held is None else held[2] + 1
            if changes > _LAYOUT_CHANGES:
                raise ValueError(
                    f"QuantizedHookState: bucket {bucket.index()} changed its parameters {changes} times, "
                    f"more than DDP's bucket rebuild does: is this state registered on two DDP models? "
                    "Give each DDP model its own QuantizedHookState")
            held = self._feedback[bucket.index()] = (layout, ErrorFeedback(), changes)
        return held[1]

    @property
    def error_feedback_bytes(self) -> int:
        return sum(ef.nbytes for _, ef, _ in self._feedback.values())

    def end_of_iteration(self, last_bucket: Optional[int] = None) -> None:
        """The iteration's last bucket was `last_bucket`: residuals of buckets past it (a
        rebuild left fewer) are dropped."""
        if last_bucket is not None:
            for index in [i for i in self._feedback if i > last_bucket]:
                del self._feedback[index]
        self.iteration += 1


def quantized_allreduce_hook(state: QuantizedHookState, bucket: dist.GradBucket
                             ) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's gradients averaged over state.group with
    qcoll.quantized_all_reduce; the Future completes with the averaged bucket tensor."""
    buffer = bucket.buffer()
    work = quantized_all_reduce(buffer, state.group, op="avg", error_feedback=state.feedback_for(bucket),
                                async_op=True, **state.policy.kwargs())
    if bucket.is_last():
        state.end_of_iteration(bucket.index())
    return work.get_future(buffer)


def counted_allreduce_hook(state: QuantizedHookState, bucket: dist.GradBucket
                             ) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce (torch's allreduce_hook over the ProcessGroup the state was
    made from), its bytes counted in qcoll.stats()["all_reduce"] as an unquantized
    reduce-scatter + all-gather exchanged directly (qcoll's rule; bits=None's count)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buffer = bucket.buffer()
    shard = -(-buffer.numel() // state.group.size)
    account(state.group, "all_reduce", 2 * shard * buffer.element_size())
    return allreduce_hook(state.process_group, bucket)


__all__ = ["QuantizedHookState", "quantized_allreduce_hook", "counted_allreduce_hook"]
