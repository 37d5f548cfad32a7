"""The engine core in its own process (``zpp serve``); the front end's client for it is
:class:`zpp.frontend.core_client.CoreProcessClient`.

The front end spawns one core process; the core binds a ZeroMQ ROUTER on an ipc address and
each front end connects a DEALER (several front ends may share one core). Every message is a
msgspec-tagged struct from :mod:`zpp.transport.core_messages`, msgpack-encoded; nothing is pickled.

Lifecycle:

- start-up: front -> FrontHello; core -> CoreReady once its workers are up, or CoreFailed
  (ConfigError / WorkerDiedError text) and exit 1.
- a worker dies: core -> CoreDead(reason), the core stops its workers and exits 1; a core that
  dies without a word is seen through its process sentinel. Either way the front end fails its
  requests, ``/health`` answers 503 and ``zpp serve`` exits non-zero.
- the front end dies (even SIGKILL): the core gets SIGKILL from the kernel (PR_SET_PDEATHSIG, as
  the workers do from the core), so nothing is left behind.
- stop: front -> ShutdownCore; the core stops its workers and exits 0. The core ignores SIGINT
  (a terminal's Ctrl-C reaches the whole process group; the front end decides; it is even blocked
  from the core's first instruction, see ``zpp.utils.process.sigint_blocked``) and treats SIGTERM as ShutdownCore.
  Either, during start-up, aborts the start-up: the workers started so far are stopped at once.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Optional

import msgspec

from zpp.config import EngineConfig
from zpp.errors import ConfigError, WorkerDiedError
from zpp.transport import core_messages as cm
from zpp.transport.core_channels import FrontEndsSocket
from zpp.utils.process import freeze_gc, watch_parent

logger = logging.getLogger(__name__)



# --- the core process --------------------------------------------------------------------------
def core_main(config_bytes: bytes, address: str, eos_token_ids: list[int], log_level: int) -> None:
    """Entry point of the engine-core process. Exits 0 after ShutdownCore, 1 on a failure."""
    watch_parent()
    from zpp.proctitle import set_process_title
    set_process_title("zpp::core")
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [core] %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    try:
        status = asyncio.run(_CoreServer(config, address, set(eos_token_ids)).run())
    except Exception:
        logger.exception("engine core failed")
        status = 1
    logging.shutdown()
    os._exit(status)


class _CoreServer:
    def __init__(self, config: EngineConfig, address: str, eos_token_ids: set[int]):
        self.config = config
        self.address = address
        self.eos_token_ids = eos_token_ids
        self.fronts: list[bytes] = []
        self.owner: dict[str, bytes] = {}  # live sequence id -> the front end that sent it
        self.core = None
        self.ready: Optional[cm.CoreReady | cm.CoreFailed] = None
        self.stop = asyncio.Event()
        self.status = 0
        self._stats_pending = False

    async def run(self) -> int:
        self.sock = FrontEndsSocket(self.address)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop.set)
        reader = asyncio.create_task(self._read())
        try:
            from zpp.engine.core import EngineCore
            starting = asyncio.ensure_future(
                EngineCore.start(self.config, self.eos_token_ids, self._emit, self._on_dead))
            stopped = asyncio.ensure_future(self.stop.wait())
            await asyncio.wait([starting, stopped], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not starting.done():
                # SIGTERM or ShutdownCore during start-up (the front end got a Ctrl-C): give up now
                # rather than after loading every weight; Executor.start stops the workers it started.
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
                logger.debug("start-up aborted: asked to stop")
                return self.status
            try:
                self.core = starting.result()
                # A stage's busy / idle report that comes after the last step (stages before the last
                # report after 250 ms idle) reaches /metrics now, not with the next request.
                self.core.executor.on_stage_stats = self._push_stats_soon
                self.ready = cm.CoreReady(self.core.kv.num_blocks, self.config.cache.block_size, self.core.depth)
                freeze_gc()
            except (ConfigError, ValueError) as e:  # e.g. --num-kv-blocks that does not fit
                self.ready, self.status = cm.CoreFailed("config", str(e)), 1
            except WorkerDiedError as e:
                self.ready, self.status = cm.CoreFailed("worker", str(e)), 1
            self._broadcast(self.ready)
            if isinstance(self.ready, cm.CoreFailed):
                await self._linger_for_front()
                return self.status
            await self.stop.wait()
            return self.status
        finally:
            reader.cancel()
            if self.core is not None:
                await self.core.shutdown()
            await asyncio.sleep(0.05)  # let queued messages (CoreDead) leave
            self.sock.close(linger_ms=1000)

    async def _linger_for_front(self) -> None:
        """After a failed start, give the front end a moment to connect and read CoreFailed."""
        for _ in range(50):
            if self.fronts:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.2)

    async def _read(self) -> None:
        while True:
            ident, msg = await self.sock.recv()
            if isinstance(msg, cm.AddRequests):
                if self.core is None or self.core.dead:
                    continue
                fresh, taken = [], []
                for r in msg.requests:
                    (taken if r.req_id in self.owner else fresh).append(r)
                    self.owner.setdefault(r.req_id, ident)
                if taken:  # a live id again (a front-end bug): end the newcomer, never re-route the live one
                    logger.error("sequence ids already live, ended: %s", ", ".join(r.req_id for r in taken))
                    self.sock.send(ident, cm.StepOutputs([cm.SeqDelta(r.req_id, finish_reason="abort") for r in taken],
                                                         self.core.stats()))
                self.core.add_requests(fresh)
                self._push_stats_soon()
            elif isinstance(msg, cm.AbortRequests):
                if self.core is not None:
                    self.core.abort(msg.req_ids)
                    for rid in msg.req_ids:
                        self.owner.pop(rid, None)
                    self._push_stats_soon()
            elif isinstance(msg, cm.FrontHello):
                if ident not in self.fronts:
                    self.fronts.append(ident)
                if self.ready is not None:
                    self.sock.send(ident, self.ready)
            elif isinstance(msg, cm.ShutdownCore):
                self.stop.set()

    def _push_stats_soon(self) -> None:
        """The gauges changed with no step to carry them (requests queued or aborted): send them
        within 5 ms, once for a burst of messages."""
        if not self._stats_pending:
            self._stats_pending = True
            asyncio.get_running_loop().call_later(0.005, self._push_stats)

    def _push_stats(self) -> None:
        self._stats_pending = False
        if self.core is not None and not self.core.dead:
            self._broadcast(cm.StepOutputs([], self.core.stats()))

    def _broadcast(self, msg) -> None:
        self.sock.broadcast(self.fronts, msg)

    def _emit(self, step: cm.StepOutputs) -> None:
        if len(self.fronts) <= 1:
            for d in step.deltas:
                if d.finish_reason is not None:
                    self.owner.pop(d.req_id, None)
            self._broadcast(step)
            return
        by_front: dict[bytes, list[cm.SeqDelta]] = {f: [] for f in self.fronts}
        for d in step.deltas:
            f = self.owner.get(d.req_id)
            if f is not None:
                by_front[f].append(d)
                if d.finish_reason is not None:
                    self.owner.pop(d.req_id, None)
        for f, deltas in by_front.items():
            self.sock.send(f, cm.StepOutputs(deltas, step.stats))

    def _on_dead(self, reason: str) -> None:
        logger.error("engine core: %s", reason)
        self._broadcast(cm.CoreDead(reason))
        self.status = 1
        self.stop.set()
