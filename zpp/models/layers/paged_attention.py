"""Paged attention for the CUDA path (Triton): one kernel for prefill, chunked prefill and decode
tiles over the paged KV cache, with split-KV (flash-decoding) for small decode batches.

References: FlashAttention-2 (Dao 2023) for the online-softmax tiling, PagedAttention (Kwon et al.
2023) for the block-table indirection, vLLM's Triton "unified attention" for handling prefill,
chunked prefill and decode in one kernel (every token's K/V is written to the cache first, then
each query tile attends over the cache up to its causal limit), flash-decoding (Dao et al. 2023)
for the split contexts (merged by a second kernel: a merge by each tile's last split program,
through an atomic counter, measured slower on an H100 -- batch 1, context 256, 16 splits: 8.91 against
5.84 us per layer, ``scripts/fp8_gemv_card_sweep.py``). Re-exported by :mod:`zpp.models.layers.triton_ops`.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from zpp.models.layers.pdl import pdl, pdl_enter


# --- attention --------------------------------------------------------------------------------
@triton.jit
def _kv_for_dot(x, dtype: tl.constexpr, FP8_KV: tl.constexpr):
    # A K / V tile as read from the cache, made the products' operand (see _paged_attention_kernel).
    if FP8_KV:
        return x.to(dtype)
    else:
        return x


@triton.jit
def _paged_attention_kernel(
    Q, K_cache, V_cache, Out, block_tables, seq_lens, query_start, tile_seq, tile_qstart,
    Part_O, Part_ML, Sinks, scale_log2e, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_BLOCK: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HQ: tl.constexpr, SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr,
    D_EXTRA: tl.constexpr = 0, BLOCK_DE: tl.constexpr = 16, V_FROM_K: tl.constexpr = False,
    v_scale=1.0, FP8_KV: tl.constexpr = False, FP8_F16: tl.constexpr = True, USE_PDL: tl.constexpr = False,
):
    # D_EXTRA > 0: queries and keys have D + D_EXTRA dims, values D (their scores add the extra
    # dims' dot product). V_FROM_K: the value of a key row is its first D dims (MLA's latent cache).
    # FP8_KV: the caches hold float8_e4m3fn K / V (--kv-cache-dtype fp8), upcast to the query's dtype as
    # they are read; K's scale is folded into scale_log2e by the caller, V's multiplies the output.
    # FP8_F16 (with FP8_KV): the products run in fp16, q cast down once: every e4m3 value is exact in
    # fp16 and e4m3 -> fp16 is one cvt per two values, where e4m3 -> bf16 goes through fp32 (the
    # conversions, not the bytes, bounded the FP8 cache's speed). False: upcast to q's dtype.
    pdl_enter(USE_PDL)
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq + tile)
    q0 = tl.load(tile_qstart + tile)
    qs = tl.load(query_start + seq)
    q_len = tl.load(query_start + seq + 1) - qs
    seq_len = tl.load(seq_lens + seq)
    ctx = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    t = r // G
    head = kvh * G + (r % G)
    tok = q0 + t
    row_ok = (t < BLOCK_Q) & (tok < q_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + (qs + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP8_KV and FP8_F16:
        q = q.to(tl.float16)
    if D_EXTRA > 0:
        de = tl.arange(0, BLOCK_DE)
        de_ok = de < D_EXTRA
        q_ext = tl.load(Q + (qs + tok)[:, None] * stride_qt + head[:, None] * stride_qh + D + de[None, :],
                        mask=row_ok[:, None] & de_ok[None, :], other=0.0)
        if FP8_KV and FP8_F16:
            q_ext = q_ext.to(tl.float16)
    qpos = ctx + tok

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        # The sink joins the softmax as one more logit with a zero value: start the running max at
        # it with a running sum of exp2(0) = 1. With split-KV only split 0 counts it; the merge of
        # the splits then carries it exactly like any key.
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634                  # [BLOCK_M], log2 units
        first = split == 0
        m_i = tl.where(first, sink, m_i)
        l_i = tl.where(first, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum(seq_len, ctx + q0 + BLOCK_Q)
    lo = 0
    if SLIDING:  # keys before the tile's first query's window are invisible to every row: not read
        lo = tl.maximum(ctx + q0 - window + 1, 0)
    if NUM_SPLITS > 1:  # flash-decoding: this program covers one slice of the (visible) context
        chunk = tl.cdiv(tl.cdiv(end - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * chunk
        end = tl.minimum(end, lo + chunk)
    for start in range(lo, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < end
        blk = tl.load(block_tables + seq * stride_bt + n // KV_BLOCK, mask=n_ok, other=0).to(tl.int64)
        off = blk * stride_kb + (n % KV_BLOCK) * stride_ks + kvh * stride_kh
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = _kv_for_dot(tl.load(K_cache + off[:, None] + d[None, :], mask=kv_mask, other=0.0), q.dtype, FP8_KV)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2e                       # [BLOCK_M, BLOCK_N], log2 units
        if D_EXTRA > 0:
            k_ext = _kv_for_dot(tl.load(K_cache + off[:, None] + D + de[None, :], mask=n_ok[:, None] & de_ok[None, :],
                                        other=0.0), q.dtype, FP8_KV)
            s += tl.dot(q_ext, tl.trans(k_ext), input_precision=PREC) * scale_log2e
        visible = (n[None, :] <= qpos[:, None]) & n_ok[None, :]
        if SLIDING:
            visible = visible & (n[None, :] > qpos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_FROM_K:
            v = k
        else:
            v = _kv_for_dot(tl.load(V_cache + off[:, None] + d[None, :], mask=kv_mask, other=0.0), q.dtype, FP8_KV)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if FP8_KV:
        out = out * v_scale
    if NUM_SPLITS == 1:
        tl.store(Out + (qs + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        row = ((qs + tok) * HQ + head) * NUM_SPLITS + split                  # [BLOCK_M]
        tl.store(Part_O + row[:, None] * BLOCK_D + d[None, :], out, mask=row_ok[:, None])
        tl.store(Part_ML + row * 2, m_i, mask=row_ok)
        tl.store(Part_ML + row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(Part_O, Part_ML, Out, stride_ot, stride_oh, HQ: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    row = (t * HQ + h) * NUM_SPLITS + sp
    m = tl.load(Part_ML + row * 2)
    l = tl.load(Part_ML + row * 2 + 1)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max) * l                                          # [S]
    o = tl.load(Part_O + row[:, None] * BLOCK_D + d[None, :])               # [S, BLOCK_D]
    out = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(Out + t * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < D)


def attention_tiles(q_lens: list[int], block_q: int) -> tuple[list[int], list[int]]:
    """Map query tiles to (sequence, first local query index) for :func:`paged_attention`."""
    seqs, starts = [], []
    for i, n in enumerate(q_lens):
        for s in range(0, n, block_q):
            seqs.append(i)
            starts.append(s)
    return seqs, starts


def pick_block_m(max_q_len: int, group: int) -> int:
    """Rows per program (query tokens x heads of one KV group): 16 for decode-like batches, 64 for
    prefill; at least the group size."""
    g = triton.next_power_of_2(group)
    return max(16, g) if max_q_len * group <= 16 else max(64, g)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                    tile_seq: torch.Tensor, tile_qstart: torch.Tensor, scale: float, block_m: int,
                    num_splits: int = 1, block_n: Optional[int] = None, num_warps: Optional[int] = None,
                    num_stages: Optional[int] = None, window: Optional[int] = None,
                    sinks: Optional[torch.Tensor] = None, k_scale: float = 1.0, v_scale: float = 1.0,
                    fp8_f16: bool = True) -> torch.Tensor:
    """Causal attention of new query tokens over the paged KV cache (their own K/V already written).

    Args:
        q: ``[T, Hq, D]`` queries (rotary applied). out: ``[T, Hq, D]`` result buffer.
        k_cache, v_cache: ``[num_blocks, block_size, Hk, D]``.
            Shared rows (multi-head latent attention): ``out`` ``[T, Hq, Dv]`` with ``Dv < D`` means
            the value of each key row is its first ``Dv`` dims; ``v_cache`` must then be ``k_cache``
            (ValueError otherwise).
        block_tables: ``[B, max_blocks]`` int32. seq_lens: ``[B]`` int32 (context + new tokens).
        query_start: ``[B + 1]`` int32 offsets of each sequence's new tokens in ``q``.
        tile_seq, tile_qstart: ``[num_tiles]`` int32 from :func:`attention_tiles` with
            ``block_q = block_m // (Hq // Hk)``.
        num_splits: decode batches only (``block_m == 16``): split each context into this many
            slices computed in parallel and merged (flash-decoding, Dao et al. 2023).
        block_n, num_stages, num_warps: launch tuning; by default 64 keys per loop step, 2 stages
            and 4 warps for prefill tiles, 32, 2 and 4 for split decode; an unsplit decode batch of
            at least 2048 programs (sequences x KV heads) 32 keys, 3 stages and ONE warp, a smaller
            one 64, 3 and 2. One warp holds the whole 16-row tile, so the row max and sum and the
            scores' way from the QK product into the PV product need no exchange between warps
            (with 4 warps, each step waited on shared memory and barriers). On the H200 (Llama-3-8B
            heads, ``python scripts/decode_attn_probe.py``): an FP8 cache at 1024 sequences x 384
            keys 304 us against 387 with 64 keys and 4 warps (2.6 vs 2.1 TB/s; a bf16 cache's 4.0
            TB/s is already the memory's pace, 393 vs 399 us), 2048 x 192 324 vs 430 us, 64 x 1024
            (2 warps) 65 vs 90 us. FP8 tensor-core products (q quantized per row, probabilities x
            256 in e4m3, or each split into two e4m3 terms for bf16's precision) were no faster.
        window: sliding window ``W`` (None: full causal): the query at position ``i`` sees keys
            ``i - W < j <= i`` (HF's ``sliding_window_overlay``); each tile's key loop starts at its
            first query's first visible key, so blocks wholly outside the window are never read.
        sinks: ``[Hq]`` attention-sink logits (gpt-oss), any float dtype, or None.
        k_scale, v_scale: an FP8 cache (float8_e4m3fn ``k_cache`` / ``v_cache``) holds ``K / k_scale`` and
            ``V / v_scale``: K's scale multiplies the logits (not the sinks), V's the output (the cache
            values are converted to fp16, and a 16-bit ``q`` with them, for the products; an fp32 ``q``,
            or ``fp8_f16=False`` (kept for A/B runs), upcasts them to ``q``'s dtype instead).
    """
    T, Hq, Dq = q.shape
    _, kv_block, Hk, _ = k_cache.shape
    D = out.shape[2]  # the value dim: Dq, or its prefix for shared K/V rows
    d_extra = Dq - D
    if d_extra and v_cache is not k_cache:
        raise ValueError(f"paged_attention: a value dim {D} below the key dim {Dq} needs v_cache to be k_cache")
    G = Hq // Hk
    block_q = max(1, block_m // G)
    BLOCK_D = triton.next_power_of_2(D)
    if d_extra and BLOCK_D >= 256:  # MLA's 512-dim latent rows: smaller key tiles, so K fits in shared memory
        block_n = block_n or 32
        num_stages = num_stages or 1
        num_warps = num_warps or 8
    splits = num_splits if block_m <= 16 else 1
    if splits > 1:
        part_o = torch.empty((T * Hq * splits, BLOCK_D), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((T * Hq * splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    f16 = fp8 and fp8_f16 and q.dtype != torch.float32
    if block_m <= 16 and splits == 1:  # a decode batch of its own, one program per sequence and KV head
        wide = tile_seq.shape[0] * Hk >= 2048
        block_n = block_n or (32 if wide else 64)
        num_warps = num_warps or (1 if wide else 2)
        num_stages = num_stages or 3
    num_warps = num_warps or 4
    if block_n is None:
        block_n = 64 if block_m == 64 else 32
    if num_stages is None:
        num_stages = 2
    grid = (tile_seq.shape[0], Hk, splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start, tile_seq, tile_qstart,
        part_o, part_ml, sinks if sinks is not None else out, scale * k_scale * 1.4426950408889634, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        G=G, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        KV_BLOCK=kv_block, D=D, BLOCK_D=BLOCK_D, PREC="ieee" if q.dtype == torch.float32 else "tf32",
        NUM_SPLITS=splits, HQ=Hq, SLIDING=window is not None, HAS_SINKS=sinks is not None,
        D_EXTRA=d_extra, BLOCK_DE=max(16, triton.next_power_of_2(max(d_extra, 1))),
        V_FROM_K=bool(d_extra), v_scale=v_scale, FP8_KV=fp8, FP8_F16=f16,
        num_warps=num_warps, num_stages=num_stages, **pdl(q))
    if splits > 1:
        _merge_splits_kernel[(T, Hq)](part_o, part_ml, out, out.stride(0), out.stride(1), HQ=Hq,
                                      NUM_SPLITS=splits, D=D, BLOCK_D=BLOCK_D, num_warps=4,
                                      **pdl(q))
    return out


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Context slices per (sequence, KV head) for decode batches (flash-decoding): enough programs
    to cover the GPU twice; 1 once the batch alone fills it. A power of two in [1, 16]."""
    want = (2 * num_sms) // max(1, num_seqs * num_kv_heads)
    return 1 if want < 2 else min(16, 1 << (want.bit_length() - 1))
