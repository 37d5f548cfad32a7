"""The engine core: scheduler, KV block manager and executor, in a busy loop with no HTTP and no
tokenizer.

The loop keeps up to ``pipeline_depth`` micro-batches in flight (schedule, send to every stage),
waits for the oldest to come back from the last stage, applies it to the scheduler and hands
the step's per-sequence *deltas* (:class:`~zpp.engine.core_messages.StepOutputs`) to ``emit``.
Requests join and leave between steps (continuous batching).

The core runs in the front end's event loop for the offline ``LLM`` (in-process) and in its own
process for ``zpp serve`` (:mod:`zpp.engine.core_proc`); the class is the same. Follows the
split vLLM V1 settled on (``EngineCore`` behind ``AsyncLLM``), kept to zpp's size.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Callable, Optional

from zpp.config import EngineConfig
from zpp.engine.core_messages import CoreRequest, EngineStats, SeqDelta, StepOutputs
from zpp.engine.executor import Executor, StageExecutor, WorkerDiedError
from zpp.engine.kv_cache_manager import KVCacheManager
from zpp.engine.request import Request
from zpp.engine.scheduler import ScheduledBatch, Scheduler

logger = logging.getLogger(__name__)


class EngineCore:
    """Runs sequences on a pipeline of stage workers.

    Create with ``await EngineCore.start(config, eos_token_ids, emit, on_dead)``. ``emit`` gets one
    StepOutputs per applied micro-batch; ``on_dead`` gets the reason once if a worker dies or the
    loop fails (every sequence is lost then).
    """

    def __init__(self, config: EngineConfig, executor: StageExecutor, emit: Callable[[StepOutputs], None],
                 on_dead: Callable[[str], None]):
        self.config = config
        self.executor = executor
        self.emit = emit
        self.on_dead = on_dead
        self.eos_token_ids = executor.eos_token_ids
        self.max_model_len = config.max_model_len
        self.kv = KVCacheManager(executor.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.depth = config.pipeline_depth
        self.scheduler = Scheduler(self.kv, config.scheduler.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.scheduler.enable_chunked_prefill, self.depth,
                                   config.prefill_attention_budget)
        self.inflight: deque[ScheduledBatch] = deque()
        self._loop_task: Optional[asyncio.Task] = None
        self.dead: Optional[str] = None
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    @classmethod
    async def start(cls, config: EngineConfig, eos_token_ids: set[int], emit: Callable[[StepOutputs], None],
                    on_dead: Callable[[str], None]) -> "EngineCore":
        """Start the workers (weights loaded, KV cache sized) and the loop.

        Raises:
            WorkerDiedError: a worker failed to start.
        """
        t = time.perf_counter()
        executor = await Executor.start(config, eos_token_ids)
        core = cls(config, executor, emit, on_dead)
        logger.info("engine ready in %.1fs: %d stage(s), %d KV blocks of %d tokens, pipeline depth %d, "
                    "%d tokens per micro-batch", time.perf_counter() - t, config.parallel.pipeline_parallel_size,
                    executor.num_blocks, config.cache.block_size, core.depth, config.max_num_batched_tokens)
        cache_tokens = executor.num_blocks * config.cache.block_size
        if cache_tokens < config.max_model_len:
            logger.warning("the KV cache holds %d tokens, fewer than --max-model-len %d: longer requests "
                           "are refused", cache_tokens, config.max_model_len)
        core._loop_task = asyncio.create_task(core._run())
        return core

    async def shutdown(self) -> None:
        """Stop the loop and every worker."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        self.executor.shutdown()

    # --- requests -----------------------------------------------------------------------------
    def add_requests(self, reqs: list[CoreRequest]) -> None:
        """Queue sequences (validated by the front end). A sequence whose id is live is refused."""
        for r in reqs:
            if r.req_id in self.scheduler.requests:
                logger.error("sequence id %r is already running; ignored", r.req_id)
                continue
            self.scheduler.add_request(Request(r.req_id, r.prompt_token_ids, r.sampling, r.max_tokens,
                                               self.eos_token_ids))
            self.num_prompt_tokens += len(r.prompt_token_ids)
        self._wake()

    def abort(self, req_ids: list[str]) -> None:
        """End sequences (blocks freed once no batch in flight writes them); unknown ids are ignored."""
        for rid in req_ids:
            self.scheduler.abort(rid)
        self._wake()

    def stats(self) -> EngineStats:
        """The scheduler's, KV cache's and stages' counters now."""
        kv, sch = self.kv, self.scheduler
        return EngineStats(sch.num_running, sch.num_waiting, kv.usage, kv.num_free_blocks, kv.num_blocks,
                           sch.stats.num_preemptions, kv.prefix_queries, kv.prefix_hits,
                           list(self.executor.stage_busy_s), self.num_prompt_tokens, self.num_generation_tokens,
                           list(self.executor.stage_idle_s))

    # --- the loop -----------------------------------------------------------------------------
    def _die(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
            self.on_dead(reason)
        self._wake()

    def _wake(self) -> None:
        """Make the loop look at the queues again (a request arrived or was aborted)."""
        self.executor.interrupt()

    async def _run(self) -> None:
        """Keep the pipeline full; then wait for the executor: the next result (in batch order),
        None when new or aborted requests interrupted the wait, or WorkerDiedError."""
        trace = self.executor.trace
        drained = True  # nothing in flight and nothing to schedule: the workers' next gap is no bubble
        try:
            while True:
                if self.dead:
                    return
                while len(self.inflight) < self.depth:
                    t = time.monotonic() if trace.enabled else 0.0
                    sched = self.scheduler.schedule()
                    if sched is None:
                        break
                    trace.mark("schedule", sched.batch.batch_id, t)
                    sched.batch.after_idle = drained
                    drained = False
                    self.executor.send(sched.batch)
                    self.inflight.append(sched)
                if not self.inflight:
                    drained = True
                item = await self.executor.next_result()
                if item is None:
                    continue
                sched = self.inflight.popleft()
                if item.batch_id != sched.batch.batch_id:
                    raise RuntimeError(f"result for batch {item.batch_id}, expected {sched.batch.batch_id}")
                trace.mark("apply_start", item.batch_id)
                self.emit(self._apply(sched, item))
                trace.mark("applied", item.batch_id)
        except asyncio.CancelledError:
            raise
        except WorkerDiedError as e:
            self._die(str(e))
        except Exception as e:  # an engine bug: fail loudly, never hang
            logger.exception("engine loop crashed")
            self._die(f"engine loop crashed: {e!r}")

    def _apply(self, sched: ScheduledBatch, result) -> StepOutputs:
        updates = self.scheduler.update(sched, result)
        plp = {p.req_id: p for p in result.prompt_logprobs} if result.prompt_logprobs else {}
        deltas = []
        finished = []
        for req, sampled in updates:
            p = plp.get(req.req_id)
            if sampled is None:
                if p is not None:
                    deltas.append(SeqDelta(req.req_id, prompt_logprobs=p))
                continue
            d = SeqDelta(req.req_id, sampled.token_id, sampled.logprobs, prompt_logprobs=p)
            self.num_generation_tokens += 1
            if req.status.finished:
                d.finish_reason = req.status.finish_reason
                d.stop_reason = req.stop_reason
                finished.append(req)
            deltas.append(d)
        self.scheduler.release_finished(finished)
        return StepOutputs(deltas, self.stats())

