"""ZeroMQ sockets between the engine and its workers, typed by the msgspec messages they carry.

The engine binds one ROUTER socket; every worker (local or started by ``zpp-node`` on another
host) connects one DEALER socket whose identity is its rank. Frames are msgpack only.
"""
from __future__ import annotations

import os
import socket
import tempfile
import uuid
from typing import Optional

import zmq
import zmq.asyncio

from zpp.transport import messages as m


def local_ipc_address() -> str:
    """A fresh ipc:// endpoint in the temp directory (single-host runs)."""
    return f"ipc://{tempfile.gettempdir()}/zpp-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def identity(rank: int) -> bytes:
    return f"rank{rank}".encode()


class EngineSocket:
    """The engine's ROUTER: sends ToWorker messages to ranks, receives FromWorker messages.

    One instance per engine; used from the engine's asyncio loop only.
    """

    def __init__(self, address: str):
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, rank: int, msg: m.ToWorker) -> None:
        self.send_bytes([rank], m.encode(msg))

    def send_bytes(self, ranks, payload: bytes) -> None:
        """Send one encoded frame to several ranks (encode once, fan out)."""
        for r in ranks:
            # ROUTER sends never block with the default HWM; NOBLOCK turns an unknown peer into an error.
            fut = self.sock.send_multipart([identity(r), payload], flags=zmq.NOBLOCK, copy=False)
            if fut.done() and fut.exception() is not None:
                raise fut.exception()

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
        rank = int(ident.decode().removeprefix("rank"))
        return rank, m.from_worker_decoder.decode(payload)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
        addr = self.address
        if addr.startswith("ipc://"):
            try:
                os.unlink(addr[len("ipc://"):])
            except OSError:
                pass


class WorkerSocket:
    """A worker's DEALER to the engine (blocking; the worker loop is synchronous)."""

    def __init__(self, address: str, rank: int):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity(rank))
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(address)

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
