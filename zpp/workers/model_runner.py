"""Runs one pipeline stage's share of every micro-batch the engine sends.

Per batch: update the per-request state from what changed, build inputs and attention metadata,
receive the previous stage's activations (unless first), run the stage's layers, then either send
the activations on (not last) or compute logits, sample and build the StepResult (last).

With tensor parallelism every TP rank of a stage runs every batch (the layers' all-reduces need all
of them); on the last stage only TP rank 0 (``StageInfo.produces_results``) computes logits,
samples and returns a StepResult, the others return None.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from zpp.models.base import StageModel
from zpp.models.layers.attention import build_attention_metadata, triton_metadata_arrays
from zpp.trace import Trace
from zpp.transport import messages as m
from zpp.transport.p2p import StageLink
from zpp.workers.sampler import Sampler, SeqState, apply_allowed, token_logprobs, unpack_bitmask
from zpp.workers.staging import PinnedStaging

logger = logging.getLogger(__name__)


def logit_buckets(max_rows: int) -> list[int]:
    """Row counts the LM head of an eager step is padded to on CUDA (up to ``max_rows``): 1, 2, 4,
    ..., 64, then multiples of 128 to 1024, then of 1024.

    Why: cuBLAS picks a kernel per matrix shape, and CUDA loads a kernel's module on its first
    launch (lazy loading), which waits for the GPU to drain. Every prefill micro-batch of a run
    samples a different number of rows, so its LM head was a new shape, and the worker's host sat
    until its own forward ended (the next micro-batch was launched late: 5-25 ms GPU gaps before
    every second prefill batch of a 1000 x 256/256 run on the H200; scripts/gpu_host_block_probe.py
    shows 75-180 ms host stalls for new shapes and 0.3 ms for known ones). A fixed set of shapes,
    each run once at start-up (``ModelRunner.warm_up_logits``), never loads a kernel mid-run; the
    padding costs at most 127 rows of LM head (< 0.2 ms at 8B) on a step that takes ~180 ms."""
    out = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < max_rows]
    out += list(range(128, min(max_rows, 1024), 128)) + list(range(1024, max_rows, 1024))
    return sorted(set(out + [max_rows]))


@dataclass
class LogitPlan:
    """The rows of a step's hidden states that need logits (``ModelRunner._logit_plan``).

    rows: indices into the step's flat tokens ``[T]``; sample_rows: for each sampling chunk (in
    chunk order) its index into ``rows``; plp_spans: ``(chunk index, first index into rows, count)``
    of each prompt-logprobs chunk."""

    rows: list[int]
    sample_rows: list[int]
    plp_spans: list[tuple[int, int, int]]


class PendingResult:
    """A last-stage result still on the GPU: token ids copied to pinned memory asynchronously.
    ``finish(runner)`` waits for them and builds the StepResult."""

    def __init__(self, batch_id: int, req_ids: list[str], tokens: torch.Tensor, host_buf: torch.Tensor):
        self.batch_id = batch_id
        self.tokens = tokens  # int64[N] on the device, kept alive until the copy is done
        self.req_ids = req_ids
        self.host = host_buf[: tokens.shape[0]]
        self.host.copy_(tokens, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def done(self) -> bool:
        """Whether the GPU has finished the batch and the copy (never blocks)."""
        return self.event.query()

    def finish(self, runner: "ModelRunner") -> m.StepResult:
        self.event.synchronize()
        runner.reap_timings()
        return m.StepResult(self.batch_id, [m.SampledOutput(r, t) for r, t in zip(self.req_ids, self.host.tolist())],
                            busy_s=runner.busy_s, idle_s=runner.idle_s)


class Activity:
    """What a worker is doing, for its heartbeat thread (``zpp.transport.messages.Heartbeat``).

    ``state`` is one tuple (micro-batch id or -1, blocked on activations, since: monotonic s),
    replaced whole so the other thread never sees a mix of two states.
    """

    def __init__(self):
        self.state = (-1, False, time.monotonic())
        self.last_done = -1

    def start(self, batch_id: int) -> None:
        self.state = (batch_id, False, time.monotonic())

    def wait(self, waiting: bool) -> None:
        self.state = (self.state[0], waiting, time.monotonic())

    def done(self, batch_id: int) -> None:
        self.last_done = batch_id
        self.state = (-1, False, time.monotonic())


class ModelRunner:
    """Holds a stage's model, its KV cache and the state of every request it has been sent.

    Time accounting (cumulative seconds, reported to the engine for ``/metrics``):
        busy_s: the stage's forward passes (sampling included on the last stage): device time
            between two CUDA events on GPU, ``perf_counter`` time on CPU.
        idle_s: the gaps between consecutive forward passes, measured the same way: waiting for the
            micro-batch's message, for the previous stage's activations, or for the worker's own
            host work. The gap before a micro-batch sent with ``after_idle`` (the engine had run out
            of work) is not counted, so ``idle_s`` is the pipeline bubble, not time without requests.
    """

    def __init__(self, model: StageModel, device: torch.device, dtype: torch.dtype, block_size: int,
                 link: Optional[StageLink], eos_token_ids: set[int], seed: int = 0, trace_name: str = "stage",
                 async_scheduling: bool = False):
        self.model = model
        self.async_scheduling = async_scheduling
        # Async scheduling: request id -> (the device tensor of sampled ids int64[N] of the last
        # micro-batch that sampled for it, its row): the input of its next ``from_prev`` chunk.
        self._sampled: dict[str, tuple[torch.Tensor, int]] = {}
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.link = link
        self.stage = model.stage
        self.seqs: dict[str, SeqState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler(device, seed) if self.stage.produces_results else None
        self.eos_token_ids = eos_token_ids
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.num_batches = 0
        self._after_idle = True  # the current micro-batch's ExecuteBatch.after_idle
        self._prev_end = None  # the end of the previous forward: perf_counter s (CPU) or a CUDA event
        self.activity = Activity()
        # Query heads per KV head (the same on every TP rank: both counts are divided by tp_size).
        # GPT-2's config.json names its head count n_head.
        heads = int(model.cfg.get("num_attention_heads") or model.cfg.get("n_head") or 1)
        self.group = max(1, heads // max(1, model.num_kv_heads * self.stage.tp_size))
        self._timings: deque = deque()
        self._pinned = [torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)]
        self._pin_idx = 0
        # Structured outputs on CUDA: pinned staging for the token bitmask, two alternating (a
        # batch's copy is done once its result has been waited for, before the buffer's next turn).
        self._mask_pinned = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        self._mask_idx = 0
        self.graphs = None  # DecodeGraphs on CUDA unless --enforce-eager
        self.trace = Trace(trace_name)  # ZPP_TRACE timeline (off unless set)
        self.staging = PinnedStaging(device)  # a step's index arrays -> device, never blocking the host
        self._logit_buckets: list[int] = []  # CUDA: row counts the LM head is padded to (warm_up_logits)
        self._batch_id = -1

    # --- KV cache -----------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """Bytes one block takes across this stage's layers (K and V) on this worker: with tensor
        parallelism only this rank's ``num_kv_heads / tp_size`` KV heads."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.block_size * self.model.num_kv_heads * self.model.head_dim * elem * self.model.num_local_layers

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks per layer, plus one scratch block (id ``num_blocks``) that
        CUDA-graph padding rows write into."""
        shape = (2, num_blocks + 1, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.model.num_local_layers)]
        self.scratch_slot = num_blocks * self.block_size

    def capture_graphs(self, max_model_len: int, max_num_seqs: int) -> None:
        from zpp.workers.cuda_graphs import DecodeGraphs
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, max_model_len, max_num_seqs,
                                   self.scratch_slot, self.dtype, self.device, self.group)
        self.graphs.capture()

    def _logit_bucket(self, n: int) -> int:
        """The row count ``n`` rows of logits are computed at (see :func:`logit_buckets`); ``n`` itself
        past the largest bucket or before :meth:`warm_up_logits`."""
        for b in self._logit_buckets:
            if b >= n:
                return b
        return n

    @torch.inference_mode()
    def warm_up_logits(self, max_rows: int) -> None:
        """CUDA, result rank: run the LM head (and argmax, and the float32 upcast) once at every
        row count of :func:`logit_buckets` up to ``max_rows`` -- at most the rows the memory profile
        covered -- so no step of a run loads a cuBLAS kernel (a device-wide wait) for a new shape."""
        if self.device.type != "cuda" or not self.stage.produces_results:
            return
        t = time.perf_counter()
        buckets = logit_buckets(max_rows)
        h = torch.zeros(buckets[-1], self.model.hidden_size, dtype=self.dtype, device=self.device)
        for b in buckets:
            logits = self.model.compute_logits(h[:b], upcast=False)
            logits.argmax(dim=-1)
            logits.float()
        torch.cuda.synchronize()
        self._logit_buckets = buckets
        logger.info("LM head warmed up at %d row counts (up to %d) in %.1fs", len(buckets), max_rows,
                    time.perf_counter() - t)

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int, num_logit_rows: int) -> int:
        """CUDA: run the largest micro-batch once (one sequence of ``num_tokens`` tokens, logits for
        ``num_logit_rows`` rows) and return the peak bytes allocated, weights included."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        blocks = -(-num_tokens // self.block_size)
        self.init_kv_cache(blocks)
        meta = build_attention_metadata([0], [num_tokens], [list(range(blocks))], self.block_size, self.device,
                                        self.group)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        pos = torch.arange(num_tokens, device=self.device)
        acts = None if self.stage.is_first else torch.zeros(
            self.model.num_acts, num_tokens, self.model.hidden_size, dtype=self.dtype, device=self.device)
        out = self.model(ids if self.stage.is_first else None, pos, acts, self.kv_caches, meta)
        if self.stage.produces_results:
            rows = out[:1].expand(num_logit_rows, -1).contiguous()
            logits = self.model.compute_logits(rows)
            torch.log_softmax(logits, -1)
            logits.softmax(-1).sort(-1)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        del out
        torch.cuda.empty_cache()
        return peak

    # --- per-batch state ----------------------------------------------------------------------
    def _update_states(self, batch: m.ExecuteBatch) -> None:
        for rid in batch.finished_req_ids:
            self.seqs.pop(rid, None)
            self._sampled.pop(rid, None)
        for r in batch.new_reqs:
            self.seqs[r.req_id] = SeqState(list(r.token_ids), r.num_prompt_tokens, r.sampling, list(r.block_ids))
            self._sampled.pop(r.req_id, None)
        for c in batch.cached_reqs:
            s = self.seqs[c.req_id]
            s.token_ids.extend(c.new_token_ids)
            s.block_ids.extend(c.new_block_ids)

    @torch.inference_mode()
    def execute(self, batch: m.ExecuteBatch) -> Optional[m.StepResult]:
        """Run one micro-batch. Returns the StepResult (or a PendingResult) on the result rank (TP
        rank 0 of the last stage), None elsewhere."""
        self._update_states(batch)
        self._batch_id = batch.batch_id
        self._after_idle = batch.after_idle
        self.activity.start(batch.batch_id)
        if not batch.chunks:
            return m.StepResult(batch.batch_id, [], busy_s=self.busy_s, idle_s=self.idle_s) \
                if self.stage.produces_results else None
        seqs = [self.seqs[c.req_id] for c in batch.chunks]
        starts = [c.start for c in batch.chunks]
        q_lens = [c.num_tokens for c in batch.chunks]
        if self.async_scheduling:  # the token before the sampled one may be on the device only
            for c, s in zip(batch.chunks, seqs):
                if c.sample:
                    s.sample_end = c.start + c.num_tokens
        T = sum(q_lens)
        B = len(seqs)
        if (self.graphs is not None and T == B and self.graphs.bucket(B) is not None
                and not any(c.prompt_logprobs for c in batch.chunks)):
            return self._execute_graph(batch, seqs, starts)
        # Every index array of the step goes to the device in one pinned upload, before the
        # forward is queued (see zpp/workers/staging.py): positions, input ids, the rows fed from
        # tokens sampled on the device, the rows whose logits are needed, attention metadata.
        st = np.asarray(starts, dtype=np.int64)
        ql = np.asarray(q_lens, dtype=np.int64)
        offsets = np.cumsum(ql) - ql
        host = [np.arange(T, dtype=np.int64) + np.repeat(st - offsets, ql)]  # positions [T]
        prev = []
        if self.stage.is_first:
            host.append(np.fromiter((t for c, s, a, n in zip(batch.chunks, seqs, starts, q_lens)
                                     for t in ((0,) if c.from_prev else s.token_ids[a:a + n])),
                                    dtype=np.int64, count=T))
            if self.async_scheduling:  # from_prev chunks: their token is on the device
                prev = self._prev_sources(batch, offsets.tolist())
                for _, dst, rows in prev:
                    host += [np.asarray(dst, dtype=np.int64), np.asarray(rows, dtype=np.int64)]
        plan = self._logit_plan(batch, seqs) if self.stage.produces_results else None
        if plan is not None and plan.rows:
            padded = self._logit_bucket(len(plan.rows))  # the last row repeated up to a warmed-up shape
            host.append(np.asarray(plan.rows + plan.rows[-1:] * (padded - len(plan.rows)), dtype=np.int64))
        tables = [s.block_ids for s in seqs]
        tmeta = None
        if self.device.type == "cuda":
            tmeta = triton_metadata_arrays(starts, q_lens, tables, self.block_size, self.group,
                                           num_kv_heads=self.model.num_kv_heads)
            host += tmeta.array_list()
        dev = self.staging.upload(host)
        self.trace.mark("uploaded", batch.batch_id)
        positions, i = dev[0], 1
        input_ids = None
        if self.stage.is_first:
            input_ids, i = dev[1], 2
            for src, _, _ in prev:
                input_ids[dev[i]] = src[dev[i + 1]]
                i += 2
        logit_rows = None
        if plan is not None and plan.rows:
            logit_rows, i = dev[i], i + 1
        meta = tmeta.to_device(dev[i:]) if tmeta is not None else build_attention_metadata(
            starts, q_lens, tables, self.block_size, self.device, self.group)

        acts = None
        if not self.stage.is_first:  # time blocked on the previous stage is not busy time
            acts = self._recv_acts((self.model.num_acts, T, self.model.hidden_size))
        t0 = self._begin()
        out = self.model(input_ids, positions, acts, self.kv_caches, meta)
        self.trace.mark("forward_queued", batch.batch_id)
        if not self.stage.is_last:
            self._end(t0)
            self.link.send(out)
            return None
        if not self.stage.produces_results:  # a last-stage TP rank > 0: forward only
            self._end(t0)
            return None
        result = self._sample(batch, seqs, out, plan, logit_rows)
        self.trace.mark("sample_queued", batch.batch_id)
        self._end(t0)
        if not isinstance(result, PendingResult):
            result.busy_s, result.idle_s = self.busy_s, self.idle_s
        return result

    def _execute_graph(self, batch: m.ExecuteBatch, seqs: list[SeqState], starts: list[int]):
        """Decode batch through a captured CUDA graph."""
        B = len(seqs)
        bs = self.block_size
        pos = np.asarray(starts, dtype=np.int64)
        w = int(pos.max()) // bs + 1
        bt = np.zeros((B, w), dtype=np.int32)
        for i, s in enumerate(seqs):
            n = min(len(s.block_ids), w)
            bt[i, :n] = s.block_ids[:n]
        slots = bt[np.arange(B), pos // bs].astype(np.int64) * bs + pos % bs
        ids = np.asarray([0 if c.from_prev else s.token_ids[p] for c, s, p in zip(batch.chunks, seqs, starts)],
                         dtype=np.int64) if self.stage.is_first else None
        acts = None
        if not self.stage.is_first:
            acts = self._recv_acts((self.model.num_acts, B, self.model.hidden_size))
        rows = [i for i, c in enumerate(batch.chunks) if c.sample] if self.stage.produces_results else []
        rows_dev = self.staging.upload([np.asarray(rows, dtype=np.int64)])[0] if 0 < len(rows) < B else None
        t0 = self._begin()
        prev = self._prev_sources(batch, range(B)) if self.stage.is_first and self.async_scheduling else []
        out = self.graphs.run(B, ids, pos, slots, bt, acts, prev)
        self.trace.mark("forward_queued", batch.batch_id)
        if not self.stage.is_last:
            self._end(t0)
            self.link.send(out)
            return None
        if not self.stage.produces_results:
            self._end(t0)
            return None
        if not rows:
            self._end(t0)
            return m.StepResult(batch.batch_id, [], busy_s=self.busy_s, idle_s=self.idle_s)
        if rows_dev is not None:
            out = out[rows_dev]
        row_seqs = [seqs[i] for i in rows]
        allowed = self._allowed(batch, out.shape[1])
        if self.sampler.plain_greedy(row_seqs):  # the graph's logits are bf16: argmax needs no upcast
            pending = self._greedy_pending(batch, rows, out, allowed)
            self._end(t0)
            return pending
        keep = [] if self.async_scheduling else None
        tokens, lps = self.sampler(out.float(), row_seqs, self.eos_token_ids, allowed, keep)
        if keep:
            self._keep_sampled(batch, rows, keep[0])
        sampled = [m.SampledOutput(batch.chunks[i].req_id, tok, lp) for i, tok, lp in zip(rows, tokens, lps)]
        self._end(t0)
        return m.StepResult(batch.batch_id, sampled, busy_s=self.busy_s, idle_s=self.idle_s)

    def _greedy_pending(self, batch: m.ExecuteBatch, rows: list[int], logits: torch.Tensor, allowed) -> PendingResult:
        """Plain greedy rows (CUDA): argmax on the device and leave the GPU running; the worker
        finishes this result after launching the next batch. ``rows``: chunk indices of the sampled
        rows, ``logits [len(rows), V]`` in that order. Two pinned buffers, alternating: at most one
        result is pending while the next is made."""
        apply_allowed(logits, allowed)
        self._pin_idx ^= 1
        if self._pinned[self._pin_idx].shape[0] < len(rows):
            self._pinned[self._pin_idx] = torch.empty(max(len(rows), 1024), dtype=torch.int64, pin_memory=True)
        tokens = logits.argmax(dim=-1)
        self.trace.mark("argmax_queued", batch.batch_id)
        self._keep_sampled(batch, rows, tokens)
        return PendingResult(batch.batch_id, [batch.chunks[i].req_id for i in rows], tokens,
                             self._pinned[self._pin_idx])

    # --- async scheduling ----------------------------------------------------------------------
    def _keep_sampled(self, batch: m.ExecuteBatch, rows, tokens: torch.Tensor) -> None:
        """Async scheduling: remember where each sampled row's token lies on the device.
        ``rows``: chunk indices of the sampled rows, in the order of ``tokens`` (int64[len(rows)])."""
        if not self.async_scheduling:
            return
        for i, ci in enumerate(rows):
            self._sampled[batch.chunks[ci].req_id] = (tokens, i)

    def _prev_sources(self, batch: m.ExecuteBatch, dst_index) -> list[tuple[torch.Tensor, list[int], list[int]]]:
        """The device-side inputs of the batch's ``from_prev`` chunks, grouped by the tensor of
        sampled ids they come from: ``[(tokens int64[N], dst positions, rows of tokens)]``;
        ``dst_index[ci]`` is chunk ``ci``'s position in the step's flat token ids.

        Raises:
            RuntimeError: a ``from_prev`` chunk for a request this worker has sampled nothing for
                (an engine bug: such a chunk must follow one that samples)."""
        groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for ci, c in enumerate(batch.chunks):
            if not c.from_prev:
                continue
            try:
                src, row = self._sampled[c.req_id]
            except KeyError:
                raise RuntimeError(f"sequence {c.req_id}: asked for its previous sampled token, which this "
                                   f"worker does not hold") from None
            g = groups.get(id(src))
            if g is None:
                g = groups[id(src)] = (src, [], [])
            g[1].append(dst_index[ci])
            g[2].append(row)
        return list(groups.values())

    # --- busy-time accounting -----------------------------------------------------------------
    def _recv_acts(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The previous stage's activations for the current micro-batch (blocking)."""
        self.activity.wait(True)
        self.trace.mark("acts_wait", self._batch_id)
        acts = self.link.recv(shape, self.dtype)
        self.trace.mark("acts_ready", self._batch_id)
        self.activity.wait(False)
        return acts

    def _begin(self):
        """Start timing a batch: a CUDA event on GPU (device time), a wall-clock stamp on CPU."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _end(self, start) -> None:
        self.num_batches += 1
        if self.device.type != "cuda":
            now = time.perf_counter()
            self.busy_s += now - start
            if self._prev_end is not None and not self._after_idle:
                self.idle_s += max(0.0, start - self._prev_end)
            self._prev_end = now
            if self.trace.enabled:
                offset = time.monotonic() - now
                self.trace.mark("gpu_start", self._batch_id, start + offset)
                self.trace.mark("gpu_end", self._batch_id, now + offset)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._timings.append((start, end, self._batch_id, self._after_idle))
        self.reap_timings()

    def reap_timings(self) -> None:
        """Add the device time of finished batches to ``busy_s`` and the device gaps before them
        to ``idle_s`` (never blocks)."""
        while self._timings and self._timings[0][1].query():
            start, end, batch_id, after_idle = self._timings.popleft()
            self.busy_s += start.elapsed_time(end) / 1000.0
            if self._prev_end is not None and not after_idle:
                self.idle_s += max(0.0, self._prev_end.elapsed_time(start) / 1000.0)
            self._prev_end = end
            self.trace.gpu_interval(batch_id, start, end)

    def _allowed(self, batch: m.ExecuteBatch, vocab_size: int):
        """Structured outputs: ``(rows int64[R], disallowed bool[R, vocab_size])`` over the batch's
        sampled rows (in chunk order, one per chunk with ``sample``; ``rows`` increasing, as
        ``grammar_rows`` is), from the batch's token bitmask; None when no row is constrained."""
        if not batch.grammar_rows:
            return None
        pos = {ci: k for k, ci in enumerate(i for i, c in enumerate(batch.chunks) if c.sample)}
        rows = self.staging.upload([np.asarray([pos[ci] for ci in batch.grammar_rows], dtype=np.int64)])[0]
        staging = None
        if self.device.type == "cuda":
            self._mask_idx ^= 1
            n = len(batch.grammar_bitmask)
            if self._mask_pinned[self._mask_idx].shape[0] < n:
                self._mask_pinned[self._mask_idx] = torch.empty(max(n, 1 << 20), dtype=torch.uint8, pin_memory=True)
            staging = self._mask_pinned[self._mask_idx]
        return rows, unpack_bitmask(batch.grammar_bitmask, len(batch.grammar_rows), vocab_size, self.device, staging)

    def _logit_plan(self, batch: m.ExecuteBatch, seqs: list[SeqState]) -> "LogitPlan":
        """Which hidden rows of the step need logits: the last row of each sampling chunk, and the
        rows of prompt-logprob chunks (position p predicts token p + 1; prompt tokens only)."""
        plan = LogitPlan([], [], [])
        offset = 0
        for ci, c in enumerate(batch.chunks):
            s = seqs[ci]
            if c.prompt_logprobs:
                n = max(0, min(c.start + c.num_tokens, s.num_prompt_tokens - 1) - c.start)
                if n:
                    plan.plp_spans.append((ci, len(plan.rows), n))
                    plan.rows.extend(range(offset, offset + n))
            if c.sample:
                plan.sample_rows.append(len(plan.rows))
                plan.rows.append(offset + c.num_tokens - 1)
            offset += c.num_tokens
        return plan

    def _sample(self, batch: m.ExecuteBatch, seqs: list[SeqState], hidden: torch.Tensor, plan: "LogitPlan",
                logit_rows: Optional[torch.Tensor]) -> m.StepResult:
        """Logits of ``plan``'s rows (``logit_rows``: the same indices, on the device), then sampling
        and prompt logprobs."""
        sample_rows, plp_spans = plan.sample_rows, plan.plp_spans
        if not plan.rows:
            return m.StepResult(batch.batch_id, [])
        logits = self.model.compute_logits(hidden[logit_rows], upcast=False)[:len(plan.rows)]  # [N, V], model dtype
        self.trace.mark("logits_queued", batch.batch_id)

        sampled: list[m.SampledOutput] = []
        sample_chunks = [c for c in batch.chunks if c.sample]
        if sample_rows:
            sample_seqs = [self.seqs[c.req_id] for c in sample_chunks]
            if not plp_spans and self.device.type == "cuda" and self.sampler.plain_greedy(sample_seqs):
                # No host round trip for a prefill (or mixed) batch either: the next one is launched first.
                return self._greedy_pending(batch, [i for i, c in enumerate(batch.chunks) if c.sample], logits,
                                            self._allowed(batch, logits.shape[1]))
            logits = logits.float()
            keep = [] if self.async_scheduling else None
            tokens, lps = self.sampler(logits[sample_rows], sample_seqs, self.eos_token_ids,
                                       self._allowed(batch, logits.shape[1]), keep)
            if keep:
                self._keep_sampled(batch, [i for i, c in enumerate(batch.chunks) if c.sample], keep[0])
            for c, tok, lp in zip(sample_chunks, tokens, lps):
                sampled.append(m.SampledOutput(c.req_id, tok, lp))

        plps: list[m.PromptLogprobsOutput] = []
        if plp_spans:
            logits = logits.float()
        for ci, first, n in plp_spans:
            c, s = batch.chunks[ci], seqs[ci]
            k = (s.sampling.prompt_logprobs if s.sampling else 0) or 0
            lp = torch.log_softmax(logits[first:first + n], dim=-1)
            targets = s.token_ids[c.start + 1:c.start + 1 + n]
            entries = [token_logprobs(lp[j], targets[j], k) for j in range(n)]
            plps.append(m.PromptLogprobsOutput(c.req_id, c.start + 1, entries))
        return m.StepResult(batch.batch_id, sampled, plps)
