"""The head's side of multi-host runs: start ``zpp-node`` on each extra host over SSH.

Ranks are split into contiguous blocks: the head first, then each node in the order given
(``--nodes user@a,user@b:2``; ``:N`` pins a host's number of ranks, otherwise they are shared as
evenly as possible). The SSH command is ``ssh -o BatchMode=yes -o ConnectTimeout=10 ...`` unless
``$ZPP_SSH`` names another; the remote command is ``--node-command`` (default ``zpp-node``, e.g.
``/opt/venv/bin/zpp-node`` for a virtualenv). The run's keys travel on the session's stdin, which
stays open: its end tells the agent that the head is gone. The SSH client dies with the head
(``PR_SET_PDEATHSIG`` through ``setpriv``), so a SIGKILLed head still ends every session.

With ``launcher="manual"`` nothing is started: the head logs the command to run on each host
(a cluster launcher or a person starts ``zpp-node --keys-file``) and waits for the workers. With
``launcher="pernode"`` (:data:`PER_NODE`, ``--nnodes``) the hosts are ``node rank 1`` ... and each
runs ``zpp serve --node-rank R`` by itself; the head waits for them to join.
"""
from __future__ import annotations

import collections
import logging
import shlex
import shutil
import subprocess
import threading
from typing import Optional

from zpp import envs
from zpp.node.placement import describe_stages, split_ranks
from zpp.transport.security import RunKeys

logger = logging.getLogger(__name__)

PER_NODE = "pernode"
"""The launcher of a per-node launch (``--nnodes``): each node runs ``zpp serve --node-rank R``
itself (``zpp.node.pernode``); the head starts nothing and waits for them to join."""


def per_node_name(node_rank: int) -> str:
    """How a per-node launch's host is named in the head's logs and errors."""
    return f"node rank {node_rank}"


DEFAULT_SSH = envs.VARIABLES["ZPP_SSH"].default
"""``$ZPP_SSH``'s default (``zpp.envs``)."""


def parse_node(spec: str) -> tuple[str, Optional[int]]:
    """``user@host:N`` -> (``user@host``, N); ``user@host`` -> (``user@host``, None)."""
    host, sep, n = spec.rpartition(":")
    if sep and n.isdigit() and not host.endswith(":"):
        return host, int(n)
    return spec, None


class NodeLauncher:
    """Starts and watches the agents of a multi-host run."""

    def __init__(self, nodes: tuple[str, ...], engine_address: str, keys: RunKeys,
                 node_command: str = "zpp-node", launcher: str = "ssh", keys_file: Optional[str] = None,
                 log_level: str = "info", tp_size: int = 1):
        self.nodes = [parse_node(n) for n in nodes]
        self.address = engine_address
        self.keys = keys
        self.node_command = node_command
        self.launcher = launcher
        self.keys_file = keys_file
        self.log_level = log_level
        self.tp_size = tp_size
        self.assignment: dict[str, list[int]] = {}
        self.procs: list[tuple[str, subprocess.Popen]] = []  # the current session of each host
        self._reported: set[int] = set()  # ids of sessions whose end was reported (or was ours)
        self._stderr: dict[str, collections.deque[str]] = {}
        self._local_index: dict[int, int] = {}

    def assign(self, world: int) -> list[int]:
        """Split ranks over head + nodes (see :func:`zpp.node.placement.split_ranks`); return the
        head's ranks. Raises ConfigError."""
        ranks_per_host = split_ranks(world, [None] + [n for _, n in self.nodes])
        for i, (host, _) in enumerate(self.nodes):
            self.assignment[host] = ranks_per_host[i + 1]
        for rs in ranks_per_host:
            for j, r in enumerate(rs):
                self._local_index[r] = j
        return ranks_per_host[0]

    def local_index(self, rank: int) -> int:
        """Device index of ``rank`` on its own host."""
        return self._local_index.get(rank, 0)

    def host_of_rank(self, rank: int) -> Optional[str]:
        return next((h for h, rs in self.assignment.items() if rank in rs), None)

    def _stages(self, host: str) -> str:
        return describe_stages(self.assignment.get(host, []), self.tp_size)

    def stages_of(self, host: str) -> str:
        """``stage 1`` / ``stages 1, 2``: the stages of ``host``'s ranks."""
        return self._stages(host)

    def command_for(self, host: str) -> str:
        """The ``zpp-node`` command line for ``host`` (keys on stdin, or ``--keys-file``)."""
        cmd = (f"{self.node_command} --engine {shlex.quote(self.address)} "
               f"--ranks {','.join(map(str, self.assignment[host]))} --log-level {self.log_level}")
        if self.launcher == "manual":
            cmd += f" --keys-file {shlex.quote(self.keys_file or 'KEYS_FILE')}"
        return cmd

    def start(self) -> None:
        if self.launcher == PER_NODE:
            for host, ranks in self.assignment.items():
                logger.info("waiting for %s (%s, ranks %s) to join", host, self._stages(host),
                            ",".join(map(str, ranks)))
            return
        if self.launcher == "manual":
            for host, ranks in self.assignment.items():
                if ranks:
                    logger.info("waiting for %s (%s): start there, with a 0600 copy of %s: %s", host,
                                self._stages(host), self.keys_file, self.command_for(host))
            return
        for host, ranks in self.assignment.items():
            if ranks:
                self._start_session(host)

    def _start_session(self, host: str) -> None:
        ssh = shlex.split(envs.ZPP_SSH)
        # The SSH client must die with the head, even a SIGKILLed one, or the session (and the
        # remote agent) would stay: PR_SET_PDEATHSIG via setpriv.
        prefix = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
        line = self.keys.for_workers().encode().decode()
        logger.info("starting zpp-node on %s over SSH (%s)", host, self._stages(host))
        proc = subprocess.Popen(prefix + ssh + [host, self.command_for(host)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        proc.stdin.write(line)
        proc.stdin.flush()  # stdin stays open: closing it tells the agent to stop
        self._stderr[host] = collections.deque(maxlen=20)
        threading.Thread(target=self._relay, args=(host, proc), name=f"zpp-ssh-{host}", daemon=True).start()
        self.procs = [(h, p) for h, p in self.procs if h != host] + [(host, proc)]

    def restart(self, host: str) -> None:
        """Stage restarts: end ``host``'s session (its agent stops that host's workers, a stopped one
        included) and start a new one over SSH (its agent starts them again). Blocking (seconds)."""
        old = next((p for h, p in self.procs if h == host), None)
        if old is not None:
            self._reported.add(id(old))
            self._end(old)
        self._start_session(host)

    def is_current(self, session: object) -> bool:
        """Whether ``session`` (from :meth:`poll_lost`) is still its host's current session."""
        return any(p is session for _, p in self.procs)

    def poll_lost(self) -> dict[str, tuple[str, object]]:
        """Hosts whose current agent session ended since the last call: host -> (an error message
        as :meth:`poll` gives it, the session)."""
        out = {}
        for host, proc in list(self.procs):
            if proc.poll() is not None and id(proc) not in self._reported:
                self._reported.add(id(proc))
                out[host] = (self._failure(host, proc), proc)
        return out

    def _relay(self, host: str, proc: subprocess.Popen) -> None:
        """Log what the remote side prints (agent and worker logs, ssh's own errors)."""
        for raw in proc.stderr:
            text = raw.rstrip()
            if text:
                self._stderr[host].append(text)
                logger.info("[%s] %s", host, text)

    def poll(self) -> Optional[str]:
        """An error message naming the host, its stages and the remote side's last words if an
        agent's session ended, else None."""
        for host, proc in self.procs:
            if proc.poll() is not None:
                return self._failure(host, proc)
        return None

    def _failure(self, host: str, proc: subprocess.Popen) -> str:
        try:
            proc.wait(1.0)
        except subprocess.TimeoutExpired:
            pass
        lines = list(self._stderr.get(host, ()))
        said = next((t for t in reversed(lines) if "zpp-node:" in t or "rror" in t or "ssh:" in t
                     or "denied" in t or "not found" in t), lines[-1] if lines else "")
        how = (f"the SSH session ended with code {proc.returncode}" if proc.returncode != 255
               else "ssh failed (code 255)")
        hint = (f" (is zpp installed there? --node-command names the agent, now {self.node_command!r})"
                if proc.returncode == 127 else "")
        return f"{self._stages(host)} on {host}: {how}" + (f": {said}" if said else "") + hint

    def stop(self) -> None:
        for _, proc in self.procs:
            self._reported.add(id(proc))
            try:
                proc.stdin.close()
            except OSError:
                pass
        for _, proc in self.procs:
            self._end(proc)

    @staticmethod
    def _end(proc: subprocess.Popen) -> None:
        """Close the session's stdin (the agent stops its workers and exits), then wait for it:
        up to 10 s, then SIGTERM, then SIGKILL."""
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
