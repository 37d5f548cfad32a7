"""Continuous-batching scheduler producing pipeline micro-batches.

Each call to :meth:`Scheduler.schedule` decides one micro-batch for every stage (batches are
decided once, here; no stage ever decides on its own). Policy, after vLLM V1:

* a token budget (``max_num_batched_tokens``) per micro-batch, spent on decodes first: every
  micro-batch takes its share of the running requests that decode (oldest first, about
  ``1/depth`` of them), so a running stream gets a token every ``depth`` micro-batches whatever
  is being prefilled;
* chunked prefill: prompts (unfinished ones and waiting ones) share only what the decodes leave,
  so a long prompt is computed over several batches and never delays a decode; while streams
  decode, chunks are cut to keep their gaps near a target (:mod:`zpp.engine.step_cost`: a cost model
  fitted to the stages' step times; a fixed attention budget may apply too); between prompts,
  the oldest keeps at least half of that remainder and shorter ones that fit whole in the rest
  go first (a short request sent during a long prefill is not queued behind all of its chunks;
  a long prefill is not starved by a flow of short ones). See :meth:`Scheduler._plan_prefills`;
* preemption by recompute when blocks run out, with a strict age priority so that there is always
  forward progress (even with micro-batches in flight):

  - a request may only take blocks from requests that arrived after it: the newest of those that
    is not in flight is freed and put back at the head of the queue (it resumes with the same
    tokens); if every newer request is in flight, the request waits (keeps its blocks, runs no
    chunk) until their batches return, and newer requests may then use only slots they already
    hold; a request with no newer one running preempts itself (the newest yields);
  - so the oldest running request is never preempted by another and waits at most for the
    batches in flight before it runs again: some request always progresses, and every request
    finishes (tests/test_scheduler.py checks a bound on steps over random loads);
  - a preempted request is readmitted only when blocks for its whole recompute (prompt and the
    tokens generated so far) are free, and takes them all at once, so the chunks of its recompute
    cannot be starved by requests admitted after it;
* pipeline overlap: up to ``depth`` micro-batches in flight, each taking about ``1/depth`` of the
  decodes and of the prefill work on offer so that the stages stay busy. A decoding request is in
  at most one of them (it needs the token the previous one samples); consecutive prefill chunks
  of one prompt may be in several (stages run batches in the order sent, so each chunk finds the
  KV of the ones before it): a long prompt alone still keeps every stage busy.
* async scheduling (``async_scheduling``, PP=1 only; vLLM's ``--async-scheduling``): a decoding
  request whose newest micro-batch in flight samples its next token may be scheduled again at
  once, for the position of that token, which the engine does not know yet: the chunk carries
  the FROM_PREV flag and the worker feeds it the token it sampled on the device (no host round trip
  per token). Every micro-batch then takes all such decodes (not ``1/depth`` of them). A request
  that finishes with the token in flight has the extra step's output dropped (the slot it wrote
  is in its own, private block). Requests whose sampling needs the previous token on the host
  (repetition / frequency / presence penalties) are never scheduled this way, nor a token that
  will be the request's last by length. Structured outputs are: the result rank fills the token
  bitmask of such a chunk once its matcher has accepted the previous token (``zpp.workers.grammar``).
* speculative decoding (``spec``, :mod:`zpp.engine.spec_decode`): a decode may carry draft tokens
  (a chunk of 1 + k tokens, within the token budget); when it returns, only its accepted positions
  count as computed, and until then it is not scheduled again.
* LongRoPE (``rope_switch_len``, Phi-3's ``original_max_position_embeddings``): a sequence of at most
  that many tokens is computed with the short rotary factors, a longer one with the long factors
  for all its positions. A request that grows past the length is recomputed (preempted, not
  counted as a preemption, and readmitted with its whole sequence), as HF's ``generate`` drops
  and recomputes its KV cache there; its ``kv_variant`` (the seed of its prefix-cache hashes)
  keeps short and long blocks apart.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import deque, namedtuple
from dataclasses import dataclass
from typing import Optional

from zpp.engine.kv_cache_manager import KVCacheManager
from zpp.engine.request import Request, RequestStatus
from zpp.engine.schedule_rules import RequestRules
from zpp.engine.spec_decode import split_tokens
from zpp.engine.step_cost import MIN_PROMPT_CHUNK, StepFeatures, StepTarget, chunk_pairs, tokens_within_pairs
from zpp.transport import messages as m


ScheduledChunk = namedtuple("ScheduledChunk", ("req_id",) + m.ChunkView._fields)
ScheduledChunk.__doc__ = """One chunk of a scheduled micro-batch as its message carries it (the fields of
:class:`~zpp.transport.messages.ChunkView`) after its request's id (:attr:`ScheduledBatch.chunks`:
tests and debugging)."""


@dataclass
class ScheduledBatch:
    """A micro-batch in flight: the message every stage gets and the requests it holds, with what
    the engine needs of each chunk when the result comes back (in chunk order, as Python lists:
    the message's columns are for the workers)."""

    batch: m.ExecuteBatch
    reqs: list[Request]
    num_tokens: int
    num_prefill_tokens: int = 0  # of num_tokens, those of prompt (or recompute) chunks
    chunk_tokens: Optional[list[int]] = None  # tokens each chunk computes
    sample: Optional[list[bool]] = None  # whether each chunk samples
    num_sampled: int = 0
    predicted_s: float = 0.0  # the cost model's slowest-stage seconds for it (0 without a target)
    drafts: Optional[list[int]] = None  # speculative decoding: draft tokens of each chunk (None: no drafts)

    @property
    def chunks(self) -> list:
        """The chunks, decoded from the message (slow: for tests and debugging)."""
        return [ScheduledChunk(r.req_id, *c) for r, c in zip(self.reqs, m.chunks_of(self.batch))]


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_rope_recomputes: int = 0  # LongRoPE: requests recomputed on growing past rope_switch_len


MIN_PREFILL_SPLIT = 128
"""Fewest prompt tokens a micro-batch takes when the prefill work on offer is spread over the
pipeline (below this a part costs more in per-step overhead than pipelining saves)."""


def _priority(req: Request) -> tuple[float, int]:
    """Scheduling priority: lower is older and goes first; newer requests are preempted first."""
    return req.arrival, req.order


class Scheduler(RequestRules):
    """Owns the waiting / running queues and the KV block manager."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True, depth: int = 1,
                 prefill_attention_budget: Optional[int] = None, async_scheduling: bool = False,
                 rope_switch_len: Optional[int] = None, target: Optional[StepTarget] = None,
                 spec=None):
        self.spec = spec  # speculative decoding: a zpp.engine.spec_decode.SpecDecoder, or None
        self.target = target  # a target inter-token latency; its cost model records every batch
        self.cost = target.cost if target is not None else None
        self.kv = kv
        self.rope_switch_len = rope_switch_len
        self.async_scheduling = async_scheduling
        self.prefill_attention_budget = prefill_attention_budget
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked = enable_chunked_prefill
        self.depth = depth
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Worker slots (see zpp.transport.messages): the lowest free one goes to a request when it
        # is first sent; freed ones are told to the workers with the next batch.
        self._free_slots: list[int] = []  # a heap
        self._num_slots = 0
        self._freed_slots: list[int] = []
        self._batch_ids = itertools.count()
        self._order = itertools.count()  # tie-break for equal arrival times
        self._num_in_flight = 0  # micro-batches scheduled and not yet applied
        self._num_prefill_in_flight = 0  # prompt tokens in those micro-batches
        self.stats = SchedulerStats()

    # --- queue management ---------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.req_id] = req
        req.order = next(self._order)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request. Its blocks are freed now unless a batch in flight still writes them
        (then on that batch's return, see :meth:`update`)."""
        if req.status.finished:
            return
        req.status = status
        if req.in_flight:
            return
        self._release(req)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)
        self.requests.pop(req.req_id, None)
        self._free_slot(req)
        if self.spec is not None:
            self.spec.forget(req.req_id)

    def _take_slot(self) -> int:
        if self._free_slots:
            return heapq.heappop(self._free_slots)
        self._num_slots += 1
        return self._num_slots - 1

    def _free_slot(self, req: Request) -> None:
        """Give back the slot of a request the workers hold (they forget it with the next batch)."""
        if req.sent_to_workers:
            heapq.heappush(self._free_slots, req.slot)
            self._freed_slots.append(req.slot)
            req.sent_to_workers = False
            req.slot = -1

    def abort(self, req_id: str) -> Optional[Request]:
        req = self.requests.get(req_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def _preempt(self, req: Request, count: bool = True) -> None:
        """Free ``req``'s blocks and queue its recompute (``count``: a preemption for blocks, counted
        in the stats; False for the LongRoPE recompute)."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_sent_tokens = 0
        req.last_token_at = None  # the recompute's wait is no inter-token gap
        self._free_slot(req)  # resent in full as a NewRequest, maybe in another slot
        if count:
            self.stats.num_preemptions += 1
        else:
            self.stats.num_rope_recomputes += 1
        # Back to the head of the queue, keeping arrival order among preempted requests.
        i = 0
        while i < len(self.waiting) and self.waiting[i].status == RequestStatus.PREEMPTED \
                and _priority(self.waiting[i]) <= _priority(req):
            i += 1
        self.waiting.insert(i, req)

    def restart_all(self, inflight: list["ScheduledBatch"]) -> int:
        """A stage restarted (its KV and every worker's request state are gone): forget the
        micro-batches ``inflight`` (their results never come), and put every running request back at
        the head of the queue, in age order, to be recomputed from its prompt and the tokens it has
        produced (nothing is repeated or skipped: only applied tokens count). The prefix cache is
        dropped and the workers' slots start afresh. Returns the number of requests requeued."""
        for sched in inflight:
            for req, n in zip(sched.reqs, sched.chunk_tokens):
                req.in_flight -= 1
                req.num_in_flight_tokens -= n
        self._num_in_flight = 0
        self._num_prefill_in_flight = 0
        for req in [r for r in self.requests.values() if r.status.finished]:  # aborted while in flight
            self._release(req)
        requeued = sorted(self.running, key=_priority)
        for req in requeued:
            self.kv.free(req)
            req.status = RequestStatus.PREEMPTED
        self.running = []
        self.waiting.extendleft(reversed(requeued))
        for req in self.waiting:
            req.num_computed_tokens = 0
            req.num_sent_tokens = 0
            req.last_token_at = None
            req.sent_to_workers = False
            req.slot = -1
        self._free_slots, self._num_slots, self._freed_slots = [], 0, []
        self.kv.forget_cached_blocks()
        return len(requeued)

    # --- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> Optional[ScheduledBatch]:
        """Decide the next micro-batch, or None if no request can run now (nothing fits, or every
        runnable request is in flight or waits for blocks that in-flight requests hold).

        Tokens: decodes first, then prefill chunks in what remains of the budget
        (:meth:`_plan_prefills`). Blocks: requests already running get them in age order (an older
        one may preempt newer ones, see :meth:`_allocate_or_preempt`), then the admitted waiting
        requests, also in age order; a waiting request that cannot get its blocks stops admission.
        """
        budget = self.max_num_batched_tokens
        running = sorted(self.running, key=_priority)
        ready = [r for r in running if r.status == RequestStatus.RUNNING
                 and (not r.in_flight or self._can_pipeline(r) or self._can_async(r))]
        # Decodes: one token each, about 1/depth of all decoding requests per micro-batch (all of
        # them with async scheduling: a request may then be in every micro-batch in flight).
        n_decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        max_decodes = len(running) if self.async_scheduling else math.ceil(n_decoding / self.depth)
        plan: dict[str, int] = {}
        async_ids: set[str] = set()
        drafts: dict[str, list[int]] = {}
        speculate = self.spec is not None and self.spec.enabled_for_step(n_decoding)
        context = 0  # positions the decodes attend
        used = 0  # tokens of the decodes (with their drafts)
        for r in ready:
            if len(plan) >= min(max(max_decodes, 1), budget) or used >= budget:
                break
            if not r.in_flight and r.num_tokens - r.num_computed_tokens == 1:
                d = self.spec.propose(r, self.max_model_len, self.rope_switch_len, budget - used - 1) \
                    if speculate else None
                if d:
                    drafts[r.req_id] = d
                plan[r.req_id] = 1 + len(d or ())
            elif self._can_async(r):
                plan[r.req_id] = 1
                async_ids.add(r.req_id)
            else:
                continue
            used += plan[r.req_id]
            context += r.num_scheduled_tokens + plan[r.req_id]
        # Prefills: running requests with a prompt (or recompute) left, then waiting requests.
        room = self.max_num_seqs - len(self.running)
        waiting = list(itertools.islice(self.waiting, max(0, room)))
        cands = [r for r in ready if (r.in_flight and self._can_pipeline(r))
                 or (not r.in_flight and r.num_tokens - r.num_computed_tokens > 1)] + waiting
        decodes = set(plan)
        time_left = self.target.time_left(len(plan), context, (len(self.waiting) + sum(  # waiting per stream
            r.num_tokens - r.num_computed_tokens > 1 for r in running)) / n_decoding) \
            if self.target and n_decoding and self.chunked else None  # per stage, for the prompt chunks
        plan.update(self._plan_prefills(cands, budget - used, n_decoding > 0, time_left))

        reqs: list[Request] = []
        picked: list[tuple[Request, int, list[int]]] = []
        preempted = False
        stalled = False  # an older request waits for blocks held by requests in flight

        for req in ready:
            num_new = plan.get(req.req_id, 0)
            if num_new == 0 or req.status != RequestStatus.RUNNING:
                continue  # not planned, or preempted by an older request just now
            end = req.num_scheduled_tokens + num_new
            if req.in_flight:  # a next prefill chunk: only free blocks (it is never preempted now)
                new_blocks = self.kv.allocate_slots(req, end) if not stalled or self.kv.has_slots(req, end) else None
            elif stalled:
                # The blocks an older request waits for must go to it: use only slots already held.
                if not self.kv.has_slots(req, end):
                    continue
                new_blocks = self.kv.allocate_slots(req, end)
            else:
                new_blocks, n_preempted, stalled = self._allocate_or_preempt(req, end, reqs)
                preempted = preempted or n_preempted > 0
            if new_blocks is None:
                continue
            picked.append((req, num_new, new_blocks))
            reqs.append(req)

        for req in sorted((r for r in waiting if r.req_id in plan), key=_priority):
            if preempted or stalled or len(self.running) >= self.max_num_seqs:
                break
            self._set_kv_variant(req)
            computed, num_cached = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_cached, plan[req.req_id])
            # A request resuming after preemption takes blocks for its whole recompute at once.
            reserve = req.num_tokens if req.status == RequestStatus.PREEMPTED else num_cached + num_new
            new_blocks = self.kv.allocate_slots(req, reserve, computed)
            if new_blocks is None:
                break
            if req.status != RequestStatus.PREEMPTED:
                self.kv.record_prefix_lookup(req, num_cached)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            self.running.append(req)
            picked.append((req, num_new, new_blocks))
            reqs.append(req)

        if not picked:
            return None  # freed slots (if any) ride on the next real batch
        picked.sort(key=lambda p: p[0].req_id not in decodes)  # decodes first
        reqs = [p[0] for p in picked]
        builder = m.BatchBuilder()
        samples: list[bool] = []
        num_prefill = 0
        decode_rows = decode_context = prompt_pairs = 0
        for req, num_new, new_blocks in picked:
            start = req.num_computed_tokens + req.num_in_flight_tokens
            d = drafts.get(req.req_id, ()) if drafts else ()
            if req.req_id in decodes:
                decode_rows += num_new  # a verify chunk costs about as many decode rows as its tokens
                decode_context += (start + 1) * num_new
            else:
                num_prefill += num_new
                prompt_pairs += chunk_pairs(start, num_new)
            samples.append(self._add_chunk(req, num_new, new_blocks, builder, req.req_id in async_ids, d))
            req.in_flight += 1
            req.num_in_flight_tokens += num_new
        batch_id = next(self._batch_ids)
        feats = StepFeatures(1.0, decode_rows, num_prefill, prompt_pairs, decode_context)
        predicted = self.cost.record(batch_id, feats) if self.cost is not None else 0.0
        batch = builder.build(batch_id, self._freed_slots)
        self._freed_slots = []
        self._num_in_flight += 1
        self._num_prefill_in_flight += num_prefill
        chunk_tokens = builder.num_tokens
        return ScheduledBatch(batch, reqs, sum(chunk_tokens), num_prefill, chunk_tokens, samples, sum(samples),
                              predicted, [len(drafts.get(r.req_id, ())) for r in reqs] if drafts else None)

    def _plan_prefills(self, cands: list[Request], budget: int, streams_waiting: bool = True,
                       time_left: Optional[list[float]] = None) -> dict[str, int]:
        """Share ``budget`` tokens among prefill candidates (running requests with more than one
        token to compute, and waiting requests); returns request id -> tokens.

        * The micro-batch takes about ``1/depth`` of the prefill work on offer and in flight
          (prompt tokens in the micro-batches not yet returned), so that a burst of prompts is
          spread evenly over the pipeline (each stage computes one part while the next stage
          computes the part before); but
          never less than ``MIN_PREFILL_SPLIT`` tokens (or the largest single remainder if
          smaller; without chunked prefill, the largest remainder): ``limit``. Taking it all
          whenever only one slot is left (as this scheduler did) left 31 prompts arriving over
          HTTP within a second in one micro-batch that crossed the stages alone: prefill 7.2 s
          instead of ~4 s on the CPU at PP=2.
        * The oldest candidate is guaranteed ``min(its remainder, limit / 2)``.
        * The others share the rest of ``limit``, smallest remainder first (whole, or a partial
          chunk when prefill is chunked): a short prompt that arrives during a long prompt's
          prefill is computed in the next micro-batch or two instead of after every chunk of the
          long one.
        * The oldest then takes what remains of the budget; if it needed less than its share,
          the others take what remains of ``limit``, oldest first.

        So the oldest prompt keeps at least half of the prefill budget however many short prompts
        arrive (and once it is done the next oldest does: every prompt finishes), and the newer
        ones are served shortest first. Without chunked prefill a candidate gets its whole
        remainder or nothing.

        With an attention budget (``prefill_attention_budget``, query-key pairs) and requests
        decoding (``streams_waiting``: someone waits for this step's tokens), every chunk is also
        cut to the pairs left: a chunk of ``C`` tokens from position ``s`` costs
        ``C * s + C * (C + 1) / 2`` pairs. The oldest candidate always gets at least one token.
        With nothing decoding the budget does not apply: a prompt alone is computed in full chunks.

        With ``time_left`` (per stage, the seconds the step target leaves after the decodes; while
        streams decode), each chunk is also cut to what the cost model says fits on every stage. A
        shorter candidate goes whole if it fits, else takes at most half of the time before the
        oldest's turn; the oldest and the shortest other get ``MIN_PROMPT_CHUNK`` tokens whatever
        the prediction (a short request next to a long prefill is not starved when time is short).
        """
        if not cands or budget <= 0:
            return {}
        need = {r.req_id: r.num_tokens - r.num_scheduled_tokens for r in cands}
        share = -(-(sum(need.values()) + self._num_prefill_in_flight) // self.depth)
        floor = min(max(need.values()), MIN_PREFILL_SPLIT) if self.chunked else max(need.values())
        limit = min(budget, max(share, floor))
        oldest = min(cands, key=_priority)
        n_old = need[oldest.req_id]
        reserve = min(n_old, -(-limit // 2)) if self.chunked else (n_old if n_old <= budget else 0)
        plan: dict[str, int] = {}
        used = 0
        pairs_left = None
        if self.chunked and streams_waiting and self.prefill_attention_budget:
            pairs_left = self.prefill_attention_budget

        held = [t / 2 for t in time_left] if time_left is not None else None  # the oldest's half
        others = sorted((r for r in cands if r is not oldest), key=lambda r: (need[r.req_id], _priority(r)))
        floors = {r.req_id: MIN_PROMPT_CHUNK for r in [oldest] + others[:1]}

        def give(r: Request, room: int, hold: bool = False) -> None:
            nonlocal used, pairs_left, time_left
            have = plan.get(r.req_id, 0)
            left = need[r.req_id] - have
            start = r.num_scheduled_tokens + have
            if pairs_left is not None:
                fit = tokens_within_pairs(start, pairs_left)
                if r is oldest and not have:
                    fit = max(fit, 1)  # progress whatever the budget
                room = min(room, fit)
            if time_left is not None:
                fit = self.cost.max_chunk(time_left, start)
                if fit is not None and hold and fit < left:  # not whole: keep the oldest's half
                    fit = self.cost.max_chunk([t - h for t, h in zip(time_left, held)], start)
                if fit is not None:
                    room = min(room, max(fit, floors.get(r.req_id, 0) - have))  # progress whatever the time
            take = left if left <= room else (room if self.chunked and room > 0 else 0)
            if take > 0:
                plan[r.req_id] = have + take
                used += take
                if pairs_left is not None:
                    pairs_left = max(0, pairs_left - chunk_pairs(start, take))
                if time_left is not None:
                    time_left = [t - c for t, c in zip(time_left, self.cost.chunk_times(start, take))]

        for r in others:
            give(r, limit - reserve - used, hold=True)
        give(oldest, budget - used)
        for r in sorted(others, key=_priority):
            give(r, limit - used)
        return plan

    def _allocate_or_preempt(self, req: Request, num_tokens: int,
                             scheduled: list[Request]) -> tuple[Optional[list[int]], int, bool]:
        """Give running ``req`` slots for ``num_tokens`` tokens, preempting newer requests if needed.

        Returns ``(new block ids or None, number of requests preempted, stalled)``: None when
        ``req`` cannot run this step, either because it preempted itself (it was the newest) or
        because the newer requests that hold the blocks are in flight (``stalled``: ``req`` keeps
        its blocks and retries once their batches return).
        """
        n = 0
        while True:
            new_blocks = self.kv.allocate_slots(req, num_tokens)
            if new_blocks is not None:
                return new_blocks, n, False
            newer = [r for r in self.running if _priority(r) > _priority(req) and r not in scheduled]
            idle = [r for r in newer if not r.in_flight and r.status == RequestStatus.RUNNING]
            if idle:
                self._preempt(max(idle, key=_priority))
                n += 1
            elif newer:
                return None, n, True
            else:  # req is the newest running request: it yields
                self._preempt(req)
                return None, n + 1, False

    def _add_chunk(self, req: Request, num_new: int, new_blocks: list[int], b: m.BatchBuilder,
                   from_prev: bool = False, drafts=()) -> bool:
        """Write ``req``'s chunk of ``num_new`` tokens (and, the first time, the request itself) into
        the batch (``drafts``: speculative decoding, the last ``len(drafts)`` of them). Returns
        whether the chunk samples."""
        start = req.num_computed_tokens + req.num_in_flight_tokens
        known = len(req.token_ids)
        sample = from_prev or start + num_new - len(drafts) == known
        flags = (m.SAMPLE if sample else 0) | (m.FROM_PREV if from_prev else 0)
        if req.sampling.prompt_logprobs is not None and start < req.num_prompt_tokens:
            flags |= m.PROMPT_LOGPROBS
        if not req.sent_to_workers:
            req.slot = self._take_slot()
            b.new_request(req.slot, req.req_id, req.token_ids, req.num_prompt_tokens, self.kv.blocks_of(req),
                          req.sampling)
            req.sent_to_workers = True
            b.add(req.slot, start, num_new, flags, drafts=drafts)
        else:  # what the workers have not heard of yet: tokens since the last chunk, new blocks
            sent = req.num_sent_tokens
            b.add(req.slot, start, num_new, flags, req.token_ids[sent:] if sent < known else (), new_blocks, drafts)
        req.num_sent_tokens = known
        return sample

    # --- results ------------------------------------------------------------------------------
    def update(self, sched: ScheduledBatch, result: m.StepResult,
               now: Optional[float] = None) -> list[tuple[Request, int, int]]:
        """Apply a returned batch. Returns (request, chunk index, sampled token id or -1 when the
        chunk does not sample) for every request of the batch that is still alive (speculative
        decoding: one entry per token a verify chunk returned, up to one that ends the request); finished /
        aborted ones are released here. ``now`` (monotonic seconds; with a target inter-token
        latency) times the gaps between the requests' tokens (:meth:`StepTarget.add_gaps`).

        Raises:
            RuntimeError: the result holds more or fewer tokens than the batch has sampling chunks.
        """
        self._num_in_flight -= 1
        self._num_prefill_in_flight -= sched.num_prefill_tokens
        per_chunk = split_tokens(result, sched.num_sampled)  # each sampling chunk's tokens
        drafts = m.int32s(result.draft_tokens) if result.draft_tokens else None  # MTP: k per sampling chunk
        j = 0  # next sampling chunk
        out = []
        gaps: list[float] = []
        for i, (req, n, sample) in enumerate(zip(sched.reqs, sched.chunk_tokens, sched.sample)):
            toks = per_chunk[j] if sample else ()
            j += sample
            req.in_flight -= 1
            req.num_in_flight_tokens -= n
            if req.status.finished:  # aborted while in flight: free once no batch writes its blocks
                if not req.in_flight:
                    self._release(req)
                continue
            nd = sched.drafts[i] if sched.drafts is not None else 0
            # Speculative decoding: of a verify chunk's positions, only the accepted ones count as computed.
            req.num_computed_tokens += self.spec.accepted(req.req_id, nd, len(toks)) if nd else n
            if not toks:
                out.append((req, i, -1))
            for tok in toks:
                req.append_token(tok)
                req.check_stop(self.max_model_len)
                out.append((req, i, tok))
                if req.status.finished:
                    break  # the tokens after one that ends the request are dropped
            self.kv.cache_full_blocks(req)  # after the tokens: a block's hash reads them
            if toks and drafts is not None and not req.status.finished:  # MTP: the next step's drafts
                self.spec.store_drafts(req, drafts[(j - 1) * self.spec.k:j * self.spec.k].tolist())
            if toks:
                if now is not None and req.last_token_at is not None:
                    gaps.append(now - req.last_token_at)
                req.last_token_at = now
            if (not req.status.finished and not req.in_flight and req.status == RequestStatus.RUNNING
                    and self._crosses_rope_switch(req, req.num_tokens)):
                self._preempt(req, count=False)  # LongRoPE: recomputed with the long factors
        if gaps and self.target:
            self.target.add_gaps(gaps, sched.predicted_s)
        return out

    def release_finished(self, reqs: list[Request]) -> None:
        """Free requests that finished while their outputs were processed (EOS, stop string, length)."""
        for r in reqs:
            if r.status.finished and not r.in_flight and r.req_id in self.requests:
                self._release(r)
