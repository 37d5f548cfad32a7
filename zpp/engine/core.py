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
from zpp.engine.spec_decode import SpecDecoder
from zpp.engine.step_cost import StepCostModel, StepTarget, prior_coefficients
from zpp.engine.structured_output import GrammarSender
from zpp.models.partition import partition_layers
from zpp.models.registry import resolve_model_class
from zpp.transport import messages as m

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
        self.spec = SpecDecoder(config.speculative_config) if config.speculative_config is not None else None
        if self.spec is not None:
            self.spec.setup_kv(self.kv, self.max_model_len)
        hf = config.model.hf_config
        itl = config.target_inter_token_latency  # a stream's tokens are `depth` micro-batches apart, or 1 (async)
        target = StepTarget(StepCostModel(self._cost_priors()), itl, 1 if config.async_scheduling else self.depth) \
            if itl else None
        self.scheduler = Scheduler(self.kv, config.scheduler.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.scheduler.enable_chunked_prefill, self.depth,
                                   config.prefill_attention_budget, config.async_scheduling,
                                   rope_switch_len=resolve_model_class(hf).rope_switch_length(hf),
                                   target=target, spec=self.spec)
        if target is not None:
            executor.on_step_times = target.cost.observe  # the stages' step times teach the chunk sizes
        self.inflight: deque[ScheduledBatch] = deque()
        self._loop_task: Optional[asyncio.Task] = None
        self.dead: Optional[str] = None
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.grammars = GrammarSender()
        """Structured outputs: what goes to the result rank, which holds the matchers."""
        self.paused = False
        """A lost stage is being restarted: nothing is scheduled until it is back."""

    def _cost_priors(self) -> list[tuple[float, ...]]:
        """The step cost model's prior coefficients of each stage, from its layers (the executor's
        split, else an even one) and the model's shape."""
        hf, pp = self.config.model.hf_config, self.config.parallel.pipeline_parallel_size
        ranges = getattr(self.executor, "layer_ranges", None)  # a StageExecutor stand-in has none
        if ranges is None:
            ranges = partition_layers(resolve_model_class(hf).num_layers_of(hf), pp)
        return [prior_coefficients(hf, b - a, self.config.parallel.device, last=k == pp - 1)
                for k, (a, b) in enumerate(ranges)]

    @classmethod
    async def start(cls, config: EngineConfig, eos_token_ids: set[int], emit: Callable[[StepOutputs], None],
                    on_dead: Callable[[str], None]) -> "EngineCore":
        """Start the workers (weights loaded, KV cache sized) and the loop.

        Raises:
            WorkerDiedError: a worker failed to start.
        """
        t = time.perf_counter()
        if config.speculative_config is not None:  # as vLLM logs its speculative config at start
            logger.info(config.speculative_config.describe(config.model.hf_config))
        executor = await Executor.start(config, eos_token_ids)
        core = cls(config, executor, emit, on_dead)
        logger.info("engine ready in %.1fs: %d stage(s), %d KV blocks of %d tokens, pipeline depth %d, "
                    "%d tokens per micro-batch, target inter-token latency %s, async scheduling %s",
                    time.perf_counter() - t, config.parallel.pipeline_parallel_size, executor.num_blocks,
                    config.cache.block_size, core.depth, config.max_num_batched_tokens,
                    f"{config.target_inter_token_latency:g} s" if config.target_inter_token_latency else "none",
                    "on" if config.async_scheduling else "off")
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
        A structured-output sequence keeps its grammar for the result rank (sent with the batch
        that sends the sequence to the workers); one whose grammar comes without any tokenizer
        info (a front-end bug) is finished at once with ``finish_reason`` ``"abort"``."""
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
                    self.grammars.check(r.grammar)
                    grammar = (r.grammar, sorted(self.eos_token_ids | set(sampling.stop_token_ids or ())))
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
                           list(getattr(ex, "stage_restarts", ())), list(getattr(ex, "recovery_seconds", ())),
                           list(getattr(ex, "stage_weight_bytes", ())), kv.num_blocks * kv.block_size,
                           *self._spec_stats())

    def _spec_stats(self) -> tuple:
        """Speculative decoding's counters for EngineStats (zeros when it is off)."""
        sp = self.spec
        if sp is None:
            return ()
        return sp.num_drafts, sp.num_draft_tokens, sp.num_accepted_tokens, list(sp.accepted_per_pos)

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
        None when new or aborted requests interrupted the wait, or WorkerDiedError.

        A result is applied in this order (structured outputs: see :meth:`_apply_result`):
        the scheduler's update, the sequences the grammars ended finished, the pipeline
        refilled, the step's outputs emitted."""
        trace = self.executor.trace
        drained = True  # nothing in flight and nothing to schedule: the workers' next gap is no bubble
        try:
            while True:
                if self.dead:
                    return
                drained = self._fill_pipeline(drained)
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
                drained = self._apply_result(sched, item, drained)
                trace.mark("applied", item.batch_id)
        except asyncio.CancelledError:
            raise
        except WorkerDiedError as e:
            self._die(str(e))
        except Exception as e:  # an engine bug: fail loudly, never hang
            logger.exception("engine loop crashed")
            self._die(f"engine loop crashed: {e!r}")

    def _fill_pipeline(self, drained: bool) -> bool:
        """Schedule and send micro-batches until ``depth`` are in flight or nothing can run.
        Returns ``drained`` for the next one (False once one was sent)."""
        trace = self.executor.trace
        while len(self.inflight) < self.depth and not self.paused:
            t = time.monotonic() if trace.enabled else 0.0
            sched = self.scheduler.schedule()
            if sched is None:
                break
            trace.mark("schedule", sched.batch.batch_id, t)
            if sched.drafts is not None and trace.enabled:  # the drafts proposed for it (their span: seconds)
                trace.mark("draft", sched.batch.batch_id, t, {"s": self.spec.propose_s, "chunks": sum(
                    1 for d in sched.drafts if d), "tokens": sum(sched.drafts)})
            sched.batch.after_idle = drained
            drained = False
            self.executor.send(sched.batch, self._grammar_fields(sched))
            self.inflight.append(sched)
        return drained

    def _apply_result(self, sched: ScheduledBatch, result, drained: bool) -> bool:
        """Apply micro-batch ``sched``'s result, refill the pipeline, and emit the step's outputs.

        Structured outputs: the result rank holds the grammar matchers (:mod:`zpp.workers.grammar`).
        It accepted this batch's tokens before sending the result, which names the sampling chunks
        whose grammar completed (the sequence ends with ``"stop"``, even with ``ignore_eos``:
        nothing may follow) or refused the token (a dead end: the token is dropped, the sequence
        ends with ``"abort"``); :meth:`_grammar_ends` applies that before the refill, so the next
        micro-batch no longer runs them. A sequence ended while a later batch in flight samples it
        (async scheduling) is finished like an abort: that batch's token is dropped (the result
        rank gives its row any token). Nothing of the grammar's work is on the core's thread, and
        the core never waits for it: the result rank fills a batch's bitmask itself, after the
        result it depends on, with the batch's forward queued.

        Returns ``drained`` for the next micro-batch."""
        updates = self.scheduler.update(sched, result, time.monotonic())
        # Requests the update finished (EOS, stop token, length) free their blocks before the refill.
        self.scheduler.release_finished([r for r, _, _ in updates if r.status.finished])
        refused = self._grammar_ends(updates, result) if result.grammar_stopped or result.grammar_refused else ()
        drained = self._fill_pipeline(drained)
        self.emit(self._outputs(result, updates, refused))
        return drained

    def _stage_restart(self, starting: bool) -> None:
        """A stage was lost (``starting``): the micro-batches in flight are void; every running
        request goes back to the queue to be recomputed from its prompt and the tokens it has
        produced (streams see a pause, no token repeated or skipped), and scheduling waits. Or the
        restarted stage is back: scheduling resumes."""
        if starting:
            n = self.scheduler.restart_all(list(self.inflight))
            self.inflight.clear()
            self.grammars.reset()  # the restarted stages hold no grammar: sent again with the requests
            self.paused = True
            logger.warning("a stage is restarting: %d running request(s) will be recomputed once it is back", n)
        else:
            self.paused = False
            logger.info("stages back: %d request(s) resume", self.scheduler.num_waiting + self.scheduler.num_running)
        self.emit(StepOutputs([], self.stats()))

    def _grammar_fields(self, sched: ScheduledBatch) -> dict:
        """The result rank's extra fields of a micro-batch about to be sent: the grammars of the
        constrained requests it sends to the workers (:class:`GrammarSender`); ``{}`` if none."""
        new = sched.batch.new_reqs
        if not new:
            return {}
        requests = self.scheduler.requests
        out = []
        for r in new:
            req = requests.get(r.req_id)
            if req is not None and req.grammar is not None:
                out.append((r.slot, req.grammar[0], req.grammar[1]))
        return self.grammars.batch_fields(out)

    def _grammar_ends(self, updates: list, result) -> set[str]:
        """End the sequences whose grammar the result rank reports complete (``"stop"``, even
        with ``ignore_eos``: nothing may follow) or dead (its token refused: dropped, the sequence
        finishes as aborted); returns the ids of the latter."""
        stopped, refused_chunks = set(result.grammar_stopped), set(result.grammar_refused)
        refused: set[str] = set()
        done = []
        last = {i: n for n, (_, i, _) in enumerate(updates)}  # a verify chunk's tokens: its grammar ends at its last
        for n, (req, i, token_id) in enumerate(updates):
            if token_id < 0 or last[i] != n:
                continue
            if i in refused_chunks:
                logger.warning("sequence %s: its grammar allows no token the sampler could pick (dead end, e.g. "
                               "min_tokens suppressing the only allowed stop token): finished with reason 'abort'",
                               req.req_id)
                req.token_ids.pop()
                req.status = RequestStatus.FINISHED_ABORTED
                refused.add(req.req_id)
                done.append(req)
            elif i in stopped and not req.status.finished:
                req.status = RequestStatus.FINISHED_STOPPED
                done.append(req)
        self.scheduler.release_finished(done)  # those in a batch sent meanwhile: when it returns
        return refused

    def _outputs(self, result, updates: list, refused: set[str]) -> StepOutputs:
        """The step's per-sequence deltas (``updates``: from the scheduler's update; ``refused``:
        sequences whose grammar refused their token, from :meth:`_grammar_ends`)."""
        # Logprobs and prompt logprobs come only for the chunks that asked, named by chunk index.
        plp = {p.chunk: p for p in result.prompt_logprobs} if result.prompt_logprobs else None
        lps = None
        if result.logprobs:  # chunk -> its tokens' logprobs, in order (several with speculative decoding)
            lps = {}
            for ci, lp in zip(result.logprob_chunks, result.logprobs):
                lps.setdefault(ci, []).append(lp)
        deltas = []
        finished = []
        last = len(updates) - 1
        for n, (req, i, token_id) in enumerate(updates):
            more = n < last and updates[n + 1][1] == i  # more tokens of this chunk follow (drafts)
            p = plp.pop(i, None) if plp else None
            if token_id < 0:
                if p is not None:
                    deltas.append(SeqDelta(req.req_id, prompt_logprobs=p))
                continue
            if refused and req.req_id in refused:
                deltas.append(SeqDelta(req.req_id, finish_reason="abort", prompt_logprobs=p))
                continue
            lp = lps.get(i) if lps else None
            d = SeqDelta(req.req_id, token_id, lp.pop(0) if lp else None, prompt_logprobs=p)
            self.num_generation_tokens += 1
            if req.status.finished and not more:
                d.finish_reason = req.status.finish_reason
                d.stop_reason = req.stop_reason
                finished.append(req)
            deltas.append(d)
        self.scheduler.release_finished(finished)
        return StepOutputs(deltas, self.stats())
