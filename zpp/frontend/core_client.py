"""The front end's client of the engine core: :class:`CoreClient` is what
:class:`~zpp.frontend.async_engine.AsyncEngine` needs of a core; :class:`InProcessCoreClient` runs
the core on the caller's event loop (the offline ``LLM``, tests), :class:`CoreProcessClient` in
its own process behind ZeroMQ (``zpp serve``, see :mod:`zpp.engine.core_proc`).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
from typing import Callable, Optional, Protocol

import msgspec
import zmq

from zpp.config import EngineConfig
from zpp.engine.core_proc import core_main
from zpp.errors import ConfigError, WorkerDiedError
from zpp.transport import core_messages as cm
from zpp.transport.core_channels import CoreSocket
from zpp.transport.channels import local_ipc_address, remove_ipc_file, remove_ipc_files_of
from zpp.utils.process import main_module_hidden, sigint_blocked

logger = logging.getLogger("zpp.engine.core_proc")



class CoreClient(Protocol):
    """The engine core as the front end sees it.

    * ``await start(config, eos_token_ids, on_step, on_dead)``: start (or join) the core; after it,
      ``num_kv_blocks`` and ``block_size`` are set. ``on_step(StepOutputs)`` then gets every step's
      outputs and ``on_dead(reason)`` the reason, once, if the core or a worker dies. Raises
      ConfigError / WorkerDiedError when the core cannot start.
    * ``add(requests)`` / ``abort(seq_ids)``: send without waiting.
    * ``stats()``: the core's counters after its latest step.
    * ``await shutdown()``: stop the core and its workers (idempotent); ``kill()``: now.
    """

    num_kv_blocks: int
    block_size: int

    async def start(self, config: EngineConfig, eos_token_ids: set[int], on_step: Callable[[cm.StepOutputs], None],
                    on_dead: Callable[[str], None]) -> None: ...

    def add(self, reqs: list[cm.CoreRequest]) -> None: ...

    def abort(self, req_ids: list[str]) -> None: ...

    def stats(self) -> cm.EngineStats: ...

    async def shutdown(self) -> None: ...

    def kill(self) -> None: ...


class InProcessCoreClient:
    """The engine core on the caller's event loop (the offline ``LLM``, tests)."""

    def __init__(self):
        self.core = None

    async def start(self, config: EngineConfig, eos_token_ids: set[int], on_step, on_dead) -> None:
        from zpp.engine.core import EngineCore
        self.core = await EngineCore.start(config, eos_token_ids, on_step, on_dead)
        self.num_kv_blocks = self.core.kv.num_blocks
        self.block_size = config.cache.block_size

    def add(self, reqs: list[cm.CoreRequest]) -> None:
        self.core.add_requests(reqs)

    def abort(self, req_ids: list[str]) -> None:
        self.core.abort(req_ids)

    def stats(self) -> cm.EngineStats:
        return self.core.stats()

    async def shutdown(self) -> None:
        if self.core is not None:
            await self.core.shutdown()

    def kill(self) -> None:
        if self.core is not None:
            self.core.executor.shutdown(timeout_s=1.0)


# --- the engine core in its own process ----------------------------------------------------------------------
class CoreProcessClient:
    """Spawns the core process (or joins one at ``address``) and talks to it.

    ``start`` raises ConfigError / WorkerDiedError with the core's one-line reason when the core
    cannot start; cancelled while the core starts, it stops the core (and so its workers) first.
    After start: ``add``/``abort`` send without waiting; ``on_step`` gets every StepOutputs and
    ``on_dead`` the reason once if the core or a worker dies.
    """

    def __init__(self, address: Optional[str] = None, index: int = 0):
        self.address = address
        self.index = index
        self.proc: Optional[mp.Process] = None
        self._stats = cm.EngineStats()
        self._stopping = False
        self._dead = False
        self._reader: Optional[asyncio.Task] = None
        self._on_exit_during_start: Optional[asyncio.Future] = None

    async def start(self, config: EngineConfig, eos_token_ids: set[int], on_step, on_dead) -> None:
        self.on_step, self.on_dead = on_step, on_dead
        loop = asyncio.get_running_loop()
        if self.address is None:
            self.address = local_ipc_address()
            ctx = mp.get_context("spawn")
            level = logging.getLogger("zpp").getEffectiveLevel()
            with main_module_hidden(), sigint_blocked():
                # Not a daemon: the core starts the worker processes itself.
                self.proc = ctx.Process(target=core_main, name="zpp-engine-core",
                                        args=(msgspec.msgpack.encode(config), self.address,
                                              sorted(eos_token_ids), level))
                self.proc.start()
            loop.add_reader(self.proc.sentinel, self._core_exited)
        self.sock = CoreSocket(self.address)
        self._send(cm.FrontHello(self.index))
        first = asyncio.ensure_future(self.sock.recv())
        exited = loop.create_future()
        self._on_exit_during_start = exited
        try:
            done, _ = await asyncio.wait([first, exited], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled (zpp serve got SIGINT / SIGTERM): stop the core and its workers
            first.cancel()
            await self._abort_start()
            raise
        finally:
            self._on_exit_during_start = None
        if first not in done:
            first.cancel()
            self._stopping = True
            self._close()
            raise WorkerDiedError(f"the engine core process exited during start-up (exit code "
                                  f"{self.proc.exitcode}); see the log above")
        msg = first.result()
        if isinstance(msg, cm.CoreFailed):
            self._stopping = True
            self._join(5.0)
            self._close()
            raise (ConfigError if msg.kind == "config" else WorkerDiedError)(msg.message)
        assert isinstance(msg, cm.CoreReady), msg
        self.num_kv_blocks, self.block_size, self.pipeline_depth = msg.num_kv_blocks, msg.block_size, msg.pipeline_depth
        self._reader = asyncio.create_task(self._read())

    async def _abort_start(self) -> None:
        """Stop a core that is still starting: SIGTERM makes it abort its start-up and stop the
        workers it started (then it exits); SIGKILL if it has not within 10 s."""
        self._stopping = True
        if self.proc is not None:
            loop = asyncio.get_running_loop()
            loop.remove_reader(self.proc.sentinel)
            if self.proc.is_alive():
                self.proc.terminate()
            await loop.run_in_executor(None, self._join, 10.0)
        self._close()

    def _send(self, msg) -> None:
        self.sock.send(msg)

    def add(self, reqs: list[cm.CoreRequest]) -> None:
        self._send(cm.AddRequests(reqs))

    def abort(self, req_ids: list[str]) -> None:
        self._send(cm.AbortRequests(req_ids))

    def stats(self) -> cm.EngineStats:
        return self._stats

    async def _read(self) -> None:
        while True:
            msg = await self.sock.recv()
            if isinstance(msg, cm.StepOutputs):
                self._stats = msg.stats
                try:
                    self.on_step(msg)
                except Exception:  # a front-end bug must not silence the core's stream
                    logger.exception("processing the engine core's outputs failed")
            elif isinstance(msg, cm.CoreDead):
                self._die(msg.reason)

    def _die(self, reason: str) -> None:
        if not self._dead and not self._stopping:
            self._dead = True
            self.on_dead(reason)

    def _core_exited(self) -> None:
        loop = asyncio.get_event_loop()
        loop.remove_reader(self.proc.sentinel)
        self.proc.join(0)
        self._sweep()
        if self._on_exit_during_start is not None and not self._on_exit_during_start.done():
            self._on_exit_during_start.set_result(None)
            return
        # A CoreDead message sent just before exiting may still be in the socket: let it win.
        loop.call_later(0.2, self._die, f"the engine core process exited (exit code {self.proc.exitcode})")

    def _join(self, timeout: float) -> None:
        if self.proc is None:
            return
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(3.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(1.0)

    def _close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.sock.close()
        self._sweep()

    def _sweep(self) -> None:
        """Once the core this front end started has exited: remove the socket files it may have
        left (its own, bound at our address, and its workers' control plane), as a core that was
        SIGKILLed or died mid-way does not."""
        if self.proc is not None and self.proc.exitcode is not None:
            remove_ipc_file(self.address)
            remove_ipc_files_of(self.proc.pid)

    async def shutdown(self) -> None:
        """Ask the core to stop its workers and exit; wait (then SIGTERM, SIGKILL). Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        if self.proc is not None:
            try:
                asyncio.get_running_loop().remove_reader(self.proc.sentinel)
            except Exception:
                pass
        if self.proc is not None:  # only the front end that started the core stops it
            try:
                self._send(cm.ShutdownCore())
            except zmq.ZMQError:
                pass
            await asyncio.get_running_loop().run_in_executor(None, self._join, 15.0)
        self._close()

    def kill(self) -> None:
        """Stop the core now (SIGTERM: it still stops its workers)."""
        self._stopping = True
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
