"""qcoll inside DistributedDataParallel (qcoll.ddp): the gradient all-reduce as a comm hook,
on gloo ranks emulating 2 nodes x 2, on a model of nn.TransformerEncoderLayer blocks
(test_fsdp.EncoderLM: tied head, widths that do not divide the world).

- bits=None through the hook matches DDP's default all-reduce step by step (rel 1e-5); on
  bf16 gradients it rounds each bucket's fp32 sum once (bit for bit).
- int8 in the node / int4 across (the defaults, with error feedback) trains to within 1%
  of DDP-default's final loss, with the replicas bit-identical, and sends <= 0.3x the
  cross-node bytes per step (both counted under qcoll's rule; numbers printed).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.distributed import run_ranks
from tests.plugins.test_fsdp import VOCAB, SEQ, EncoderLM
from tests.support.zero_helpers import gpt

NODE_SIZE = 2


def _train(rank, world, mode, steps, *, shape=(20, 2, 36), lr=3e-3, per_rank=4, hook_kw=None,
           sgd=False, static_graph=False):
    import qcoll
    import qcoll.ddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(EncoderLM(*shape), bucket_cap_mb=0.01,  # several buckets, of uneven sizes
                static_graph=static_graph)
    group = qcoll.new_group(node_size=NODE_SIZE)
    state = qcoll.ddp.QuantizedHookState(group, **(hook_kw or {}))
    if mode == "qcoll":
        model.register_comm_hook(state, qcoll.ddp.quantized_allreduce_hook)
    elif mode == "counted":
        model.register_comm_hook(state, qcoll.ddp.counted_allreduce_hook)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if sgd
           else torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01))
    language = gpt.MarkovLanguage(VOCAB)
    losses, inter, intra = [], [], []
    for step in range(steps):
        x, y = language.batch(step, per_rank * world, SEQ)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        qcoll.reset_stats()
        opt.zero_grad()
        loss = gpt.lm_loss(model(x), y)
        loss.backward()
        opt.step()
        s = qcoll.stats()["all_reduce"]
        losses.append(loss.item())
        inter.append(s["inter_bytes"])
        intra.append(s["intra_bytes"])
    params = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return dict(losses=losses, params=params, inter=inter, intra=intra,
                ef_bytes=state.error_feedback_bytes)


def _match_worker(rank, world):
    # SGD: Adam turns the summation-order noise of gradients that are zero in exact
    # arithmetic (attention's key bias) into lr-sized steps.
    return {mode: _train(rank, world, mode, 4, hook_kw=dict(bits=None, inter_bits=None), sgd=True)
            for mode in ("none", "qcoll")}


def test_unquantized_hook_matches_ddp_default_step_by_step():
    for runs in run_ranks(4, _match_worker, timeout=180):
        ref, ours = runs["none"], runs["qcoll"]
        assert ours["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        for name, p in ref["params"].items():
            torch.testing.assert_close(ours["params"][name], p, rtol=1e-5, atol=1e-7, msg=name)
        assert ours["ef_bytes"] == 0  # nothing is lost unquantized: no residual kept


def _bf16_round_once_worker(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import qcoll
    import qcoll.ddp
    import qcoll.policy

    import qcoll.all_reduce

    # Every bucket through the raw exchange (4 ranks: bf16 of every size), never the
    # transport's all-reduce of fp32 copies, which would round once too.
    def refuse(*args, **kwargs):
        raise AssertionError("the bucket took the transport's all-reduce, not the raw exchange")
    qcoll.all_reduce._transport_all_reduce = refuse
    torch.manual_seed(0)
    model = DDP(EncoderLM(20, 2, 36).to(torch.bfloat16), bucket_cap_mb=0.01)
    state = qcoll.ddp.QuantizedHookState(qcoll.new_group(node_size=NODE_SIZE), bits=None, inter_bits=None)
    results = []

    def checked_hook(st, bucket):
        # The reference, independent of qcoll: every rank's bf16 gradients, summed in fp32
        # and rounded once (world = 4: dividing by it is exact).
        mine = bucket.buffer().clone()
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        want = (torch.stack(every).float().sum(0) / world).to(torch.bfloat16)
        assert qcoll.policy.unquantized_host_all_reduce(2, mine.numel(), world) == "exchange"

        def compare(fut):
            got = fut.value()
            results.append((got.numel(), torch.equal(got.view(torch.int16), want.view(torch.int16))))
            return got
        return qcoll.ddp.quantized_allreduce_hook(st, bucket).then(compare)

    model.register_comm_hook(state, checked_hook)
    language = gpt.MarkovLanguage(VOCAB)
    for step in range(3):
        x, y = language.batch(step, 4 * world, SEQ)
        model.zero_grad()
        gpt.lm_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    return results


def test_unquantized_bf16_hook_rounds_the_fp32_sum_once():
    # bits=None on bf16 gradients: the raw exchange (inputs to their owner, fp32 sum,
    # rounded once), not gloo's bf16 all-reduce, which rounds at every step.
    for results in run_ranks(4, _bf16_round_once_worker, timeout=180):
        assert len(results) >= 5 and sum(n for n, _ in results) > 0  # 1 bucket, then 2 a step
        assert all(same for _, same in results), results


def _convergence_worker(rank, world, steps):
    kw = dict(shape=(32, 1, 64), lr=1e-2, per_rank=8)
    return {"counted": _train(rank, world, "counted", steps, **kw),
            "qcoll": _train(rank, world, "qcoll", steps, **kw)}


def test_quantized_hook_trains_within_1_percent_of_ddp_default():
    steps, world = 120, 4  # at 80 steps the loss still falls fast: a small lag reads as > 1%
    runs = run_ranks(world, _convergence_worker, steps, timeout=600)
    tail = lambda losses: sum(losses[-20:]) / 20  # noqa: E731
    default = sum(tail(r["counted"]["losses"]) for r in runs) / world
    quantized = sum(tail(r["qcoll"]["losses"]) for r in runs) / world
    assert default < 0.7 * math.log(VOCAB)  # it learned (ln(vocab) = 2.56 at the start)
    assert abs(quantized - default) <= 0.01 * default, (quantized, default)
    for r in runs[1:]:  # every rank decoded the same bytes: the replicas never drift
        for name, p in runs[0]["qcoll"]["params"].items():
            assert torch.equal(r["qcoll"]["params"][name], p), name
    per_step = {mode: sum(r[mode]["inter"][-1] for r in runs) / world for mode in ("counted", "qcoll")}
    in_node = {mode: sum(r[mode]["intra"][-1] for r in runs) / world for mode in ("counted", "qcoll")}
    print(f"\nDDP 2x2, {steps} steps: final loss (mean of last 20) default {default:.4f}, qcoll "
          f"{quantized:.4f}; cross-node bytes per rank and step {per_step['counted']:.0f} vs "
          f"{per_step['qcoll']:.0f} ({per_step['qcoll'] / per_step['counted']:.3f}x); in-node "
          f"{in_node['counted']:.0f} vs {in_node['qcoll']:.0f}; error feedback state "
          f"{runs[0]['qcoll']['ef_bytes']} bytes per rank")
    assert 0 < per_step["qcoll"] <= 0.3 * per_step["counted"]
    n_params = sum(p.numel() for p in runs[0]["qcoll"]["params"].values())
    # error feedback: 4 bytes per gradient element (input), + 4 / node_size (the 2-hop's
    # inter residual) + 4 / world (the shard), padding aside: 1.75x here
    assert 4 * n_params * 1.5 <= runs[0]["qcoll"]["ef_bytes"] <= 4 * n_params * 1.75 * 1.1


def _feedback_kept(rank, world):
    import qcoll
    import qcoll.ddp
    import qcoll.fsdp

    g = qcoll.new_group(node_size=1)
    kept = {}
    for bits, inter_bits in ((8, None), (None, 4), (None, None), (8, 4)):
        hook = qcoll.ddp.QuantizedHookState(g, bits=bits, inter_bits=inter_bits)
        replica = qcoll.fsdp.QuantizedReplicaAllReduce(g, bits=bits, inter_bits=inter_bits)
        kept[(bits, inter_bits)] = (hook.error_feedback, replica.error_feedback is not None)
    g.close()
    return kept


def test_error_feedback_is_kept_wherever_a_hop_is_quantized():
    """bits=None with inter_bits=4 quantizes the hop across nodes: the DDP hook and the HSDP
    replica all-reduce keep its residuals (they dropped them whenever bits was None)."""
    kept = run_ranks(1, _feedback_kept)[0]
    assert kept == {(8, None): (True, True), (None, 4): (True, True), (None, None): (False, False),
                    (8, 4): (True, True)}, kept


def _static_graph_worker(rank, world):
    return {mode: _train(rank, world, mode, 5, static_graph=True) for mode in ("counted", "qcoll")}


def test_static_graph_rebuilds_buckets_after_the_second_iteration():
    """With static_graph=True DDP runs two iterations on one bucket before rebuilding its
    buckets; the hook kept that bucket's error feedback for the new bucket 0 and raised on
    every rank at the third step (the residuals follow each bucket's layout now)."""
    for run in run_ranks(4, _static_graph_worker, timeout=300):
        assert run["qcoll"]["ef_bytes"] > 0
        for q, d in zip(run["qcoll"]["losses"], run["counted"]["losses"]):
            assert q == pytest.approx(d, rel=2e-2), (run["qcoll"]["losses"], run["counted"]["losses"])


class _FakeBucket:
    """What the hook state reads of a dist.GradBucket."""

    def __init__(self, index, numel, params):
        self._index, self._buffer, self._params = index, torch.zeros(numel), params

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params


def _rebuild_drops_buckets(rank, world):
    import qcoll
    import qcoll.ddp

    state = qcoll.ddp.QuantizedHookState(qcoll.new_group(node_size=1))
    params = [torch.zeros(1) for _ in range(3)]
    old = [_FakeBucket(i, 10 + i, [params[i]]) for i in range(3)]  # three buckets, then one
    kept = [state.feedback_for(b) for b in old]
    state.end_of_iteration(2)
    rebuilt = _FakeBucket(0, 33, params)
    fresh = state.feedback_for(rebuilt)
    state.end_of_iteration(0)
    return fresh is not kept[0], state.feedback_for(rebuilt) is fresh, sorted(state._feedback)


def test_a_rebuild_to_fewer_buckets_drops_the_old_residuals():
    """The buckets past the last one of an iteration are gone (their residuals stayed for the
    whole run, in error_feedback_bytes too)."""
    assert run_ranks(1, _rebuild_drops_buckets) == [(True, True, [0])]


def _shared_state(rank, world):
    import qcoll
    import qcoll.ddp

    state = qcoll.ddp.QuantizedHookState(qcoll.new_group(node_size=1))
    generator, discriminator = [torch.zeros(1)], [torch.zeros(1)]
    try:
        for _ in range(3):  # two models' bucket 0, alternating
            state.feedback_for(_FakeBucket(0, 10, generator))
            state.feedback_for(_FakeBucket(0, 12, discriminator))
    except ValueError as e:
        return str(e)
    return None


def test_one_state_for_two_ddp_models_raises():
    """Each call found the other model's layout and started fresh: error feedback silently
    off. Before the layout keys it raised an ErrorFeedback binding error."""
    (message,) = run_ranks(1, _shared_state)
    assert message is not None and "its own QuantizedHookState" in message, message


def _disagreeing_ranks(rank, world):
    import qcoll.ddp

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    model.register_comm_hook(qcoll.ddp.QuantizedHookState(bits=8 if rank == 0 else 4),
                             qcoll.ddp.quantized_allreduce_hook)
    try:
        model(torch.randn(2, 8)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_ranks_that_disagree_raise_the_call_check_through_ddp():
    """The call check's error reached DDP's reducer as the future's value: every rank raised
    "Unable to cast <the message> to Tensor"."""
    for rank, message in enumerate(run_ranks(2, _disagreeing_ranks)):
        assert message is not None and "ranks disagree on the call" in message, message
        assert "Unable to cast" not in message and f"member {rank} (this rank)" in message, message
