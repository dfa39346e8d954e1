"""An emulated cluster on one Linux machine: one network namespace per node, joined by
throttled links.

    root namespace:   bridge qcoll-bench-b
                        |-- veth qcoll-bench-0  (tbf: bridge -> node 0 at the link rate)
                        |-- veth qcoll-bench-1  ...
    namespace qcoll-bench-n0:  qcb-eth 10.77.0.1/24 (tbf: node 0 -> bridge), lo
    namespace qcoll-bench-n1:  qcb-eth 10.77.0.2/24 ...

Each node's ranks run inside its namespace with gloo bound to qcb-eth
(GLOO_SOCKET_IFNAME), so every rank advertises its node's veth address. A connection
between two ranks of one node targets a local address, which the kernel routes over that
namespace's loopback: intra-node traffic never touches the veth and runs at memory speed.
Cross-node traffic leaves through the node's veth, whose egress (node -> bridge) and the
bridge port's egress (bridge -> node) each carry a tbf qdisc at the link rate: a full-duplex
NIC of that rate per node. netem adds a one-way delay when the kernel has it (this VM's
kernel has no netem; the link then has the veth's own latency, tens of microseconds).

Everything made here is named with the qcoll-bench- prefix. Cleanup (teardown, called from
a finally block, atexit and SIGINT/SIGTERM/SIGHUP handlers) is idempotent and also removes
leftovers of an earlier run that died: namespaces and links with the prefix (processes still
inside a leftover namespace, which only this benchmark starts, are killed first).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import time

PREFIX = "qcoll-bench-"
IFACE = "qcb-eth"  # the node's interface, inside its namespace
SUBNET = "10.77.0"


def _ip(*args, check=True, ns=None) -> subprocess.CompletedProcess:
    argv = ["ip"] + (["-n", ns] if ns else []) + list(args)
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def _tc(ns, *args, check=True) -> subprocess.CompletedProcess:
    argv = (["ip", "netns", "exec", ns] if ns else []) + ["tc"] + list(args)
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def available() -> str:
    """'' when this machine can emulate a cluster, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"needs the `{tool}` command (iproute2)"
    return ""


def leftovers(prefix: str = PREFIX) -> tuple:
    """(namespaces, links) with the prefix, in the root namespace."""
    out = _ip("netns", "list", check=False).stdout.split("\n")
    spaces = [line.split()[0] for line in out if line.startswith(prefix)]
    links = []
    for line in _ip("-o", "link", "show", check=False).stdout.split("\n"):
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(prefix):
                links.append(name)
    return spaces, links


def cleanup(prefix: str = PREFIX) -> list:
    """Remove every namespace and link with the prefix; returns what was removed."""
    spaces, links = leftovers(prefix)
    for ns in spaces:
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:  # processes left in our own namespace by a run that died
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _ip("netns", "del", ns, check=False)
    for link in links:
        _ip("link", "del", link, check=False)
    # Namespace deletion frees its veth asynchronously: wait until nothing is left.
    deadline = time.monotonic() + 5
    while any(leftovers(prefix)) and time.monotonic() < deadline:
        for link in leftovers(prefix)[1]:
            _ip("link", "del", link, check=False)
        time.sleep(0.1)
    return spaces + links


class EmulatedCluster:
    """Context manager: nodes namespaces on a bridge; set_link() throttles them. prefix
    names everything made (a test uses its own, so it never removes a benchmark's)."""

    def __init__(self, nodes: int, prefix: str = PREFIX):
        if nodes > 250:
            raise ValueError("at most 250 nodes")
        if len(prefix) > 12:  # interface names: at most 15 characters
            raise ValueError(f"prefix {prefix!r} is longer than 12 characters")
        self.nodes = nodes
        self.prefix = prefix
        self._cleanup = lambda: cleanup(prefix)
        self.link = None
        self.delay_us = 0
        self._old_handlers = {}

    def namespace(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def _root_veth(self, node: int) -> str:
        return f"{self.prefix}{node}"

    # ---- life cycle -----------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        why = available()
        if why:
            raise RuntimeError(f"cannot emulate a cluster here: {why}")
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        atexit.register(self._cleanup)
        self._cleanup()  # leftovers of a run that died
        try:
            self._create()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._cleanup()
        finally:
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            self._old_handlers.clear()
            atexit.unregister(self._cleanup)

    def _on_signal(self, signum, frame):
        # Unwind through the finally blocks (the launcher kills the ranks, __exit__ cleans up).
        raise KeyboardInterrupt(f"signal {signum}")

    def _create(self) -> None:
        bridge = self.prefix + "b"
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for k in range(self.nodes):
            ns, veth = self.namespace(k), self._root_veth(k)
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", IFACE, "netns", ns)
            _ip("link", "set", veth, "master", bridge, "up")
            _ip("addr", "add", f"{self.address(k)}/24", "dev", IFACE, ns=ns)
            _ip("link", "set", IFACE, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)

    # ---- links ----------------------------------------------------------------------------
    def set_link(self, gbit, delay_us: int = 0) -> None:
        """Throttle every node's link to gbit Gbit/s each way (None: unthrottled), with a
        one-way delay where netem exists (recorded in self.delay_us: 0 if not applied)."""
        self.link, self.delay_us = gbit, 0
        for k in range(self.nodes):
            for ns, dev in ((self.namespace(k), IFACE), (None, self._root_veth(k))):
                _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
                if gbit is None:
                    continue
                parent = ["root"]
                if delay_us and _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                                    "delay", f"{delay_us}us", "limit", "100000", check=False).returncode == 0:
                    parent = ["parent", "1:"]
                    self.delay_us = delay_us
                # burst: ~1 ms of traffic at the rate (at least 64 KB, a GSO packet).
                burst = max(64 << 10, int(gbit * 1e9 / 8 / 1000))
                _tc(ns, "qdisc", "add", "dev", dev, *parent, "tbf", "rate", f"{gbit}gbit",
                    "burst", str(burst), "latency", "50ms")

    def exec_prefix(self, node: int) -> list:
        return ["ip", "netns", "exec", self.namespace(node)]

    def qdiscs(self) -> list:
        """`tc qdisc show` of every node's interface (for the record)."""
        return [_tc(self.namespace(k), "qdisc", "show", "dev", IFACE, check=False).stdout.strip()
                for k in range(self.nodes)]

    def probe(self, nbytes: int = 32 << 20, src: int = 0, dst: int = 1) -> dict:
        """Measured throughput node src -> node dst (one TCP stream) and round-trip time."""
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_netprobe.py")
        server = subprocess.Popen(self.exec_prefix(dst) + [sys.executable, here, "server", self.address(dst)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            server.stdout.readline()  # "ready"
            out = subprocess.run(self.exec_prefix(src) + [sys.executable, here, "client", self.address(dst),
                                                          str(nbytes)],
                                 check=True, capture_output=True, text=True, timeout=120).stdout
            gbps, rtt_us = map(float, out.split())
            return {"gbit_s": gbps, "rtt_us": rtt_us}
        finally:
            if server.poll() is None:
                server.kill()
            server.wait()
            server.stdout.close()


if __name__ == "__main__":  # python bench/suites/_netns.py: remove leftovers by hand
    removed = cleanup()
    print("removed: " + (", ".join(removed) if removed else "nothing"))
