"""Causal self-attention over the paged KV cache.

A micro-batch is a flat list of ``T`` tokens from ``B`` sequences; sequence ``i`` contributes a
chunk of ``q_len[i]`` new tokens at positions ``[start[i], start[i] + q_len[i])`` and attends to
its cached context plus the chunk (prefill, chunked prefill and decode are the same case).

KV cache of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; token at position
``p`` of a sequence with block table ``bt`` lives in slot ``bt[p // block_size] * block_size +
p % block_size`` (the paged layout of vLLM, Kwon et al. 2023, "PagedAttention").

The portable path (CPU, and CUDA when no fused kernel applies) gathers each sequence's context
into a padded ``[B, L_k]`` view and runs ``torch.nn.functional.scaled_dot_product_attention`` with
a boolean mask, one call per layer for the whole batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    """Per-micro-batch indices shared by every attention layer of a stage.

    Portable path (CPU):
        slot_mapping: ``[T]`` int64, KV-cache slot each new token's K/V is written to.
        q_index: ``[B, L_q]`` int64 into the flat tokens; padding points at row ``T`` (a zero row).
        out_index: ``[T]`` int64 into the flattened ``[B * L_q]`` padded output.
        ctx_slots: ``[B, L_k]`` int64 slots of each sequence's context (padding -> slot 0).
        mask: ``[B, 1, L_q, L_k]`` bool, True where the query may attend the key.
    Triton path (CUDA), see ``triton_ops.paged_attention``:
        block_tables ``[B, W]`` int32, seq_lens ``[B]`` int32, query_start ``[B + 1]`` int32,
        tile_seq / tile_qstart ``[num_tiles]`` int32, block_m (rows per program).
    """

    slot_mapping: torch.Tensor
    q_index: Optional[torch.Tensor] = None
    out_index: Optional[torch.Tensor] = None
    ctx_slots: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    decode_only: bool = False
    block_tables: Optional[torch.Tensor] = None
    seq_lens: Optional[torch.Tensor] = None
    query_start: Optional[torch.Tensor] = None
    tile_seq: Optional[torch.Tensor] = None
    tile_qstart: Optional[torch.Tensor] = None
    block_m: int = 16

    @property
    def triton(self) -> bool:
        return self.block_tables is not None


def build_attention_metadata(starts: list[int], q_lens: list[int], block_tables: list[list[int]],
                             block_size: int, device: torch.device, group: int = 1) -> AttentionMetadata:
    """Build :class:`AttentionMetadata` for one micro-batch (host-side index math, then copies to
    ``device``). On CUDA the Triton layout is built (``group`` = query heads per KV head)."""
    if device.type == "cuda":
        return _build_triton_metadata(starts, q_lens, block_tables, block_size, device, group)
    B = len(starts)
    T = sum(q_lens)
    Lq = max(q_lens)
    seq_lens = [s + q for s, q in zip(starts, q_lens)]
    Lk = max(seq_lens)
    starts_t = torch.tensor(starts, dtype=torch.int64)
    qlens_t = torch.tensor(q_lens, dtype=torch.int64)
    seqlens_t = torch.tensor(seq_lens, dtype=torch.int64)
    nblk = (Lk + block_size - 1) // block_size
    bt = torch.zeros(B, nblk, dtype=torch.int64)
    for i, blocks in enumerate(block_tables):
        n = min(len(blocks), nblk)
        bt[i, :n] = torch.tensor(blocks[:n], dtype=torch.int64)

    kpos = torch.arange(Lk, dtype=torch.int64)
    ctx_slots = bt[:, kpos // block_size] * block_size + kpos % block_size     # [B, Lk]
    ctx_slots = torch.where(kpos[None, :] < seqlens_t[:, None], ctx_slots, torch.zeros_like(ctx_slots))

    j = torch.arange(Lq, dtype=torch.int64)
    cu = torch.cumsum(qlens_t, 0) - qlens_t                                     # [B] first flat index
    valid_q = j[None, :] < qlens_t[:, None]                                     # [B, Lq]
    q_index = torch.where(valid_q, cu[:, None] + j[None, :], torch.full_like(valid_q, T, dtype=torch.int64))
    qpos = torch.where(valid_q, starts_t[:, None] + j[None, :], torch.zeros_like(q_index))  # pad rows see key 0
    mask = (kpos[None, None, :] <= qpos[:, :, None]).unsqueeze(1)               # [B, 1, Lq, Lk]
    out_index = (torch.arange(B)[:, None] * Lq + j[None, :])[valid_q]            # [T]
    slot_mapping = ctx_slots.gather(1, (starts_t[:, None] + j[None, :]).clamp(max=Lk - 1))[valid_q]

    to = lambda t: t.to(device, non_blocking=True)
    return AttentionMetadata(slot_mapping=to(slot_mapping), q_index=to(q_index), out_index=to(out_index),
                             ctx_slots=to(ctx_slots), mask=to(mask), decode_only=(Lq == 1))


def _build_triton_metadata(starts, q_lens, block_tables, block_size, device, group) -> AttentionMetadata:
    from zpp.models.layers.triton_ops import pick_block_m
    B = len(starts)
    st = np.asarray(starts, dtype=np.int64)
    ql = np.asarray(q_lens, dtype=np.int64)
    seq_lens = st + ql
    T = int(ql.sum())
    qstart = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(ql, out=qstart[1:])
    W = max(1, int(-(-seq_lens.max() // block_size)))
    bt = np.zeros((B, W), dtype=np.int64)
    for i, blocks in enumerate(block_tables):
        n = min(len(blocks), W)
        bt[i, :n] = blocks[:n]
    seq_of_tok = np.repeat(np.arange(B), ql)
    pos = np.arange(T) - qstart[seq_of_tok] + st[seq_of_tok]
    slots = bt[seq_of_tok, pos // block_size] * block_size + pos % block_size
    block_m = pick_block_m(int(ql.max()), group)
    block_q = max(1, block_m // group)
    n_tiles = -(-ql // block_q)
    tile_seq = np.repeat(np.arange(B), n_tiles)
    first = np.cumsum(n_tiles) - n_tiles
    tile_qstart = (np.arange(int(n_tiles.sum())) - first[tile_seq]) * block_q
    i32 = lambda a: torch.from_numpy(a.astype(np.int32)).to(device, non_blocking=True)
    return AttentionMetadata(slot_mapping=torch.from_numpy(slots).to(device, non_blocking=True),
                             block_tables=i32(bt), seq_lens=i32(seq_lens), query_start=i32(qstart),
                             tile_seq=i32(tile_seq), tile_qstart=i32(tile_qstart), block_m=block_m,
                             decode_only=bool((ql == 1).all()))


class Attention(nn.Module):
    """Multi-head / grouped-query attention reading and writing one layer's paged KV cache.

    ``forward(q [T, Hq*D], k [T, Hk*D], v [T, Hk*D], kv_cache, meta)`` -> ``[T, Hq*D]``.
    ``kv_cache`` is ``[2, num_blocks, block_size, Hk, D]`` or None (profiling pass: no cache, the
    batch attends only to itself).
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: Optional[float] = None):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale if scale is not None else head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: Optional[torch.Tensor], meta: AttentionMetadata,
                positions: Optional[torch.Tensor] = None, rotary=None) -> torch.Tensor:
        """With ``rotary`` (a RotaryEmbedding) and ``positions [T]``, RoPE is applied to q and k
        first (fused with the cache write on CUDA)."""
        T = q.shape[0]
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = q.view(T, H, D)
        k = k.view(T, Hk, D)
        v = v.view(T, Hk, D)
        if meta.triton and kv_cache is not None:
            from zpp.models.layers import triton_ops
            if rotary is not None:
                q = q.contiguous()
                triton_ops.rope_and_cache(q, k, v, positions, rotary.cos, rotary.sin, kv_cache[0], kv_cache[1],
                                          meta.slot_mapping)
            else:
                kv_cache[0].view(-1, Hk, D).index_copy_(0, meta.slot_mapping, k)
                kv_cache[1].view(-1, Hk, D).index_copy_(0, meta.slot_mapping, v)
            out = torch.empty_like(q)
            splits = triton_ops.decode_splits(meta.seq_lens.shape[0], Hk) if meta.decode_only else 1
            triton_ops.paged_attention(q, kv_cache[0], kv_cache[1], out, meta.block_tables, meta.seq_lens,
                                       meta.query_start, meta.tile_seq, meta.tile_qstart, self.scale, meta.block_m,
                                       splits)
            return out.view(T, H * D)
        if rotary is not None:
            q, k = rotary(positions, q, k)
        if kv_cache is not None:
            k_flat = kv_cache[0].view(-1, Hk, D)
            v_flat = kv_cache[1].view(-1, Hk, D)
            k_flat.index_copy_(0, meta.slot_mapping, k)
            v_flat.index_copy_(0, meta.slot_mapping, v)
            k_ctx = k_flat[meta.ctx_slots]                                   # [B, Lk, Hk, D]
            v_ctx = v_flat[meta.ctx_slots]
        else:  # profiling: a single sequence attending to itself
            k_ctx, v_ctx = k.unsqueeze(0), v.unsqueeze(0)
        q_pad = torch.cat([q, q.new_zeros(1, H, D)])[meta.q_index]          # [B, Lq, H, D]
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),
            attn_mask=meta.mask, scale=self.scale, enable_gqa=(H != Hk))     # [B, H, Lq, D]
        out = out.transpose(1, 2).reshape(-1, H * D)                          # [B*Lq, H*D]
        return out[meta.out_index]
