"""qcoll.policy: one frozen policy per kind of call (AllGatherPolicy, ReduceScatterPolicy,
AllReducePolicy), its defaults and checks; every entry point (functional API, FSDP2 comms,
DDP hook state, ZeroConfig) builds the same policy from the same arguments, takes one as
``policy=``, and gives bit-identical results (4 gloo ranks as 2 nodes x 2)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from types import SimpleNamespace

import pytest
import torch

import qcoll
import qcoll.ddp
import qcoll.fsdp
from tests.support.distributed import run_ranks
from qcoll import AllGatherPolicy, AllReducePolicy, ReduceScatterPolicy
from qcoll._formats import format_name
from qcoll.policy import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from qcoll.zero import ZeroConfig

NODE_SIZE = 2


# ---- defaults, normalization, checks --------------------------------------------------------
def test_defaults():
    assert AllGatherPolicy() == AllGatherPolicy(bits=8, group_size=qcoll.DEFAULT_GROUP_SIZE)
    rs = ReduceScatterPolicy()
    assert (rs.intra_bits, rs.inter_bits, rs.group_size, rs.pipeline_stages, rs.hierarchical,
            rs.hadamard, rs.hadamard_size) == (8, 4, 256, 2, None, False, None)
    ar = AllReducePolicy()
    assert (ar.bits, ar.inter_bits, ar.group_size, ar.pipeline_stages, ar.hierarchical) == (8, None, 256, 2, True)
    assert ar.cross_bits == 8 and AllReducePolicy(inter_bits=4).cross_bits == 4
    assert ar.reduce_scatter() == ReduceScatterPolicy(intra_bits=8, inter_bits=8, hierarchical=True)


def test_normalization_and_frozen():
    assert ReduceScatterPolicy(pipeline_stages=None) == ReduceScatterPolicy(pipeline_stages=1)
    assert AllGatherPolicy(group_size=None) == AllGatherPolicy(group_size=256)
    assert AllGatherPolicy(bits="int8").bits == "int8" and AllGatherPolicy(bits=8).bits == 8  # as spelled
    assert ReduceScatterPolicy(hadamard=True, group_size=96).hadamard_block == 32
    assert ReduceScatterPolicy().hadamard_block == 0
    p = AllGatherPolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.bits = 4
    assert dataclasses.replace(p, bits=None).code == qcoll._formats.RAW_CODE


@pytest.mark.parametrize("cls,kwargs,exc,words", [
    (AllGatherPolicy, dict(bits=3), ValueError, "bits must be 8 / 'int8', 4 / 'int4', 'fp8_e4m3' or None"),
    (AllGatherPolicy, dict(bits=True), ValueError, "bits must be"),
    (AllGatherPolicy, dict(group_size=100), ValueError, "group_size must be a positive multiple of"),
    (ReduceScatterPolicy, dict(intra_bits=16), ValueError, "intra_bits must be"),
    (ReduceScatterPolicy, dict(inter_bits="int2"), ValueError, "inter_bits must be"),
    (ReduceScatterPolicy, dict(pipeline_stages=0), ValueError, "pipeline_stages must be a positive int or None"),
    (ReduceScatterPolicy, dict(pipeline_stages=1.5), ValueError, "pipeline_stages must be"),
    (ReduceScatterPolicy, dict(hierarchical="yes"), ValueError, "hierarchical must be True, False or None"),
    (ReduceScatterPolicy, dict(hadamard=1), TypeError, "hadamard must be a bool"),
    (ReduceScatterPolicy, dict(hadamard_size=16), ValueError, "hadamard_size=16 needs hadamard=True"),
    (ReduceScatterPolicy, dict(hadamard=True, hadamard_size=512), ValueError, "hadamard_size must be a power of two"),
    (ReduceScatterPolicy, dict(hadamard=True, intra_bits=None, inter_bits=None), ValueError,
     "hadamard=True needs a quantized hop"),
    (AllReducePolicy, dict(bits=2), ValueError, "bits must be"),
    (AllReducePolicy, dict(inter_bits=2), ValueError, "inter_bits must be"),
    (AllReducePolicy, dict(group_size=0), ValueError, "group_size must be"),
    (AllReducePolicy, dict(pipeline_stages=-1), ValueError, "pipeline_stages must be"),
])
def test_checks_name_the_field_and_what_is_allowed(cls, kwargs, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        cls(**kwargs)


def test_cached_policies_are_one_object_per_spelling_and_still_checked():
    """The functional API's per-call policy (qcoll.policy.cached): the same arguments give
    the same frozen object; 8 and 8.0, 1 and True are different keys (the float and the
    bool are refused, every time); an unhashable argument reaches the constructor's check."""
    from qcoll.policy import cached

    a = cached(ReduceScatterPolicy, 8, 4, None, None, None, False, None)
    assert a is cached(ReduceScatterPolicy, 8, 4, None, None, None, False, None)
    assert a == ReduceScatterPolicy(8, 4, None, None, None, False, None)
    assert (a.intra_code, a.inter_code) == (ReduceScatterPolicy().intra_code, ReduceScatterPolicy().inter_code)
    assert cached(AllGatherPolicy, 8, None).bits == 8
    for bad in (8.0, True, [8]):
        for _ in range(2):
            with pytest.raises(ValueError, match="bits must be"):
                cached(AllGatherPolicy, bad, None)
    assert cached(AllReducePolicy, None, None, None, None, True).unquantized
    assert not cached(AllReducePolicy, 8, None, None, None, True).unquantized


def test_kwargs_are_the_functional_keywords():
    for policy, fn in ((AllGatherPolicy(), qcoll.quantized_allgather),
                       (ReduceScatterPolicy(), qcoll.quantized_reduce_scatter),
                       (AllReducePolicy(), qcoll.quantized_all_reduce),
                       (AllGatherPolicy(), qcoll.delta_allgather)):
        assert set(policy.kwargs()) <= set(inspect.signature(fn).parameters)


def test_documented_defaults_of_every_entry_point():
    """One default per kind of call, but what each entry point documented stays (see the
    qcoll.policy docstring): functional reduce-scatter one stage, DDP int4 across, qWD int4."""
    def defaults(fn, *names):
        params = inspect.signature(fn).parameters
        return tuple(params[n].default for n in names)

    assert defaults(qcoll.quantized_allgather, "bits", "group_size") == (8, None)
    assert defaults(qcoll.quantized_reduce_scatter, "intra_bits", "inter_bits", "pipeline_stages",
                    "hierarchical") == (8, 4, None, None)
    assert defaults(qcoll.quantized_all_reduce, "bits", "inter_bits", "pipeline_stages",
                    "hierarchical") == (8, None, 2, True)
    assert defaults(qcoll.delta_allgather, "bits") == (4,)
    assert defaults(qcoll.ddp.QuantizedHookState, "bits", "inter_bits", "pipeline_stages") == (8, 4, 2)
    assert defaults(qcoll.fsdp.QuantizedAllGather, "bits") == (8,)
    assert defaults(qcoll.fsdp.QuantizedReduceScatter, "intra_bits", "inter_bits", "pipeline_stages") == (8, 4, 2)
    assert defaults(qcoll.fsdp.QuantizedReplicaAllReduce, "bits", "inter_bits", "pipeline_stages") == (8, None, 2)
    assert defaults(qcoll.fsdp.use_qcoll, "weight_bits", "grad_intra_bits", "grad_inter_bits",
                    "grad_pipeline_stages", "replicate_bits", "replicate_inter_bits") == (8, 8, 4, 2, 8, None)
    c = ZeroConfig()
    assert (c.weight_bits, c.grad_intra_bits, c.grad_inter_bits, c.grad_pipeline_stages) == (8, 8, 4, 2)


# ---- the same policy from every entry point ------------------------------------------------
def test_fsdp_comms_and_zero_config_build_the_same_policy():
    from qcoll.fsdp import QuantizedAllGather, QuantizedReduceScatter

    ag = AllGatherPolicy(bits="fp8_e4m3", group_size=64)
    assert QuantizedAllGather(bits="fp8_e4m3", group_size=64).policy == ag
    assert ZeroConfig(weight_bits="fp8_e4m3", group_size=64).weight_policy == ag
    assert ZeroConfig(qwz=False).weight_policy == AllGatherPolicy(bits=None)

    rs = ReduceScatterPolicy(intra_bits=4, inter_bits="fp8_e4m3", group_size=128, pipeline_stages=3)
    assert QuantizedReduceScatter(4, "fp8_e4m3", 3, 128).policy == rs
    assert ZeroConfig(grad_intra_bits=4, grad_inter_bits="fp8_e4m3", grad_pipeline_stages=3,
                      group_size=128).grad_policy == rs
    assert ZeroConfig(grad_hadamard=True).grad_policy == ReduceScatterPolicy(hadamard=True)
    # Unquantized: the transport's own reduce-scatter, whichever way it is asked for.
    assert ZeroConfig(qgz=False).grad_policy == ReduceScatterPolicy.transport()
    baseline = QuantizedReduceScatter(intra_bits=None, inter_bits=None, pipeline_stages=4).policy
    assert baseline == ReduceScatterPolicy.transport()
    assert (baseline.unquantized, baseline.hierarchical) == (True, False)


def test_plugins_take_a_policy_instead_of_loose_keywords():
    from qcoll.fsdp import QuantizedAllGather, QuantizedReduceScatter

    ag = AllGatherPolicy(bits=4, group_size=32)
    comm = QuantizedAllGather(policy=ag, node_size=2)
    assert comm.policy is ag and (comm.bits, comm.group_size, comm.node_size) == (4, 32, 2)
    assert repr(comm) == "QuantizedAllGather(bits=4, group_size=32, node_size=2)"
    rs = ReduceScatterPolicy(inter_bits=8, pipeline_stages=1)
    assert QuantizedReduceScatter(policy=rs).policy is rs
    with pytest.raises(TypeError, match="pass either policy= or bits, not both"):
        QuantizedAllGather(bits=4, policy=ag)
    with pytest.raises(TypeError, match="pass either policy= or inter_bits, pipeline_stages, not both"):
        QuantizedReduceScatter(inter_bits=8, pipeline_stages=3, policy=rs)
    with pytest.raises(TypeError, match="policy must be a qcoll.ReduceScatterPolicy, 'auto' or None, got AllGatherPolicy"):
        QuantizedReduceScatter(policy=ag)
    # Both bits None builds the transport's baseline (one stage, flat): the conflict names the
    # keywords the caller passed, not the fields the baseline sets.
    with pytest.raises(TypeError, match=r"pass either policy= or intra_bits, inter_bits, not both$"):
        QuantizedReduceScatter(intra_bits=None, inter_bits=None, policy=rs)
    # The default block spelled out is no conflict, as for the all-gather.
    assert QuantizedReduceScatter(group_size=qcoll.DEFAULT_GROUP_SIZE, policy=rs).policy is rs
    assert QuantizedAllGather(group_size=qcoll.DEFAULT_GROUP_SIZE, policy=ag).policy is ag
    # So is the default format in its other spelling (8 is "int8").
    assert QuantizedAllGather(bits=format_name(ALL_GATHER.bits), policy=ag).policy is ag
    assert QuantizedReduceScatter(inter_bits=format_name(REDUCE_SCATTER.inter_bits), policy=rs).policy is rs


def _record_policies(monkeypatch) -> list:
    """use_qcoll's comms' policies, in the order it sets them on a stand-in FSDPModule."""
    set_on = []

    class Recorder:
        def set_custom_all_gather(self, comm):
            set_on.append(comm.policy)

        def set_custom_reduce_scatter(self, comm):
            set_on.append(comm.policy)

    monkeypatch.setattr(qcoll.fsdp, "_fsdp_modules", lambda module: [Recorder()])
    return set_on


def test_use_qcoll_composes_the_same_policies(monkeypatch):
    set_on = _record_policies(monkeypatch)
    qcoll.fsdp.use_qcoll(None, weight_bits=4, grad_intra_bits=None, grad_inter_bits=8, grad_pipeline_stages=1)
    assert set_on == [AllGatherPolicy(bits=4), ReduceScatterPolicy(intra_bits=None, inter_bits=8, pipeline_stages=1)]
    set_on.clear()
    ag, rs = AllGatherPolicy(bits=None), ReduceScatterPolicy(hadamard=True)
    qcoll.fsdp.use_qcoll(None, weight_policy=ag, grad_policy=rs)
    assert set_on[0] is ag and set_on[1] is rs
    with pytest.raises(TypeError, match="pass either grad_policy= or grad_inter_bits, not both"):
        qcoll.fsdp.use_qcoll(None, grad_inter_bits=8, grad_policy=rs)
    with pytest.raises(TypeError, match="weight_policy must be a qcoll.AllGatherPolicy"):
        qcoll.fsdp.use_qcoll(None, weight_policy=rs)
    with pytest.raises(TypeError, match=r"pass either grad_policy= or grad_intra_bits, grad_inter_bits, not both$"):
        qcoll.fsdp.use_qcoll(None, grad_intra_bits=None, grad_inter_bits=None, grad_policy=rs)
    with pytest.raises(TypeError, match="replicate_error_feedback must be True or False, got 'yes'"):
        qcoll.fsdp.use_qcoll(None, replicate_error_feedback="yes")


@pytest.mark.parametrize("keywords, named", [
    (dict(replicate_bits=4), "replicate_bits"),
    (dict(replicate_inter_bits=4), "replicate_inter_bits"),
    (dict(replicate_error_feedback=False), "replicate_error_feedback"),
    (dict(replicate_policy=AllReducePolicy(bits=4)), "replicate_policy"),
    (dict(replicate_policy="auto"), "replicate_policy"),
    (dict(replicate_bits=None, replicate_policy=AllReducePolicy()), "replicate_bits, replicate_policy"),
])
def test_use_qcoll_replicate_settings_need_replicate_group(monkeypatch, keywords, named):
    # Without replicate_group the replicas' settings would be silently ignored: an error
    # naming them, before any module is touched.
    monkeypatch.setattr(qcoll.fsdp, "_fsdp_modules", lambda module: pytest.fail("modules touched"))
    with pytest.raises(TypeError, match=rf"^{named}: act only with replicate_group= .*pass it, or leave"):
        qcoll.fsdp.use_qcoll(None, **keywords)


@pytest.mark.parametrize("keywords", [
    dict(replicate_bits=ALL_REDUCE.bits, replicate_inter_bits=ALL_REDUCE.inter_bits,
         replicate_error_feedback=True, replicate_policy=None),
    dict(replicate_bits=format_name(ALL_REDUCE.bits)),  # the default's other spelling
])
def test_use_qcoll_replicate_defaults_without_group(monkeypatch, keywords):
    # The defaults spelled out act on nothing either way: no error, the comms set as usual.
    set_on = _record_policies(monkeypatch)
    qcoll.fsdp.use_qcoll(None, **keywords)
    assert set_on == [ALL_GATHER, REDUCE_SCATTER]


def test_use_qcoll_replicate_policy_with_gradient_stages(monkeypatch):
    # grad_pipeline_stages is the gradient reduce-scatter's keyword: with replicate_policy it
    # is no conflict (it once raised naming a replicate_pipeline_stages keyword that does not exist).
    hooks = []

    class Recorder:
        def set_custom_all_gather(self, comm):
            pass

        def set_custom_reduce_scatter(self, comm):
            assert comm.policy.pipeline_stages == 4

        def set_all_reduce_hook(self, hook):
            hooks.append(hook)

    monkeypatch.setattr(qcoll.fsdp, "_fsdp_modules", lambda module: [Recorder()])
    monkeypatch.setattr(qcoll.fsdp, "_check_not_native_hsdp", lambda m: None)
    replicas = object.__new__(qcoll.Group)  # never called: the hook only holds it
    ar = AllReducePolicy(bits=4, pipeline_stages=1)
    qcoll.fsdp.use_qcoll(None, grad_pipeline_stages=4, replicate_group=replicas, replicate_policy=ar)
    assert len(hooks) == 1 and hooks[0].policy is ar and hooks[0].replicate_group is replicas
    with pytest.raises(TypeError, match=r"pass either replicate_policy= or replicate_bits, not both$"):
        qcoll.fsdp.use_qcoll(None, replicate_bits=4, replicate_group=replicas, replicate_policy=ar)


# ---- bit-identical results through every entry point ---------------------------------------
class _Bucket:
    """What quantized_allreduce_hook reads of a dist.GradBucket."""

    def __init__(self, buffer):
        self._buffer = buffer

    def buffer(self):
        return self._buffer

    def index(self):
        return 0

    PARAMETERS = [torch.zeros(1)]  # a real bucket's parameters are the same tensors every step

    def parameters(self):
        return self.PARAMETERS

    def is_last(self):
        return False  # the first iteration's last bucket would drop the residuals


def _entry_points_worker(rank, world):
    import torch.distributed as dist

    import qcoll._runtime.steps
    from qcoll.zero.comms import EngineComms

    qcoll._runtime.steps.MIN_STAGE_BYTES = 64  # let small calls pipeline
    g = qcoll.new_group(node_size=NODE_SIZE)
    pg = dist.group.WORLD
    gen = torch.Generator().manual_seed(rank)
    n = 1000  # elements per rank: not a multiple of any group size

    # all-gather: functional, FSDP2's comm, the engine's forward gather
    shard = torch.randn(n, generator=gen)
    got = [torch.empty(world * n) for _ in range(3)]
    qcoll.quantized_allgather(got[0], shard, g, bits=4, group_size=64)
    qcoll.fsdp.QuantizedAllGather(bits=4, group_size=64, node_size=NODE_SIZE)(got[1], shard, pg)
    flat = SimpleNamespace(full=got[2], compute_shard=shard)
    engine = EngineComms(ZeroConfig(weight_bits=4, group_size=64), g, g)
    engine.gather_forward(flat).wait()
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])

    # reduce-scatter (2-hop, 3 stages; with and without Hadamard smoothing)
    for hadamard in (False, True):
        grad = torch.randn(world * n, generator=gen)
        got = [torch.empty(n) for _ in range(3)]
        qcoll.quantized_reduce_scatter(got[0], grad, g, op="avg", intra_bits=8, inter_bits=4,
                                       group_size=128, pipeline_stages=3, hadamard=hadamard)
        qcoll.fsdp.QuantizedReduceScatter(
            node_size=NODE_SIZE, policy=ReduceScatterPolicy(8, 4, 128, 3, hadamard=hadamard),
        )(got[1], grad, pg, dist.ReduceOp.AVG)
        config = ZeroConfig(grad_intra_bits=8, grad_inter_bits=4, group_size=128, grad_pipeline_stages=3,
                            grad_hadamard=hadamard)
        flat = SimpleNamespace(flat_grad=lambda: grad, shard_numel=n,
                               accumulate_grad_shard=lambda s: got[2].copy_(s))
        engine = EngineComms(config, g, g)
        engine.reduce_grads(flat)
        engine.finish_reduces()
        assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])

    # all-reduce with error feedback, two steps: functional, FSDP2's replica hook, DDP's hook
    ef = qcoll.ErrorFeedback()
    replica = qcoll.fsdp.QuantizedReplicaAllReduce(pg, bits=8, inter_bits=4, group_size=64, node_size=NODE_SIZE)
    state = qcoll.ddp.QuantizedHookState(g, bits=8, inter_bits=4, group_size=64)
    assert replica.policy == state.policy == AllReducePolicy(bits=8, inter_bits=4, group_size=64)
    for _ in range(2):
        x = torch.randn(999, generator=gen)
        got = [x.clone() for _ in range(3)]
        qcoll.quantized_all_reduce(got[0], g, bits=8, inter_bits=4, group_size=64, error_feedback=ef)
        replica(got[1])
        qcoll.ddp.quantized_allreduce_hook(state, _Bucket(got[2])).wait()
        assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
    return True


def test_entry_points_give_bit_identical_results():
    assert run_ranks(4, _entry_points_worker, timeout=300) == [True] * 4


@pytest.mark.parametrize("bits,itemsize,numel,ranks,host_transport,route", [
    # quantized: the two halves as configured, whatever the device
    (8, 4, 256, 4, True, ("halves", True, False)),
    (8, 2, 256, 4, False, ("halves", True, False)),
    # bits=None on GPU (no host transport): the halves; bf16/fp16 exchange the raw inputs
    (None, 2, 256, 4, False, ("halves", True, True)),
    (None, 4, 256, 4, False, ("halves", True, False)),
    # bits=None on host: unquantized_host_all_reduce's path; the exchange flat, raw inputs
    (None, 4, 256, 4, True, ("exchange", False, True)),
    (None, 2, 256, 4, True, ("exchange", False, True)),
    (None, 4, 256, 2, True, ("transport", True, False)),
    (None, 4, (1 << 20) // 4 + 1, 4, True, ("transport", True, False)),
    # 2-3 ranks: bf16/fp16 by the exchange from 1 MB, below it and fp32 by the transport
    (None, 2, (1 << 20) // 2, 3, True, ("exchange", False, True)),
    (None, 2, (1 << 20) // 2 - 1, 3, True, ("transport", True, False)),
    (None, 4, 64 << 20, 3, True, ("transport", True, False)),
])
def test_all_reduce_route_of_a_call(bits, itemsize, numel, ranks, host_transport, route):
    # all_reduce.py and the cost model both take their path from route: what it answers is
    # the call's path, hop layout and reduce-scatter input.
    policy = AllReducePolicy(bits=bits)
    assert tuple(policy.route(itemsize, numel, ranks, host_transport)) == route
    assert tuple(AllReducePolicy(bits=bits, hierarchical=False).route(itemsize, numel, ranks, host_transport))[1] is False


def test_all_reduce_route_follows_a_forced_host_path():
    policy = AllReducePolicy(bits=None)
    with qcoll.policy.host_all_reduce_path("exchange"):  # fp32 over 1 MB on 4 ranks: transport by the rule
        assert policy.route(4, 64 << 20, 4, True).path == "exchange"
        assert policy.route(4, 64 << 20, 4, False).path == "halves"  # no host transport: nothing to force
    with qcoll.policy.host_all_reduce_path("transport"):
        assert policy.route(2, 256, 4, True).path == "transport"
        assert AllReducePolicy(bits=8).route(2, 256, 4, True).path == "halves"  # quantized: never forced
