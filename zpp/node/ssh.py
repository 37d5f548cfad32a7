"""The head's side of multi-host runs: start ``zpp-node`` on each extra host over SSH.

Ranks are split into contiguous blocks: the head first, then each node in the order given
(``--nodes user@a,user@b:2``; ``:N`` pins a host's number of stages, otherwise the ranks are shared
as evenly as possible). The SSH command is ``ssh -o BatchMode=yes`` unless ``$ZPP_SSH`` names
another (the tests use a local stand-in). The engine key travels on the session's stdin.
"""
from __future__ import annotations

import os
import shlex
import subprocess
from typing import Optional

from zpp.config import ConfigError


def parse_node(spec: str) -> tuple[str, Optional[int]]:
    host, _, n = spec.rpartition(":") if ":" in spec and spec.rsplit(":", 1)[1].isdigit() else (spec, "", "")
    return host, (int(n) if n else None)


class NodeLauncher:
    """Starts and watches the agents of a multi-host run."""

    def __init__(self, nodes: tuple[str, ...], engine_address: str, key: str):
        self.nodes = [parse_node(n) for n in nodes]
        self.address = engine_address
        self.key = key
        self.assignment: dict[str, list[int]] = {}
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._local_index: dict[int, int] = {}

    def assign(self, world: int) -> list[int]:
        """Split ranks over head + nodes; return the head's ranks. Raises ConfigError."""
        hosts = len(self.nodes) + 1
        pinned = sum(n or 0 for _, n in self.nodes)
        free_hosts = 1 + sum(1 for _, n in self.nodes if n is None)
        rest = world - pinned
        if rest < 0:
            raise ConfigError(f"--nodes pins {pinned} stages but only {world} ranks exist")
        base, extra = divmod(max(rest, 0), free_hosts)
        counts = []
        k = 0
        for i in range(hosts):
            pin = None if i == 0 else self.nodes[i - 1][1]
            if pin is None:
                counts.append(base + (1 if k < extra else 0))
                k += 1
            else:
                counts.append(pin)
        start = 0
        ranks_per_host = []
        for c in counts:
            ranks_per_host.append(list(range(start, start + c)))
            start += c
        for i, (host, _) in enumerate(self.nodes):
            self.assignment[host] = ranks_per_host[i + 1]
        for rs in ranks_per_host:
            for j, r in enumerate(rs):
                self._local_index[r] = j
        return ranks_per_host[0]

    def local_index(self, rank: int) -> int:
        """Device index of ``rank`` on its own host."""
        return self._local_index.get(rank, 0)

    def start(self) -> None:
        ssh = shlex.split(os.environ.get("ZPP_SSH", "ssh -o BatchMode=yes"))
        for host, ranks in self.assignment.items():
            if not ranks:
                continue
            remote = f"zpp-node --engine {shlex.quote(self.address)} --ranks {','.join(map(str, ranks))}"
            proc = subprocess.Popen(ssh + [host, remote], stdin=subprocess.PIPE, text=True, start_new_session=True)
            proc.stdin.write(self.key + "\n")
            proc.stdin.flush()  # stdin stays open: closing it tells the agent to stop
            self.procs.append((host, proc))

    def poll(self) -> Optional[str]:
        """An error message if an agent's session ended, else None."""
        for host, proc in self.procs:
            if proc.poll() is not None:
                return f"zpp-node on {host} exited with code {proc.returncode}"
        return None

    def stop(self) -> None:
        for _, proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for _, proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(3)
                except subprocess.TimeoutExpired:
                    proc.kill()
