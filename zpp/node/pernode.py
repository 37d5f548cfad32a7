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
* **Faults**: fail-stop, as launchers expect. A node's workers exit when their connection to the
  head drops, and the node with them (non-zero, within seconds). The head probes every remote
  rank's connection each half second and fails (non-zero) when one drops; a stage on a node is not
  restarted by the head (it cannot start processes there): the launcher restarts the group. Stages
  on the head itself are still restarted in place (``--max-stage-restarts``).
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import time
import uuid
from typing import Optional

from zpp.config import EngineConfig
from zpp.errors import ConfigError
from zpp.node.placement import describe_stages, split_ranks
from zpp.transport.addresses import interface_of, is_loopback, route_source_address
from zpp.transport.channels import tcp_address

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


def join_head(master_addr: str, master_port: int, keys, timeout_s: float, node_rank: int) -> str:
    """Wait until node rank 0's control plane completes a CURVE handshake with ``keys``; return its
    address ``tcp://IP:PORT`` for the workers.

    Retries (every half second, up to ``timeout_s``) while the name does not resolve or nothing
    listens there yet: a launcher starts the nodes in any order. Kubernetes publishes a pod's DNS
    name only once the pod runs.

    Raises:
        JoinError: the head refused the handshake (the key file is not the head's, or something
            else listens there), or no head answered within ``timeout_s``.
    """
    import zmq
    from zmq.utils.monitor import recv_monitor_message

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
            outcome = _handshake(zmq, recv_monitor_message, address, keys, deadline)
            if outcome == "ok":
                return address
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


def _handshake(zmq, recv_monitor_message, address: str, keys, deadline: float) -> str:
    """One CURVE handshake attempt at ``address`` until ``deadline``: ``ok``, ``auth`` (our client key
    refused), ``protocol`` (the handshake failed: another server key, or not ZeroMQ CURVE), or
    ``none`` (no connection)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"join-{uuid.uuid4().hex[:8]}".encode())
    sock.curve_serverkey = keys.server_public.encode()
    sock.curve_publickey = keys.client_public.encode()
    sock.curve_secretkey = keys.client_secret.encode()
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    try:
        sock.connect(address)
        # A refused TCP connection is retried by ZeroMQ itself; give up on this address after a
        # few seconds to look the name up again (a pod's address can change while it starts).
        until = min(deadline, time.monotonic() + 5.0)
        while (left := until - time.monotonic()) > 0:
            if not mon.poll(int(left * 1000) + 1):
                break
            event = recv_monitor_message(mon)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return "ok"
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return "auth"
            return "protocol"
        return "none"
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)
        ctx.term()


def node_ranks(config: EngineConfig) -> list[list[int]]:
    """Global ranks of every node rank (head first) for a per-node launch."""
    par = config.parallel
    return split_ranks(par.world_size, [None] * par.nnodes)


def run_node(config: EngineConfig, log_level: str = "info") -> int:
    """``zpp serve --nnodes N --node-rank R`` with R > 0: join the head, start this host's workers
    (``zpp-node``'s agent) and stay until the run ends.

    Returns:
        The agent's status: 0 after the head's orderly end, 1 when a worker died or the head did.
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
    engine = join_head(par.master_addr, par.master_port, keys, par.node_join_timeout, par.node_rank)
    logger.info("node rank %d: joined the head at %s (CURVE handshake done); starting this host's workers",
                par.node_rank, engine)
    status = run_agent(engine, ranks, keys, log_level, name=f"zpp: node rank {par.node_rank}")
    if status:
        print(f"zpp: node rank {par.node_rank}: a worker failed or the head went away; exiting {status}",
              file=sys.stderr, flush=True)
    return status
