"""A node's own connection to the head, kept for the whole run so that the node notices the head's
end by itself, without waiting on its workers.

Used by the headless nodes of a per-node launch (``zpp serve --nnodes N --node-rank R``, R > 0:
the connection that joined the head stays open, see :func:`zpp.node.pernode.join_head`) and by a
``zpp-node`` started by hand (``--keys-file``). An agent started over SSH does not need it: the
session's end is the head's end.

The link is a ZeroMQ DEALER with the run's CURVE client keys that never sends a message: the head's
ZeroMQ I/O thread answers its ZMTP heartbeats (every 2 s). A ZeroMQ monitor reports the handshake
and the drop; a connection that has completed its handshake once and then drops (the head process
died: its kernel closes the TCP connection; or the head's host went silent for
:data:`HEAD_SILENCE_S`) sets :attr:`HeadLink.lost`.
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import Optional

from zpp.transport.channels import ENGINE_SILENCE_S

HEAD_SILENCE_S = ENGINE_SILENCE_S
"""Seconds of silence (no ZMTP heartbeat answered: a hung or unreachable head host) after which
the link counts as dropped; the same bound as the workers' (``ENGINE_SILENCE_S``)."""

HEARTBEAT_IVL_S = 2.0
"""Seconds between the link's ZMTP heartbeats."""


class HeadLink:
    """One CURVE connection to the head's control plane (see the module docstring).

    Args:
        address: the head's control-plane address, ``tcp://HOST:PORT``.
        keys: the run's :class:`~zpp.transport.security.RunKeys` (client side).
        where: how messages name the head, e.g. ``node rank 0 at zppn01:29501``.
    """

    def __init__(self, address: str, keys, where: str):
        import zmq
        self.address = address
        self.where = where
        self.lost = threading.Event()
        """Set once the connection, after its handshake, dropped (the head is gone)."""
        self.lost_at: Optional[float] = None
        """``time.monotonic()`` when :attr:`lost` was set."""
        self.connected = False
        """Whether a handshake has succeeded (the head was there)."""
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IDENTITY, f"head-link-{uuid.uuid4().hex[:8]}".encode())
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_IVL_S * 1000))
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEAD_SILENCE_S * 1000))
        self._sock.curve_serverkey = keys.server_public.encode()
        self._sock.curve_publickey = keys.client_public.encode()
        self._sock.curve_secretkey = keys.client_secret.encode()
        self._mon = self._sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED)
        self._thread: Optional[threading.Thread] = None
        self._sock.connect(address)  # after the monitor: no event is missed

    def _next_event(self, timeout_s: Optional[float]) -> Optional[int]:
        from zmq.utils.monitor import recv_monitor_message
        if timeout_s is not None and not self._mon.poll(max(0, int(timeout_s * 1000)) + 1):
            return None
        return recv_monitor_message(self._mon)["event"]

    def handshake(self, until: float) -> str:
        """Wait (until ``time.monotonic()`` reaches ``until``) for the CURVE handshake.

        Returns:
            ``ok``; ``auth`` (the head refused our client key); ``protocol`` (the handshake failed:
            another server key, or not a ZeroMQ CURVE server); ``none`` (no handshake by ``until``:
            nothing listens there, ZeroMQ keeps retrying).
        """
        zmq = self._zmq
        while (left := until - time.monotonic()) > 0:
            event = self._next_event(left)
            if event is None:
                break
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
                return "ok"
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return "auth"
            if event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_MONITOR_STOPPED):  # closed before its handshake
                continue
            return "protocol"
        return "none"

    def watch(self) -> None:
        """Watch the connection from a daemon thread from now on: :attr:`lost` is set when it drops
        after a handshake (made by :meth:`handshake`, or later: a link made before the head
        listens waits for it)."""
        if self._thread is not None:
            return
        zmq = self._zmq

        def loop():
            while True:
                try:
                    event = self._next_event(None)
                except zmq.ZMQError:
                    return
                if event == zmq.EVENT_MONITOR_STOPPED:  # close(): the monitor socket is this thread's to close
                    self._mon.close(0)
                    return
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.connected = True
                elif event == zmq.EVENT_DISCONNECTED and self.connected and not self.lost.is_set():
                    self.lost_at = time.monotonic()
                    self.lost.set()

        self._thread = threading.Thread(target=loop, name="zpp-head-link", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Close the connection (idempotent); the watch thread ends with it."""
        if self._sock.closed:
            return
        self._sock.disable_monitor()  # MONITOR_STOPPED reaches the watch thread, which closes the monitor socket
        if self._thread is not None:
            self._thread.join(2.0)
        if not self._mon.closed and (self._thread is None or not self._thread.is_alive()):
            self._mon.close(0)
        self._sock.close(0)
        if self._mon.closed:
            self._ctx.term()
