"""CUDA graphs for decode micro-batches (one new token per sequence).

One graph per batch-size bucket is captured over a shared set of static input buffers (token ids,
positions, KV slots, block tables, sequence lengths) and a shared memory pool. A batch of ``b``
sequences replays the smallest bucket ``>= b``; padding rows have zero-length queries and write
their K/V into a scratch slot outside the engine's block space.

The stage processes micro-batches strictly one after another, so one set of static buffers is
enough even with several micro-batches in flight: a graph's output is copied out (``clone``)
before it is handed to an asynchronous send, so a later replay never overwrites a tensor that is
still being sent (the PP "buffer aliasing" hazard).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np
import torch

from zpp.models.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768,
             896, 1024]
    out = [s for s in sizes if s < max_num_seqs] + [min(max_num_seqs, 1024)]
    return sorted(set(out))


class DecodeGraphs:
    """Captured decode graphs of one stage. ``run(...)`` returns logits ``[b, V]`` on the last
    stage and activations ``[num_acts, b, H]`` elsewhere."""

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, max_model_len: int,
                 max_num_seqs: int, scratch_slot: int, dtype: torch.dtype, device: torch.device, group: int):
        self.model = model
        self.kv_caches = kv_caches
        self.stage = model.stage
        self.sizes = capture_sizes(max_num_seqs)
        B = self.max_bs = self.sizes[-1]
        W = -(-max_model_len // block_size)
        self.scratch_slot = scratch_slot
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(B, **i64)
        self.positions = torch.zeros(B, **i64)
        self.slot_mapping = torch.full((B,), scratch_slot, **i64)
        self.block_tables = torch.zeros(B, W, **i32)
        self.seq_lens = torch.zeros(B, **i32)
        self.query_start = torch.zeros(B + 1, **i32)
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
        out = self.model(self.input_ids[:bs] if self.stage.is_first else None, self.positions[:bs],
                         self.acts[:, :bs] if self.acts is not None else None, self.kv_caches, self._meta(bs))
        if self.stage.is_last:
            out = self.model.compute_logits(out)
        return out

    @torch.inference_mode()
    def capture(self) -> None:
        t = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bs in sorted(self.sizes, reverse=True):
            for _ in range(2):
                self._forward(bs)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self._forward(bs)
            self.graphs[bs] = g
            self.outputs[bs] = out
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1fs", len(self.graphs),
                    ",".join(map(str, self.sizes)), time.perf_counter() - t)

    def bucket(self, b: int) -> Optional[int]:
        for s in self.sizes:
            if s >= b:
                return s
        return None

    def run(self, b: int, input_ids: Optional[np.ndarray], positions: np.ndarray, slots: np.ndarray,
            block_tables: np.ndarray, acts: Optional[torch.Tensor]) -> torch.Tensor:
        """Replay for ``b`` decode rows. ``block_tables`` is ``[b, w]`` (w <= the static width)."""
        bs = self.bucket(b)
        if input_ids is not None:
            self.input_ids[:b].copy_(torch.from_numpy(input_ids))
        self.positions[:b].copy_(torch.from_numpy(positions))
        self.slot_mapping[:b].copy_(torch.from_numpy(slots))
        self.slot_mapping[b:bs].fill_(self.scratch_slot)
        w = block_tables.shape[1]
        self.block_tables[:b, :w].copy_(torch.from_numpy(block_tables))
        self.seq_lens[:b].copy_(torch.from_numpy((positions + 1).astype(np.int32)))
        self.seq_lens[b:bs].zero_()
        qs = np.minimum(np.arange(bs + 1, dtype=np.int32), b)
        self.query_start[:bs + 1].copy_(torch.from_numpy(qs))
        if acts is not None:
            self.acts[:, :b].copy_(acts)
        self.graphs[bs].replay()
        out = self.outputs[bs]
        return out[:b] if self.stage.is_last else out[:, :b].clone()
