"""Per-node launch: the same ``zpp serve`` on every host, as Slurm, a Kubernetes LeaderWorkerSet or
any launcher starts it (vLLM's ``--nnodes N --node-rank R --master-addr A --master-port P``).

* **Node rank 0 is the head**: engine core and API. Its control plane (ZeroMQ with CURVE) listens
  on ``--master-addr`` (resolved to one of this host's addresses, :func:`head_bind_address`) at
  ``--master-port``; it waits for every node's workers to join (``--node-join-timeout``), logs the
  placement, and fails start-up with one line naming a node rank that did not join.
* **Node ranks > 0 are headless** (:func:`run_node`): no HTTP server, no engine; they join the head
  (:func:`join_head`: the CURVE handshake succeeds with the keys of ``--node-keys-file``, or start-up
  ends in one line) and then run ``zpp-node``'s agent (:func:`zpp.node.agent.run_agent`) for this
  host's ranks. Which ranks those are follows from the flags every node shares
  (:func:`zpp.node.placement.split_ranks`: head first, as even as possible), so nothing is sent.
* **Keys**: ``--node-keys-file``, written once by ``zpp node-keys FILE`` (mode 0400) and readable by
  every node's user only (a Kubernetes secret mounted 0400, a file on the job's shared storage).
  There is no unencrypted mode.
* **Faults**: fail-stop, as launchers expect. A node keeps the connection that joined the head
  open (:class:`zpp.node.head_link.HeadLink`): when it drops without the head's orderly Shutdown
  (the head died, even by SIGKILL, or its host went silent), the node stops its workers and exits 1
  within seconds with one line naming the head; its workers also exit on their own when their
  connection to the head drops. The head probes every remote
  rank's connection each half second and fails (non-zero) when one drops; a stage on a node is not
  restarted by the head (it cannot start processes there): the launcher restarts the group. Stages
  on the head itself are still restarted in place (``--max-stage-restarts``).
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import time
from typing import TYPE_CHECKING, Optional

from zpp.config import EngineConfig
from zpp.errors import ConfigError
from zpp.node.placement import describe_stages, split_ranks
from zpp.transport.addresses import interface_of, is_loopback, route_source_address
from zpp.transport.channels import tcp_address

if TYPE_CHECKING:
    from zpp.node.head_link import HeadLink

logger = logging.getLogger(__name__)

_JOIN_RETRY_S = 0.5


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def head_bind_address(master_addr: str, distributed_host: Optional[str] = None) -> str:
    """The address node rank 0 binds its control plane and rendezvous store to.

    ``distributed_host`` if given; else ``master_addr`` itself when it is an IP address (or
    ``localhost``: every node on this host); else what the name resolves to here, which must be one
    of this host's addresses. A name that resolves to a loopback address (Debian's ``127.0.1.1
    <hostname>`` line in /etc/hosts) is replaced by this host's address on its default route, with
    a warning: the other nodes resolve the name to the real address.

    Raises:
        ConfigError: the name does not resolve, or it is not an address of this host.
    """
    if distributed_host:
        return distributed_host
    if _is_ip(master_addr):
        return master_addr
    if master_addr == "localhost":
        return "127.0.0.1"
    try:
        resolved = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        raise ConfigError(f"--master-addr {master_addr}: does not resolve on node rank 0 "
                          f"({e.strerror or e}); give --distributed-host ADDRESS to listen on") from None
    if is_loopback(resolved):
        try:
            outside = route_source_address("192.0.2.1" if ":" not in resolved else "2001:db8::1")
        except OSError:
            outside = None
        if outside is None or is_loopback(outside):
            raise ConfigError(f"--master-addr {master_addr} resolves to the loopback address {resolved} on node "
                              f"rank 0, which other nodes cannot reach, and this host has no default route: give "
                              f"--distributed-host ADDRESS (this host's address on the nodes' network)")
        logger.warning("--master-addr %s resolves to the loopback address %s here (/etc/hosts?); listening on %s, "
                       "this host's address on its default route (--distributed-host chooses another)",
                       master_addr, resolved, outside)
        return outside
    if interface_of(resolved) is None:
        raise ConfigError(f"--master-addr {master_addr} resolves to {resolved}, which is not an address of this host: "
                          f"node rank 0 must run where --master-addr points (or give --distributed-host ADDRESS)")
    return resolved


class JoinError(ConfigError):
    """A node could not join the head (wrong keys, no head within the timeout): one line."""


def join_head(master_addr: str, master_port: int, keys, timeout_s: float, node_rank: int) -> "HeadLink":
    """Wait until node rank 0's control plane completes a CURVE handshake with ``keys``; return that
    connection, kept open for the run (:class:`~zpp.node.head_link.HeadLink`; its ``address``,
    ``tcp://IP:PORT``, is the workers'), so that this node notices when the head is gone.

    Retries (every half second, up to ``timeout_s``) while the name does not resolve or nothing
    listens there yet: a launcher starts the nodes in any order. Kubernetes publishes a pod's DNS
    name only once the pod runs.

    Raises:
        JoinError: the head refused the handshake (the key file is not the head's, or something
            else listens there), or no head answered within ``timeout_s``.
    """
    from zpp.node.head_link import HeadLink

    deadline = time.monotonic() + timeout_s
    last = "it does not resolve"
    while True:
        try:
            ip = socket.getaddrinfo(master_addr, master_port, type=socket.SOCK_STREAM)[0][4][0]
        except OSError as e:
            last = f"it does not resolve ({e.strerror or e})"
        else:
            address = tcp_address(ip, master_port)
            where = f"{master_addr}:{master_port}" + (f" ({ip})" if ip != master_addr else "")
            link = HeadLink(address, keys, f"node rank 0 at {where}")
            # A refused TCP connection is retried by ZeroMQ itself; give up on this address after a
            # few seconds to look the name up again (a pod's address can change while it starts).
            outcome = link.handshake(min(deadline, time.monotonic() + 5.0))
            if outcome == "ok":
                return link
            link.close()
            if outcome in ("auth", "protocol"):
                why = ("its keys are not this run's" if outcome == "auth" else
                       "the head's CURVE key differs, or it is not a zpp head")
                raise JoinError(f"node rank {node_rank}: {where} refused the control-plane handshake ({why}): give "
                                f"every node the --node-keys-file node rank 0 uses")
            last = f"nothing answered at {where}"
        if time.monotonic() >= deadline:
            raise JoinError(f"node rank {node_rank}: no head within {timeout_s:.0f} s (--node-join-timeout): {last}; "
                            f"is node rank 0 running with the same --master-addr and --master-port?")
        time.sleep(_JOIN_RETRY_S)


def node_ranks(config: EngineConfig) -> list[list[int]]:
    """Global ranks of every node rank (head first) for a per-node launch."""
    par = config.parallel
    return split_ranks(par.world_size, [None] * par.nnodes)


def run_node(config: EngineConfig, log_level: str = "info") -> int:
    """``zpp serve --nnodes N --node-rank R`` with R > 0: join the head, start this host's workers
    (``zpp-node``'s agent) and stay until the run ends.

    Returns:
        The agent's status: 0 after the head's orderly end (its workers got Shutdown) or SIGTERM
        here; 1 when a worker died or failed, or when the head is gone (its control-plane
        connection dropped, or was silent for ``HEAD_SILENCE_S``, without an orderly end): this
        host's workers are stopped first, and one line on stderr says which.
    Raises:
        ConfigError: the key file cannot be used, or the head could not be joined (one line).
    """
    from zpp.node.agent import run_agent
    from zpp.transport.security import read_node_keys

    par = config.parallel
    keys = read_node_keys(par.node_keys_file, head=False)
    ranks = node_ranks(config)[par.node_rank]
    tp = par.tensor_parallel_size
    logger.info("node rank %d of %d (headless: %s, ranks %s): joining the head at %s:%d", par.node_rank, par.nnodes,
                describe_stages(ranks, tp), ranks, par.master_addr, par.master_port)
    head = join_head(par.master_addr, par.master_port, keys, par.node_join_timeout, par.node_rank)
    head.watch()
    logger.info("node rank %d: joined the head at %s (CURVE handshake done); starting this host's workers",
                par.node_rank, head.address)
    try:
        return run_agent(head.address, ranks, keys, log_level, name=f"zpp: node rank {par.node_rank}", head=head)
    finally:
        head.close()
