"""qcoll's host GPU path on the CPU (README "The GPU host path on the CPU"): under the
virtual GPU (QCOLL_VIRTUAL_GPU=1) CPU tensors take qcoll's CUDA branch, over its NCCL
driver (src/comm/nccl_comm.cpp, loaded through the unchanged loader) and the NCCL
stand-in, on the emulated CUDA runtime's streams, events and graphs; the kernels run under
the SIMT emulator. Ranks are processes (virtual_gpu.py, scenarios in vgpu_scenarios.py)."""

from __future__ import annotations

import importlib.util
import time

import pytest

from tests.support.virtual_gpu import run_virtual

pytestmark = [
    pytest.mark.virtual_gpu,
    pytest.mark.skipif(importlib.util.find_spec("qcoll._C_emu") is None,
                       reason="qcoll was built without the virtual GPU (QCOLL_VGPU=OFF)"),
]


@pytest.mark.parametrize("world,node_size", [(4, 2), (6, 2)], ids=["2x2", "3x2"])
def test_collectives_over_nccl_driver_match_gloo(world, node_size):
    results = run_virtual(world, "collectives", node_size, timeout=300)
    checked = results[0]["checked"]
    assert all(r["checked"] == checked for r in results)
    assert len(checked) >= 30, checked
    # The stand-in's own fp16/fp32 reduce-scatter against numpy's per-step rounding.
    assert sum("nccl reduce_scatter" in c for c in checked) == 4, checked
    # Every call went through qcoll's NCCL communicators (their watchdog counts them).
    assert all(r["nccl_ops"] >= len(checked) for r in results), [r["nccl_ops"] for r in results]


def test_async_calls_overlap_and_wait():
    results = run_virtual(4, "async_calls", 2, timeout=120)
    # Ranks other than the late one got their Works back while the calls were pending.
    for r in results[:-1]:
        assert r["issued_s"] < 2.5, r  # the late rank joins after 3 s
        assert all(r["pending"]), r


def test_graph_capture_and_replay_give_the_same_bits():
    assert run_virtual(4, "graph_replay", 2, timeout=120) == [[0, 1]] * 4


@pytest.mark.parametrize("fault", ["die", "stall"])
def test_dead_or_stalled_peer_fails_every_survivor_within_the_timeout(fault):
    timeout_s = 3.0
    dead = (3,) if fault == "die" else ()
    env = {3: {"QCOLL_NCCL_EMU_FAULT": f"{fault}:1"}}
    results = run_virtual(4, "dead_peer", 2, timeout_s, env=env, dead=dead, timeout=60)
    survivors = [r for r in results if r is not None]
    assert len(survivors) == (3 if fault == "die" else 4)
    for r in survivors:
        if r["elapsed"] < 0.5:  # the staller's own call: its peers' aborts end it
            continue
        assert r["elapsed"] < timeout_s + 3.0, r
        # The call's Work raises CommunicationError; a dead peer that NCCL already reports
        # when the call is enqueued makes the call itself raise it (the same type).
        assert r["error"] == "CommunicationError" or (
            fault == "die" and r["error"] == "at enqueue: CommunicationError"), r
        # A dead peer is NCCL's asynchronous remote error; a stalled one, the timeout.
        why = "remote process exited" if fault == "die" else "did not complete within the timeout"
        assert r["raised"] and why in r["raised"], r
        assert r["later"] and "NCCL communicator aborted" in r["later"], r
        assert r["later_type"] == "CommunicationError", r


def test_init_that_never_completes_is_bounded_and_aborted():
    timeout_s = 2.0
    results = run_virtual(2, "never_joins", timeout_s,
                          env={1: {"QCOLL_NCCL_EMU_FAULT": "never_join"}}, timeout=90)
    for r in results:
        assert r["error"] and "did not all join within the timeout" in r["error"], r
        assert r["error_type"] == "CommunicationError", r
        assert r["elapsed"] < timeout_s + 3.0, r
        assert r["live"] == 0, r


def test_interpreter_exit_with_live_communicators():
    assert run_virtual(2, "exit_with_live_communicators", timeout=90) == ["exiting"] * 2


def test_a_group_dropped_with_a_call_in_flight_keeps_its_memory():
    # Before the CUDA calls of dropped Groups were orphaned (streams.py), about 1 run in 12-24
    # died of heap corruption here: the call's buffers were freed under the running stream.
    for _ in range(3):
        assert run_virtual(2, "exit_with_live_communicators", False, timeout=90) == ["exiting"] * 2



def test_dropping_a_group_never_waits_for_the_peers():
    timeout_s = 20.0
    results = run_virtual(2, "dropped_while_a_peer_keeps_it", timeout_s, timeout=120)
    assert results[0]["dropped_s"] < 2.0, results  # was the whole timeout, then an abort
    for r in results:
        # Destroyed and freed once both dropped (finalize met the peer), not aborted at the
        # timeout, and gone from the registry that aborts at exit.
        assert r["freed"] and r["freed_s"] < timeout_s / 2 and r["live"] == 0, results


def test_exit_ends_a_release_still_waiting_for_its_peers():
    timeout_s = 30.0
    ended = run_virtual(2, "exit_while_a_release_waits", timeout_s, timeout=120)
    assert time.time() - max(ended) < timeout_s / 2  # the exits, not held up until the timeout


def test_a_kept_sub_group_works_after_its_parent_is_dropped():
    for r in run_virtual(4, "sub_group_outlives_its_parent", timeout=120):
        assert r["parent_freed"], r  # the parent's and inter's communicators, not the kept one's
        assert r["dropped_s"] < 2.0 and r["freed"] and r["freed_s"] < 15, r

def test_ddp_fsdp2_and_zero_train_the_same_bits_over_the_nccl_driver():
    # Each rank compared its losses and parameters with the gloo run's, bit for bit.
    results = run_virtual(4, "training", 3, timeout=300)
    assert all(set(r) == {"ddp", "fsdp", "zero"} and len(r["ddp"]) == 3 for r in results)
    assert all(r["zero"] == results[0]["zero"] for r in results)  # the global mean loss


def test_loader_reports_bad_libraries_and_reuses_a_mapped_nccl(tmp_path):
    (r,) = run_virtual(1, "loader", str(tmp_path), timeout=60)
    assert "cannot load NCCL" in r["missing"] and "no-such-libnccl" in r["missing"], r
    assert "lacks symbol ncclGetVersion" in r["not-nccl"], r
    assert r["mapped"] == "2.28.3" and r["unique_id"] == 128, r


def test_backend_none_takes_one_transport_on_every_rank():
    """A rank that cannot load NCCL makes every rank of a backend=None group take the torch
    transport (one exchange at its first GPU call): deciding alone, it left the others
    waiting in the NCCL communicator's creation."""
    results = run_virtual(2, "backend_none_agrees", 1, timeout=120)
    assert results == [{"nccl": False, "usable": False}] * 2, results


def test_async_calls_keep_their_error_feedback_residuals():
    results = run_virtual(4, "residuals_kept", 2, timeout=180)
    for r in results:
        assert r["all_reduce"] == (["input", "inter", "shard"], True), r
        assert r["reduce_scatter"] == (["input", "inter"], True), r
