"""Runs one pipeline stage's share of every micro-batch the engine sends.

Per batch: update the per-request state from what changed, build inputs and attention metadata,
receive the previous stage's activations (unless first), run the stage's layers, then either send
the activations on (not last) or compute logits, sample and build the StepResult (last).

With tensor parallelism every TP rank of a stage runs every batch (the layers' all-reduces need all
of them); on the last stage only TP rank 0 (``StageInfo.produces_results``) computes logits,
samples and returns a StepResult, the others return None.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from typing import Callable, Optional

import numpy as np
import torch

from zpp.models.base import StageModel
from zpp.models.layers.attention import (TABLE_WIDTH_ALIGN, block_table_width, build_attention_metadata,
                                         triton_metadata_arrays)
from zpp.trace import Trace
from zpp.transport import messages as m
from zpp.transport.p2p import StageLink
from zpp.utils.host_memory import zeroed_tensor
from zpp.workers.grammar import SlotGrammars, default_fill_threads, import_in_background, sampled_rows
from zpp.workers import rejection_sampler
from zpp.workers.runner_state import Activity, PendingResult
from zpp.workers.sampler import Sampler, prompt_logprobs, unpack_bitmask
from zpp.workers.slots import SlotTable
from zpp.workers.staging import PinnedStaging
from zpp.workers.start_up_passes import StartUpPasses
from zpp.workers.verify_graphs import execute_verify_graph, uniform_q

logger = logging.getLogger(__name__)


class ModelRunner(StartUpPasses):
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
                 async_scheduling: bool = False, max_model_len: int = 4096, max_num_seqs: int = 256,
                 kv_cache_dtype: Optional[torch.dtype] = None):
        self.model = model
        self.async_scheduling = async_scheduling
        # Async scheduling: the device tensors of sampled ids (int64[N]) of recent micro-batches, by
        # key; ``table.prev_src`` / ``prev_row`` name each request's (the input of its next
        # FROM_PREV chunk). Tensors no slot names any more are dropped (see _keep_sampled).
        self._kept: dict[int, torch.Tensor] = {}
        self._next_key = 0
        self.device = device
        self.dtype = dtype
        # The KV cache's element type: the model's, or float8_e4m3fn (--kv-cache-dtype fp8, with the
        # attention layers' k_scale / v_scale; zpp.models.layers.attention).
        self.kv_dtype = kv_cache_dtype or dtype
        self.block_size = block_size
        self.link = link
        self.stage = model.stage
        # The requests this worker holds, by the engine's slots (--max-num-seqs of them).
        self.table = SlotTable(max_num_seqs, max_model_len, block_size)
        self.max_model_len = max_model_len
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler(device, seed) if self.stage.produces_results else None
        self.eos_token_ids = eos_token_ids
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.num_batches = 0
        self.step_times: deque = deque(maxlen=1024)
        """``(batch id, seconds)`` of the micro-batches timed since the worker last reported them
        (``StageStats.step_batches``): on the CPU the wall time of :meth:`execute` less the wait for
        the previous stage's activations; on CUDA the device time, as ``busy_s``."""
        self._exec_t0 = 0.0  # perf_counter when the current batch's execute() began
        self._acts_wait = 0.0  # seconds of it spent waiting for the previous stage
        self._after_idle = True  # the current micro-batch's ExecuteBatch.after_idle
        self._prev_end = None  # the end of the previous forward: perf_counter s (CPU) or a CUDA event
        self.activity = Activity()
        self.thread_governor = None  # CPU: a zpp.workers.adaptive_threads.ThreadGovernor, timed around each forward
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
        self.grammars: Optional[SlotGrammars] = None
        """Structured outputs (result rank only): the matchers of the constrained requests."""
        if self.stage.produces_results:
            vocab = int(model.cfg.get("vocab_size") or 1 << 30)  # unknown: the tokenizer's decides
            self.grammars = SlotGrammars(max_num_seqs, vocab, default_fill_threads())
            import_in_background()  # while the weights load, not at the first constrained request
        self._grammar_sel = None  # the current batch's constrained rows (grammar.sampled_rows)
        self.before_fill: Optional[Callable[[], None]] = None
        """Structured outputs: called before a batch's bitmask is filled, with its forward queued
        (set by the worker's loop: it finishes and sends the result it holds, whose tokens the
        matchers must accept first)."""
        self.graphs = None  # DecodeGraphs on CUDA unless --enforce-eager
        self.verify_graphs = None  # speculative decoding: zpp.workers.verify_graphs.VerifyGraphs (or its stand-in)
        self.trace = Trace(trace_name)  # ZPP_TRACE timeline (off unless set)
        self.staging = PinnedStaging(device)  # a step's index arrays -> device, never blocking the host
        self._logit_buckets: list[int] = []  # CUDA: row counts the LM head is padded to (warm_up_logits)
        self._batch_id = -1
        self.mtp = None
        """Speculative decoding with MTP (result rank): a :class:`zpp.workers.mtp.MTPDrafter`."""

    def forget_requests(self) -> None:
        """After a stage restart (the engine recomputes every request from its tokens): drop every
        request this worker holds and every device tensor kept for async scheduling. The KV cache
        stays allocated; its contents are stale and the engine's block tables start afresh."""
        t = self.table
        self.table = SlotTable(t.num_slots, t.max_model_len, t.block_size)
        self._kept.clear()
        if self.grammars is not None:
            self.grammars.forget()
        self._timings.clear()
        self._prev_end = None
        self._after_idle = True
        self.activity.state = (-1, False, time.monotonic())

    # --- KV cache -----------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """Bytes one block takes across this stage's layers on this worker, from the model's
        per-layer cache layout (:meth:`StageModel.kv_cache_shape`): K and V of this rank's
        ``num_kv_heads / tp_size`` KV heads by default, the latent rows for DeepSeek's MLA; 1 byte
        per element with an FP8 KV cache (``--kv-cache-dtype fp8``), so twice the blocks fit."""
        return self.model.kv_cache_bytes_per_block(self.block_size, self.kv_dtype)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks per layer, plus one scratch block (id ``num_blocks``) that
        CUDA-graph padding rows write into."""
        shape = self.model.kv_cache_shape(num_blocks + 1, self.block_size)
        if self.device.type == "cpu":  # pages from the kernel as blocks are first written (zeroed_tensor)
            self.kv_caches = [zeroed_tensor(shape, self.kv_dtype) for _ in range(self.model.num_local_layers)]
        else:
            self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
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
        i = bisect.bisect_left(self._logit_buckets, n)
        return self._logit_buckets[i] if i < len(self._logit_buckets) else n

    # --- per-batch state ----------------------------------------------------------------------
    def _update_states(self, batch: m.ExecuteBatch) -> m.BatchColumns:
        """Apply the batch to the slot table (freed slots, new requests, new tokens and blocks);
        returns its columns. Raises ValueError for a batch that is malformed or does not fit the
        state (``SlotTable.apply``)."""
        cols = self.table.apply(batch)
        g = self.grammars
        if g is not None and (g.num_live or batch.grammars or batch.grammar_evict or batch.grammar_tokenizer):
            g.apply(batch, self.table)
        return cols

    @torch.inference_mode()
    def execute(self, batch: m.ExecuteBatch) -> Optional[m.StepResult]:
        """Run one micro-batch. Returns the StepResult (or a PendingResult) on the result rank (TP
        rank 0 of the last stage), None elsewhere."""
        self._exec_t0, self._acts_wait = time.perf_counter(), 0.0
        cols = self._update_states(batch)
        self._batch_id = batch.batch_id
        self._grammar_sel = None
        self._after_idle = batch.after_idle
        self.activity.start(batch.batch_id)
        if not cols.size:
            return m.StepResult(batch.batch_id, busy_s=self.busy_s, idle_s=self.idle_s) \
                if self.stage.produces_results else None
        starts = cols.starts.astype(np.int64)
        q_lens = cols.num_tokens.astype(np.int64)
        T = int(q_lens.sum())
        B = cols.size
        long_seq = None
        switch = getattr(self.model, "rope_switch_len", None)
        if switch is not None:
            # LongRoPE: which sequences are longer than the switch length (their every token reads the
            # long rotary rows). The decode graphs derive it from the positions (position >= switch),
            # right for decodes; a batch with a 1-token prompt chunk of a long sequence at an earlier
            # position runs eagerly with the flags.
            long_seq = np.maximum(self.table.num_tokens[cols.slots], starts + q_lens) > switch
        if self.verify_graphs is not None and len(cols.draft_tokens):  # a uniform verify batch: its graph
            q = uniform_q(cols, self.max_model_len)
            if q and self.verify_graphs.bucket(B, q) is not None:
                return execute_verify_graph(self, batch, cols, q)
        if (self.graphs is not None and T == B and self.graphs.bucket(B) is not None
                and not cols.prompt_logprobs.any()
                and (long_seq is None or (long_seq == (starts >= switch)).all())):
            return self._execute_graph(batch, cols)
        # Every index array of the step goes to the device in one pinned upload, before the
        # forward is queued (see zpp/workers/staging.py): positions, input ids, the rows fed from
        # tokens sampled on the device, the rows whose logits are needed, attention metadata.
        offsets = np.cumsum(q_lens) - q_lens  # each chunk's first row in the step's flat tokens
        owner = np.repeat(np.arange(B), q_lens)
        pos = np.arange(T) - offsets[owner] + starts[owner]
        host = [pos]
        prev = []
        if self.stage.is_first:
            ids = self.table.tokens[cols.slots[owner], pos].astype(np.int64)
            ids[offsets[cols.from_prev]] = 0  # FROM_PREV chunks: their token is on the device
            host.append(ids)
            if self.async_scheduling:
                prev = self._prev_sources(cols, offsets)
                for _, dst, rows in prev:
                    host += [np.asarray(dst, dtype=np.int64), np.asarray(rows, dtype=np.int64)]
        plan = self._logit_plan(cols) if self.stage.produces_results else None
        if plan is not None and plan[0]:
            rows = plan[0]
            padded = self._logit_bucket(len(rows))  # the last row repeated up to a warmed-up shape
            host.append(np.asarray(rows + rows[-1:] * (padded - len(rows)), dtype=np.int64))
        rope_long_at = None
        if long_seq is not None:
            rope_long_at = len(host)
            host.append(np.repeat(long_seq, q_lens).astype(np.int64))
        width = block_table_width(int((starts + q_lens).max()), self.block_size,
                                  TABLE_WIDTH_ALIGN if self.device.type == "cuda" else 1)
        tables = self.table.block_rows(cols.slots, width)
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
        if plan is not None and plan[0]:
            logit_rows, i = dev[i], i + 1
        if rope_long_at is not None:
            i += 1
        meta = tmeta.to_device(dev[i:]) if tmeta is not None else build_attention_metadata(
            starts.tolist(), q_lens.tolist(), tables, self.block_size, self.device, self.group)
        if rope_long_at is not None:
            meta.rope_long = dev[rope_long_at]

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
        result = self._sample(batch, cols, out, plan, logit_rows)
        self.trace.mark("sample_queued", batch.batch_id)
        if self.mtp is not None:  # the next step's drafts, from this step's hidden states and tokens
            self.mtp.draft(cols, out, positions, meta, result)
        self._end(t0)
        if not isinstance(result, PendingResult):
            result.busy_s, result.idle_s = self.busy_s, self.idle_s
        return result

    def _execute_graph(self, batch: m.ExecuteBatch, cols: m.BatchColumns):
        """Decode batch through a captured CUDA graph."""
        B = cols.size
        bs = self.block_size
        pos = cols.starts.astype(np.int64)
        w = int(pos.max()) // bs + 1
        bt = self.table.block_rows(cols.slots, w)
        slots = bt[np.arange(B), pos // bs].astype(np.int64) * bs + pos % bs
        ids = None
        if self.stage.is_first:
            ids = self.table.tokens[cols.slots, pos].astype(np.int64)
            ids[cols.from_prev] = 0  # their token is on the device (prev)
        acts = None
        if not self.stage.is_first:
            acts = self._recv_acts((self.model.num_acts, B, self.model.hidden_size))
        rows = np.flatnonzero(cols.sample) if self.stage.produces_results else np.zeros(0, dtype=np.int64)
        rows_dev = self.staging.upload([rows.astype(np.int64)])[0] if 0 < len(rows) < B else None
        t0 = self._begin()
        prev = self._prev_sources(cols, np.arange(B)) if self.stage.is_first and self.async_scheduling else []
        out = self.graphs.run(B, ids, pos, slots, bt, acts, prev)
        self.trace.mark("forward_queued", batch.batch_id)
        if not self.stage.is_last:
            self._end(t0)
            self.link.send(out)
            return None
        if not self.stage.produces_results:
            self._end(t0)
            return None
        if not len(rows):
            self._end(t0)
            return m.StepResult(batch.batch_id, busy_s=self.busy_s, idle_s=self.idle_s)
        if rows_dev is not None:
            out = out[rows_dev]
        row_slots = cols.slots[rows]
        allowed = self._allowed(batch, cols, out.shape[1])
        if self.table.plain[row_slots].all():  # the graph's logits are bf16: argmax needs no upcast
            pending = self._greedy_pending(batch, rows, row_slots, out, allowed)
            self._end(t0)
            return pending
        keep = [] if self.async_scheduling else None
        seqs = self.table.seq_states(row_slots, pos[rows] + 1)
        tokens, lps = self.sampler(out.float(), seqs, self.eos_token_ids, allowed, keep)
        if keep:
            self._keep_sampled(row_slots, keep[0])
        self._end(t0)
        return self._result(batch.batch_id, rows, tokens, lps)

    def _result(self, batch_id: int, rows: np.ndarray, tokens: list[int], lps: list,
                plps: Optional[list] = None) -> m.StepResult:
        """The StepResult of sampled chunks ``rows`` (chunk indices, increasing), their ``tokens``
        and logprobs (None where not asked), and prompt logprobs."""
        lp_chunks = [int(ci) for ci, lp in zip(rows.tolist(), lps) if lp is not None]
        res = m.StepResult(batch_id, m.pack_int32(tokens), lp_chunks, [lp for lp in lps if lp is not None],
                           plps or [], busy_s=self.busy_s, idle_s=self.idle_s)
        if self._grammar_sel is not None:
            self.accept_sampled(res, rows, tokens, self._grammar_sel)
        return res

    def accept_sampled(self, result: m.StepResult, chunks: np.ndarray, tokens, sel) -> None:
        """Structured outputs: the matchers of the constrained rows ``sel`` (:func:`sampled_rows`)
        accept the tokens sampled (``tokens``, one per sampling chunk ``chunks``), and ``result``
        names the chunks whose grammar completed or refused its token."""
        rows, slots, _ = sel
        t = tokens.tolist() if isinstance(tokens, np.ndarray) else tokens
        stopped, refused = self.grammars.accept(slots, [t[i] for i in rows.tolist()])
        if stopped:
            result.grammar_stopped = chunks[rows[stopped]].tolist()
        if refused:
            result.grammar_refused = chunks[rows[refused]].tolist()
        self.trace.mark("accepted", result.batch_id)

    def _greedy_pending(self, batch: m.ExecuteBatch, chunks: np.ndarray, row_slots: np.ndarray,
                        logits: torch.Tensor, allowed) -> PendingResult:
        """Plain greedy rows (CUDA): argmax on the device and leave the GPU running; the worker
        finishes this result after launching the next batch (the matchers accept its tokens then).
        ``logits [N, V]``: the sampling chunks' rows in chunk order, ``chunks`` their chunk indices,
        ``row_slots`` their slots. Two pinned buffers, alternating: at most one
        result is pending while the next is made."""
        n = logits.shape[0]
        self._pin_idx ^= 1
        if self._pinned[self._pin_idx].shape[0] < n:
            self._pinned[self._pin_idx] = torch.empty(max(n, 1024), dtype=torch.int64,
                                                      pin_memory=self.device.type == "cuda")
        tokens = Sampler.greedy(logits, allowed)
        self.trace.mark("argmax_queued", batch.batch_id)
        self._keep_sampled(row_slots, tokens)
        grammar = None if self._grammar_sel is None else (chunks, self._grammar_sel)
        return PendingResult(batch.batch_id, tokens, self._pinned[self._pin_idx], grammar)

    # --- async scheduling ----------------------------------------------------------------------
    def _keep_sampled(self, row_slots: np.ndarray, tokens: torch.Tensor) -> None:
        """Async scheduling: remember where each sampled row's token lies on the device.
        ``row_slots``: the slots of the sampled rows, in the order of ``tokens`` (int64[N])."""
        if not self.async_scheduling:
            return
        key = self._next_key
        self._next_key += 1
        self._kept[key] = tokens
        self.table.prev_src[row_slots] = key
        self.table.prev_row[row_slots] = np.arange(len(row_slots))
        if len(self._kept) > 8:  # drop the tensors no request's next token comes from any more
            named = self.table.prev_src
            live = set(np.unique(named[named >= 0]).tolist())
            for k in [k for k in self._kept if k not in live]:
                del self._kept[k]

    def _prev_sources(self, cols: m.BatchColumns, dst_index: np.ndarray) -> list[tuple[torch.Tensor, np.ndarray, np.ndarray]]:
        """The device-side inputs of the batch's FROM_PREV chunks, grouped by the tensor of sampled
        ids they come from: ``[(tokens int64[N], dst positions, rows of tokens)]``; ``dst_index[ci]``
        is chunk ``ci``'s position in the step's flat token ids.

        Raises:
            RuntimeError: a FROM_PREV chunk for a request this worker has sampled nothing for
                (an engine bug: such a chunk must follow one that samples)."""
        fp = np.flatnonzero(cols.from_prev)
        if not len(fp):
            return []
        slots = cols.slots[fp]
        src = self.table.prev_src[slots]
        if (src < 0).any():
            slot = int(slots[np.argmax(src < 0)])
            raise RuntimeError(f"sequence {self.table.req_ids[slot]}: asked for its previous sampled token, which "
                               f"this worker does not hold")
        rows, dst = self.table.prev_row[slots], dst_index[fp]
        keys = np.unique(src)
        if len(keys) == 1:
            return [(self._kept[int(keys[0])], dst, rows)]
        return [(self._kept[k], dst[src == k], rows[src == k]) for k in keys.tolist()]

    # --- busy-time accounting -----------------------------------------------------------------
    def _recv_acts(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The previous stage's activations for the current micro-batch (blocking)."""
        self.activity.wait(True)
        self.trace.mark("acts_wait", self._batch_id)
        t = time.perf_counter()
        acts = self.link.recv(shape, self.dtype)
        self._acts_wait += time.perf_counter() - t
        self.trace.mark("acts_ready", self._batch_id)
        self.activity.wait(False)
        return acts

    def _begin(self):
        """Start timing a batch: a CUDA event on GPU (device time), a wall-clock stamp on CPU."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        if self.thread_governor is not None:
            self.thread_governor.begin()
        return time.perf_counter()

    def _end(self, start) -> None:
        self.num_batches += 1
        if self.device.type != "cuda":
            now = time.perf_counter()
            if self.thread_governor is not None:
                self.thread_governor.end()
            self.busy_s += now - start
            self.step_times.append((self._batch_id, now - self._exec_t0 - self._acts_wait))
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
            self.step_times.append((batch_id, start.elapsed_time(end) / 1000.0))
            if self._prev_end is not None and not after_idle:
                self.idle_s += max(0.0, self._prev_end.elapsed_time(start) / 1000.0)
            self._prev_end = end
            self.trace.gpu_interval(batch_id, start, end)

    def _allowed(self, batch: m.ExecuteBatch, cols: m.BatchColumns, vocab_size: int):
        """Structured outputs: ``(rows int64[R], disallowed bool[R, vocab_size])`` over the batch's
        sampled rows (in chunk order, one per chunk with SAMPLE; ``rows`` increasing), filled from
        the matchers of the constrained requests (:class:`~zpp.workers.grammar.SlotGrammars`) once
        the result this rank holds has been finished (:attr:`before_fill`: its tokens are
        accepted first); None when no row is constrained. Called with the batch's forward queued,
        so the fill overlaps it. Remembers the rows for the accept of the sampled tokens."""
        sel = sampled_rows(self.grammars, cols, self.table.num_prompt)
        self._grammar_sel = sel
        if sel is None:
            return None
        if self.before_fill is not None:
            self.before_fill()
        self.trace.mark("fill", batch.batch_id)
        grows, slots, needs = sel
        bitmask = self.grammars.fill(slots, needs).reshape(-1).view(np.uint8)
        self.trace.mark("filled", batch.batch_id)
        rows = self.staging.upload([grows])[0]
        staging = None
        if self.device.type == "cuda":
            self._mask_idx ^= 1
            n = len(bitmask)
            if self._mask_pinned[self._mask_idx].shape[0] < n:
                self._mask_pinned[self._mask_idx] = torch.empty(max(n, 1 << 20), dtype=torch.uint8, pin_memory=True)
            staging = self._mask_pinned[self._mask_idx]
        return rows, unpack_bitmask(bitmask, len(grows), vocab_size, self.device, staging)

    def _logit_plan(self, cols: m.BatchColumns) -> tuple[list[int], list[int], list[tuple[int, int, int]]]:
        """Which hidden rows of the step need logits: ``(rows, sample_rows, plp_spans)`` -- rows into
        the step's flat tokens (the last of each sampling chunk, and the prompt positions of
        prompt-logprobs chunks), for each sampling chunk its index into ``rows``, and
        ``(chunk index, first index into rows, count)`` of each prompt-logprobs chunk."""
        q_lens = cols.num_tokens.astype(np.int64)
        ends = np.cumsum(q_lens)  # each chunk's end in the step's flat tokens
        plp_spans: list[tuple[int, int, int]] = []
        if not cols.prompt_logprobs.any() and not len(cols.draft_tokens):
            rows = (ends - 1)[np.flatnonzero(cols.sample)].tolist()
            return rows, list(range(len(rows))), plp_spans
        rows, sample_rows = [], []
        num_prompt = self.table.num_prompt[cols.slots]
        for ci, (start, n_tok, f, end) in enumerate(zip(cols.starts.tolist(), q_lens.tolist(),
                                                        cols.flags.tolist(), ends.tolist())):
            if f & m.PROMPT_LOGPROBS:
                # Position p predicts token p + 1; only prompt tokens get prompt logprobs.
                n = max(0, min(start + n_tok, int(num_prompt[ci]) - 1) - start)
                if n:
                    plp_spans.append((ci, len(rows), n))
                    rows.extend(range(end - n_tok, end - n_tok + n))
            if f & m.SAMPLE:  # speculative decoding: every position of a verify chunk
                sample_rows.append(len(rows))
                rows.extend(range(end - 1 - int(cols.draft_counts[ci]), end))
        return rows, sample_rows, plp_spans

    def _sample(self, batch: m.ExecuteBatch, cols: m.BatchColumns, hidden: torch.Tensor, plan,
                logit_rows: Optional[torch.Tensor]) -> m.StepResult:
        """Logits of ``plan``'s rows (:meth:`_logit_plan`; ``logit_rows``: the same indices padded to a
        warmed-up count, on the device), then sampling and prompt logprobs."""
        rows, sample_rows, plp_spans = plan
        q_lens = cols.num_tokens.astype(np.int64)
        sample_chunks = np.flatnonzero(cols.sample)
        if not rows:
            return m.StepResult(batch.batch_id)
        logits = self.model.compute_logits(hidden[logit_rows], upcast=False)[:len(rows)]  # [N, V], model dtype
        self.trace.mark("logits_queued", batch.batch_id)

        tokens: list[int] = []
        lps: list = []
        if sample_rows and len(cols.draft_tokens):
            return rejection_sampler.verify(self, batch, cols, logits, sample_rows, sample_chunks, plp_spans)
        if sample_rows:
            row_slots = cols.slots[sample_chunks]
            allowed = self._allowed(batch, cols, logits.shape[1])
            plain = bool(self.table.plain[row_slots].all())
            if not plp_spans and self.device.type == "cuda" and plain and self.mtp is None:
                # No host round trip for a prefill (or mixed) batch either: the next one is launched first.
                return self._greedy_pending(batch, sample_chunks, row_slots, logits, allowed)
            keep = [] if self.async_scheduling else None
            sample_logits = logits[sample_rows]
            if plain:  # argmax: the same on the model's dtype as on float32
                tokens = Sampler.greedy(sample_logits, allowed, keep).tolist()
                lps = [None] * len(tokens)
            else:
                seqs = self.table.seq_states(row_slots, cols.starts[sample_chunks] + q_lens[sample_chunks])
                tokens, lps = self.sampler(sample_logits.float(), seqs, self.eos_token_ids, allowed, keep)
            if keep:
                self._keep_sampled(row_slots, keep[0])

        return self._result(batch.batch_id, sample_chunks, tokens, lps, prompt_logprobs(self.table, cols, logits,
                                                                                         plp_spans))
