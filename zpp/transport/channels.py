"""ZeroMQ sockets between the engine and its workers, typed by the msgspec messages they carry.

The engine binds one ROUTER socket; every worker (local or started by ``zpp-node`` on another
host) connects one DEALER socket whose identity is its rank. Frames are msgpack only. Over TCP
(multi-host) both ends use CURVE with the run's keys (``zpp.transport.security``): the ROUTER
admits only the run's client key and logs every refused connection.
"""
from __future__ import annotations

import glob
import logging
import os
import socket
import tempfile
import threading
import time
import uuid
from typing import Optional

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from zpp.transport import messages as m
from zpp.transport.security import RunKeys

logger = logging.getLogger(__name__)


def local_ipc_address() -> str:
    """A fresh ipc:// endpoint in the temp directory (single-host runs):
    ``ipc://$TMPDIR/zpp-<pid>-<8 hex>.sock``, ``<pid>`` the process that chose it. The socket file
    the binding end creates is not removed by ZeroMQ (libzmq 4.3 leaves it): every binder removes it
    when it closes (:func:`remove_ipc_file`), and the parent of a process that died without closing
    sweeps that process's files (:func:`remove_ipc_files_of`)."""
    return f"ipc://{tempfile.gettempdir()}/zpp-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"


def remove_ipc_file(address: str) -> None:
    """Remove the socket file of an ``ipc://`` address (nothing for other transports, or when it is
    already gone)."""
    if address.startswith("ipc://"):
        try:
            os.unlink(address[len("ipc://"):])
        except OSError:
            pass


def remove_ipc_files_of(pid: int) -> None:
    """Remove the socket files :func:`local_ipc_address` chose in process ``pid`` (called once that
    process has exited: a SIGKILLed engine core leaves its workers' control-plane socket behind)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"zpp-{int(pid)}-*.sock")):
        try:
            os.unlink(path)
        except OSError:
            pass


def tcp_address(host: str, port: int | str) -> str:
    """``tcp://host:port`` (IPv6 literals bracketed)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def identity(rank: int, kind: str = "rank") -> bytes:
    """A worker socket's ZeroMQ identity: ``rankN`` (its main socket) or ``hbN`` (heartbeats)."""
    return f"{kind}{rank}".encode()


class PeerUnreachable(ConnectionError):
    """A send to a worker whose connection to the engine is gone (its process died, or its host)."""

    def __init__(self, rank: int):
        super().__init__(f"rank {rank} is not connected")
        self.rank = rank


class EngineSocket:
    """The engine's ROUTER: sends ToWorker messages to ranks, receives FromWorker messages.

    One instance per engine; used from the engine's asyncio loop only.
    """

    def __init__(self, address: str, keys: Optional[RunKeys] = None):
        """Bind ``address`` (``ipc://...`` or ``tcp://HOST:PORT``, port 0 = any free one); with
        CURVE ``keys`` (TCP), encrypt and admit only peers holding the run's client key."""
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A restarted rank takes over its identity even while its predecessor's connection is still
        # open (a stopped process, a hung host): without this the ROUTER refuses the newcomer.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._auth = None
        self.refused = 0
        """Control-plane connections refused so far (CURVE handshakes without this run's keys)."""
        if keys is not None and keys.curve:
            self._secure(keys)
        if address.startswith("tcp://") and address.endswith(":0"):
            address = address[:-2] + ":*"
        self.sock.bind(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _secure(self, keys: RunKeys) -> None:
        from zmq.auth.thread import ThreadAuthenticator
        sync_ctx = zmq.Context.shadow(self.ctx.underlying)  # the ZAP handler must share our context
        self._auth = ThreadAuthenticator(sync_ctx, log=logging.getLogger("zpp.transport.zap"))
        self._auth.start()
        self._auth.configure_curve_callback("zpp", credentials_provider=_ClientKey(keys.client_public))
        self.sock.curve_server = True
        self.sock.curve_secretkey = keys.server_secret.encode()
        self.sock.curve_publickey = keys.server_public.encode()
        self.sock.zap_domain = b"zpp"
        monitor_address = f"inproc://zpp-monitor-{uuid.uuid4().hex[:8]}"
        self.sock.monitor(monitor_address, zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                          | zmq.EVENT_MONITOR_STOPPED)
        mon = sync_ctx.socket(zmq.PAIR)
        mon.connect(monitor_address)
        threading.Thread(target=_log_refusals, args=(mon, self), name="zpp-zmq-monitor", daemon=True).start()

    def send(self, rank: int, msg: m.ToWorker) -> None:
        self.send_bytes([rank], m.encode(msg))

    def send_bytes(self, ranks, payload: bytes) -> None:
        """Send one encoded frame to several ranks (encode once, fan out).

        Raises:
            PeerUnreachable: a rank's connection is gone (ZeroMQ's EHOSTUNREACH).
        """
        for r in ranks:
            # ROUTER sends never block with the default HWM; NOBLOCK turns an unknown peer into an error.
            fut = self.sock.send_multipart([identity(r), payload], flags=zmq.NOBLOCK, copy=False)
            if fut.done() and fut.exception() is not None:
                e = fut.exception()
                if isinstance(e, zmq.ZMQError) and e.errno == zmq.EHOSTUNREACH:
                    raise PeerUnreachable(r) from e
                raise e

    def send_heartbeat_socket(self, rank: int, msg: m.ToHeartbeat) -> bool:
        """Send ``msg`` to ``rank``'s heartbeat socket (read by its heartbeat thread, which never
        waits on a peer). Returns False when that connection is gone (nothing sent)."""
        fut = self.sock.send_multipart([identity(rank, "hb"), m.encode(msg)], flags=zmq.NOBLOCK)
        if fut.done() and fut.exception() is not None:
            e = fut.exception()
            if isinstance(e, zmq.ZMQError) and e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise e
        return True

    def connected(self, rank: int) -> bool:
        """Whether ``rank``'s heartbeat socket is still connected: an empty frame is sent to it (the
        worker's heartbeat thread discards what it receives); with ROUTER_MANDATORY a peer whose
        connection dropped fails the send at once (EHOSTUNREACH). A full queue (EAGAIN) counts as
        connected."""
        fut = self.sock.send_multipart([identity(rank, "hb"), b""], flags=zmq.NOBLOCK)
        if fut.done() and fut.exception() is not None:
            e = fut.exception()
            return not (isinstance(e, zmq.ZMQError) and e.errno == zmq.EHOSTUNREACH)
        return True

    async def recv(self, timeout_s: Optional[float] = None) -> tuple[int, m.FromWorker]:
        """Next message from any worker: (rank, message).

        Raises:
            TimeoutError: nothing arrived within ``timeout_s``.
            msgspec.ValidationError / DecodeError: a malformed frame.
        """
        if timeout_s is not None:
            if not await self.sock.poll(int(timeout_s * 1000)):
                raise TimeoutError("no message from any worker")
        ident, payload = await self.sock.recv_multipart()
        rank = int(ident.decode().lstrip("rankhb"))
        return rank, m.from_worker_decoder.decode(payload)

    def close(self) -> None:
        if self._auth is not None:
            self.sock.disable_monitor()
            self._auth.stop()
        self.sock.close(0)
        self.ctx.term()
        remove_ipc_file(self.address)


SHUTDOWN_GRACE_S = 3.0
ENGINE_SILENCE_S = 15.0
"""A remote worker whose engine connection has been silent this long treats it as dropped."""


class WorkerSocket:
    """A worker's DEALER to the engine (blocking; the worker loop is synchronous)."""

    def __init__(self, address: str, rank: int, keys: Optional[RunKeys] = None, kind: str = "rank",
                 exit_on_disconnect: bool = False):
        """Connect to the engine at ``address``; with CURVE ``keys`` over TCP. ``exit_on_disconnect``:
        see :meth:`_exit_on_disconnect`."""
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity(rank, kind))
        self.sock.setsockopt(zmq.LINGER, 2000)
        if keys is not None and keys.curve:
            self.sock.curve_serverkey = keys.server_public.encode()
            self.sock.curve_publickey = keys.client_public.encode()
            self.sock.curve_secretkey = keys.client_secret.encode()
        if exit_on_disconnect:
            self._exit_on_disconnect()
        self.sock.connect(address)

    def _exit_on_disconnect(self) -> None:
        """Exit this process (status 1) when the connection to the engine, once made, drops: the
        engine's host died or the network between them failed (workers on other hosts cannot rely
        on their parent process for that). ZMTP heartbeats (answered by the engine's ZeroMQ I/O
        thread) turn a silent peer into a drop within ``ENGINE_SILENCE_S``. Set up before connecting,
        so that no event is missed."""
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(ENGINE_SILENCE_S * 1000))
        monitor_address = f"inproc://zpp-worker-monitor-{uuid.uuid4().hex[:8]}"
        self.sock.monitor(monitor_address, zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        mon = self.ctx.socket(zmq.PAIR)
        mon.connect(monitor_address)

        def watch():
            connected = False
            while True:
                try:
                    event = recv_monitor_message(mon)["event"]
                except zmq.ZMQError:  # context terminated: orderly close
                    return
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    connected = True
                elif event == zmq.EVENT_DISCONNECTED and connected:
                    # An orderly Shutdown may still sit unread in the queue: let the main thread
                    # act on it (and exit 0) first.
                    time.sleep(SHUTDOWN_GRACE_S)
                    logger.error("lost the connection to the engine; exiting")
                    os._exit(1)

        threading.Thread(target=watch, name="zpp-engine-watch", daemon=True).start()

    def send(self, msg: m.FromWorker) -> None:
        self.sock.send(m.encode(msg))

    def recv(self, timeout_s: Optional[float] = None) -> m.ToWorker:
        """Blocking receive. Raises TimeoutError after ``timeout_s`` seconds without a message."""
        if timeout_s is not None and not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("no message from the engine")
        return m.to_worker_decoder.decode(self.sock.recv())

    def poll(self, timeout_ms: int = 0) -> bool:
        """Is a message from the engine waiting?"""
        return bool(self.sock.poll(timeout_ms))

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


class _ClientKey:
    """ZAP credentials check: only the run's CURVE client key is admitted."""

    def __init__(self, client_public: str):
        self.expected = client_public.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.expected  # a refusal is logged by _log_refusals


def _log_refusals(mon: zmq.Socket, owner: Optional["EngineSocket"] = None) -> None:
    """Log every connection the engine's CURVE socket refuses (with the peer's address when the
    connection is still open to ask)."""
    peer = "an unknown peer"
    reasons = {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "it does not speak CURVE with this run's server key",
               zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed",
               zmq.EVENT_HANDSHAKE_FAILED_AUTH: "its client key is not this run's"}
    while True:
        try:
            ev = recv_monitor_message(mon)
        except zmq.ZMQError:
            return
        event = ev["event"]
        if event == zmq.EVENT_MONITOR_STOPPED:
            mon.close(0)
            return
        if event == zmq.EVENT_ACCEPTED:
            peer = _peer_of(int(ev["value"]))
        elif event in reasons:
            if owner is not None:
                owner.refused += 1
            logger.warning("refused a control-plane connection from %s on %s: %s", peer,
                           ev["endpoint"].decode(), reasons[event])


def _peer_of(fd: int) -> str:
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            host, port = s.getpeername()[:2]
            return f"{host}:{port}"
    except OSError:
        return "an unknown peer"
