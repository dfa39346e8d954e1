"""qcoll.ddp's hook inside DistributedDataParallel on a GPU: DDP over torch's NCCL, the
hook's all-reduce over qcoll's raw-NCCL transport, 4 ranks sharing ONE GPU as 2 nodes x 2
(test_nccl.py's NCCL_HOSTID set-up).

- Every bucket the hook averaged on the GPU equals the same quantized_all_reduce of the
  same bucket over gloo on the CPU, bit for bit (one algorithm, two transports).
- The replicas stay bit-identical, and int8/int4 training tracks DDP's own NCCL
  all-reduce (the loss falls, the final loss within 3%).

The worker takes the device, so the same scenario runs on gloo CPU ranks too
(test_ddp_scenario_on_cpu_ranks): the harness and the training checks are proven there
first, though on CPU both transports are gloo, so its bit check only shows the hook equals
a direct quantized_all_reduce. error_feedback=False: each bucket is checked on its own."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.cuda.test_nccl import _REASON, _nccl_env
from tests.plugins.test_fsdp import SEQ, VOCAB, EncoderLM
from tests.support import gpt
from tests.support.distributed import run_ranks

WORLD, NODE, STEPS = 4, 2, 60


def _train(rank, world, device_type, hooked):
    import qcoll
    import qcoll.ddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dev = torch.device(device_type, 0) if cuda else torch.device("cpu")
    pg = dist.new_group(backend="nccl" if cuda else "gloo")  # DDP's own process group
    ours = qcoll.new_group(None, node_size=NODE, backend="nccl" if cuda else "torch")
    gloo = qcoll.new_group(None, node_size=NODE, backend="torch")  # the reference, on the CPU
    torch.manual_seed(0)
    model = DDP(EncoderLM(32, 1, 64).to(dev), device_ids=[0] if cuda else None,
                process_group=pg, bucket_cap_mb=0.01)  # after the first step: several buckets
    state = qcoll.ddp.QuantizedHookState(ours, error_feedback=False)  # int8 in, int4 across
    seen = []  # (bucket index, the rank's bucket before, the hook's result), this step

    def recording_hook(st, bucket):
        before = bucket.buffer().detach().to("cpu", copy=True)  # the buffer becomes the result

        def record(fut):
            seen.append((bucket.index(), before, fut.value().detach().to("cpu", copy=True)))
            return fut.value()
        return qcoll.ddp.quantized_allreduce_hook(st, bucket).then(record)

    if hooked:
        model.register_comm_hook(state, recording_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    language = gpt.MarkovLanguage(VOCAB)
    losses, buckets, mismatched = [], 0, []
    for step in range(STEPS):
        x, y = language.batch(step, 8 * world, SEQ)
        x, y = x.chunk(world)[rank].to(dev), y.chunk(world)[rank].to(dev)
        opt.zero_grad()
        loss = gpt.lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        # The same buckets through the gloo transport, in the same order on every rank.
        for index, before, got in sorted(seen, key=lambda s: s[0]):
            want = before.clone()
            qcoll.quantized_all_reduce(want, gloo, op="avg", **state.policy.kwargs())
            buckets += 1
            if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
                mismatched.append((step, index, (got - want).abs().max().item()))
        seen.clear()
    params = {k: v.detach().cpu() for k, v in model.module.state_dict().items()}
    for g in (ours, gloo):
        g.close()
    return dict(losses=losses, params=params, buckets=buckets, mismatched=mismatched)


def _ddp_worker(rank, world, device_type):
    return {"default": _train(rank, world, device_type, hooked=False),
            "qcoll": _train(rank, world, device_type, hooked=True)}


def _check(runs):
    tail = lambda losses: sum(losses[-10:]) / 10  # noqa: E731
    default = sum(tail(r["default"]["losses"]) for r in runs) / WORLD
    quantized = sum(tail(r["qcoll"]["losses"]) for r in runs) / WORLD
    for r in runs:
        assert r["qcoll"]["buckets"] >= 2 * STEPS, r["qcoll"]["buckets"]  # several a step
        assert not r["qcoll"]["mismatched"], r["qcoll"]["mismatched"][:5]
    for r in runs[1:]:  # every rank decoded the same bytes: the replicas never drift
        for name, p in runs[0]["qcoll"]["params"].items():
            assert torch.equal(r["qcoll"]["params"][name], p), name
    assert default < 0.7 * math.log(VOCAB), default  # it learned
    assert abs(quantized - default) <= 0.03 * default, (quantized, default)
    return default, quantized


def test_ddp_scenario_on_cpu_ranks():
    default, quantized = _check(run_ranks(WORLD, _ddp_worker, "cpu", timeout=300))
    print(f"\nDDP on gloo, {STEPS} steps: final loss default {default:.4f}, qcoll {quantized:.4f}")


@pytest.mark.gpu
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_ddp_hook_on_nccl_matches_gloo_and_tracks_ddp_default():
    runs = run_ranks(WORLD, _ddp_worker, "cuda", env={r: _nccl_env(r) for r in range(WORLD)},
                     timeout=300)
    default, quantized = _check(runs)
    print(f"\nDDP on NCCL, {STEPS} steps: final loss default {default:.4f}, qcoll {quantized:.4f}")
