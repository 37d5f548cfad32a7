"""Self-test of the two-hosts infrastructure (tests/two_hosts.py): ssh from the head really lands in
the node's network namespace, the node reaches the head's address (and not its loopback), and
teardown leaves nothing behind."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers import alive
from two_hosts import TwoHosts, unavailable_reason

pytestmark = pytest.mark.slow

# Serves b"head\n" to every connection on (HOST, 0); prints its port once listening.
LISTENER = """
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], 0))
s.listen()
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    c.sendall(b"head\\n")
    c.close()
"""

# Connects to (HOST, PORT): prints what it read, or the error's name.
CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3) as c:
        print(c.makefile().readline().strip())
except OSError as e:
    print(type(e).__name__)
"""

# The source address the kernel picks for an outside destination (what zpp's head advertises).
ROUTE_SOURCE = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect(("10.255.255.255", 1))
print(s.getsockname()[0])
"""


def _output(p: subprocess.Popen, timeout: float = 20) -> str:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"exit {p.returncode}: {err}"
    return out


def _wait_empty(hosts: TwoHosts, ns: str, timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := hosts.pids_in(ns)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _count(pids: list[int], comm: str) -> int:
    n = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/comm") as f:
                n += f.read().strip() == comm
        except OSError:
            pass
    return n


def test_ssh_from_head_runs_in_node(two_hosts):
    h = two_hosts
    parts = ["ip -4 -o addr", "readlink /proc/self/ns/net", "echo $SSH_CONNECTION", "cat /proc/self/net/dev",
             "command -v zpp-node; echo \"$PYTHONPATH\""]
    p = h.run_in_head(h.ssh_argv("; echo ---; ".join(parts)), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
    addrs, ns_link, ssh_connection, net_dev, env = _output(p).split("---\n")
    assert f"inet {h.node_ip}/24" in addrs and h.head_ip not in addrs
    assert ns_link.strip() == f"net:[{os.stat(f'/run/netns/{h.node_ns}').st_ino}]"  # the node namespace itself
    assert ssh_connection.split()[0] == h.head_ip  # came from the head's address over the veth
    assert sorted(line.split(":")[0].strip() for line in net_dev.splitlines()[2:]) == ["eth0", "lo"]
    # The fixture's session environment: this PYTHONPATH, but not this venv on PATH (like a fresh
    # host: tests name the agent with --node-command).
    venv_agent = os.path.join(os.path.dirname(sys.executable), "zpp-node")
    assert venv_agent not in env
    assert env.splitlines()[-1] == os.environ.get("PYTHONPATH", "")
    assert not _wait_empty(h, h.node_ns), "ssh session left processes on the node"
    assert h.sshd_pid in h.pids_in(h.node_ns, include_sshd=True)


def test_node_reaches_head_address_not_its_loopback(two_hosts):
    h = two_hosts
    pipes = dict(stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    on_addr = h.run_in_head([sys.executable, "-c", LISTENER, h.head_ip], **pipes)
    on_lo = h.run_in_head([sys.executable, "-c", LISTENER, "127.0.0.1"], **pipes)
    try:
        port_addr, port_lo = on_addr.stdout.readline().strip(), on_lo.stdout.readline().strip()
        assert port_addr and port_lo, "listeners did not start"

        def connect(run, host, port):
            return _output(run([sys.executable, "-c", CLIENT, host, port], **pipes)).strip()

        assert connect(h.run_in_node, h.head_ip, port_addr) == "head"
        assert connect(h.run_in_head, "127.0.0.1", port_lo) == "head"  # the listener works...
        assert connect(h.run_in_node, "127.0.0.1", port_lo) == "ConnectionRefusedError"  # ...not from the node
        # With the default route, the head's outward address is head_ip (not 127.0.0.1).
        assert _output(h.run_in_head([sys.executable, "-c", ROUTE_SOURCE], **pipes)).strip() == h.head_ip
    finally:
        for p in (on_addr, on_lo):
            p.kill()
            p.communicate()
    assert not h.pids_in(h.head_ns) and not _wait_empty(h, h.node_ns)


def test_name_lookups_fail_at_once(two_hosts):
    """No DNS server is reachable from the namespaces: a reverse lookup (what the rendezvous store
    does for each client) must fail at once, not wait out the resolver's timeouts (10 s a lookup)."""
    h = two_hosts
    for run, ip in ((h.run_in_head, h.node_ip), (h.run_in_node, h.head_ip)):
        t0 = time.monotonic()
        p = run(["getent", "hosts", ip], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.communicate(timeout=30)
        assert time.monotonic() - t0 < 2, f"a lookup of {ip} took {time.monotonic() - t0:.1f} s"


def test_teardown_leaves_nothing():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    hosts = TwoHosts().start()
    try:
        local = hosts.run_in_node(["sleep", "60"])
        remote = hosts.run_in_head(hosts.ssh_argv("sleep 60"), stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10  # until the session runs its command: two sleeps on the node
        while _count(hosts.pids_in(hosts.node_ns), "sleep") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = hosts.pids_in(hosts.head_ns) + hosts.pids_in(hosts.node_ns, include_sshd=True)
        assert {hosts.sshd_pid, local.pid, remote.pid} <= set(pids) and len(pids) >= 5
    finally:
        hosts.teardown()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    for ns in (hosts.head_ns, hosts.node_ns):
        assert ns not in listed and not os.path.exists(f"/run/netns/{ns}")
        assert not os.path.exists(f"/etc/netns/{ns}")
    assert not [p for p in pids if alive(p)]
    assert not os.path.exists(hosts.tmpdir)
    sshd_left = subprocess.run(["pgrep", "-f", hosts.sshd_config], capture_output=True, text=True).stdout
    assert not sshd_left
    hosts.teardown()  # idempotent
