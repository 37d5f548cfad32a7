"""Stage supervision: a lost stage (its worker process or host died, went silent or stalled) is
started again in place while the other stages keep their processes (``--max-stage-restarts``).

A mixin of :class:`zpp.engine.executor.Executor` (its state lives there). While a restart is under
way the result stream carries :data:`STAGES_RESTARTING`, then :data:`STAGES_RECOVERED`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from zpp import envs
from zpp.config import STAGE_RESTART_WINDOW_S
from zpp.transport import messages as m

logger = logging.getLogger("zpp.engine.executor")


class _Marker:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


STAGES_RESTARTING = _Marker("STAGES_RESTARTING")
"""Put in the result stream when a stage is lost and will be restarted: the micro-batches in flight
are void (their results never come); the core requeues every running request and schedules
nothing until :data:`STAGES_RECOVERED`."""

STAGES_RECOVERED = _Marker("STAGES_RECOVERED")
"""The restarted stages and the survivors form one pipeline again: scheduling resumes."""


class _TryFailed(Exception):
    """One restart try failed (a rank died or did not answer in time); the reason is the message."""


class _GiveUp(Exception):
    """A restart cannot succeed whatever the tries left (the message says why): fail-stop now."""


class StageRestarts:
    """The stage restarts of :class:`~zpp.engine.executor.Executor`."""

    def _restarts_on(self) -> bool:
        return self._supervised and self.max_restarts > 0

    def _why_not_restartable(self, rank: int) -> Optional[str]:
        par = self.config.parallel
        if self.nodes is not None and rank not in self._local_ranks and par.node_launcher == "manual":
            return "its host's agent was started by hand (--node-launcher manual)"
        if self.nodes is not None and rank not in self._local_ranks and self.nodes.launcher == "pernode":
            return (f"{self.nodes.host_of_rank(rank)} runs its own zpp serve (--nnodes), which the head cannot start "
                    f"again: its launcher restarts the group")
        return None

    def _restart_budget_left(self) -> bool:
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < STAGE_RESTART_WINDOW_S]
        return len(self._restart_times) < self.max_restarts

    def _ranks_of_loss(self, rank: int) -> set[int]:
        """The ranks to start again when ``rank`` is lost: itself on this host; every rank of its
        host elsewhere (its agent stops them all and is started again over SSH)."""
        if self.nodes is None or rank in self._local_ranks:
            return {rank}
        host = self.nodes.host_of_rank(rank)
        return set(self.nodes.assignment.get(host, [rank]))

    @property
    def recovering(self) -> bool:
        """A lost stage is being restarted (the pipeline is paused)."""
        return self._recovery is not None

    def _lost(self, rank: int, reason: str, kill: bool = False, pid: Optional[int] = None,
              session: object = None) -> None:
        """``rank``'s worker (or host) is gone, silent or stuck: restart it in place while the other
        stages keep their processes (see :meth:`_recover`), or fail the engine when restarts are off,
        spent, impossible, or the engine is still starting. ``kill``: the process may still be alive
        (stopped or stuck) and is killed first. ``pid`` / ``session``: the process or node session
        the report is about; a report about one a restart has already replaced is ignored. Runs on
        the engine's loop."""
        if self.dead or self._stopping:
            return
        if pid is not None and not any(p.pid == pid for p in self.procs):
            return  # an earlier incarnation of the rank (killed by a restart), reported late
        if session is not None and (self.nodes is None or not self.nodes.is_current(session)):
            return
        why_not = self._why_not_restartable(rank) if self._restarts_on() else None
        if not self._restarts_on() or why_not:
            self._fail(reason + (f" (not restarted: {why_not})" if why_not else ""))
            return
        ranks = self._ranks_of_loss(rank)
        if self._recovery is None and ranks <= self._lost_ranks:
            return  # already known (several watchers saw the same loss)
        if kill:
            for r in ranks & self._local_ranks:
                self._kill_local(r)
        self._lost_ranks |= ranks
        self._abort_survivors(reason)
        self._causes.append(" ".join(reason.split("\n", 1)[0].split()))
        self.trace.mark("stage_lost", -1, args={"rank": rank, "reason": reason[:200]})
        if self._recovery is None:
            logger.warning("%s; restarting %s (the other stages keep running; requests resume)", reason,
                           ", ".join(f"stage {r // self.tp}" + (f" rank {r}" if self.tp > 1 else "")
                                     for r in sorted(ranks)))
            self.inflight.clear()
            self._recovery = asyncio.ensure_future(self._recover())
            self._results.put_nowait(STAGES_RESTARTING)
            self._stats_changed()
        else:
            logger.warning("%s (during the restart)", reason)
            self._control.put_nowait((rank, None))

    def _abort_survivors(self, reason: str) -> None:
        """Have every surviving rank abort its process groups of the current generation
        (:class:`~zpp.transport.messages.AbortLinks` to its heartbeat thread): a survivor blocked
        receiving from (or all-reducing with) a lost rank is released at once, whether or not the
        lost process's connections close (under NCCL a death closes nothing a survivor waits on; a
        stopped process or a hung host keeps gloo's open)."""
        msg = m.AbortLinks(generation=self.generation, reason=" ".join(reason.split("\n", 1)[0].split())[:300])
        for r in range(self.world):
            if r not in self._lost_ranks:
                try:
                    self.socket.send_heartbeat_socket(r, msg)
                except Exception as e:  # never let a survivor's socket stop the restart
                    logger.debug("AbortLinks to rank %d: %s", r, e)

    def _stats_changed(self) -> None:
        if self.on_stage_stats is not None:
            self.on_stage_stats()

    def _kill_local(self, rank: int) -> None:
        for p in self.procs:
            if p.name == f"zpp-worker-{rank}" and p.is_alive():
                self._killed.add(p.pid)
                if envs.ZPP_FAULT_KEEP_LOST:  # fault injection: as if the process were out of reach
                    logger.warning("ZPP_FAULT_KEEP_LOST: not killing %s (pid %d)", self.describe_rank(rank), p.pid)
                    continue
                p.kill()
                p.join(2.0)

    async def _recover(self) -> None:
        """Bring the lost ranks back: each try kills what is left of them, starts them again (this
        host: a new process; another host: a new ``zpp-node`` session), has every rank form process
        group generation ``g + 1`` (survivors: Rejoin; new ranks: InitWorker), loads the new ranks'
        weights and KV cache, and then resumes scheduling (:data:`STAGES_RECOVERED`). Each try
        counts against ``--max-stage-restarts``; when none is left the engine fails with every
        try's cause in one line."""
        t0 = time.monotonic()
        tries = 0
        try:
            while True:
                ranks = set(self._lost_ranks)
                if not self._restart_budget_left():
                    stages = ", ".join(sorted({self.describe_rank(r) for r in ranks}))
                    causes = "; ".join(f"try {i}: {c}" if i else c for i, c in enumerate(self._causes))
                    self._fail(f"{stages}: not restarted, --max-stage-restarts {self.max_restarts} used up within "
                               f"{STAGE_RESTART_WINDOW_S / 60:g} min: {causes}")
                    return
                self._restart_times.append(time.monotonic())
                tries += 1
                for stage in {r // self.tp for r in ranks}:
                    self.stage_restarts[stage] += 1
                try:
                    await self._restart_try(ranks)
                except _TryFailed as e:
                    logger.warning("restart try %d failed: %s", tries, e)
                    if not self._causes or self._causes[-1] != str(e):  # a death is recorded by _lost
                        self._causes.append(str(e))
                    continue
                if self._lost_ranks - ranks:  # another rank was lost meanwhile: restart it too
                    continue
                break
        except asyncio.CancelledError:
            return
        except _GiveUp as e:
            self._fail(str(e))
            return
        except Exception as e:  # a bug in the recovery: fail loudly, never hang
            logger.exception("stage restart failed")
            self._fail(f"stage restart failed: {e!r}")
            return
        took = time.monotonic() - t0
        self.recovery_seconds.append(took)
        logger.info("pipeline formed again in %.1fs (generation %d, %d try/tries); requests resume", took,
                    self.generation, tries)
        self.trace.mark("stages_recovered", -1, args={"seconds": took})
        self._lost_ranks.clear()
        self._causes.clear()
        self._recovery = None
        self.last_progress = time.monotonic()
        self._results.put_nowait(STAGES_RECOVERED)
        self._stats_changed()

    async def _restart_try(self, ranks: set[int]) -> None:
        """One try of :meth:`_recover` for ``ranks``. Raises _TryFailed."""
        while not self._control.empty():  # what came for an earlier try
            self._control.get_nowait()
        for r in ranks & self._local_ranks:
            self._kill_local(r)
        hosts = {self.nodes.host_of_rank(r) for r in ranks - self._local_ranks} if self.nodes else set()
        self.generation += 1
        gen = self.generation
        self._lost_ranks = set(ranks)
        now = time.monotonic()
        for r in ranks:
            self.last_heard.pop(r, None)
            self.heartbeats.pop(r, None)
        survivors = [r for r in range(self.world) if r not in ranks]
        for r in survivors:
            self.last_heard[r] = max(self.last_heard.get(r, now), now)
        logger.info("restarting %s (process group generation %d)", ", ".join(map(self.describe_rank, sorted(ranks))), gen)
        self._spawn_local(sorted(ranks & self._local_ranks))
        for host in hosts:
            await asyncio.get_running_loop().run_in_executor(None, self.nodes.restart, host)

        hello_s = 120.0
        waiting_hello, waiting_ready, waiting_cache = set(ranks), set(ranks), set(ranks)
        waiting_rejoin = set(survivors)
        deadline = time.monotonic() + hello_s
        what = "its Hello"
        while waiting_hello or waiting_ready or waiting_cache or waiting_rejoin:
            left = deadline - time.monotonic()
            if left <= 0:
                late = sorted(waiting_hello or waiting_rejoin or waiting_ready or waiting_cache)
                raise _TryFailed(f"{'; '.join(map(self.describe_rank, late))}: no {what} within {hello_s:.0f} s")
            try:
                rank, msg = await asyncio.wait_for(self._control.get(), timeout=min(left, 1.0))
            except asyncio.TimeoutError:
                continue
            if msg is None:  # a rank died during this try
                raise _TryFailed(self._causes[-1] if self._causes else f"{self.describe_rank(rank)} died")
            if isinstance(msg, m.Hello) and rank in waiting_hello:
                self._check_hello(rank, msg)
                self.placement[rank] = msg
                self.last_heard[rank] = time.monotonic()
                waiting_hello.discard(rank)
                self.socket.send(rank, self._init_worker(rank, self.num_blocks))
                if not waiting_hello:  # every new rank is alive and about to form the groups
                    for r in survivors:
                        self.socket.send(r, m.Rejoin(generation=gen))
                    deadline, what = time.monotonic() + 1800.0, "answer (weights, KV cache, process groups)"
            elif isinstance(msg, m.Rejoined) and msg.generation == gen:
                waiting_rejoin.discard(rank)
            elif isinstance(msg, m.WorkerReady) and rank in waiting_ready:
                waiting_ready.discard(rank)
                if msg.num_kv_blocks_fit < self.num_blocks:
                    raise _GiveUp(f"{self.describe_rank(rank)}: restarted, but it holds only {msg.num_kv_blocks_fit} "
                                  f"KV blocks, not the engine's {self.num_blocks}")
                self.socket.send(rank, m.InitKVCache(num_blocks=self.num_blocks))
            elif isinstance(msg, m.CacheReady) and rank in waiting_cache:
                waiting_cache.discard(rank)
            elif isinstance(msg, m.LinkDown):
                logger.info("%s: %s", self.describe_rank(rank), msg.message)
        for r in sorted(ranks):
            self._log_placement(r, " (restarted)")
