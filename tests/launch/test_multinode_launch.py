"""Issue 14.6: a real multi-node launch. Two emulated nodes, each a network namespace with
its own address (bench/suites/_netns.py), run `torchrun --nnodes 2 --nproc-per-node 2`
with c10d rendezvous at node 0's address; the examples take the node layout from the
launcher's environment (LOCAL_WORLD_SIZE), not from --node-size. Needs root and iproute2
(network namespaces); skipped with the reason elsewhere."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    """The same torchrun command on both nodes; returns [(returncode, output)] per node.
    Each launcher runs in a session of its own, killed whole (workers too) if it hangs."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME=_netns.IFACE, OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    env.pop("LOCAL_WORLD_SIZE", None)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.address(0)}:{PORT}",
            "--rdzv-id", run_id, "--max-restarts", "0", "--monitor-interval", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        logs = [os.path.join(tmp, f"node{node}.log") for node in range(2)]
        procs = []
        for node in range(2):
            with open(logs[node], "w") as log:
                # Both namespaces share the machine's hostname, so torchrun cannot tell
                # which node owns the endpoint address, nor reach a node by its name: node 0
                # is told it hosts the rendezvous store, and each node its own address.
                procs.append(subprocess.Popen(
                    cluster.exec_prefix(node) + argv + ["--rdzv-conf", f"is_host={int(node == 0)}",
                                                        "--local-addr", cluster.address(node)]
                    + script_args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True))
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            hung = [p.poll() is None for p in procs]
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        outs = []
        for p, log in zip(procs, logs):
            with open(log, errors="replace") as f:
                outs.append((p.returncode, f.read()))
    if any(hung):
        raise AssertionError(f"torchrun did not finish within {timeout} s:\n"
                             + "\n---\n".join(out[-3000:] for _, out in outs))
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


def test_train_fsdp2_under_torchrun_on_two_nodes(cluster):
    # No --node-size: the world's layout is the launcher's, the hpZ sub-groups' their hosts'.
    outs = _torchrun(cluster, ["examples/train_fsdp2.py", "--steps", "5", "--log-every", "5"],
                     "qcoll-fsdp2")
    for node, (code, out) in enumerate(outs):
        assert code == 0, f"node {node} failed:\n{out[-3000:]}"
    text = " ".join("".join(out for _, out in outs).split())  # rich wraps at the terminal width
    assert "4 ranks as 2 node(s) x 2" in text, text[-3000:]
    assert "FSDP2 + qcoll" in text and "cross-node bytes / step" in text, text[-3000:]


def test_examples_refuse_node_size_under_a_launcher():
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    for script in ("examples/collectives_demo.py", "examples/train_zero3.py"):
        proc = subprocess.run([sys.executable, script, "--node-size", "2"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "launcher" in proc.stderr, (script, proc.stderr[-500:])
