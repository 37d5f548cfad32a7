"""The engine core: scheduler, KV block manager and executor, in a busy loop with no HTTP and no
tokenizer.

The loop keeps up to ``pipeline_depth`` micro-batches in flight (schedule, send to every stage),
waits for the oldest to come back from the last stage, applies it to the scheduler and hands
the step's per-sequence *deltas* (:class:`~zpp.transport.core_messages.StepOutputs`) to ``emit``.
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

import msgspec

from zpp.config import EngineConfig
from zpp.transport.core_messages import CoreRequest, EngineStats, SeqDelta, StepOutputs
from zpp.engine.executor import Executor, StageExecutor
from zpp.engine.stage_restarts import STAGES_RECOVERED, STAGES_RESTARTING
from zpp.errors import WorkerDiedError
from zpp.engine.kv_cache_manager import KVCacheManager
from zpp.engine.request import Request, RequestStatus
from zpp.engine.scheduler import ScheduledBatch, Scheduler
from zpp.engine.structured_output import GrammarStore, default_fill_threads
from zpp.models.registry import resolve_model_class

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
        hf = config.model.hf_config
        self.scheduler = Scheduler(self.kv, config.scheduler.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.scheduler.enable_chunked_prefill, self.depth,
                                   config.prefill_attention_budget, config.async_scheduling,
                                   rope_switch_len=resolve_model_class(hf).rope_switch_length(hf))
        self.inflight: deque[ScheduledBatch] = deque()
        self._loop_task: Optional[asyncio.Task] = None
        self.dead: Optional[str] = None
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.grammars = GrammarStore(int(config.model.hf_config["vocab_size"]), default_fill_threads())
        self.paused = False
        """A lost stage is being restarted: nothing is scheduled until it is back."""

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
                    "%d tokens per micro-batch, async scheduling %s", time.perf_counter() - t,
                    config.parallel.pipeline_parallel_size, executor.num_blocks, config.cache.block_size, core.depth,
                    config.max_num_batched_tokens, "on" if config.async_scheduling else "off")
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
        """Queue sequences (validated by the front end). A sequence whose id is live is refused.
        A structured-output sequence gets its grammar matcher here; one whose grammar cannot be
        read (a front-end bug) is finished at once with ``finish_reason`` ``"abort"``."""
        failed = []
        for r in reqs:
            if r.req_id in self.scheduler.requests:
                logger.error("sequence id %r is already running; ignored", r.req_id)
                continue
            sampling, grammar = r.sampling, None
            if sampling.structured_outputs is not None:  # the workers need only the mask, not the spec
                sampling = msgspec.structs.replace(sampling, structured_outputs=None)
            if r.grammar is not None:
                try:
                    stop = sorted(self.eos_token_ids | set(sampling.stop_token_ids or ()))
                    grammar = self.grammars.new_matcher(r.grammar, stop)
                except Exception:
                    logger.exception("sequence %s: its grammar cannot be read; finished", r.req_id)
                    failed.append(SeqDelta(r.req_id, finish_reason="abort"))
                    continue
            req = Request(r.req_id, r.prompt_token_ids, sampling, r.max_tokens, self.eos_token_ids)
            req.grammar = grammar
            self.scheduler.add_request(req)
            self.num_prompt_tokens += len(r.prompt_token_ids)
        if failed:
            self.emit(StepOutputs(failed, self.stats()))
        self._wake()

    def abort(self, req_ids: list[str]) -> None:
        """End sequences (blocks freed once no batch in flight writes them); unknown ids are ignored."""
        for rid in req_ids:
            self.scheduler.abort(rid)
        self._wake()

    def stats(self) -> EngineStats:
        """The scheduler's, KV cache's and stages' counters now."""
        kv, sch, ex = self.kv, self.scheduler, self.executor
        return EngineStats(sch.num_running, sch.num_waiting, kv.usage, kv.num_free_blocks, kv.num_blocks,
                           sch.stats.num_preemptions, kv.prefix_queries, kv.prefix_hits,
                           list(ex.stage_busy_s), self.num_prompt_tokens, self.num_generation_tokens,
                           list(ex.stage_idle_s), bool(getattr(ex, "recovering", False)),
                           list(getattr(ex, "stage_restarts", ())), list(getattr(ex, "recovery_seconds", ())))

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
                while len(self.inflight) < self.depth and not self.paused:
                    t = time.monotonic() if trace.enabled else 0.0
                    sched = self.scheduler.schedule()
                    if sched is None:
                        break
                    trace.mark("schedule", sched.batch.batch_id, t)
                    sched.batch.after_idle = drained
                    drained = False
                    self.executor.send(sched.batch, *self._grammar_rows(sched))
                    self.inflight.append(sched)
                if not self.inflight:
                    drained = True
                item = await self.executor.next_result()
                if item is None:
                    continue
                if item is STAGES_RESTARTING or item is STAGES_RECOVERED:
                    self._stage_restart(item is STAGES_RESTARTING)
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

    def _stage_restart(self, starting: bool) -> None:
        """A stage was lost (``starting``): the micro-batches in flight are void; every running
        request goes back to the queue to be recomputed from its prompt and the tokens it has
        produced (streams see a pause, no token repeated or skipped), and scheduling waits. Or the
        restarted stage is back: scheduling resumes."""
        if starting:
            n = self.scheduler.restart_all(list(self.inflight))
            self.inflight.clear()
            self.paused = True
            logger.warning("a stage is restarting: %d running request(s) will be recomputed once it is back", n)
        else:
            self.paused = False
            logger.info("stages back: %d request(s) resume", self.scheduler.num_waiting + self.scheduler.num_running)
        self.emit(StepOutputs([], self.stats()))

    def _grammar_rows(self, sched: ScheduledBatch) -> tuple[list[int], bytes]:
        """The constrained rows of a micro-batch (indices into its chunks) and their token bitmask
        (see ``ExecuteBatch.grammar_rows``); ``([], b"")`` when none is constrained.

        Raises:
            RuntimeError: a sequence is scheduled to sample before its previous token was accepted
                (the scheduler keeps a decoding sequence in one micro-batch at a time; this checks it).
        """
        rows, grammars = [], []
        for i, (req, sample) in enumerate(zip(sched.reqs, sched.sample)):
            g = req.grammar
            if g is None or not sample:
                continue
            if g.num_accepted != req.num_output_tokens:
                raise RuntimeError(f"sequence {req.req_id}: scheduled to sample with {req.num_output_tokens} "
                                   f"tokens generated but {g.num_accepted} accepted by its grammar")
            rows.append(i)
            grammars.append(g)
        if not rows:
            return [], b""
        return rows, self.grammars.fill_bitmask(grammars)

    def _apply(self, sched: ScheduledBatch, result) -> StepOutputs:
        updates = self.scheduler.update(sched, result)
        # Logprobs and prompt logprobs come only for the chunks that asked, named by chunk index.
        plp = {p.chunk: p for p in result.prompt_logprobs} if result.prompt_logprobs else None
        lps = dict(zip(result.logprob_chunks, result.logprobs)) if result.logprobs else None
        deltas = []
        finished = []
        for req, i, token_id in updates:
            p = plp.get(i) if plp else None
            if token_id < 0:
                if p is not None:
                    deltas.append(SeqDelta(req.req_id, prompt_logprobs=p))
                continue
            if req.grammar is not None and not self._advance_grammar(req, token_id):
                deltas.append(SeqDelta(req.req_id, finish_reason="abort", prompt_logprobs=p))
                finished.append(req)
                continue
            d = SeqDelta(req.req_id, token_id, lps.get(i) if lps else None, prompt_logprobs=p)
            self.num_generation_tokens += 1
            if req.status.finished:
                d.finish_reason = req.status.finish_reason
                d.stop_reason = req.stop_reason
                finished.append(req)
            deltas.append(d)
        self.scheduler.release_finished(finished)
        return StepOutputs(deltas, self.stats())

    def _advance_grammar(self, req: Request, token_id: int) -> bool:
        """Feed the sampled token (already appended by the scheduler) to the sequence's matcher.

        A complete grammar ends the sequence (``"stop"``, even with ``ignore_eos``: nothing may
        follow). A token the grammar refuses is a dead end: the token is dropped, the sequence
        finishes as aborted and False is returned."""
        if req.grammar.accept(token_id):
            if req.grammar.terminated and not req.status.finished:
                req.status = RequestStatus.FINISHED_STOPPED
            return True
        logger.warning("sequence %s: its grammar allows no token the sampler could pick (dead end, e.g. "
                       "min_tokens suppressing the only allowed stop token): finished with reason 'abort'",
                       req.req_id)
        req.token_ids.pop()
        req.status = RequestStatus.FINISHED_ABORTED
        return False

