"""Continuous-batching scheduler producing pipeline micro-batches.

Each call to :meth:`Scheduler.schedule` decides one micro-batch for every stage (batches are
decided once, here; no stage ever decides on its own). Policy, after vLLM V1:

* a token budget (``max_num_batched_tokens``) per micro-batch; running requests first (decodes
  and unfinished chunked prefills, oldest first), then waiting ones (FIFO, preempted first);
* chunked prefill: a prompt longer than the remaining budget is computed over several batches;
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
* pipeline overlap: up to ``depth`` micro-batches in flight; a request is in at most one of them,
  and each batch takes about ``1/depth`` of the active requests so that the stages stay busy.
"""
from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Optional

from zpp.engine.kv_cache_manager import KVCacheManager
from zpp.engine.request import Request, RequestStatus
from zpp.transport import messages as m


@dataclass
class ScheduledBatch:
    """A micro-batch in flight: the message every stage gets and the requests it holds."""

    batch: m.ExecuteBatch
    reqs: list[Request]
    num_tokens: int


@dataclass
class SchedulerStats:
    num_preemptions: int = 0


def _priority(req: Request) -> tuple[float, int]:
    """Scheduling priority: lower is older and goes first; newer requests are preempted first."""
    return req.arrival, req.order


class Scheduler:
    """Owns the waiting / running queues and the KV block manager."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True, depth: int = 1):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked = enable_chunked_prefill
        self.depth = depth
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # to tell the workers with the next batch
        self._batch_ids = itertools.count()
        self._order = itertools.count()  # tie-break for equal arrival times
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
        if req.sent_to_workers:
            self._finished_ids.append(req.req_id)

    def abort(self, req_id: str) -> Optional[Request]:
        req = self.requests.get(req_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_sent_tokens = 0
        req.sent_to_workers = False  # resent in full as a NewRequest (workers replace their state)
        self.stats.num_preemptions += 1
        # Back to the head of the queue, keeping arrival order among preempted requests.
        i = 0
        while i < len(self.waiting) and self.waiting[i].status == RequestStatus.PREEMPTED \
                and _priority(self.waiting[i]) <= _priority(req):
            i += 1
        self.waiting.insert(i, req)

    # --- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> Optional[ScheduledBatch]:
        """Decide the next micro-batch, or None if no request can run now (nothing fits, or every
        runnable request is in flight or waits for blocks that in-flight requests hold)."""
        budget = self.max_num_batched_tokens
        active = min(len(self.running) + len(self.waiting), self.max_num_seqs)
        max_reqs = max(1, math.ceil(active / self.depth))
        chunks: list[m.ScheduledChunk] = []
        new_reqs: list[m.NewRequest] = []
        cached_reqs: list[m.CachedRequest] = []
        reqs: list[Request] = []
        preempted = False
        stalled = False  # an older request waits for blocks held by requests in flight

        for req in sorted(self.running, key=_priority):
            if budget <= 0 or len(reqs) >= max_reqs:
                break
            if req.in_flight or req.status != RequestStatus.RUNNING:
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            end = req.num_computed_tokens + num_new
            if stalled:
                # The blocks an older request waits for must go to it: use only slots already held.
                if not self.kv.has_slots(req, end):
                    continue
                new_blocks = self.kv.allocate_slots(req, end)
            else:
                new_blocks, n_preempted, stalled = self._allocate_or_preempt(req, end, reqs)
                preempted = preempted or n_preempted > 0
            if new_blocks is None:
                continue
            self._add_chunk(req, num_new, new_blocks, chunks, new_reqs, cached_reqs)
            reqs.append(req)
            budget -= num_new

        while self.waiting and not preempted and not stalled and budget > 0 and len(reqs) < max_reqs \
                and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            computed, num_cached = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_cached
            if num_new > budget and not self.chunked:
                break
            num_new = min(num_new, budget)
            # A request resuming after preemption takes blocks for its whole recompute at once.
            reserve = req.num_tokens if req.status == RequestStatus.PREEMPTED else num_cached + num_new
            new_blocks = self.kv.allocate_slots(req, reserve, computed)
            if new_blocks is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            self.running.append(req)
            self._add_chunk(req, num_new, new_blocks, chunks, new_reqs, cached_reqs)
            reqs.append(req)
            budget -= num_new

        if not chunks:
            return None  # finished ids (if any) ride on the next real batch
        batch = m.ExecuteBatch(batch_id=next(self._batch_ids), chunks=chunks, new_reqs=new_reqs,
                               cached_reqs=cached_reqs, finished_req_ids=self._finished_ids)
        self._finished_ids = []
        for r in reqs:
            r.in_flight = True
        num_tokens = sum(c.num_tokens for c in chunks)
        return ScheduledBatch(batch, reqs, num_tokens)

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

    def _add_chunk(self, req: Request, num_new: int, new_blocks: list[int], chunks, new_reqs, cached_reqs) -> None:
        start = req.num_computed_tokens
        sample = start + num_new == req.num_tokens
        want_plp = req.sampling.prompt_logprobs is not None and start < req.num_prompt_tokens
        if not req.sent_to_workers:
            new_reqs.append(m.NewRequest(req.req_id, list(req.token_ids), req.num_prompt_tokens,
                                         list(self.kv.blocks_of(req)), req.sampling))
            req.sent_to_workers = True
        else:
            new_tokens = req.token_ids[req.num_sent_tokens:]
            if new_tokens or new_blocks:
                cached_reqs.append(m.CachedRequest(req.req_id, new_tokens, new_blocks))
        req.num_sent_tokens = req.num_tokens
        chunks.append(m.ScheduledChunk(req.req_id, start, num_new, sample, want_plp))

    # --- results ------------------------------------------------------------------------------
    def update(self, sched: ScheduledBatch, result: m.StepResult) -> list[tuple[Request, Optional[m.SampledOutput]]]:
        """Apply a returned batch. Returns (request, sampled output or None) for every request of
        the batch that is still alive; finished / aborted ones are released here."""
        sampled = {s.req_id: s for s in result.sampled}
        out = []
        for req, chunk in zip(sched.reqs, sched.batch.chunks):
            req.in_flight = False
            if req.status.finished:  # aborted while in flight: free now that no batch writes its blocks
                self._release(req)
                continue
            req.num_computed_tokens += chunk.num_tokens
            self.kv.cache_full_blocks(req)
            s = sampled.get(req.req_id) if chunk.sample else None
            if s is not None:
                req.append_token(s.token_id)
                req.check_stop(self.max_model_len)
            out.append((req, s))
        return out

    def release_finished(self, reqs: list[Request]) -> None:
        """Free requests that finished while their outputs were processed (EOS, stop string, length)."""
        for r in reqs:
            if r.status.finished and not r.in_flight and r.req_id in self.requests:
                self._release(r)
