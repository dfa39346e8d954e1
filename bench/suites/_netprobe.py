"""Link probe for the emulated cluster: one TCP stream's throughput and the round-trip time.

    python _netprobe.py server ADDR            (prints "ready", serves one client)
    python _netprobe.py client ADDR NBYTES     (prints "GBIT_PER_S RTT_US")
"""

import socket
import statistics
import sys
import time

PORT = 29555


def server(addr: str) -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, PORT))
    s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(20):  # ping-pong for the RTT
        c.sendall(c.recv(1))
    buf = bytearray(1 << 20)
    while c.recv_into(buf):
        pass
    c.sendall(b"k")
    c.close()


def client(addr: str, nbytes: int) -> None:
    c = socket.create_connection((addr, PORT))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(20):
        t0 = time.perf_counter()
        c.sendall(b"p")
        c.recv(1)
        rtts.append(time.perf_counter() - t0)
    data = b"x" * (1 << 20)
    t0 = time.perf_counter()
    for _ in range(max(1, nbytes >> 20)):
        c.sendall(data)
    c.shutdown(socket.SHUT_WR)
    c.recv(1)
    dt = time.perf_counter() - t0
    print(f"{max(1, nbytes >> 20) * (1 << 20) * 8 / dt / 1e9:.4f} {statistics.median(rtts) * 1e6:.1f}")


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(sys.argv[2])
    else:
        client(sys.argv[2], int(sys.argv[3]))
