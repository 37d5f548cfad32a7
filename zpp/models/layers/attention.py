"""Causal self-attention over the paged KV cache.

A micro-batch is a flat list of ``T`` tokens from ``B`` sequences; sequence ``i`` contributes a
chunk of ``q_len[i]`` new tokens at positions ``[start[i], start[i] + q_len[i])`` and attends to
its cached context plus the chunk (prefill, chunked prefill and decode are the same case).

KV cache of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (or, for attention
whose values are a prefix of its keys -- DeepSeek's latent cache -- one ``[num_blocks, block_size,
num_kv_heads, head_dim]`` tensor, see :class:`Attention`); token at position
``p`` of a sequence with block table ``bt`` lives in slot ``bt[p // block_size] * block_size +
p % block_size`` (the paged layout of vLLM, Kwon et al. 2023, "PagedAttention").

The portable path (CPU) gathers each sequence's context into a padded ``[B, L_k]`` view and runs
``torch.nn.functional.scaled_dot_product_attention`` with a boolean mask, one call per layer for
each group of sequences (decodes together; prefill chunks of similar size together, so that a
decode is never padded to a long prefill chunk's query length, see ``_attention_groups``).

Sliding-window attention (Mistral, Gemma 2/3, gpt-oss; HF ``masking_utils.sliding_window_overlay``):
a layer with window ``W`` lets the query at position ``i`` see the key at position ``j`` iff
``i - W < j <= i`` (``W`` keys, the query's own included). The window is a property of the layer,
not of the micro-batch, so one :class:`AttentionMetadata` serves every layer of a stage: the CPU
path builds each group's view of the context for a window on first use and keeps it for the other
layers with that window (:meth:`AttentionGroup.view`); the Triton path takes the window as a kernel
argument and starts each query tile's key loop at its first visible key.

Attention sinks (gpt-oss, HF ``modeling_gpt_oss.eager_attention_forward``): a learned logit per
query head joins the softmax's denominator and contributes no value, i.e.
``out = sum_j exp(s_j) v_j / (exp(sink_h) + sum_j exp(s_j))``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from zpp import envs


@dataclass
class KeyView:
    """What one SDPA call of a group reads for one (window, sinks) setting.

    ctx_blocks: ``[B_g, W]`` int64 KV-cache blocks gathered per sequence (padding -> block 0, masked).
    num_keys: ``L_k``, keys kept after the gather (the rest are sliced off).
    mask: ``[B_g, 1, L_q, L_k (+1 with sinks)]`` bool, True where the query may attend the key (with
        sinks the last column is the sink key, always True); None: plain causal (``is_causal``).
    """

    ctx_blocks: torch.Tensor
    num_keys: int
    mask: Optional[torch.Tensor]


@dataclass
class AttentionGroup:
    """Portable path: ``B_g`` sequences of a micro-batch attended in one padded SDPA call.

    q_index: ``[B_g, L_q]`` int64 into the flat tokens; padding points at row ``T`` (a zero row).
    ctx_blocks: ``[B_g, W]`` int64 KV-cache blocks of each sequence's context, ``W = ceil(L_k /
        block_size)`` (padding -> block 0, masked). Gathering whole blocks moves ``block_size``
        contiguous positions per index (about 3x faster on CPU than one slot per position).
    num_keys: ``L_k``, the group's longest context; keys past it are sliced off after the gather.
    mask: ``[B_g, 1, L_q, L_k]`` bool, True where the query may attend the key; None for one
        sequence starting at position 0 (plain causal attention).
    out_index: ``[T_g]`` int64 into the flattened ``[B_g * L_q]`` padded output.
    tok_index: ``[T_g]`` int64, the flat token of each ``out_index`` row; None when the group is
        the whole batch in order.
    starts, q_lens: ``[B_g]`` int64 host arrays, each sequence's first new position and new tokens;
    tables: ``[B_g, >= W]`` int64 host block-table rows. From these :meth:`view` builds the
        sliding-window / sink views, once per window per micro-batch (cached in ``views``).
    """

    q_index: torch.Tensor
    ctx_blocks: torch.Tensor
    num_keys: int
    mask: Optional[torch.Tensor]
    out_index: torch.Tensor
    tok_index: Optional[torch.Tensor]
    starts: Optional[np.ndarray] = None
    q_lens: Optional[np.ndarray] = None
    tables: Optional[np.ndarray] = None
    block_size: int = 16
    views: dict = field(default_factory=dict)

    def view(self, window: Optional[int], sinks: bool) -> KeyView:
        """The keys and mask for layers with sliding window ``window`` (None: full causal) and,
        with ``sinks``, one extra always-visible key column at the end for the sink (its key and
        value are filled in by the caller). Built on the first layer that asks, then cached.

        With a window, each sequence's gather starts at the block of the first key its first new
        token sees (``start - window + 1``), so keys before that block are never read; a key's
        position is then ``first_block * block_size + column``.
        """
        key = (window, sinks)
        v = self.views.get(key)
        if v is not None:
            return v
        if window is None and not sinks:
            v = KeyView(self.ctx_blocks, self.num_keys, self.mask)
        else:
            v = self._build_view(window, sinks)
        self.views[key] = v
        return v

    def _build_view(self, window: Optional[int], sinks: bool) -> KeyView:
        bs = self.block_size
        st, ql = self.starts, self.q_lens
        sl = st + ql                                                               # [Bg] context + new
        first_blk = np.zeros_like(st) if window is None else np.maximum(st - window + 1, 0) // bs
        key0 = first_blk * bs                                                      # [Bg] position of column 0
        Lk = int((sl - key0).max())
        W = -(-Lk // bs)
        nb = -(-sl // bs)                                                          # [Bg] blocks used
        cols = first_blk[:, None] + np.arange(W)[None, :]                          # [Bg, W]
        padded = np.zeros((len(st), int(cols.max()) + 1), dtype=np.int64)
        n = min(padded.shape[1], self.tables.shape[1])
        padded[:, :n] = self.tables[:, :n]
        ctx_blocks = np.where(cols < nb[:, None], np.take_along_axis(padded, cols, 1), 0)
        Lq = int(ql.max())
        j = np.arange(Lq)
        valid_q = j[None, :] < ql[:, None]
        qpos = np.where(valid_q, st[:, None] + j[None, :], st[:, None])            # pad rows: first query's
        kpos = key0[:, None] + np.arange(Lk)[None, :]                              # [Bg, Lk]
        mask = kpos[:, None, :] <= qpos[:, :, None]                                # [Bg, Lq, Lk]
        if window is not None:
            mask &= kpos[:, None, :] > qpos[:, :, None] - window
        if sinks:
            mask = np.concatenate([mask, np.ones((*mask.shape[:2], 1), dtype=bool)], axis=2)
        dev = self.q_index.device
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)
        return KeyView(to(ctx_blocks), Lk, to(mask[:, None]))


@dataclass
class AttentionMetadata:
    """Per-micro-batch indices shared by every attention layer of a stage.

    Portable path (CPU):
        slot_mapping: ``[T]`` int64, KV-cache slot each new token's K/V is written to.
        groups: the sequences split into padded attention calls (see :class:`AttentionGroup`).
    Triton path (CUDA), see ``triton_ops.paged_attention``:
        block_tables ``[B, W]`` int32, seq_lens ``[B]`` int32, query_start ``[B + 1]`` int32,
        tile_seq / tile_qstart ``[num_tiles]`` int32, block_m (rows per program); in a mixed batch
        (decodes and prompt chunks) the decodes' tiles apart, ``decode_tile_seq`` /
        ``decode_tile_qstart`` at ``decode_block_m`` rows (see :func:`triton_metadata_arrays`).
    Both paths:
        rope_long: ``[T]`` int64 0/1, set by the model runner's eager steps for models with LongRoPE
            (``rope_switch_len``): 1 for the tokens of sequences longer than
            ``original_max_position_embeddings`` (see ``RotaryEmbedding.rope_rows``); None otherwise
            (decode graphs: the model derives it from the positions).
    """

    slot_mapping: torch.Tensor
    groups: Optional[list["AttentionGroup"]] = None
    decode_only: bool = False
    block_tables: Optional[torch.Tensor] = None
    seq_lens: Optional[torch.Tensor] = None
    query_start: Optional[torch.Tensor] = None
    tile_seq: Optional[torch.Tensor] = None
    tile_qstart: Optional[torch.Tensor] = None
    block_m: int = 16
    decode_tile_seq: Optional[torch.Tensor] = None
    decode_tile_qstart: Optional[torch.Tensor] = None
    decode_block_m: int = 16
    rope_long: Optional[torch.Tensor] = None

    @property
    def triton(self) -> bool:
        return self.block_tables is not None


TABLE_WIDTH_ALIGN = 16
"""The Triton path's block tables are this many columns wide, or a multiple: Triton compiles a
kernel variant per class of an integer argument (1, a multiple of 16, other) and per pointer
alignment, so a table width that followed each batch's longest sequence compiled new attention
variants in the middle of a run (three on the H200 in the first seconds of a 1000 x 256/256 run on a
fresh machine: 1-2 s each, ``benchmarks/results/h200_fp8_issue38/s17/compiles.txt``)."""


def block_table_width(max_seq_len: int, block_size: int, align: int = 1) -> int:
    """Columns of a block table that covers ``max_seq_len`` tokens in blocks of ``block_size``,
    rounded up to a multiple of ``align`` (at least one column)."""
    w = max(1, -(-int(max_seq_len) // block_size))
    return -(-w // align) * align


def _padded_block_tables(block_tables, num_seqs: int, width: int, dtype) -> np.ndarray:
    """``[num_seqs, width]`` block tables, 0 past each sequence's blocks: ``block_tables`` as is when
    it is already such an array (the model runner's slot-table rows), else built from lists."""
    if isinstance(block_tables, np.ndarray) and block_tables.shape == (num_seqs, width):
        return block_tables.astype(dtype, copy=False)
    bt = np.zeros((num_seqs, width), dtype=dtype)
    for i, blocks in enumerate(block_tables):
        n = min(len(blocks), width)
        bt[i, :n] = blocks[:n]
    return bt


def build_attention_metadata(starts: list[int], q_lens: list[int], block_tables,
                             block_size: int, device: torch.device, group: int = 1) -> AttentionMetadata:
    """Build :class:`AttentionMetadata` for one micro-batch (host-side index math, then copies to
    ``device``). On CUDA the Triton layout is built (``group`` = query heads per KV head), without
    the mixed-batch split (the model runner builds that itself: :func:`triton_metadata_arrays`).
    ``block_tables``: one list of block ids per sequence, or a ``[B, ceil(max seq len / block_size)]``
    array."""
    if device.type == "cuda":
        return _build_triton_metadata(starts, q_lens, block_tables, block_size, device, group)
    st = np.asarray(starts, dtype=np.int64)
    ql = np.asarray(q_lens, dtype=np.int64)
    seq_lens = st + ql
    T = int(ql.sum())
    first_tok = np.cumsum(ql) - ql                                              # [B] first flat index
    nblk = int(-(-seq_lens.max() // block_size))
    bt = _padded_block_tables(block_tables, len(starts), nblk, np.int64)
    seq_of_tok = np.repeat(np.arange(len(starts)), ql)
    pos = np.arange(T) - first_tok[seq_of_tok] + st[seq_of_tok]
    slot_mapping = bt[seq_of_tok, pos // block_size] * block_size + pos % block_size
    groups = _attention_groups(q_lens, seq_lens.tolist())
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)
    built = []
    for members in groups:
        idx = np.asarray(members, dtype=np.int64)
        g_st, g_ql, g_sl, g_first = st[idx], ql[idx], seq_lens[idx], first_tok[idx]
        Lq, Lk = int(g_ql.max()), int(g_sl.max())
        kpos = np.arange(Lk)
        W = -(-Lk // block_size)
        nb = -(-g_sl // block_size)                                                # [Bg] blocks used
        ctx_blocks = np.where(np.arange(W)[None, :] < nb[:, None], bt[idx][:, :W], 0)  # [Bg, W]
        j = np.arange(Lq)
        valid_q = j[None, :] < g_ql[:, None]                                       # [Bg, Lq]
        q_index = np.where(valid_q, g_first[:, None] + j[None, :], T)
        out_index = (np.arange(len(members))[:, None] * Lq + j[None, :])[valid_q]     # [Tg]
        tok_index = q_index[valid_q]                                               # [Tg] flat tokens
        causal = len(members) == 1 and int(g_st[0]) == 0                           # plain causal prefill
        mask = None
        if not causal:
            qpos = np.where(valid_q, g_st[:, None] + j[None, :], 0)                # pad rows see key 0
            mask = to((kpos[None, None, :] <= qpos[:, :, None])[:, None])          # [Bg, 1, Lq, Lk]
        whole = len(groups) == 1 and members == list(range(len(starts)))
        built.append(AttentionGroup(q_index=to(q_index), ctx_blocks=to(ctx_blocks), num_keys=Lk, mask=mask,
                                    out_index=to(out_index), tok_index=None if whole else to(tok_index),
                                    starts=g_st, q_lens=g_ql, tables=bt[idx], block_size=block_size))
    return AttentionMetadata(slot_mapping=to(slot_mapping), groups=built, decode_only=bool((ql == 1).all()))


def _attention_groups(q_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Split a micro-batch into groups of sequences that share one padded attention call.

    Padding every sequence to the batch's longest query and longest context costs
    ``B x max(q_len) x max(seq_len)``: a batch of decodes next to one long prefill chunk (the mix the
    scheduler makes on purpose) would compute each decode as if it were that chunk, and short
    decodes next to one at context 6000 would each gather 6000 positions. So decodes and prefill
    chunks are grouped apart, each costliest first, while the padded cost (query x key pairs)
    stays within 1.5 times the real one plus 2048 pairs (many equal or small sequences still run
    as one call; a call's overhead, tens of microseconds, is worth about that many pairs)."""
    groups: list[list[int]] = []
    for members in ([i for i, q in enumerate(q_lens) if q == 1], [i for i, q in enumerate(q_lens) if q > 1]):
        cur: list[int] = []
        for i in sorted(members, key=lambda i: -q_lens[i] * seq_lens[i]):
            trial = cur + [i]
            padded = len(trial) * max(q_lens[k] for k in trial) * max(seq_lens[k] for k in trial)
            if cur and padded > 1.5 * sum(q_lens[k] * seq_lens[k] for k in trial) + 2048:
                groups.append(sorted(cur))
                trial = [i]
            cur = trial
        if cur:
            groups.append(sorted(cur))
    return groups


# Mixed micro-batches (decodes next to prompt chunks) attend in two launches: decode rows with the
# decode tile shape, prompt chunks with the prefill one, once the decodes give a launch of their own
# at least MIN_SPLIT_DECODE_PROGRAMS programs (decodes x KV heads; fewer ran slower split on the H200:
# 32 decodes x 8 heads 197 vs 190 us per layer, 500 x 8 333 vs 387, 960 x 8 462 vs 568, 1000 x 8 next
# to one 64-token chunk 339 vs 436; benchmarks/results/h200_kernel_mixed_attention.txt).
# ZPP_SPLIT_MIXED_ATTENTION=0: one launch with the prefill shape for all; =all: split whenever
# decodes and chunks mix (A/B runs and tests with small models).
_SPLIT_MODE = envs.ZPP_SPLIT_MIXED_ATTENTION
_SPLIT_MIXED = _SPLIT_MODE != "0"
MIN_SPLIT_DECODE_PROGRAMS = 0 if _SPLIT_MODE == "all" else 512

_TRITON_FIELDS = ("slot_mapping", "block_tables", "seq_lens", "query_start", "tile_seq", "tile_qstart",
                  "decode_tile_seq", "decode_tile_qstart")


@dataclass
class TritonMetadataHost:
    """The Triton path's :class:`AttentionMetadata` as host (numpy) arrays, before the copy to the
    GPU: ``arrays`` maps the field names of ``_TRITON_FIELDS`` that are present to int64
    (``slot_mapping``) / int32 (the rest) arrays; :meth:`to_device` assembles the metadata from the
    uploaded tensors (same order as :meth:`array_list`)."""

    arrays: dict[str, np.ndarray]
    block_m: int
    decode_block_m: int
    decode_only: bool

    def array_list(self) -> list[np.ndarray]:
        return [self.arrays[k] for k in _TRITON_FIELDS if k in self.arrays]

    def to_device(self, tensors: list[torch.Tensor]) -> AttentionMetadata:
        named = dict(zip([k for k in _TRITON_FIELDS if k in self.arrays], tensors))
        return AttentionMetadata(block_m=self.block_m, decode_block_m=self.decode_block_m,
                                 decode_only=self.decode_only, **named)


def triton_metadata_arrays(starts, q_lens, block_tables, block_size, group: int, *, num_kv_heads: int,
                           split_mixed: Optional[bool] = None) -> TritonMetadataHost:
    """Host-side index math of the Triton path (see :class:`AttentionMetadata`): slot of every new
    token, padded block tables, sequence lengths, query offsets and the query tiles. With
    ``split_mixed`` (default: ``ZPP_SPLIT_MIXED_ATTENTION``, on) a batch holding both decodes
    (``q_len == 1``) and longer chunks gets two tile lists: ``decode_tile_*`` for the decodes at the
    decode tile shape (``pick_block_m(1, group)`` rows), ``tile_*`` for the chunks at the prefill
    shape, so a decode does not occupy a 64-row prefill tile with one valid token; only when the
    decodes times ``num_kv_heads`` reach ``MIN_SPLIT_DECODE_PROGRAMS`` (a smaller launch of its own
    leaves the GPU half idle)."""
    from zpp.models.layers.triton_ops import pick_block_m
    if split_mixed is None:
        split_mixed = _SPLIT_MIXED
    B = len(starts)
    st = np.asarray(starts, dtype=np.int64)
    ql = np.asarray(q_lens, dtype=np.int64)
    seq_lens = st + ql
    T = int(ql.sum())
    qstart = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(ql, out=qstart[1:])
    W = block_table_width(seq_lens.max(), block_size, TABLE_WIDTH_ALIGN)
    bt = _padded_block_tables(block_tables, B, W, np.int32)
    seq_of_tok = np.repeat(np.arange(B), ql)
    pos = np.arange(T) - qstart[seq_of_tok] + st[seq_of_tok]
    slots = bt[seq_of_tok, pos // block_size].astype(np.int64) * block_size + pos % block_size
    is_dec = ql == 1
    decode_block_m = pick_block_m(1, group)
    arrays = {"slot_mapping": slots, "block_tables": bt, "seq_lens": seq_lens.astype(np.int32),
              "query_start": qstart.astype(np.int32)}
    tiled = np.arange(B)
    num_dec = int(is_dec.sum())
    if split_mixed and 0 < num_dec < B and num_dec * num_kv_heads >= MIN_SPLIT_DECODE_PROGRAMS:
        dec = np.flatnonzero(is_dec)
        arrays["decode_tile_seq"] = dec.astype(np.int32)
        arrays["decode_tile_qstart"] = np.zeros(len(dec), dtype=np.int32)
        tiled = np.flatnonzero(~is_dec)
    block_m = pick_block_m(int(ql[tiled].max()), group)
    block_q = max(1, block_m // group)
    n_tiles = -(-ql[tiled] // block_q)
    tile_seq = np.repeat(tiled, n_tiles)
    first = np.cumsum(n_tiles) - n_tiles
    tile_qstart = (np.arange(int(n_tiles.sum())) - np.repeat(first, n_tiles)) * block_q
    arrays["tile_seq"] = tile_seq.astype(np.int32)
    arrays["tile_qstart"] = tile_qstart.astype(np.int32)
    return TritonMetadataHost(arrays, block_m, decode_block_m, bool(is_dec.all()))


def _build_triton_metadata(starts, q_lens, block_tables, block_size, device, group) -> AttentionMetadata:
    host = triton_metadata_arrays(starts, q_lens, block_tables, block_size, group, num_kv_heads=0, split_mixed=False)
    return host.to_device([torch.from_numpy(a).to(device, non_blocking=True) for a in host.array_list()])


# Shared K/V rows (MLA) on CUDA with more query heads than this per KV row: the kernel runs once per
# chunk of this many heads (each launch a tile of LATENT_HEAD_CHUNK heads x the metadata's tokens per
# tile), so a 512-dim fp32 accumulator stays at <= 64 rows (128 heads in one tile would need 256 KiB).
LATENT_HEAD_CHUNK = 16


class Attention(nn.Module):
    """Multi-head / grouped-query attention reading and writing one layer's paged KV cache.

    ``forward(q [T, Hq*D], k [T, Hk*D], v [T, Hk*D], kv_cache, meta)`` -> ``[T, Hq*D]``.
    ``kv_cache`` is ``[2, num_blocks, block_size, Hk, D]`` or None (profiling pass: no cache, the
    batch attends only to itself).

    Shared K/V rows (``v_head_dim < head_dim``; multi-head latent attention in its absorbed form,
    DeepSeek-V2, arXiv:2405.04434): the cache is ONE tensor ``[num_blocks, block_size, Hk, D]``,
    each row a key whose first ``v_head_dim`` dims are also the value; ``forward(q, k, None, ...)``
    writes ``k`` only and returns ``[T, Hq*v_head_dim]``.

    ``sliding_window``: this layer's window ``W`` (None: full causal attention); the query at
    position ``i`` sees keys ``i - W < j <= i``. ``forward(..., sinks=[Hq])``: attention-sink logits
    (gpt-oss), one per query head of this rank.

    FP8 KV cache (``--kv-cache-dtype fp8``: ``kv_cache`` float8_e4m3fn): K is stored as ``K / k_scale``
    and V as ``V / v_scale`` (saturated to +-448), per-layer floats from the checkpoint's
    ``self_attn.k_scale`` / ``v_scale`` (``kv_scales_loaded``) or 1.0 (vLLM's default), and read back
    upcast and scaled (vLLM's ``fp8_e4m3`` cache). Shared rows (MLA) use ``k_scale`` for both.
    """

    k_scale = 1.0
    v_scale = 1.0
    kv_scales_loaded = False

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: Optional[float] = None,
                 v_head_dim: Optional[int] = None, sliding_window: Optional[int] = None):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.v_head_dim = v_head_dim or head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor],
                kv_cache: Optional[torch.Tensor], meta: AttentionMetadata,
                positions: Optional[torch.Tensor] = None, rotary=None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """With ``rotary`` (a RotaryEmbedding) and ``positions [T]``, RoPE is applied to q and k
        first (fused with the cache write on CUDA). ``v`` None: values are the first ``v_head_dim``
        dims of the keys (one cache tensor, see the class docstring; no ``rotary``). ``sinks``:
        ``[Hq]`` sink logits or None."""
        T = q.shape[0]
        H, Hk, D, Dv = self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim
        window = self.sliding_window
        q = q.view(T, H, D)
        k = k.view(T, Hk, D)
        shared = v is None
        if not shared:
            v = v.view(T, Hk, D)
        fp8_kv = kv_cache is not None and kv_cache.dtype == torch.float8_e4m3fn
        ks, vs = (self.k_scale, self.k_scale if shared else self.v_scale) if fp8_kv else (1.0, 1.0)
        if meta.triton and kv_cache is not None:
            from zpp.models.layers import triton_ops
            if shared:
                k_cache = v_cache = kv_cache
                _write_cache(k_cache, meta.slot_mapping, k, ks)
            else:
                k_cache, v_cache = kv_cache[0], kv_cache[1]
                if rotary is not None:  # q stays a strided view of the qkv output: rotated in place there
                    triton_ops.rope_and_cache(q, k, v, positions, rotary.cos, rotary.sin, k_cache, v_cache,
                                              meta.slot_mapping, ks, vs)
                else:
                    _write_cache(k_cache, meta.slot_mapping, k, ks)
                    _write_cache(v_cache, meta.slot_mapping, v, vs)
            out = torch.empty((T, H, Dv), dtype=q.dtype, device=q.device)
            splits = triton_ops.decode_splits(meta.seq_lens.shape[0], Hk) if meta.decode_only else 1
            if shared and H > LATENT_HEAD_CHUNK and H % LATENT_HEAD_CHUNK == 0:
                self._shared_rows_by_head_chunks(q, kv_cache, out, meta, splits, ks)
                return out.view(T, H * Dv)
            if meta.decode_tile_seq is not None:  # a mixed batch: its decodes at the decode tile shape
                triton_ops.paged_attention(q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens,
                                           meta.query_start, meta.decode_tile_seq, meta.decode_tile_qstart,
                                           self.scale, meta.decode_block_m, 1, window=window, sinks=sinks,
                                           k_scale=ks, v_scale=vs)
            triton_ops.paged_attention(q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens,
                                       meta.query_start, meta.tile_seq, meta.tile_qstart, self.scale, meta.block_m,
                                       splits, window=window, sinks=sinks, k_scale=ks, v_scale=vs)
            return out.view(T, H * Dv)
        if rotary is not None:
            q, k = rotary(positions, q, k)
        if kv_cache is not None:
            if shared:
                k_cache = v_cache = kv_cache                                    # [N, bs, Hk, D]
            else:
                k_cache, v_cache = kv_cache[0], kv_cache[1]                     # [N, bs, Hk, D]
                _write_cache(v_cache, meta.slot_mapping, v, vs)
            _write_cache(k_cache, meta.slot_mapping, k, ks)
        else:  # profiling: a single sequence attending to itself
            k_cache = v_cache = None
        q_z = torch.cat([q, q.new_zeros(1, H, D)])
        if sinks is not None:
            # The sink as one more key, seen by every query: its logit must be sinks[h] for query head
            # h whatever the query, so q gets one more dimension holding sinks[h] / scale and that key
            # is the unit vector of it (every real key has 0 there); its value is 0. Exact up to one
            # rounding of sinks[h] / scale * scale.
            q_z = torch.cat([q_z, (sinks.to(q.dtype) / self.scale).view(1, H, 1).expand(T + 1, H, 1)], dim=2)
        out = None
        for g in meta.groups:
            view = g.view(window, sinks is not None)
            q_pad = q_z[g.q_index]                                              # [Bg, Lq, H, D(+1)]
            if k_cache is None:
                k_ctx, v_ctx = k.unsqueeze(0), (k if shared else v).unsqueeze(0)  # one sequence from 0
            else:
                Bg = view.ctx_blocks.shape[0]
                blocks = view.ctx_blocks.view(-1)
                k_ctx = _gather(k_cache, blocks, q.dtype, ks).view(Bg, -1, Hk, D)[:, :view.num_keys]  # [Bg, Lk, Hk, D]
                v_ctx = k_ctx if shared else _gather(v_cache, blocks, q.dtype, vs).view(Bg, -1, Hk, D)[:, :view.num_keys]
            if shared:
                v_ctx = v_ctx[..., :Dv]                                         # [Bg, Lk, Hk, Dv]
            if sinks is not None:
                Bg, Lk = k_ctx.shape[0], k_ctx.shape[1]
                k_s = k_ctx.new_zeros(Bg, Lk + 1, Hk, D + 1)
                k_s[:, :Lk, :, :D] = k_ctx
                k_s[:, Lk, :, D] = 1.0
                v_ctx = torch.cat([v_ctx, v_ctx.new_zeros(Bg, 1, Hk, v_ctx.shape[-1])], dim=1)  # [Bg, Lk+1, Hk, Dv]
                k_ctx = k_s                                                        # [Bg, Lk+1, Hk, D+1]
            o = F.scaled_dot_product_attention(
                q_pad.transpose(1, 2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),
                attn_mask=view.mask, is_causal=view.mask is None, scale=self.scale,
                enable_gqa=(H != Hk))                                           # [Bg, H, Lq, Dv]
            o = o.transpose(1, 2).reshape(-1, H * Dv)[g.out_index]              # [Tg, H*Dv]
            if g.tok_index is None:
                return o
            if out is None:
                out = q.new_empty(T, H * Dv)
            out[g.tok_index] = o
        return out

    def _shared_rows_by_head_chunks(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                                    meta: AttentionMetadata, splits: int, kv_scale: float = 1.0) -> None:
        """Triton path, shared rows, ``H > LATENT_HEAD_CHUNK`` heads: one kernel launch per chunk of
        heads (``q[:, h0:h1]`` / ``out[:, h0:h1]`` views) with the metadata's query tiles; a tile's
        rows are its tokens (``block_m // H`` of them) times the chunk's heads."""
        from zpp.models.layers import triton_ops
        H, c = self.num_heads, LATENT_HEAD_CHUNK
        launches = [(meta.decode_tile_seq, meta.decode_tile_qstart, meta.decode_block_m, 1)] \
            if meta.decode_tile_seq is not None else []
        launches.append((meta.tile_seq, meta.tile_qstart, meta.block_m, splits))
        for tile_seq, tile_qstart, block_m, n_splits in launches:
            block_m = max(1, block_m // H) * c
            for h0 in range(0, H, c):
                triton_ops.paged_attention(q[:, h0:h0 + c], kv_cache, kv_cache, out[:, h0:h0 + c], meta.block_tables,
                                           meta.seq_lens, meta.query_start, tile_seq, tile_qstart, self.scale, block_m,
                                           n_splits, k_scale=kv_scale, v_scale=kv_scale)


def _write_cache(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """Write ``x [T, Hk, D]`` into ``cache [num_blocks, block_size, Hk, D]`` at ``slots [T]``; a
    float8_e4m3fn cache receives ``x / scale`` saturated to +-448, copied as bytes (``index_copy_``
    has no float8 kernel)."""
    Hk, D = cache.shape[-2:]
    if cache.dtype != torch.float8_e4m3fn:
        cache.view(-1, Hk, D).index_copy_(0, slots, x)
        return
    q = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    cache.view(torch.uint8).view(-1, Hk, D).index_copy_(0, slots, q.view(torch.uint8))


def _gather(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``cache[blocks]``; a float8_e4m3fn cache (the portable path of an FP8 cache, tests) gathered as
    bytes, upcast to ``dtype`` and multiplied by ``scale``."""
    if cache.dtype != torch.float8_e4m3fn:
        return cache.index_select(0, blocks)
    return cache.view(torch.uint8).index_select(0, blocks).view(cache.dtype).to(dtype) * scale
