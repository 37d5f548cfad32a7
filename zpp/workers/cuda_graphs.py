"""CUDA graphs for decode micro-batches (one new token per sequence).

One graph per batch-size bucket is captured over a shared set of static input buffers (token ids,
positions, KV slots, block tables, sequence lengths) and a shared memory pool. A batch of ``b``
sequences replays the smallest bucket ``>= b``; padding rows have zero-length queries and write
their K/V into a scratch slot outside the engine's block space.

The stage processes micro-batches strictly one after another, so one set of static buffers is
enough even with several micro-batches in flight: a graph's output is copied out (``clone``)
before it is handed to an asynchronous send, so a later replay never overwrites a tensor that is
still being sent (the PP "buffer aliasing" hazard).

With tensor parallelism the graphs contain the layers' NCCL all-reduces (PyTorch supports capturing
NCCL collectives; the warm-up forwards before each capture create the communicator). Every TP rank
of a stage captures the same buckets in the same order and replays the same bucket for every batch,
so the captured collectives always pair up. Capture then uses ``thread_local`` error mode so that
the NCCL watchdog thread's event queries cannot invalidate the capture.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np
import torch

from zpp.models.layers.attention import TABLE_WIDTH_ALIGN, AttentionMetadata, block_table_width
from zpp.models.layers.pdl import decode_step
from zpp.workers.staging import aligned_size

logger = logging.getLogger(__name__)


MAX_GRAPH_BATCH = 4096
"""The largest decode batch a CUDA graph is captured for (``--max-num-seqs`` above it: the larger
batches run eagerly)."""
_BUCKETS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768,
            896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes captured for ``--max-num-seqs``: the buckets below it and
    ``min(max_num_seqs, MAX_GRAPH_BATCH)`` itself (a batch replays the smallest bucket >= its size).

    Up to 4096 rows, as TensorRT-LLM's published throughput runs: a 30,000 x 128/128 run at
    ``--max-num-seqs 2048`` decodes 2048 sequences a step, and launching that eagerly took the
    worker's host 35-80 ms per step against 46 ms of GPU work (H100, Llama-3-8B FP8, ZPP_TRACE),
    when the buckets stopped at 1024."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    return sorted({s for s in _BUCKETS if s < top} | {top})


def graph_pool_margin(max_num_seqs: int, row_bytes: int) -> int:
    """Bytes kept free for the CUDA graphs of :func:`capture_sizes` (``max_num_seqs``) when the KV
    cache is sized: 512 MiB, plus ``row_bytes`` (one row of a graph's output: logits on the last
    stage, activations elsewhere) for every row of the buckets above 1024 (each captured graph keeps
    its output in the graphs' pool; the buckets up to 1024 have always been served by the 512 MiB
    and the slack ``--gpu-memory-utilization`` leaves)."""
    return (512 << 20) + row_bytes * sum(s for s in capture_sizes(max_num_seqs) if s > 1024)


class DecodeGraphs:
    """Captured decode graphs of one stage. ``run(...)`` returns logits ``[b, V]`` (model dtype) on the result
    rank (TP rank 0 of the last stage), the final hidden states ``[b, H]`` on the other TP ranks of
    the last stage, and activations ``[num_acts, b, H]`` elsewhere."""

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, max_model_len: int,
                 max_num_seqs: int, scratch_slot: int, dtype: torch.dtype, device: torch.device, group: int):
        self.model = model
        self.kv_caches = kv_caches
        self.stage = model.stage
        self.sizes = capture_sizes(max_num_seqs)
        B = self.max_bs = self.sizes[-1]
        W = block_table_width(max_model_len, block_size, TABLE_WIDTH_ALIGN)
        self.scratch_slot = scratch_slot
        # All per-step inputs live in two device buffers (int64: token ids, positions, slots, and
        # for async scheduling the rows that take a token sampled on the device and where it lies;
        # int32: sequence lengths, query starts, block tables) filled from pinned host staging with
        # one copy each; two staging slots alternate so the CPU can prepare step i+1 while the copy
        # of step i is still queued.
        # The block tables start 128-byte aligned, as the eager path's uploads do (PinnedStaging),
        # and are TABLE_WIDTH_ALIGN wide: the same Triton attention variants serve both.
        self.W = W
        self.bt_at = bt_at = aligned_size(2 * B + 1)  # after seq_lens [B] and query_start [B + 1]
        self.dev64 = torch.zeros(5 * B, dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(bt_at + B * W, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.prev_dst, self.prev_src = self.dev64.view(5, B)
        self.seq_lens = self.dev32[:B]
        self.query_start = self.dev32[B:2 * B + 1]
        self.block_tables = self.dev32[bt_at:].view(B, W)
        self.slot_mapping.fill_(scratch_slot)
        self.host64 = [torch.zeros(5 * B, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.host32 = [torch.zeros(bt_at + B * W, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self.copied = [None, None]
        self.slot = 0
        i32 = dict(dtype=torch.int32, device=device)
        self.tile_seq = torch.arange(B, **i32)
        self.tile_qstart = torch.zeros(B, **i32)
        self.acts = (torch.zeros(model.num_acts, B, model.hidden_size, dtype=dtype, device=device)
                     if not self.stage.is_first else None)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        from zpp.models.layers.triton_ops import pick_block_m
        self.block_m = pick_block_m(1, group)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
                                 seq_lens=self.seq_lens[:bs], query_start=self.query_start[:bs + 1],
                                 tile_seq=self.tile_seq[:bs], tile_qstart=self.tile_qstart[:bs],
                                 block_m=self.block_m, decode_only=True)

    def _forward(self, bs: int) -> torch.Tensor:
        """The graphed forward of ``bs`` rows; at ``bs <= pdl.PDL_MAX_TOKENS`` its kernels launch with
        PDL (sm90+). One stage rank only: with tensor parallelism the graphs hold NCCL all-reduces,
        and PDL next to them has not been run on a multi-GPU host yet."""
        if self.stage.tp_size > 1:
            return self._model_forward(bs)
        with decode_step(bs):
            return self._model_forward(bs)

    def _model_forward(self, bs: int) -> torch.Tensor:
        out = self.model(self.input_ids[:bs] if self.stage.is_first else None, self.positions[:bs],
                         self.acts[:, :bs] if self.acts is not None else None, self.kv_caches, self._meta(bs))
        if self.stage.produces_results:  # in the model's dtype: the runner upcasts for anything but argmax
            out = self.model.compute_logits(out, upcast=False)
        return out

    @torch.inference_mode()
    def capture(self) -> None:
        t = time.perf_counter()
        reserved = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        mode = "thread_local" if self.stage.tp_size > 1 else "global"
        for bs in sorted(self.sizes, reverse=True):
            # the first warm-up without PDL also builds the kernels an eager step of bs tokens (a short
            # prompt, prompt logprobs) launches, which would otherwise compile mid-serving
            self._model_forward(bs)
            self._forward(bs)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, capture_error_mode=mode):
                out = self._forward(bs)
            self.graphs[bs] = g
            self.outputs[bs] = out
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1fs, %.2f GiB", len(self.graphs),
                    ",".join(map(str, self.sizes)), time.perf_counter() - t,
                    (torch.cuda.memory_reserved() - reserved) / 2**30)

    def bucket(self, b: int) -> Optional[int]:
        for s in self.sizes:
            if s >= b:
                return s
        return None

    def run(self, b: int, input_ids: Optional[np.ndarray], positions: np.ndarray, slots: np.ndarray,
            block_tables: np.ndarray, acts: Optional[torch.Tensor], prev=()) -> torch.Tensor:
        """Replay for ``b`` decode rows. ``block_tables`` is ``[b, w]`` (w <= the static width).

        ``prev`` (async scheduling): ``[(tokens int64[N] on the device, rows, source rows)]``: row
        ``rows[j]``'s input id is ``tokens[source rows[j]]`` (its ``input_ids`` entry is ignored)."""
        bs = self.bucket(b)
        B, W = self.max_bs, self.W
        k = self.slot = self.slot ^ 1
        if self.copied[k] is not None:
            self.copied[k].synchronize()  # the copy that last read this staging slot is done
        h64 = self.host64[k].numpy().reshape(5, B)
        n_prev = 0
        for _, dst, src in prev:
            h64[3, n_prev:n_prev + len(dst)] = dst
            h64[4, n_prev:n_prev + len(dst)] = src
            n_prev += len(dst)
        h32 = self.host32[k].numpy()
        h64[:, b:bs] = 0
        if input_ids is not None:
            h64[0, :b] = input_ids
        h64[1, :b] = positions
        h64[2, :b] = slots
        h64[2, b:bs] = self.scratch_slot
        h32[:b] = positions + 1                                        # seq_lens
        h32[b:bs] = 0
        h32[B:B + bs + 1] = np.minimum(np.arange(bs + 1), b)          # query_start (padding: empty)
        w = block_tables.shape[1]
        h32[self.bt_at:].reshape(B, W)[:b, :w] = block_tables
        n64 = 5 * B if n_prev else 3 * B
        self.dev64[:n64].copy_(self.host64[k][:n64], non_blocking=True)
        n32 = self.bt_at + b * W
        self.dev32[:n32].copy_(self.host32[k][:n32], non_blocking=True)
        ev = self.copied[k] = torch.cuda.Event()
        ev.record()
        o = 0
        for tokens, dst, _ in prev:  # the tokens the previous step sampled, without leaving the GPU
            n = len(dst)
            self.input_ids.index_copy_(0, self.prev_dst[o:o + n], tokens.index_select(0, self.prev_src[o:o + n]))
            o += n
        if acts is not None:
            self.acts[:, :b].copy_(acts)
        self.graphs[bs].replay()
        out = self.outputs[bs]
        return out[:b] if self.stage.is_last else out[:, :b].clone()


class EagerDecodeGraphs:
    """Testing stand-in for :class:`DecodeGraphs` on the CPU (``ZPP_EAGER_GRAPHS``, set for the
    workers by tests): the same interface (``sizes``, ``bucket``, ``run``), each "replay" an eager
    forward of exactly the inputs the model runner hands a graph. So CI, which has no GPU, runs the
    runner's decode-graph path (slots and block rows from the slot table, tokens of the previous
    step taken on the device with async scheduling, the graph's logits in the model's dtype, the
    greedy result left pending) and checks it against the eager path.

    ``run`` also checks the runner's KV slots against the ones the attention metadata derives from
    positions and block tables (a mismatch is an AssertionError, ending the worker). When
    ``ZPP_EAGER_GRAPHS`` names a file (anything but ``1``), every replay appends a line ``"{b}
    {pp_rank}"`` to it, so a test can tell that the path ran, and on which stages. Like the real
    graphs, it serves only a stage whose model ``supports_cuda_graphs``."""

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, max_num_seqs: int,
                 device: torch.device, group: int, log_path: Optional[str] = None):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.stage = model.stage
        self.sizes = capture_sizes(max_num_seqs)
        self.device, self.group, self.log_path = device, group, log_path

    bucket = DecodeGraphs.bucket

    def run(self, b: int, input_ids: Optional[np.ndarray], positions: np.ndarray, slots: np.ndarray,
            block_tables: np.ndarray, acts: Optional[torch.Tensor], prev=()) -> torch.Tensor:
        from zpp.models.layers.attention import build_attention_metadata
        ids = None
        if input_ids is not None:
            ids = torch.from_numpy(np.array(input_ids, dtype=np.int64))
            for tokens, dst, src in prev:
                ids[torch.as_tensor(np.asarray(dst, dtype=np.int64))] = tokens[torch.as_tensor(np.asarray(src, dtype=np.int64))]
        bs = self.block_size
        tables = [row[:p // bs + 1].tolist() for row, p in zip(block_tables, positions)]
        meta = build_attention_metadata(positions.tolist(), [1] * b, tables, bs, self.device, self.group)
        assert np.array_equal(meta.slot_mapping.numpy(), slots), "decode-graph slots differ from the block tables'"
        out = self.model(ids, torch.from_numpy(np.array(positions, dtype=np.int64)), acts, self.kv_caches, meta)
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(f"{b} {self.stage.pp_rank}\n")
        if self.stage.produces_results:
            return self.model.compute_logits(out, upcast=False)
        return out if self.stage.is_last else out.clone()
