"""CUDA graphs for speculative-decoding verify batches (``1 + k`` query tokens per sequence).

A batch with drafts replays a verify graph when every chunk of the micro-batch is a decode or a
verify chunk (``1 + d`` tokens, ``d = ExecuteBatch.draft_counts``, possibly 0), samples, and asks
for no prompt logprobs (:func:`uniform_q`): with ``k`` the most drafts a chunk carries, every chunk
is padded to ``q = 1 + k`` query tokens (as vLLM pads its uniform-decode graphs), and the batch of
``b`` sequences replays the graph captured for ``(bucket(b), q)`` (buckets as the decode graphs',
:func:`zpp.workers.cuda_graphs.capture_sizes`, up to :data:`MAX_VERIFY_BATCH`; ``q`` from 2 to
``1 + num_speculative_tokens``). A padding token of a chunk sits after its real tokens, so no real
query attends to it (causal), and writes its K/V into the scratch slot; its logits are not read.
Padding rows (bucket > b) are empty sequences (query length 0), as in the decode graphs. Any
other batch with drafts (a prompt chunk beside the verifies, larger batches) runs eagerly.

The attention of a graphed verify batch is the Triton paged attention's multi-token query path
(``decode_only=False``): ``query_start`` ``[0, q, 2q, ...]``, ``seq_lens`` each sequence's last
position + 1 (the kernel's causal mask puts query ``i`` of a sequence at ``seq_len - q + i``), and
a fixed tile list per ``(bucket, q)`` (``ceil(q / (block_m // group))`` tiles per sequence,
``block_m = pick_block_m(q, group)``, as ``triton_metadata_arrays`` makes them for the eager path),
so everything the host changes per step is in static buffers.

On the last stage the graph keeps the final hidden states of every position ``[T, H]`` and, on the
result rank, the logits of every position ``[T, V]`` (model dtype) in static buffers outside the
graph pool; rejection sampling (:mod:`zpp.workers.rejection_sampler`) runs on them eagerly, and
with MTP the drafter (:mod:`zpp.workers.mtp`, eager) reads the hidden states from the static
buffer, before the next replay overwrites it. So with MTP the stages replay verify graphs too
(1-token decode steps, which MTP makes only when a chain drafted nothing, run eagerly: the decode
graphs keep no hidden states).

``EagerVerifyGraphs`` is the CPU stand-in (``ZPP_EAGER_GRAPHS``, as ``EagerDecodeGraphs``): its
"replay" is an eager forward of exactly the inputs the graph would get, so the host logic of this
path runs in CI. Not yet run on a GPU: ``scripts/gpu_verify_cost.py`` runs it end to end.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np
import torch

from zpp.models.layers.attention import TABLE_WIDTH_ALIGN, AttentionMetadata, block_table_width, \
    build_attention_metadata
from zpp.transport import messages as m
from zpp.workers import rejection_sampler
from zpp.workers.cuda_graphs import capture_sizes
from zpp.workers.staging import aligned_size

logger = logging.getLogger(__name__)

MAX_VERIFY_BATCH = 32
"""The largest verify batch captured (speculation pays at low concurrency; larger verify batches,
or ``disable_by_batch_size`` above it, run eagerly)."""


def verify_sizes(max_num_seqs: int, spec) -> list[int]:
    """The batch buckets verify graphs are captured for: :func:`capture_sizes` up to
    ``min(max_num_seqs, MAX_VERIFY_BATCH, disable_by_batch_size)``."""
    top = min(max_num_seqs, MAX_VERIFY_BATCH, spec.disable_by_batch_size or MAX_VERIFY_BATCH)
    return capture_sizes(max(1, top))


def uniform_q(cols: m.BatchColumns, max_model_len: int) -> int:
    """``q = 1 + k``, ``k`` the most drafts a chunk of ``cols`` carries, when every chunk is a sampling
    decode or verify chunk (``1 + drafts`` tokens) without prompt logprobs, at least one carries
    drafts, and every chunk padded to ``q`` tokens stays within ``max_model_len``; 0 otherwise."""
    d = cols.draft_counts
    if not cols.size or not len(d):
        return 0
    q = int(d.max()) + 1
    if (q < 2 or not (cols.num_tokens == d + 1).all() or not cols.sample.all() or cols.prompt_logprobs.any()
            or int(cols.starts.max()) + q > max_model_len):
        return 0
    return q


class _Base:
    def __init__(self, model, kv_caches, block_size: int, max_num_seqs: int, spec, group: int):
        self.model, self.kv_caches, self.block_size, self.group = model, kv_caches, block_size, group
        self.stage = model.stage
        self.sizes = verify_sizes(max_num_seqs, spec)
        self.qs = list(range(2, spec.num_speculative_tokens + 2))

    def bucket(self, b: int, q: int) -> Optional[int]:
        """The bucket a uniform verify batch of ``b`` sequences of ``q`` tokens replays; None: eager."""
        if q not in self.qs or getattr(self.model, "rope_switch_len", None) is not None:
            return None
        for s in self.sizes:
            if s >= b:
                return s
        return None


class VerifyGraphs(_Base):
    """Captured verify graphs of one stage (one GPU per stage: with tensor parallelism they are not
    made). ``run(b, q, ...)`` returns ``(logits [b*q, V] or None, hidden [b*q, H])`` on the last stage
    (logits on the result rank only; both views of static buffers, valid until the next replay) and
    activations ``[num_acts, b*q, H]`` (a copy) elsewhere."""

    def __init__(self, model, kv_caches, block_size: int, max_model_len: int, max_num_seqs: int, spec,
                 scratch_slot: int, dtype: torch.dtype, device: torch.device, group: int):
        super().__init__(model, kv_caches, block_size, max_num_seqs, spec, group)
        from zpp.models.layers.triton_ops import pick_block_m
        B = self.max_bs = self.sizes[-1]
        T = self.max_t = B * self.qs[-1]
        W = self.W = block_table_width(max_model_len, block_size, TABLE_WIDTH_ALIGN)
        self.scratch_slot = scratch_slot
        # int64: token ids, positions, slots [T] each; int32: seq_lens [B], query_start [B + 1],
        # block tables [B, W] (128-byte aligned, as the decode graphs'); two pinned staging slots.
        self.bt_at = bt_at = aligned_size(2 * B + 1)
        self.dev64 = torch.zeros(3 * T, dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(bt_at + B * W, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.dev64.view(3, T)
        self.slot_mapping.fill_(scratch_slot)
        self.seq_lens = self.dev32[:B]
        self.query_start = self.dev32[B:2 * B + 1]
        self.block_tables = self.dev32[bt_at:].view(B, W)
        self.host64 = [torch.zeros(3 * T, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.host32 = [torch.zeros(bt_at + B * W, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self.copied = [None, None]
        self.slot = 0
        self.tiles: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, int]] = {}
        for q in self.qs:
            block_m = pick_block_m(q, group)
            block_q = max(1, block_m // group)
            n = -(-q // block_q)  # tiles per sequence
            for bs in self.sizes:
                seq = np.repeat(np.arange(bs), n).astype(np.int32)
                qstart = np.tile(np.arange(n) * block_q, bs).astype(np.int32)
                self.tiles[bs, q] = (torch.from_numpy(seq).to(device), torch.from_numpy(qstart).to(device), block_m)
        self.acts = (torch.zeros(model.num_acts, T, model.hidden_size, dtype=dtype, device=device)
                     if not self.stage.is_first else None)
        self.hidden = torch.zeros(T, model.hidden_size, dtype=dtype, device=device) if self.stage.is_last else None
        self.logits = None  # [T, V]: allocated at the first capture (the vocabulary of this rank's head)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def _meta(self, bs: int, q: int) -> AttentionMetadata:
        tile_seq, tile_qstart, block_m = self.tiles[bs, q]
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs * q], block_tables=self.block_tables[:bs],
                                 seq_lens=self.seq_lens[:bs], query_start=self.query_start[:bs + 1],
                                 tile_seq=tile_seq, tile_qstart=tile_qstart, block_m=block_m, decode_only=False)

    def _forward(self, bs: int, q: int):
        t = bs * q
        out = self.model(self.input_ids[:t] if self.stage.is_first else None, self.positions[:t],
                         self.acts[:, :t] if self.acts is not None else None, self.kv_caches, self._meta(bs, q))
        if not self.stage.is_last:
            return out
        self.hidden[:t].copy_(out)
        if self.stage.produces_results:
            logits = self.model.compute_logits(out, upcast=False)
            if self.logits is None:  # first (eager) warm-up: the buffer outside the graphs' pool
                self.logits = torch.zeros(self.max_t, logits.shape[1], dtype=logits.dtype, device=logits.device)
            self.logits[:t].copy_(logits)
        return None

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        reserved = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        for q in self.qs:
            for bs in sorted(self.sizes, reverse=True):
                self._forward(bs, q)  # warm-up: compiles the kernels of this shape
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self._forward(bs, q)
                self.graphs[bs, q] = g
                if out is not None:
                    self.outputs[bs, q] = out
        torch.cuda.synchronize()
        logger.info("captured %d verify CUDA graphs (batch sizes %s x query tokens %s) in %.1fs, %.2f GiB",
                    len(self.graphs), ",".join(map(str, self.sizes)), ",".join(map(str, self.qs)),
                    time.perf_counter() - t0, (torch.cuda.memory_reserved() - reserved) / 2**30)

    def run(self, b: int, q: int, input_ids: Optional[np.ndarray], positions: np.ndarray, slots: np.ndarray,
            block_tables: np.ndarray, acts: Optional[torch.Tensor], q_lens=None):
        """Replay for ``b`` sequences of ``q`` tokens: ``positions``, ``slots``, ``input_ids`` ``[b*q]``
        sequence after sequence (padding tokens: the scratch slot), ``block_tables [b, w]`` (w <= the
        static width); ``q_lens`` (each sequence's real tokens) only for the stand-in's checks."""
        bs = self.bucket(b, q)
        B, T, W = self.max_bs, self.max_t, self.W
        t, tp = b * q, bs * q
        k = self.slot = self.slot ^ 1
        if self.copied[k] is not None:
            self.copied[k].synchronize()  # the copy that last read this staging slot is done
        h64 = self.host64[k].numpy().reshape(3, T)
        h32 = self.host32[k].numpy()
        h64[:, t:tp] = 0
        if input_ids is not None:
            h64[0, :t] = input_ids
        h64[1, :t] = positions
        h64[2, :t] = slots
        h64[2, t:tp] = self.scratch_slot
        h32[:b] = positions.reshape(b, q)[:, -1] + 1                   # seq_lens
        h32[b:bs] = 0
        h32[B:B + bs + 1] = np.minimum(np.arange(bs + 1) * q, t)       # query_start (padding: empty)
        h32[self.bt_at:].reshape(B, W)[:b, :block_tables.shape[1]] = block_tables
        self.dev64.copy_(self.host64[k], non_blocking=True)
        n32 = self.bt_at + b * W
        self.dev32[:n32].copy_(self.host32[k][:n32], non_blocking=True)
        ev = self.copied[k] = torch.cuda.Event()
        ev.record()
        if acts is not None:
            self.acts[:, :t].copy_(acts)
        self.graphs[bs, q].replay()
        if not self.stage.is_last:
            return self.outputs[bs, q][:, :t].clone()
        return (self.logits[:t] if self.stage.produces_results else None), self.hidden[:t]


class EagerVerifyGraphs(_Base):
    """Testing stand-in for :class:`VerifyGraphs` on the CPU (``ZPP_EAGER_GRAPHS``): the same
    interface, each "replay" an eager forward of exactly the graph's inputs, its KV slots checked
    against the ones the block tables give (an AssertionError ends the worker). With
    ``ZPP_EAGER_GRAPHS`` naming a file, every replay appends ``"v {b} {q} {pp_rank}"`` to it."""

    def __init__(self, model, kv_caches, block_size: int, max_num_seqs: int, spec, scratch_slot: int,
                 device: torch.device, group: int, log_path: Optional[str] = None):
        super().__init__(model, kv_caches, block_size, max_num_seqs, spec, group)
        self.scratch_slot, self.device, self.log_path = scratch_slot, device, log_path

    def run(self, b: int, q: int, input_ids, positions, slots, block_tables, acts, q_lens=None):
        first = positions.reshape(b, q)[:, 0]
        tables = [row[:(p + q - 1) // self.block_size + 1].tolist() for row, p in zip(block_tables, first)]
        meta = build_attention_metadata(first.tolist(), [q] * b, tables, self.block_size, self.device, self.group)
        real = (np.arange(q)[None, :] < np.asarray(q_lens)[:, None]).reshape(-1)
        want = meta.slot_mapping.numpy()
        assert np.array_equal(want[real], slots[real]), "verify-graph slots differ from the block tables'"
        assert (slots[~real] == self.scratch_slot).all(), "a padding token writes outside the scratch slot"
        meta.slot_mapping = torch.from_numpy(np.ascontiguousarray(slots))
        ids = None if input_ids is None else torch.from_numpy(np.array(input_ids, dtype=np.int64))
        out = self.model(ids, torch.from_numpy(np.array(positions, dtype=np.int64)), acts, self.kv_caches, meta)
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(f"v {b} {q} {self.stage.pp_rank}\n")
        if not self.stage.is_last:
            return out.clone()
        return (self.model.compute_logits(out, upcast=False) if self.stage.produces_results else None), out


def execute_verify_graph(r, batch: m.ExecuteBatch, cols: m.BatchColumns, q: int):
    """A verify batch (:func:`uniform_q` ``q``) on ``r`` (a ModelRunner) through its verify graphs,
    every chunk padded to ``q`` tokens: the same result as ``ModelRunner.execute``'s eager path."""
    B, bs = cols.size, r.block_size
    q_lens = cols.num_tokens.astype(np.int64)
    starts = cols.starts.astype(np.int64)
    pos = (starts[:, None] + np.arange(q)).reshape(-1)
    real = (np.arange(q)[None, :] < q_lens[:, None]).reshape(-1)  # [B*q]: not a padding token
    owner = np.repeat(np.arange(B), q)
    bt = r.table.block_rows(cols.slots, int(pos.max()) // bs + 1)
    slots = np.where(real, bt[owner, pos // bs].astype(np.int64) * bs + pos % bs, r.scratch_slot)
    ids = None
    if r.stage.is_first:
        ids = np.where(real, r.table.tokens[cols.slots[owner], pos], 0).astype(np.int64)
    acts = None
    if not r.stage.is_first:
        acts = r._recv_acts((r.model.num_acts, B * q, r.model.hidden_size))
    t0 = r._begin()
    out = r.verify_graphs.run(B, q, ids, pos, slots, bt, acts, q_lens)
    r.trace.mark("forward_queued", batch.batch_id)
    if not r.stage.is_last:
        r._end(t0)
        r.link.send(out)
        return None
    if not r.stage.produces_results:
        r._end(t0)
        return None
    logits, hidden = out
    result = rejection_sampler.verify(r, batch, cols, logits, list(range(0, B * q, q)), np.arange(B), [])
    r.trace.mark("sample_queued", batch.batch_id)
    if r.mtp is not None:  # the next step's drafts, from the graph's hidden states (before the next replay)
        if not real.all():
            keep = np.flatnonzero(real)
            hidden, pos = hidden[r.staging.upload([keep])[0]], pos[keep]
        meta = build_attention_metadata(starts.tolist(), q_lens.tolist(), bt, bs, r.device, r.group)
        r.mtp.draft(cols, hidden, r.staging.upload([pos])[0], meta, result)
    r._end(t0)
    result.busy_s, result.idle_s = r.busy_s, r.idle_s
    return result


def set_up_graphs(runner, model, cfg_all, device_kind: str, enforce_eager: bool, max_model_len: int,
                  block_size: int) -> None:
    """The worker's graphs for ``runner``: decode graphs (none with MTP: the drafter needs the last
    stage's hidden states) and, with speculative decoding, verify graphs (CUDA without tensor
    parallelism); with ``ZPP_EAGER_GRAPHS`` on the CPU their stand-ins."""
    from zpp import envs
    spec = cfg_all.speculative_config
    mtp = spec is not None and spec.method == "mtp"
    max_num_seqs = cfg_all.scheduler.max_num_seqs
    if device_kind == "cuda" and not enforce_eager:
        if not model.supports_cuda_graphs:
            logger.info("%s runs eagerly (no CUDA graphs)", type(model).__name__)
            return
        if not mtp:
            runner.capture_graphs(max_model_len, max_num_seqs)
        if spec is not None and model.stage.tp_size == 1:
            try:
                runner.verify_graphs = VerifyGraphs(model, runner.kv_caches, block_size, max_model_len, max_num_seqs,
                                                    spec, runner.scratch_slot, runner.dtype, runner.device,
                                                    runner.group)
                runner.verify_graphs.capture()
            except Exception as e:  # not yet run on a GPU in CI: a failed capture leaves verify steps eager
                runner.verify_graphs = None
                logger.warning("verify steps run eagerly: capturing their CUDA graphs failed (%s: %s)",
                               type(e).__name__, e)
        if mtp:
            logger.info("speculative decoding with MTP: verify steps replay CUDA graphs%s; 1-token steps and the "
                        "MTP layer run eagerly", "" if runner.verify_graphs is not None else " (not with TP)")
    elif device_kind == "cpu" and envs.ZPP_EAGER_GRAPHS and model.supports_cuda_graphs:
        # tests: the graph paths on the CPU, for the stages CUDA would capture
        from zpp.workers.cuda_graphs import EagerDecodeGraphs
        flag = envs.ZPP_EAGER_GRAPHS
        log = None if flag == "1" else flag
        if not mtp:
            runner.graphs = EagerDecodeGraphs(model, runner.kv_caches, block_size, max_num_seqs, runner.device,
                                              runner.group, log)
        if spec is not None:
            runner.verify_graphs = EagerVerifyGraphs(model, runner.kv_caches, block_size, max_num_seqs, spec,
                                                     runner.scratch_slot, runner.device, runner.group, log)
