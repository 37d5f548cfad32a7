"""The executor's watch over its workers: heartbeats, the stall watchdog, process deaths.

A mixin of :class:`zpp.engine.executor.Executor` (its state lives there): a worker that goes silent
for ``--worker-heartbeat-timeout``, a micro-batch that makes no progress for ``--stage-timeout``,
a local worker process that exits and a node agent whose session is lost are each reported to
:meth:`~zpp.engine.stage_restarts.StageRestarts._lost` (restart the stage) or
:meth:`_fail` (fail the engine) on the engine's loop.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from multiprocessing.connection import wait as mp_wait

from zpp.errors import WorkerDiedError
from zpp.transport import messages as m

logger = logging.getLogger("zpp.engine.executor")

_ROOT_CAUSE_GRACE_S = 2.0
"""How long a worker's own error report waits for a process death or a lost node to explain it
(the node agent's report of a remote worker's death took over a second on a loaded 2-core CI VM)."""


class StallWatchdog:
    """Heartbeats, the stall watchdog and the death watcher of :class:`~zpp.engine.executor.Executor`."""

    def _heard(self, hb: m.Heartbeat) -> None:
        now = time.monotonic()
        old = self.heartbeats.get(hb.rank)
        if old is not None and hb.last_done > old.last_done:
            self.last_progress = now  # some stage finished a micro-batch
        self.heartbeats[hb.rank] = hb
        self.last_heard[hb.rank] = now

    async def _watchdog(self, tick_s: float = 0.5) -> None:
        """Fail the engine when a worker goes silent (no heartbeat for --worker-heartbeat-timeout:
        stopped or hung process or host) or the pipeline makes no progress for --stage-timeout
        while a micro-batch is in flight (a live worker stuck, e.g. in a wedged gloo/NCCL call);
        warn once at half that limit. Either names the stage and host and what it waits for."""
        par = self.config.parallel
        last_tick = time.monotonic()
        warned: set[int] = set()
        while not self.dead and not self._stopping:
            await asyncio.sleep(tick_s)
            now = time.monotonic()
            if now - last_tick > 4 * tick_s:
                # This loop itself was held up: heartbeats queued meanwhile are not the workers' fault.
                self.last_heard = {r: max(t, now) for r, t in self.last_heard.items()}
                self.last_progress = max(self.last_progress, now)
            last_tick = now
            silent = [(r, t) for r, t in self.last_heard.items()
                      if now - t > par.worker_heartbeat_timeout and r not in self._lost_ranks]
            for rank, t in silent:
                self._lost(rank, f"{self.describe_rank(rank)} sent no heartbeat for {now - t:.0f} s "
                                 f"(--worker-heartbeat-timeout {par.worker_heartbeat_timeout:g}): its process is "
                                 f"stopped or hung", kill=True)
            if self.dead or silent:
                continue
            if self._probed and self._recovery is None:
                # Remote ranks no SSH session watches (per-node launch, --node-launcher manual): a
                # connection that dropped (its process or host died) is seen within a tick, not
                # after --worker-heartbeat-timeout. Only ranks heard from are probed: a worker
                # connects its heartbeat socket once it has its configuration.
                for rank in sorted(self._probed & set(self.heartbeats)):
                    if rank not in self._lost_ranks and not self.socket.connected(rank):
                        self._lost(rank, f"{self.describe_rank(rank)}: its connection to the engine closed (its "
                                         f"process or its host died)")
                        break
                if self.dead:
                    continue
            if not self.inflight or self._recovery is not None:
                continue
            oldest = min(self.inflight)
            stalled = now - self.last_progress
            if stalled > par.stage_timeout:
                rank, doing = self._stuck_rank(oldest)
                self._lost(rank, f"micro-batch {oldest} made no progress for {stalled:.0f} s (--stage-timeout "
                                 f"{par.stage_timeout:g}): {doing}", kill=True)
                continue
            if stalled > par.stage_timeout / 2 and oldest not in warned:
                warned.add(oldest)
                logger.warning("micro-batch %d has made no progress for %.0f s (the engine fails at "
                               "--stage-timeout %g): %s", oldest, stalled, par.stage_timeout, self._stuck_at(oldest))

    def _stuck_at(self, batch_id: int) -> str:
        """The first stage that has not finished ``batch_id``, and what it is doing."""
        return self._stuck_rank(batch_id)[1]

    def _stuck_rank(self, batch_id: int) -> tuple[int, str]:
        """(rank, description) of the first stage that has not finished ``batch_id``: the one to
        restart when the pipeline stalls (the stages after it wait for it)."""
        for rank in range(self.world):
            hb = self.heartbeats.get(rank)
            if hb is not None and hb.last_done >= batch_id:
                continue
            if hb is None or hb.batch_id != batch_id:
                doing = "has not started it (still on an earlier micro-batch, or its message is late)"
            elif hb.waiting:
                doing = f"has waited {hb.seconds:.0f} s for activations from stage {rank // self.tp - 1}"
            else:
                doing = f"has been computing it for {hb.seconds:.0f} s"
            return rank, f"{self.describe_rank(rank)} {doing}"
        last = self.world - self.tp
        return last, f"every stage finished it, but its result has not arrived ({self.describe_rank(last)})"

    def _watch_procs(self) -> None:
        """Thread: report every local worker's death and every node agent's lost session to the
        loop (processes started by a restart are watched from their start; ones the executor killed
        on purpose are not reported)."""
        while not self._stopping:
            procs = [p for p in self.procs if p.pid not in self._reported]
            sentinels = {p.sentinel: p for p in procs}
            ready = mp_wait(list(sentinels), timeout=0.5) if sentinels else time.sleep(0.5) or []
            for s in ready:
                p = sentinels.pop(s)
                self._reported.add(p.pid)
                rank = int(p.name.rsplit("-", 1)[1])
                if self._stopping or p.pid in self._killed:
                    continue
                msg = self._death_of(rank, p)
                if p.exitcode == 1 and not self._restarts_on():
                    # A worker that failed by itself, after its WorkerError: often the echo of a
                    # neighbour's death (a remote stage's, reported by its node agent later), so the
                    # root cause gets the same grace as that WorkerError (the earlier of the two
                    # reasons is the one reported).
                    self._notify(self._loop.call_later, _ROOT_CAUSE_GRACE_S, self._fail, msg)
                else:
                    self._notify(functools.partial(self._lost, rank, msg, pid=p.pid))
            if self.nodes is not None and not self._stopping:
                for host, (err, session) in self.nodes.poll_lost().items():
                    ranks = self.nodes.assignment.get(host, [])
                    self._notify(functools.partial(self._lost, ranks[0] if ranks else 0, err, session=session))

    def _notify(self, fn, *args) -> None:
        """From the watcher thread: run ``fn(*args)`` on the engine's loop; nothing once that loop is
        closed (the engine stopped while a death was being looked into)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed
            pass

    def _death_of(self, rank: int, proc=None) -> str:
        """Why ``rank`` is gone: its local process's exit (waited for up to 1 s: the sentinel, or a
        dropped connection, comes before the exit code is collected), else its lost connection."""
        for p in ([proc] if proc is not None else self.procs):
            if p.name.rsplit("-", 1)[1] == str(rank):
                p.join(1.0)
                code = p.exitcode
                deadline = time.monotonic() + 1.0
                while code is None and time.monotonic() < deadline:
                    # Another thread may have reaped the process and not yet stored its code
                    # (multiprocessing's poll reads None meanwhile): look again shortly.
                    time.sleep(0.02)
                    code = p.exitcode
                if code is None:
                    return f"{self.describe_rank(rank)}: its worker process (pid {p.pid}) closed its connection to the engine"
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
                    else f"exited with code {code}"
                err = self._last_error.pop(rank, None)
                return f"{self.describe_rank(rank)}: its worker process (pid {p.pid}) {how}" + (f" ({err})" if err else "")
        return f"{self.describe_rank(rank)}: its connection to the engine closed (its process or its host died)"

    def _fail(self, reason: str) -> None:
        if self.dead or self._stopping:
            return
        self.dead = reason
        logger.error("%s", reason)
        if self._recovery is not None and self._recovery is not asyncio.current_task():
            self._recovery.cancel()
        self._results.put_nowait(WorkerDiedError(reason))
