"""Issue 14.6: a real multi-node launch. Two emulated nodes, each a network namespace with
its own address (bench/suites/_netns.py), run `torchrun --nnodes 2 --nproc-per-node 2`
with c10d rendezvous at node 0's address; the examples take the node layout from the
launcher's environment (LOCAL_WORLD_SIZE), not from --node-size. Needs root and iproute2
(network namespaces); skipped with the reason elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from suites import _netns  # noqa: E402

PREFIX = "qcoll-test-"  # its own names: never touches a benchmark's namespaces
PORT = 29471


def _cluster():
    why = _netns.available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    cluster = _netns.EmulatedCluster(2, prefix=PREFIX)
    try:
        cluster.__enter__()
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        _netns.cleanup(PREFIX)
        detail = getattr(exc, "stderr", "") or str(exc)
        pytest.skip(f"network namespaces unavailable: {detail.strip()}")
    return cluster


@pytest.fixture(scope="module")
def cluster():
    c = _cluster()
    try:
        yield c
    finally:
        c.__exit__(None, None, None)


def _torchrun(cluster, script_args, run_id, timeout=240):
    """The same torchrun command on both nodes; returns [(returncode, output)] per node."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME=_netns.IFACE, OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    env.pop("LOCAL_WORLD_SIZE", None)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.address(0)}:{PORT}",
            "--rdzv-id", run_id, "--max-restarts", "0", "--monitor-interval", "1"] + script_args
    procs = [subprocess.Popen(cluster.exec_prefix(node) + argv, cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for node in range(2)]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def test_collectives_demo_under_torchrun_on_two_nodes(cluster):
    outs = _torchrun(cluster, ["examples/collectives_demo.py", "--numel", "200000"], "qcoll-demo")
    for node, (code, out) in enumerate(outs):
        assert code == 0, f"node {node} failed:\n{out[-3000:]}"
    text = "".join(out for _, out in outs)
    assert "4 ranks as 2 nodes x 2" in text, text[-3000:]
    assert "cross-node bytes of the gradient reduce-scatter" in text, text[-3000:]


def test_train_zero3_under_torchrun_on_two_nodes(cluster):
    outs = _torchrun(cluster, ["examples/train_zero3.py", "--steps", "5", "--log-every", "5"],
                     "qcoll-train")
    for node, (code, out) in enumerate(outs):
        assert code == 0, f"node {node} failed:\n{out[-3000:]}"
    text = "".join(out for _, out in outs)
    assert "4 ranks as 2 node(s) x 2" in text, text[-3000:]
    assert "ZeRO++" in text and "cross-node bytes / step" in text, text[-3000:]


def test_examples_refuse_node_size_under_a_launcher():
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    for script in ("examples/collectives_demo.py", "examples/train_zero3.py"):
        proc = subprocess.run([sys.executable, script, "--node-size", "2"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "launcher" in proc.stderr, (script, proc.stderr[-500:])
