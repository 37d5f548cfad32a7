"""Two real hosts on one Linux machine, for multi-host tests: two network namespaces and a veth cable.

Topology (``R`` is picked per run among 200..250 so that 10.R.0.0/24 overlaps no address or route of
this machine; ``<id>`` is ``<pid>-<n>``, unique per run and per instance)::

      zpp-head-<id>                                   zpp-node-<id>
    +----------------------------------+            +----------------------------------+
    | lo    127.0.0.1                  |            | lo    127.0.0.1                  |
    | eth0  10.R.0.1/24 ---------------+---veth-----+ eth0  10.R.0.2/24                |
    | default via 10.R.0.2             |            | sshd on 10.R.0.2:22 (root, key)  |
    | the zpp head runs here; it       |            | sessions (zpp-node, its workers) |
    | reaches the node with ssh        |            | run here                         |
    +----------------------------------+            +----------------------------------+

Only the network is separate: both "hosts" share this machine's files, users, pids and hostname (so
the node sees the same venv and model files as the head). Neither namespace is connected to the
machine's own network, and each has its own loopback: 127.0.0.1 on the node is not the head. The head
has a default route, as a real host would, so "which of my addresses reaches the outside" (a UDP
``connect`` to any address) answers 10.R.0.1 there. The veth ends are created directly inside the
namespaces (both named ``eth0``), so nothing ever appears in the machine's own ``ip link``; deleting a
namespace deletes its end, and with it the pair.

Name lookups: the machine's resolver (``/etc/resolv.conf``) is unreachable from the namespaces, so a
DNS query from them would wait out its timeouts (10 s with glibc's defaults; the rendezvous store
looks up each client's address that way, and every zpp start-up in the head paid it). Each
namespace gets its own ``/etc/netns/<ns>/resolv.conf`` (``ip netns exec`` mounts it over
``/etc/resolv.conf``) naming no server: /etc/hosts still answers, any other lookup fails at once,
as on a host whose DNS server refuses it.

sshd runs in the node namespace only, from a throwaway config in a private temp dir (host key, client
key, authorized_keys, pid file and log all live there); ``ssh_command`` is the matching client command
(for ``$ZPP_SSH``), to be run from the head namespace. sshd gives sessions a minimal environment
(``PATH=/usr/local/sbin:...:/bin``, ``HOME=/root``, cwd ``/root``; nothing from the client since no
``AcceptEnv``): pass ``remote_env`` to set variables in every session (sshd's ``SetEnv``), e.g. a
``PATH`` that starts with the venv's ``bin`` so that ``zpp-node`` is found. The remote command runs
through root's login shell, and Debian's bash reads ``~/.bashrc`` when started by sshd, even for a
non-interactive command: whatever that file does (on this machine, pyenv and cargo put first in
``PATH``, ~0.3 s) happens on the node too, as it would on a real host.

Use::

    hosts = TwoHosts(remote_env={"PATH": ...}).start()   # or: with TwoHosts() as hosts: ...
    try:
        ...
    finally:
        hosts.teardown()   # kills every process in both namespaces, deletes them and the temp dir

``teardown`` is idempotent and also registered with ``atexit``. ``unavailable_reason()`` says why this
cannot work here (not root, no ``ip netns``); ``ensure_openssh()`` installs openssh-server when it is
missing (apt-get).
"""
from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import random
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Mapping, Optional, Sequence

SSHD = "/usr/sbin/sshd"
SUBNET_CANDIDATES = range(200, 251)  # R in 10.R.0.0/24
READY_TIMEOUT_S = 10.0
KILL_GRACE_S = 2.0

_instances = itertools.count()


class SetupError(RuntimeError):
    """The two hosts could not be set up (the message has the failing command and its stderr)."""


class TeardownError(RuntimeError):
    """Something was left behind by teardown (processes that would not die, a namespace not deleted)."""


def unavailable_reason() -> Optional[str]:
    """Why network namespaces cannot be used here (a reason to skip), or None when they can."""
    if os.geteuid() != 0:
        return "two_hosts needs root (network namespaces, sshd)"
    if shutil.which("ip") is None:
        return "two_hosts needs iproute2's `ip` (not found)"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns` is unavailable: {r.stderr.strip() or r.returncode}"
    return None


def ensure_openssh(timeout: float = 600.0) -> None:
    """Install openssh-server (which brings the client) with apt-get when sshd, ssh or ssh-keygen is
    missing. Daemons are kept from starting during the install (policy-rc.d) so that no system sshd
    is left running. Raises SetupError when the install fails."""
    if os.access(SSHD, os.X_OK) and shutil.which("ssh") and shutil.which("ssh-keygen"):
        return
    if shutil.which("apt-get") is None:
        raise SetupError(f"{SSHD} (or ssh, ssh-keygen) is missing and there is no apt-get to install openssh-server")
    print("two_hosts: sshd missing: apt-get update && apt-get install -y openssh-server", flush=True)
    policy = "/usr/sbin/policy-rc.d"
    own_policy = not os.path.exists(policy)
    if own_policy:
        with open(policy, "w") as f:
            f.write("#!/bin/sh\n# written by zpp's tests/two_hosts.py during an install; removed after it\nexit 101\n")
        os.chmod(policy, 0o755)
    try:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "openssh-server"]):
            _run(cmd, timeout=timeout, env=env)
    finally:
        if own_policy:
            os.unlink(policy)
    if not os.access(SSHD, os.X_OK):
        raise SetupError(f"openssh-server installed but {SSHD} is still missing")


def _run(cmd: Sequence[str], timeout: float = 30.0, env: Optional[Mapping[str, str]] = None) -> str:
    """Run a setup command; its stdout, or SetupError with its stderr."""
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SetupError(f"`{shlex.join(cmd)}`: {e}") from e
    if r.returncode != 0:
        raise SetupError(f"`{shlex.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def used_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks of this machine's addresses and routes (all tables), default routes left out."""
    nets = []
    for line in _run(["ip", "-4", "-o", "addr", "show"]).splitlines():
        words = line.split()
        if "inet" in words:
            nets.append(ipaddress.ip_interface(words[words.index("inet") + 1]).network)
    for line in _run(["ip", "-4", "route", "show", "table", "all"]).splitlines():
        for word in line.split()[:2]:  # "DEST ..." or "TYPE DEST ..." (local, broadcast, unreachable...)
            try:
                nets.append(ipaddress.ip_network(word, strict=False))
                break
            except ValueError:
                continue
    return [n for n in nets if n.prefixlen > 0]


def pick_subnet() -> int:
    """R such that 10.R.0.0/24 overlaps none of this machine's addresses or routes (routes wider than
    /16, e.g. a VPN's 10.0.0.0/8, are not counted: they would rule out every candidate, and the
    namespaces have routing tables of their own anyway). Random among the free ones, so that
    concurrent runs tend to differ (not required: each pair of namespaces is isolated)."""
    used = [n for n in used_networks() if n.prefixlen >= 16]
    free = [r for r in SUBNET_CANDIDATES
            if not any(ipaddress.ip_network(f"10.{r}.0.0/24").overlaps(n) for n in used)]
    if not free:
        raise SetupError(f"no free 10.R.0.0/24 with R in {SUBNET_CANDIDATES.start}..{SUBNET_CANDIDATES.stop - 1}")
    return random.choice(free)


def netns_pids(ns: str) -> list[int]:
    """Pids of the processes whose network namespace is ``ns`` (``ip netns pids``; [] once it is gone)."""
    if not os.path.exists(f"/run/netns/{ns}"):
        return []
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _quote_setenv(name: str, value: str) -> str:
    if not name.replace("_", "").isalnum() or any(c in value for c in '"\\\n'):
        raise ValueError(f"remote_env: cannot pass {name}={value!r} through sshd_config SetEnv")
    return f'"{name}={value}"'


class TwoHosts:
    """A head and a node namespace joined by a veth pair, sshd in the node. See the module docstring.

    After ``start()``:

    - ``head_ns``, ``node_ns`` (str): namespace names, for ``ip netns exec``
    - ``head_ip``, ``node_ip`` (str): 10.R.0.1 and 10.R.0.2; ``subnet`` (int): R
    - ``ssh_command`` (str): the client command, usable as ``$ZPP_SSH`` (run it from the head namespace)
    - ``node_target`` (str): ``root@<node_ip>``
    - ``sshd_pid`` (int): sshd's listener, in the node namespace
    - ``tmpdir``, ``key_path``, ``sshd_config``, ``sshd_log`` (str): the throwaway files
    """

    def __init__(self, remote_env: Optional[Mapping[str, str]] = None):
        tag = f"{os.getpid()}-{next(_instances)}"
        self.head_ns = f"zpp-head-{tag}"
        self.node_ns = f"zpp-node-{tag}"
        self.remote_env = dict(remote_env or {})
        self.subnet = 0
        self.head_ip = self.node_ip = self.node_target = self.ssh_command = ""
        self.tmpdir = self.key_path = self.sshd_config = self.sshd_log = ""
        self.sshd_pid = 0
        self._sshd: Optional[subprocess.Popen] = None
        self._children: list[subprocess.Popen] = []  # reaped at teardown
        self._made_ns: list[str] = []
        self._started = self._torn_down = False

    # ---- setup ------------------------------------------------------------------------------

    def start(self) -> "TwoHosts":
        """Create everything and wait until sshd accepts a session from the head. Raises SetupError
        (after tearing down what was made) on any failure."""
        if self._started:
            raise RuntimeError("TwoHosts.start() called twice")
        self._started = True
        atexit.register(self.teardown)
        try:
            self._make_network()
            self._start_sshd()
            self._wait_ready()
        except BaseException:
            try:
                self.teardown()
            except TeardownError:
                pass  # the setup error is the one to report
            raise
        return self

    def __enter__(self) -> "TwoHosts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _make_network(self) -> None:
        self.subnet = pick_subnet()
        self.head_ip, self.node_ip = f"10.{self.subnet}.0.1", f"10.{self.subnet}.0.2"
        self.node_target = f"root@{self.node_ip}"
        for ns in (self.head_ns, self.node_ns):
            _run(["ip", "netns", "add", ns])
            self._made_ns.append(ns)
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/resolv.conf", "w") as f:
                f.write("# zpp tests/two_hosts.py: no DNS server in this namespace (lookups fail at once)\n"
                        "options timeout:1 attempts:1\n")
        # Created inside the namespaces: the pair never shows in this machine's own `ip link`.
        _run(["ip", "link", "add", "eth0", "netns", self.head_ns, "type", "veth",
              "peer", "name", "eth0", "netns", self.node_ns])
        for ns, ip in ((self.head_ns, self.head_ip), (self.node_ns, self.node_ip)):
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", self.head_ns, "route", "add", "default", "via", self.node_ip])

    def _start_sshd(self) -> None:
        if not os.access(SSHD, os.X_OK):
            raise SetupError(f"{SSHD} is missing (install openssh-server; see ensure_openssh())")
        self.tmpdir = tempfile.mkdtemp(prefix="zpp-two-hosts-")  # mode 0700
        d = self.tmpdir
        host_key, self.key_path = f"{d}/ssh_host_ed25519_key", f"{d}/client_ed25519"
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "zpp-two-hosts-host", "-f", host_key])
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "zpp-two-hosts-client", "-f", self.key_path])
        shutil.copyfile(self.key_path + ".pub", f"{d}/authorized_keys")
        lines = [
            "# Throwaway sshd for zpp's two-hosts tests (tests/two_hosts.py); nothing from /etc/ssh.",
            f"ListenAddress {self.node_ip}",
            "Port 22",
            f"HostKey {host_key}",
            f"AuthorizedKeysFile {d}/authorized_keys",
            f"PidFile {d}/sshd.pid",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",  # the key files sit under /tmp (mode 1777), which StrictModes rejects
            "X11Forwarding no",
            "PrintMotd no",
            "PrintLastLog no",
            "UseDNS no",
            # No AcceptEnv line: sshd takes no variables from the client. Sessions get remote_env, on
            # one line: sshd honours only the first SetEnv line.
            *(["SetEnv " + " ".join(_quote_setenv(k, v) for k, v in self.remote_env.items())]
              if self.remote_env else []),
        ]
        self.sshd_config = f"{d}/sshd_config"
        with open(self.sshd_config, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation dir (sshd, even -t, needs it)
        os.chmod("/run/sshd", 0o755)
        # OpenSSH >= 9.8 penalizes sources whose sessions fail (it would then refuse the head for a
        # while, making later tests flaky): turn that off where the option exists.
        if subprocess.run([SSHD, "-t", "-f", self.sshd_config, "-o", "PerSourcePenalties=no"],
                          capture_output=True).returncode == 0:
            with open(self.sshd_config, "a") as f:
                f.write("PerSourcePenalties no\n")
        _run([SSHD, "-t", "-f", self.sshd_config])  # a config error, with its message, before starting
        self.sshd_log = f"{d}/sshd.log"
        with open(self.sshd_log, "wb") as log:
            # `ip netns exec` execs sshd in place: the Popen's pid is sshd's listener.
            self._sshd = subprocess.Popen(
                ["ip", "netns", "exec", self.node_ns, SSHD, "-D", "-e", "-f", self.sshd_config],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._children.append(self._sshd)
        self.sshd_pid = self._sshd.pid
        self.ssh_command = shlex.join([
            "ssh", "-i", self.key_path, "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
            "-o", "ConnectTimeout=5"])

    def _read_log(self) -> str:
        try:
            with open(self.sshd_log, errors="replace") as f:
                return f.read().strip()
        except OSError:
            return ""

    def _wait_ready(self) -> None:
        """Until an ssh `true` from the head succeeds (bounded by READY_TIMEOUT_S)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        last = ""
        while True:
            if self._sshd.poll() is not None:
                raise SetupError(f"sshd exited with {self._sshd.returncode}:\n{self._read_log()}")
            # sshd writes its pid file once it listens: no ssh attempt before that.
            if os.path.exists(f"{self.tmpdir}/sshd.pid"):
                cmd = ["ip", "netns", "exec", self.head_ns, *shlex.split(self.ssh_command),
                       "-o", "ConnectTimeout=2", self.node_target, "true"]
                try:
                    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                       timeout=max(0.5, deadline - time.monotonic()))
                    if r.returncode == 0:
                        return
                    last = r.stderr.strip() or f"exit {r.returncode}"
                except subprocess.TimeoutExpired:
                    last = "ssh timed out"
            if time.monotonic() > deadline:
                raise SetupError(f"sshd in {self.node_ns} did not accept `ssh {self.node_target} true` within "
                                 f"{READY_TIMEOUT_S:.0f} s: {last}\nsshd log:\n{self._read_log()}")
            time.sleep(0.05)

    # ---- helpers for tests --------------------------------------------------------------------

    def run_in(self, ns: str, args: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """``subprocess.Popen(["ip", "netns", "exec", ns, *args], **popen_kwargs)``. The pid is the
        command's own (``ip netns exec`` execs it)."""
        if isinstance(args, str):
            raise TypeError("args must be a sequence of strings (use ['sh', '-c', ...] for a shell line)")
        p = subprocess.Popen(["ip", "netns", "exec", ns, *args], **popen_kwargs)
        self._children.append(p)
        return p

    def run_in_head(self, args: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        return self.run_in(self.head_ns, args, **popen_kwargs)

    def run_in_node(self, args: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        return self.run_in(self.node_ns, args, **popen_kwargs)

    def ssh_argv(self, remote_command: str) -> list[str]:
        """argv that runs ``remote_command`` on the node over ssh; start it in the head namespace
        (``run_in_head(hosts.ssh_argv("..."))``)."""
        return [*shlex.split(self.ssh_command), self.node_target, remote_command]

    def pids_in(self, ns: str, include_sshd: bool = False) -> list[int]:
        """Pids of the processes in network namespace ``ns``, without sshd's listener (``sshd_pid``)
        unless ``include_sshd``: ``assert not hosts.pids_in(hosts.node_ns)`` means "nothing but sshd's
        listener is left on the node". sshd's per-connection processes are counted."""
        return [p for p in netns_pids(ns) if include_sshd or p != self.sshd_pid]

    def kill_all(self, keep_sshd: bool = True) -> list[int]:
        """End every process in both namespaces (sshd's listener too unless ``keep_sshd``); returns the
        pids still there after that (normally []).

        The node goes first, then the head (a killed ssh client would make the node's session end
        under its running command). In each, SIGTERM goes to the leaves of the process tree first (a
        process none of whose children are left), so that each dies before its parent and is reaped
        by it: killed all at once, children would be orphaned to init, which here leaves them as
        zombies for a while. What is left after KILL_GRACE_S gets SIGKILL, and KILL_GRACE_S more."""
        left = self._kill_ns(self.node_ns, keep_sshd)
        return left + self._kill_ns(self.head_ns, keep_sshd)

    def _kill_ns(self, ns: str, keep_sshd: bool) -> list[int]:
        def procs() -> list[int]:
            self._reap()
            return self.pids_in(ns, include_sshd=not keep_sshd)

        def send(pids, sig) -> None:
            for p in pids:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass

        term_until = time.monotonic() + KILL_GRACE_S
        termed: set[int] = set()
        while pids := procs():
            now = time.monotonic()
            if now < term_until:
                parents = {_ppid(p) for p in pids}
                leaves = [p for p in pids if p not in parents]
                send([p for p in leaves if p not in termed], signal.SIGTERM)
                termed.update(leaves)
            elif now < term_until + KILL_GRACE_S:
                send(pids, signal.SIGKILL)
            else:
                return pids
            time.sleep(0.02)
        return []

    def _reap(self) -> None:
        self._children = [p for p in self._children if p.poll() is None]

    # ---- teardown -----------------------------------------------------------------------------

    def teardown(self) -> None:
        """Kill every process in both namespaces, delete the namespaces (and so the veth pair) and the
        temp dir. Idempotent; every step runs even when one fails, then TeardownError says what was
        left behind."""
        if self._torn_down or not self._started:
            return
        self._torn_down = True
        atexit.unregister(self.teardown)
        problems = []
        try:
            left = self.kill_all(keep_sshd=False)  # leaves first: sshd's listener, the root, goes last
            if left:
                problems.append(f"processes survived SIGKILL: {left}")
        except Exception as e:  # still delete the namespaces and the temp dir
            problems.append(f"killing processes: {e!r}")
        for ns in self._made_ns:
            r = subprocess.run(["ip", "netns", "delete", ns], capture_output=True, text=True)
            if r.returncode != 0 and os.path.exists(f"/run/netns/{ns}"):
                problems.append(f"`ip netns delete {ns}`: {r.stderr.strip()}")
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
            if os.path.exists(f"/etc/netns/{ns}"):
                problems.append(f"could not remove /etc/netns/{ns}")
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            if os.path.exists(self.tmpdir):
                problems.append(f"could not remove {self.tmpdir}")
        if problems:
            raise TeardownError(f"two_hosts teardown ({self.head_ns}, {self.node_ns}): " + "; ".join(problems))
