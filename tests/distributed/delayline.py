"""A wire with delay, jitter and loss between two network namespaces, in userspace: where the
kernel has no ``sch_netem`` (``tc netem``), this process stands in for it.

Two TAP devices, one moved into each namespace with its address; every Ethernet frame read
from one is written to the other after ``delay`` seconds (plus uniform jitter in
``[-jitter, +jitter]``, order kept per direction, as netem's default queue keeps it), or
dropped with probability ``loss`` (seeded). ARP and TCP cross it like any wire. Run as a
process (root), it prints ``ready`` once both ends are up and runs until SIGTERM; every
select is bounded.

    python -m tests.distributed.delayline NS_A IF_A IP_A NS_B IF_B IP_B DELAY_MS JITTER_MS LOSS_PCT [SEED]
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time

TUNSETIFF, IFF_TAP, IFF_NO_PI = 0x400454CA, 0x0002, 0x1000


def tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def place(dev: str, ns: str, ip: str) -> None:
    for cmd in (["ip", "link", "set", dev, "netns", ns], ["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev],
                ["ip", "-n", ns, "link", "set", dev, "up"], ["ip", "-n", ns, "link", "set", "lo", "up"]):
        subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def run(ends, delay: float, jitter: float, loss: float, seed: int = 0) -> None:
    """Forward frames between the TAPs ``ends`` [(ns, dev, ip), (ns, dev, ip)] until SIGTERM."""
    fds = [tap(dev) for _, dev, _ in ends]
    for (ns, dev, ip) in ends:
        place(dev, ns, ip)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    rng, queue, seq = random.Random(seed), [], 0
    last = [0.0, 0.0]   # the latest due time per direction: frames leave in order
    print("ready", flush=True)
    while not stop:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, out, frame = heapq.heappop(queue)
            try:
                os.write(fds[out], frame)
            except OSError:   # the far end is down (a partition): the frame is lost
                pass
        wait = min(0.05, max(0.0, queue[0][0] - now)) if queue else 0.05
        ready, _, _ = select.select(fds, [], [], wait)
        now = time.monotonic()
        for i, fd in enumerate(fds):
            if fd not in ready:
                continue
            for _ in range(64):
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    break
                if loss and rng.random() < loss:
                    continue
                due = max(now + delay + (rng.uniform(-jitter, jitter) if jitter else 0.0), last[i])
                last[i] = due
                heapq.heappush(queue, (due, seq, 1 - i, frame))
                seq += 1
    for fd in fds:
        os.close(fd)


@contextlib.contextmanager
def wired(tag: str, delay_ms: float, jitter_ms: float = 0.0, loss_pct: float = 0.0, net: int = 79):
    """Two namespaces (``halt<tag>``, ``hald<tag>``) joined by this wire, its process running;
    yields (target ns, draft ns, target ip, draft ip, target if, draft if); removes them all."""
    t_ns, d_ns, t_ip, d_ip = f"halt{tag}", f"hald{tag}", f"10.{net}.1.1", f"10.{net}.1.2"
    line = None
    try:
        for ns in (t_ns, d_ns):
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=30)
        line = subprocess.Popen([sys.executable, "-m", "tests.distributed.delayline", t_ns, f"hta{tag}", t_ip, d_ns, f"htb{tag}",
                                 d_ip, str(delay_ms), str(jitter_ms), str(loss_pct)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if line.stdout.readline().strip() != "ready":
            raise RuntimeError(f"tests.distributed.delayline did not start: {line.stderr.read()[-2000:]}")
        yield t_ns, d_ns, t_ip, d_ip, f"hta{tag}", f"htb{tag}"
    finally:
        if line is not None:
            line.terminate()
            line.wait(30)
        for ns in (t_ns, d_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def tcp_rtt(ns_a: str, ns_b: str, ip_b: str, n: int = 50) -> float:
    """Median TCP round trip (s) of one-byte pings from ``ns_a`` to an echo in ``ns_b``."""
    echo = ("import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
            f"s.bind(('{ip_b}',7777));s.listen(1);print('up',flush=True);c,_=s.accept();"
            "c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\nwhile (d:=c.recv(64)): c.sendall(d)")
    ping = (f"import socket,time\nc=socket.create_connection(('{ip_b}',7777),timeout=10);"
            "c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1);ts=[]\n"
            f"for _ in range({n}):\n t=time.perf_counter();c.sendall(b'x');c.recv(64);ts.append(time.perf_counter()-t)\n"
            f"print(sorted(ts)[{n // 2}])")
    server = subprocess.Popen(["ip", "netns", "exec", ns_b, sys.executable, "-c", echo], stdout=subprocess.PIPE,
                              text=True)
    try:
        server.stdout.readline()
        r = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c", ping], capture_output=True,
                           text=True, timeout=60, check=True)
        return float(r.stdout.strip())
    finally:
        server.kill()
        server.wait(10)


if __name__ == "__main__":
    a = sys.argv[1:]
    run([(a[0], a[1], a[2]), (a[3], a[4], a[5])], float(a[6]) / 1e3, float(a[7]) / 1e3, float(a[8]) / 100,
        int(a[9]) if len(a) > 9 else 0)
