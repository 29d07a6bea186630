"""Draft and target on two hosts for real: two Linux network namespaces this test creates
and removes, joined by a veth pair with an address each (10.77.N.1 and 10.77.N.2), the
ranks talking torch.distributed (gloo) over that interface only (``GLOO_SOCKET_IFNAME``), as
on two machines. The link is shaped with a token bucket (``tc tbf``, 50 Mbit/s). Greedy
output equals plain greedy; with the link down before the rendezvous the target serves
alone.

Skips, saying why, where namespaces cannot be made (not root, no ``ip``). Delay, jitter and
loss use ``tc netem`` (the kernel's ``sch_netem``) where it exists, else `tests.distributed.delayline`: the
two namespaces joined through two TAP devices by a userspace wire that holds and drops
frames the same way. Every wait is bounded.

The partition-and-rejoin test (about a minute) is slow: it runs with HAL_SLOW=1 (``make bench``);
a worker lost and rejoined over loopback stays in the suite (tests/launch/test_generate.py)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.launch.test_generate import V, plain, serve_args, tiny  # noqa: F401  (tiny: the model fixture)


def _run(*cmd, check=True):
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture
def hosts():
    """Two namespaces and a veth pair; yields (target ns, draft ns, target ip, draft ip, target if, draft if)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    tag = f"{os.getpid() % 10000}"
    t_ns, d_ns, t_if, d_if = f"halt{tag}", f"hald{tag}", f"hvt{tag}", f"hvd{tag}"
    net = 10 + os.getpid() % 200
    t_ip, d_ip = f"10.77.{net}.1", f"10.77.{net}.2"
    try:
        _run("ip", "netns", "add", t_ns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace here: {e.stderr.strip()}")
    try:
        _run("ip", "netns", "add", d_ns)
        _run("ip", "link", "add", t_if, "type", "veth", "peer", "name", d_if)
        for ns, dev, ip in ((t_ns, t_if, t_ip), (d_ns, d_if, d_ip)):
            _run("ip", "link", "set", dev, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if shutil.which("tc"):
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", "50mbit",
                     "burst", "64kb", "latency", "50ms", check=False)
        yield t_ns, d_ns, t_ip, d_ip, t_if, d_if
    finally:
        for ns in (t_ns, d_ns):   # removing a namespace removes its end of the veth pair
            _run("ip", "netns", "del", ns, check=False)


def netem_or_delayline(hosts, delay_ms: float, jitter_ms: float, loss_pct: float):
    """Shape both ends with ``tc netem``; where the kernel has none, rewire the two namespaces
    through `tests.distributed.delayline` instead (same addresses, TAP devices in place of the veth pair).
    Returns (hosts, the delay line's process or None)."""
    t_ns, d_ns, t_ip, d_ip, t_if, d_if = hosts
    ok = all(_run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem", "delay",
                  f"{delay_ms}ms", f"{jitter_ms}ms", "loss", f"{loss_pct}%", check=False).returncode == 0
             for ns, dev in ((t_ns, t_if), (d_ns, d_if)))
    if ok:
        return hosts, None
    if not os.path.exists("/dev/net/tun"):
        pytest.skip("neither tc netem (the kernel's sch_netem) nor /dev/net/tun for tests.distributed.delayline")
    _run("ip", "-n", t_ns, "link", "del", t_if)   # the veth pair goes; TAP devices take its addresses
    tag = t_if[3:]
    line = subprocess.Popen([sys.executable, "-m", "tests.distributed.delayline", t_ns, f"hta{tag}", t_ip, d_ns, f"htb{tag}",
                             d_ip, str(delay_ms), str(jitter_ms), str(loss_pct), "7"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if line.stdout.readline().strip() != "ready":
        line.kill()
        raise AssertionError(f"tests.distributed.delayline did not start: {line.stderr.read()[-2000:]}")
    return (t_ns, d_ns, t_ip, d_ip, f"hta{tag}", f"htb{tag}"), line


def ranks(hosts, args, draft_env=None, timeout=300):
    """The draft rank in one namespace, the target rank in the other; returns the target's result."""
    t_ns, d_ns, t_ip, _, t_if, d_if = hosts
    env = {**os.environ, "MASTER_ADDR": t_ip, "MASTER_PORT": "29517", "WORLD_SIZE": "2",
           "HAL_PLACEMENT": "draft=cpu,target=cpu", "OMP_NUM_THREADS": str(_threads())}
    cmd = [sys.executable, "-m", "hal.launch", *args]
    draft = subprocess.Popen(["ip", "netns", "exec", d_ns, *cmd],
                             env={**env, "RANK": "1", "GLOO_SOCKET_IFNAME": d_if, **(draft_env or {})},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        target = subprocess.run(["ip", "netns", "exec", t_ns, *cmd], env={**env, "RANK": "0", "GLOO_SOCKET_IFNAME": t_if},
                                capture_output=True, text=True, timeout=timeout)
    finally:
        try:
            draft.wait(timeout=60)
        except subprocess.TimeoutExpired:
            draft.kill()
            draft.wait(10)
    return target, draft


def _threads() -> int:
    import torch
    return torch.get_num_threads()


def test_greedy_over_a_veth_link_equals_plain(tiny, hosts, tmp_path):  # noqa: F811
    out = tmp_path / "o.json"
    target, draft = ranks(hosts, serve_args(tiny, out, "--draft", "self:2", "--k", "3"))
    assert target.returncode == 0, target.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["world_size"] == 2 and got["link"] == "gloo"
    assert got["outputs"] == plain(tiny, "cpu"), "greedy output over the link differs from plain greedy"
    assert got["draft_failures"] == 0 and got["acceptance_rate"] > 0   # drafts crossed the link
    assert all(0 <= t < V for o in got["outputs"] for t in o)


def test_a_link_down_before_the_rendezvous_leaves_the_target_alone(tiny, hosts, tmp_path):  # noqa: F811
    t_ns, d_ns, *_ , d_if = hosts
    _run("ip", "-n", d_ns, "link", "set", d_if, "down")
    out = tmp_path / "o.json"
    target, _ = ranks(hosts, serve_args(tiny, out, "--draft", "self:2", "--k", "3", "--draft-startup-timeout", "5"))
    assert target.returncode == 0, target.stderr[-3000:]
    assert "did not join" in target.stderr
    got = json.loads(out.read_text())
    assert got["outputs"] == plain(tiny, "cpu") and got["draft_failures"] == 1


def test_greedy_under_delay_jitter_and_loss_equals_plain(tiny, hosts, tmp_path):  # noqa: F811
    """1 ms +- 0.5 ms each way and 1% loss (tc netem, or tests.distributed.delayline where the kernel has
    none): TCP retransmits, greedy output is still plain greedy's."""
    shaped, line = netem_or_delayline(hosts, 1.0, 0.5, 1.0)
    try:
        out = tmp_path / "o.json"
        target, _ = ranks(shaped, serve_args(tiny, out, "--draft", "self:2", "--k", "3"))
        assert target.returncode == 0, target.stderr[-3000:]
        got = json.loads(out.read_text())
        assert got["outputs"] == plain(tiny, "cpu") and got["draft_failures"] == 0 and got["rounds"] > 0
        print(f"shaped link: {got['rounds']} rounds, {1e3 * got['round_trip_seconds'] / got['rounds']:.2f} ms each")
    finally:
        if line is not None:
            line.terminate()
            line.wait(30)


@pytest.mark.skipif(os.environ.get("HAL_SLOW") != "1", reason="slow: run with HAL_SLOW=1 (make bench)")
def test_a_partition_mid_stream_heals_and_the_worker_rejoins(hosts, tmp_path):
    """The server as the target in one namespace, an n-gram worker in the other. Mid-stream
    the target's end of the link goes down: the target counts the worker lost and serves
    alone; the link comes back: the worker rejoins by a new epoch and drafts resume. Every
    answer (a stream spanning it all, and requests one after another) is plain greedy's."""
    pytest.importorskip("httpx")
    from tests.server.test_app import MODEL
    import hal
    try:
        from hal.models.fetch import fetch
        fetch(MODEL)
    except hal.HalError as e:
        pytest.skip(f"model not fetchable: {e}")
    t_ns, d_ns, t_ip, _, t_if, d_if = hosts
    env = {**os.environ, "MASTER_ADDR": t_ip, "MASTER_PORT": "29519", "WORLD_SIZE": "2", "HAL_BACKEND": "cpu"}
    cmd = [sys.executable, "-m", "hal.server.app", "--model", MODEL, "--draft", "ngram", "--k", "4", "--no-route", "--port", "8031",
           "--host", "127.0.0.1", "--max-model-len", "512", "--cpu-budget-gib", "2", "--draft-timeout", "3"]
    logs = [open(tmp_path / f"{n}.log", "w") for n in ("target", "draft")]
    draft = subprocess.Popen(["ip", "netns", "exec", d_ns, *cmd], env={**env, "RANK": "1", "GLOO_SOCKET_IFNAME": d_if},
                             stdout=logs[1], stderr=subprocess.STDOUT)
    target = subprocess.Popen(["ip", "netns", "exec", t_ns, *cmd], env={**env, "RANK": "0", "GLOO_SOCKET_IFNAME": t_if},
                              stdout=logs[0], stderr=subprocess.STDOUT)
    try:
        r = subprocess.run(["ip", "netns", "exec", t_ns, sys.executable, "tests/distributed/netns_partition.py",
                            "http://127.0.0.1:8031", t_if, MODEL], capture_output=True, text=True, timeout=600)
        log = "".join((tmp_path / f"{n}.log").read_text()[-2500:] for n in ("target", "draft"))
        assert r.returncode == 0, r.stdout + r.stderr[-3000:] + log
        got = json.loads(r.stdout.strip().splitlines()[-1])
        print(got)
        assert got["lost"] >= 1 and got["rejoined"] == got["lost"], got   # every loss rejoined
        assert got["wrong"] == [] and got["long_equal"], (got, log)   # nothing lost, duplicated or changed
        assert got["stream_chunks_at_down"] > 0 and got["requests"] >= 1, got   # the partition was mid-stream
    finally:
        for p in (target, draft):
            p.terminate()
        for p in (target, draft):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
