"""ZeroMQ sockets between the front end(s) and the engine core process, typed by the messages of
:mod:`zpp.transport.core_messages` (msgpack, nothing pickled), named by the peer they talk to.

The core binds one ROUTER (:class:`FrontEndsSocket`: it talks to the front ends); each front end
connects one DEALER (:class:`CoreSocket`: it talks to the core). High-water marks are 0 (a send
never blocks or drops: the front end bounds what it queues). Both are used from an asyncio loop.
"""
from __future__ import annotations

from typing import Union

import msgspec
import zmq
import zmq.asyncio

from zpp.transport import core_messages as cm
from zpp.transport.channels import remove_ipc_file

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(cm.ToCore)
_from_core = msgspec.msgpack.Decoder(cm.FromCore)


def _socket(ctx: zmq.asyncio.Context, kind: int, linger_ms: int) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


class FrontEndsSocket:
    """The core's side: ROUTER bound at ``address`` (``ipc://...``); receives ToCore messages with
    the sending front end's identity, sends FromCore messages to one front end or to several."""

    def __init__(self, address: str):
        self.address = address
        self.ctx = zmq.asyncio.Context()
        self.sock = _socket(self.ctx, zmq.ROUTER, 2000)
        self.sock.bind(address)

    async def recv(self) -> tuple[bytes, cm.ToCore]:
        ident, payload = await self.sock.recv_multipart()
        return ident, _to_core.decode(payload)

    def send(self, front: bytes, msg: cm.FromCore) -> None:
        self.sock.send_multipart([front, _encoder.encode(msg)])

    def broadcast(self, fronts, msg: cm.FromCore) -> None:
        """``msg`` to each of ``fronts`` (encoded once)."""
        payload = _encoder.encode(msg)
        for front in fronts:
            self.sock.send_multipart([front, payload])

    def close(self, linger_ms: int = 1000) -> None:
        """Close (pending sends get ``linger_ms``) and remove the ipc socket file."""
        self.sock.close(linger=linger_ms)
        self.ctx.term()
        remove_ipc_file(self.address)


class CoreSocket:
    """A front end's side: DEALER connected to the core at ``address``; sends ToCore messages,
    receives FromCore ones."""

    def __init__(self, address: str):
        self.ctx = zmq.asyncio.Context()
        self.sock = _socket(self.ctx, zmq.DEALER, 0)
        self.sock.connect(address)

    def send(self, msg: Union[cm.AddRequests, cm.AbortRequests, cm.ShutdownCore, cm.FrontHello]) -> None:
        self.sock.send(_encoder.encode(msg))  # HWM 0: never blocks; the future is already done

    async def recv(self) -> cm.FromCore:
        return _from_core.decode(await self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
