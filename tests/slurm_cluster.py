"""A real two-node Slurm cluster inside tests/two_hosts.py's namespaces: munged, slurmctld and one
slurmd per "host", from Debian's packages, with throwaway configuration and state.

Topology::

    head namespace (10.R.0.1, node name zppn01)        node namespace (10.R.0.2, node name zppn02)
      munged   (socket in the temp dir: a path, so
                both namespaces reach it)
      slurmctld (port 6817)
      slurmd -N zppn01 (port 6818)                        slurmd -N zppn02 (port 6818)

Each "host" is entered with ``nsenter --net`` plus a mount and UTS namespace of its own (not ``ip
netns exec``, which mounts a fresh /sys and so hides the cgroup file systems slurmd looks for):
its hostname is its node name, and /etc/hosts (naming both nodes) and /etc/resolv.conf (no DNS
server) are bind-mounted from ``/etc/netns/<ns>/``, as ``ip netns exec`` would. What Slurm starts
(slurmstepd, the job's tasks) inherits all of it. Everything runs as root with
``proctrack/linuxproc`` and ``task/none`` (no cgroups), ``SlurmdParameters=config_overrides`` (the
configured CPUs, not this machine's), no accounting. Clients (``sbatch``, ``srun``, ``squeue``) run
in the head namespace with ``$SLURM_CONF`` pointing at the throwaway slurm.conf: :meth:`run`.

Use::

    hosts = TwoHosts().start()
    cluster = SlurmCluster(hosts).start()     # waits until both nodes are idle
    cluster.run(["sbatch", ...])
    ...
    cluster.teardown(); hosts.teardown()      # hosts' teardown kills the daemons with everything else

``ensure_slurm()`` installs slurmd, slurmctld, slurm-client and munge with apt-get when missing.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from typing import Mapping, Optional, Sequence

from two_hosts import SetupError, TwoHosts, _run

NAMES = ("zppn01", "zppn02")
BINARIES = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "/usr/bin/sbatch", "/usr/bin/srun")
READY_TIMEOUT_S = 60.0


def slurm_missing() -> list[str]:
    return [b for b in BINARIES if not os.access(b, os.X_OK)]


def ensure_slurm(timeout: float = 900.0) -> None:
    """Install Slurm's daemons, its clients and munge (Debian's packages) when any is missing;
    services are kept from starting during the install. Raises SetupError."""
    if not slurm_missing():
        return
    if shutil.which("apt-get") is None:
        raise SetupError(f"{', '.join(slurm_missing())} missing and there is no apt-get to install Slurm")
    print("slurm_cluster: apt-get install -y slurmd slurmctld slurm-client munge", flush=True)
    policy = "/usr/sbin/policy-rc.d"
    own_policy = not os.path.exists(policy)
    if own_policy:
        with open(policy, "w") as f:
            f.write("#!/bin/sh\n# written by zpp's tests/slurm_cluster.py during an install; removed after it\nexit 101\n")
        os.chmod(policy, 0o755)
    try:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        _run(["apt-get", "update", "-qq"], timeout=timeout, env=env)
        _run(["apt-get", "install", "-y", "-qq", "slurmd", "slurmctld", "slurm-client", "munge"], timeout=timeout,
             env=env)
    finally:
        if own_policy:
            os.unlink(policy)
    if slurm_missing():
        raise SetupError(f"Slurm installed but {', '.join(slurm_missing())} still missing")


class SlurmCluster:
    """munged + slurmctld + two slurmd in a :class:`TwoHosts` pair (see the module docstring).

    After ``start()``: ``conf`` (slurm.conf's path), ``tmpdir``, ``env`` (the clients' environment:
    this process's plus ``SLURM_CONF``), ``names`` (the two node names, head first).
    """

    def __init__(self, hosts: TwoHosts, names: Sequence[str] = NAMES, cpus: int = 2):
        self.h = hosts
        self.names = tuple(names)
        self.cpus = cpus
        self.tmpdir = self.conf = ""
        self.env: dict = {}
        self._procs: list[subprocess.Popen] = []

    def start(self) -> "SlurmCluster":
        """Raises SetupError (with the daemons' logs) when the cluster is not up within READY_TIMEOUT_S."""
        h = self.h
        self.tmpdir = d = tempfile.mkdtemp(prefix="zpp-slurm-")
        os.chmod(d, 0o755)  # munged and slurmd check the directories above their files
        for ns in (h.head_ns, h.node_ns):
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{h.head_ip} {self.names[0]}\n{h.node_ip} {self.names[1]}\n")
        for sub in ("munge", "state", "spool-" + self.names[0], "spool-" + self.names[1], "log"):
            os.makedirs(f"{d}/{sub}", mode=0o755)
        os.chmod(f"{d}/munge", 0o700)
        key = f"{d}/munge/munge.key"
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        socket_path = f"{d}/munge/munge.socket.2"
        self._start(h.head_ns, ["/usr/sbin/munged", "--foreground", "--force", f"--key-file={key}",
                                f"--socket={socket_path}", f"--pid-file={d}/munge/munged.pid",
                                f"--log-file={d}/log/munged.log", f"--seed-file={d}/munge/munged.seed"])
        self._wait(lambda: os.path.exists(socket_path), "munged's socket", "munged.log")
        self.conf = f"{d}/slurm.conf"
        with open(self.conf, "w") as f:
            f.write(self._slurm_conf(socket_path))
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self._start(h.head_ns, ["/usr/sbin/slurmctld", "-D", "-i", "-f", self.conf])
        for ns, name in ((h.head_ns, self.names[0]), (h.node_ns, self.names[1])):
            self._start(ns, ["/usr/sbin/slurmd", "-D", "-N", name, "-f", self.conf])
        self._wait(self._idle, "both nodes idle in sinfo", "slurmctld.log")
        return self

    def _slurm_conf(self, munge_socket: str) -> str:
        d, h, (a, b) = self.tmpdir, self.h, self.names
        return "\n".join([
            "# Throwaway Slurm for zpp's tests (tests/slurm_cluster.py)",
            "ClusterName=zpptest",
            f"SlurmctldHost={a}({h.head_ip})",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={munge_socket}",
            f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool-%n",
            f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "SlurmctldPort=6817", "SlurmdPort=6818",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SchedulerType=sched/builtin", "SelectType=select/linear",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none", "ReturnToService=2", "SlurmdParameters=config_overrides",
            "KillWait=5", "InactiveLimit=0", "MinJobAge=5", "MailProg=/bin/true",
            f"NodeName={a} NodeAddr={h.head_ip} CPUs={self.cpus} State=UNKNOWN",
            f"NodeName={b} NodeAddr={h.node_ip} CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={a},{b} Default=YES MaxTime=INFINITE State=UP",
            ""])

    def host_argv(self, ns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on the "host" of namespace ``ns`` (see the module docstring)."""
        name = self.names[0] if ns == self.h.head_ns else self.names[1]
        setup = (f"mount --bind /etc/netns/{ns}/hosts /etc/hosts && "
                 f"mount --bind /etc/netns/{ns}/resolv.conf /etc/resolv.conf && hostname {name} && exec \"$@\"")
        return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts", "--propagation", "private",
                "sh", "-c", setup, "sh", *argv]

    def _start(self, ns: str, argv: list[str]) -> None:
        name = os.path.basename(argv[0])
        out = open(f"{self.tmpdir}/log/{name}-{ns}.out", "wb")
        self._procs.append(subprocess.Popen(self.host_argv(ns, argv), stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            env=dict(os.environ, SLURM_CONF=f"{self.tmpdir}/slurm.conf")))

    def _idle(self) -> bool:
        r = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
        states = dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)
        return all(states.get(n) == "idle" for n in self.names)

    def _wait(self, ready, what: str, log: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready():
            dead = [p for p in self._procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise SetupError(f"Slurm: no {what} within {READY_TIMEOUT_S:.0f} s"
                                 f"{' (a daemon exited: ' + str(dead[0].args) + ')' if dead else ''}:\n"
                                 f"{self.logs()}")
            time.sleep(0.3)

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(f"{self.tmpdir}/log")):
            with open(f"{self.tmpdir}/log/{name}", errors="replace") as f:
                text = f.read().strip()
            if text:
                out.append(f"--- {name}:\n{text[-3000:]}")
        return "\n".join(out)

    def run(self, argv: Sequence[str], check: bool = True, timeout: float = 60.0,
            env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess:
        """A Slurm client command on the head "host" (``$SLURM_CONF`` set)."""
        r = subprocess.run(self.host_argv(self.h.head_ns, argv), capture_output=True, text=True,
                           timeout=timeout, env={**self.env, **(env or {})})
        if check and r.returncode != 0:
            raise SetupError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def sbatch(self, script: str, env: Mapping[str, str], *options: str) -> "SbatchJob":
        """Submit ``script`` from the head "host" with ``env`` added to this process's environment
        (sbatch exports it to the job); the job's output goes to the cluster's temp dir."""
        out = f"{self.tmpdir}/job-%j.out"
        r = self.run(["sbatch", "--parsable", "-o", out, *options, script], env=env)
        job_id = r.stdout.strip().split(";")[0]
        return SbatchJob(self, job_id, out.replace("%j", job_id))

    def leftovers(self) -> list[str]:
        """``pid: cmdline`` of every process in either namespace but the daemons (munged, slurmctld
        and its slurmscriptd, slurmd) and sshd's listener: [] once no job step runs."""
        daemons = {p.pid for p in self._procs}
        out = []
        for ns in (self.h.head_ns, self.h.node_ns):
            for pid in self.h.pids_in(ns):
                if pid in daemons:
                    continue
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    continue
                if cmd.startswith("slurmctld: slurmscriptd"):  # slurmctld's own helper
                    continue
                out.append(f"{pid}: {cmd}")
        return out

    def teardown(self) -> None:
        """Stop the daemons (SIGTERM, then SIGKILL) and delete the temp dir; the namespaces stay."""
        for p in reversed(self._procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self._procs):
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


class SbatchJob:
    """A batch job submitted with :meth:`SlurmCluster.sbatch`: ``job_id``, ``output_path`` (the
    job's stdout and stderr, every task's included)."""

    def __init__(self, cluster: SlurmCluster, job_id: str, output_path: str):
        self.cluster, self.job_id, self.output_path = cluster, job_id, output_path

    def output(self) -> str:
        try:
            with open(self.output_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def state(self) -> str:
        """The job's state in squeue (``PENDING``, ``RUNNING``, ...), or "" once it has left it."""
        r = self.cluster.run(["squeue", "-h", "-j", self.job_id, "-o", "%T"], check=False)
        return r.stdout.strip()

    def wait_for(self, text: str, timeout: float) -> float:
        """Seconds until ``text`` shows in the output. Raises AssertionError (with the output) when the
        job ends first or ``timeout`` passes."""
        t0 = time.monotonic()
        while text not in self.output():
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"job {self.job_id}: no {text!r} within {timeout:.0f} s:\n{self.output()[-5000:]}")
            if not self.state():
                raise AssertionError(f"job {self.job_id} ended before {text!r}:\n{self.output()[-5000:]}")
            time.sleep(0.5)
        return time.monotonic() - t0

    def cancel(self, timeout: float = 30.0) -> float:
        """scancel; seconds until the job has left squeue."""
        t0 = time.monotonic()
        self.cluster.run(["scancel", self.job_id])
        while self.state():
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"job {self.job_id} still in squeue {timeout:.0f} s after scancel")
            time.sleep(0.3)
        return time.monotonic() - t0
