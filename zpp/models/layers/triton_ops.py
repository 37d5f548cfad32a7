"""Triton kernels for the CUDA path: paged attention, fused add + RMSNorm, rotary + KV-cache write,
SiLU-and-mul, and a matrix-vector product for small decode batches.

The CPU path never imports this module (Triton needs a GPU, or ``TRITON_INTERPRET=1`` for tests).

References: FlashAttention-2 (Dao 2023) for the online-softmax tiling, PagedAttention (Kwon et al.
2023) for the block-table indirection, vLLM's Triton "unified attention" for handling prefill,
chunked prefill and decode in one kernel (every token's K/V is written to the cache first, then
each query tile attends over the cache up to its causal limit).
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


# --- fused add + RMSNorm ----------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(X, R, W, Y, R_out, stride_x, stride_r, stride_y, N, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, W_F32: tl.constexpr, OFFSET: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x_round = x.to(R_out.dtype.element_ty)
        tl.store(R_out + row * stride_r + cols, x_round, mask=mask)
        x = x_round.to(tl.float32)
    var = tl.sum(x * x, 0) / N
    if W_F32:  # Gemma / gpt-oss: the weight (1 + weight for Gemma) multiplies in float32, cast last
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if OFFSET:
            w = w + 1.0
        tl.store(Y + row * stride_y + cols, (x * tl.math.rsqrt(var + eps) * w).to(Y.dtype.element_ty), mask=mask)
    else:  # LLaMA: cast, then multiply by the weight
        y = (x * tl.math.rsqrt(var + eps)).to(Y.dtype.element_ty)
        w = tl.load(W + cols, mask=mask, other=0.0)
        tl.store(Y + row * stride_y + cols, (w * y).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
             weight_in_float32: bool = False, offset: bool = False):
    """``[T, H]`` RMSNorm; with ``residual``: returns ``(norm(x + residual), x + residual)`` (the sum
    rounded to ``residual``'s dtype first). LLaMA's order by default (normalise, cast, multiply by
    the weight); ``weight_in_float32``: multiply by the weight in float32 and cast last (HF
    ``GptOssRMSNorm``), with ``offset`` by ``1 + weight`` (HF ``Gemma3RMSNorm``)."""
    T, N = x.shape
    y = torch.empty_like(x)
    BLOCK = triton.next_power_of_2(N)
    warps = 4 if BLOCK <= 2048 else 8
    flags = dict(W_F32=weight_in_float32 or offset, OFFSET=offset, **pdl(x))
    if residual is None:
        _rms_norm_kernel[(T,)](x, x, weight, y, x, x.stride(0), 0, y.stride(0), N, eps,
                               HAS_RES=False, BLOCK=BLOCK, num_warps=warps, **flags)
        return y
    r_out = torch.empty_like(residual)
    _rms_norm_kernel[(T,)](x, residual, weight, y, r_out, x.stride(0), residual.stride(0), y.stride(0), N, eps,
                           HAS_RES=True, BLOCK=BLOCK, num_warps=warps, **flags)
    return y, r_out


# --- rotary + KV-cache write --------------------------------------------------------------------
@triton.jit
def _rope_cache_kernel(Q, K, V, positions, cos_ptr, sin_ptr, k_cache, v_cache, slots,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_cs, stride_kcs, stride_kch,
                       HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                       k_inv=1.0, v_inv=1.0, FP8_KV: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    # One program per token. Dims [0, 2 * HALF) of each head are rotated (rotate-half pairs i and
    # i + HALF), dims [2 * HALF, D) pass through (partial rotary); HALF and D need not be powers of 2.
    # FP8_KV: K and V are stored as float8_e4m3fn, K * k_inv and V * v_inv saturated to +-448.
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    pos = tl.load(positions + t).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    i = tl.arange(0, BLOCK_R)
    r_ok = i < HALF
    cos = tl.load(cos_ptr + pos * stride_cs + i, mask=r_ok, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cs + i, mask=r_ok, other=0.0)
    h = tl.arange(0, BLOCK_H)
    # q: rotate in place (its pass-through dims stay as they are)
    qm = (h < HQ)[:, None] & r_ok[None, :]
    qp = Q + t * stride_qt + h[:, None] * stride_qh + i[None, :]
    q1 = tl.load(qp, mask=qm, other=0.0).to(tl.float32)
    q2 = tl.load(qp + HALF, mask=qm, other=0.0).to(tl.float32)
    tl.store(qp, (q1 * cos - q2 * sin).to(Q.dtype.element_ty), mask=qm)
    tl.store(qp + HALF, (q2 * cos + q1 * sin).to(Q.dtype.element_ty), mask=qm)
    # k: rotate into the cache slot
    km = (h < HK)[:, None] & r_ok[None, :]
    kp = K + t * stride_kt + h[:, None] * stride_kh + i[None, :]
    k1 = tl.load(kp, mask=km, other=0.0).to(tl.float32)
    k2 = tl.load(kp + HALF, mask=km, other=0.0).to(tl.float32)
    cp = k_cache + slot * stride_kcs + h[:, None] * stride_kch + i[None, :]
    kr1 = k1 * cos - k2 * sin
    kr2 = k2 * cos + k1 * sin
    if FP8_KV:
        kr1 = tl.clamp(kr1 * k_inv, -448.0, 448.0)
        kr2 = tl.clamp(kr2 * k_inv, -448.0, 448.0)
    tl.store(cp, kr1.to(k_cache.dtype.element_ty), mask=km)
    tl.store(cp + HALF, kr2.to(k_cache.dtype.element_ty), mask=km)
    # k's pass-through dims and all of v: into the cache slot as they are
    d = tl.arange(0, BLOCK_D)
    hk = (h < HK)[:, None]
    if 2 * HALF < D:
        pm = hk & ((d >= 2 * HALF) & (d < D))[None, :]
        kx = tl.load(K + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=pm, other=0.0)
        if FP8_KV:
            kx = tl.clamp(kx.to(tl.float32) * k_inv, -448.0, 448.0)
        tl.store(k_cache + slot * stride_kcs + h[:, None] * stride_kch + d[None, :],
                 kx.to(k_cache.dtype.element_ty), mask=pm)
    vm = hk & (d < D)[None, :]
    vx = tl.load(V + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=vm, other=0.0)
    if FP8_KV:
        vx = tl.clamp(vx.to(tl.float32) * v_inv, -448.0, 448.0)
    tl.store(v_cache + slot * stride_kcs + h[:, None] * stride_kch + d[None, :], vx.to(v_cache.dtype.element_ty),
             mask=vm)


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Rotate ``q [T, Hq, D]`` in place (rotate-half RoPE) and write rotated ``k`` and ``v``
    (``[T, Hk, D]``) into the caches (``[num_blocks, block_size, Hk, D]``) at ``slot_mapping [T]``.
    ``cos``/``sin``: ``[rows, R]`` float32 tables read at row ``positions[t]`` (a position, or a
    LongRoPE row, see ``RotaryEmbedding.rope_rows``); the first ``R <= D`` dims of each head are
    rotated, the rest pass through (partial rotary, e.g. Phi-4-mini's ``R = 0.75 D``); ``R / 2`` and
    ``D`` need not be powers of two (Phi-3-mini's ``D = 96``). A float8_e4m3fn cache receives
    ``k / k_scale`` and ``v / v_scale``, saturated to +-448.

    Raises:
        ValueError: ``R`` is odd or larger than ``D``.
    """
    T, HQ, D = q.shape
    HK = k.shape[1]
    R = cos.shape[1]
    if R > D or R % 2:
        raise ValueError(f"rotary width {R} must be even and at most the head size {D}")
    kc = k_cache.view(-1, HK, D)
    vc = v_cache.view(-1, HK, D)
    _rope_cache_kernel[(T,)](q, k, v, positions, cos, sin, kc, vc, slot_mapping,
                             q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                             cos.stride(0), kc.stride(0), kc.stride(1),
                             HQ=HQ, HK=HK, HALF=R // 2, D=D, BLOCK_R=triton.next_power_of_2(R // 2),
                             BLOCK_D=triton.next_power_of_2(D), BLOCK_H=triton.next_power_of_2(HQ),
                             k_inv=1.0 / k_scale, v_inv=1.0 / v_scale, FP8_KV=k_cache.dtype == torch.float8_e4m3fn,
                             num_warps=4, **pdl(q))


# --- SiLU and mul -------------------------------------------------------------------------------
@triton.jit
def _silu_mul_kernel(X, Y, stride_x, stride_y, N, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (g / (1.0 + tl.exp(-g)) * u).to(Y.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [T, 2I]`` (gate | up) -> ``silu(gate) * up`` ``[T, I]``."""
    T, N2 = x.shape
    N = N2 // 2
    y = torch.empty((T, N), dtype=x.dtype, device=x.device)
    BLOCK = 1024
    _silu_mul_kernel[(T, triton.cdiv(N, BLOCK))](x, y, x.stride(0), y.stride(0), N, BLOCK=BLOCK, num_warps=4,
                                                **pdl(x))
    return y


# --- small-batch matrix-vector product ------------------------------------------------------------
@triton.jit
def _gemv_kernel(X, W, B, Y, N, K, stride_xm, stride_wn, stride_ym, M: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                 USE_PDL: tl.constexpr = False):
    # One program: BLOCK_N output rows for all M (<= 4) inputs, the whole K, so each weight row is
    # read once and no second (reduce) kernel is needed. Partial sums stay in a [BLOCK_N, BLOCK_K]
    # fp32 tile and are reduced once at the end.
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    pdl_enter(USE_PDL)
    kk = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        if EVEN:
            w = tl.load(W + n[:, None] * stride_wn + k[None, :]).to(tl.float32)
            x0 = tl.load(X + k).to(tl.float32)
        else:
            k_ok = k < K
            w = tl.load(W + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            x0 = tl.load(X + k, mask=k_ok, other=0.0).to(tl.float32)
        acc0 += w * x0[None, :]
        if M > 1:
            x1 = tl.load(X + stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            acc1 += w * x1[None, :]
        if M > 2:
            x2 = tl.load(X + 2 * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            acc2 += w * x2[None, :]
        if M > 3:
            x3 = tl.load(X + 3 * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            acc3 += w * x3[None, :]
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + n, (tl.sum(acc0, 1) + bias).to(Y.dtype.element_ty), mask=n_ok)
    if M > 1:
        tl.store(Y + stride_ym + n, (tl.sum(acc1, 1) + bias).to(Y.dtype.element_ty), mask=n_ok)
    if M > 2:
        tl.store(Y + 2 * stride_ym + n, (tl.sum(acc2, 1) + bias).to(Y.dtype.element_ty), mask=n_ok)
    if M > 3:
        tl.store(Y + 3 * stride_ym + n, (tl.sum(acc3, 1) + bias).to(Y.dtype.element_ty), mask=n_ok)


GEMV_MAX_M = 4


def gemv_config(n: int, k: int) -> dict:
    """Launch configuration for an ``[n, k]`` weight at M = 1, from the in-graph sweep of
    scripts/gemv_sweep.py on one H200 (Llama-3-8B shapes; 4 rows per program was best for all four)."""
    if n >= 16384:  # gate_up: 54.2 us (4.34 TB/s) vs 56.4 for cuBLAS
        return dict(block_n=4, block_k=2048, num_warps=8)
    return dict(block_n=4, block_k=1024, num_warps=4)  # o: 10.0 us vs 13.1; down: 28.6 vs 32.0


def gemv(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, block_n: int = 4,
         block_k: int = 1024, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """``x [M, K] @ w [N, K]^T (+ bias [N])`` -> ``[M, N]`` in ``x``'s dtype, fp32 accumulation, for
    decode batches of M <= 4 tokens: each weight row is read once, coalesced, in one kernel (cuBLAS
    picks split-K GEMVs with a separate reduce kernel for these shapes). ``x`` rows contiguous.

    Raises ValueError for M > 4."""
    M, K = x.shape
    if M > GEMV_MAX_M:
        raise ValueError(f"gemv takes at most {GEMV_MAX_M} rows, got {M}")
    N = w.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    even = K % block_k == 0 and N % block_n == 0
    _gemv_kernel[(triton.cdiv(N, block_n),)](x, w, bias if bias is not None else w, y, N, K, x.stride(0),
                                             w.stride(0), y.stride(0), M=M, HAS_BIAS=bias is not None,
                                             BLOCK_N=block_n, BLOCK_K=block_k, EVEN=even,
                                             num_warps=num_warps, num_stages=num_stages, **pdl(w))
    return y


# --- per-head RMSNorm of q and k (Qwen3's QK norm) ------------------------------------------------
@triton.jit
def _qk_rms_norm_kernel(Q, K, WQ, WK, QO, KO, stride_qt, stride_kt, eps,
                        HQ: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    if h < HQ:
        x = tl.load(Q + t * stride_qt + h * D + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(WQ + cols, mask=mask, other=0.0)
        y = (x * tl.math.rsqrt(tl.sum(x * x, 0) / D + eps)).to(QO.dtype.element_ty)
        tl.store(QO + (t * HQ + h) * D + cols, (w * y).to(QO.dtype.element_ty), mask=mask)
    else:
        hk = h - HQ
        HK = tl.num_programs(1) - HQ
        x = tl.load(K + t * stride_kt + hk * D + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(WK + cols, mask=mask, other=0.0)
        y = (x * tl.math.rsqrt(tl.sum(x * x, 0) / D + eps)).to(KO.dtype.element_ty)
        tl.store(KO + (t * HK + hk) * D + cols, (w * y).to(KO.dtype.element_ty), mask=mask)


def qk_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over each head of ``q [T, Hq * D]`` and ``k [T, Hk * D]`` (rows may be strided, e.g.
    column slices of a fused qkv output; unit stride inside a row), one launch for both, as HF
    ``Qwen3RMSNorm`` on ``[..., D]``: statistics in float32, the normed value cast to the input dtype
    before the weight ``[D]`` multiplies. Returns new contiguous ``(q [T, Hq * D], k [T, Hk * D])``."""
    T = q.shape[0]
    D = head_dim
    HQ, HK = q.shape[1] // D, k.shape[1] // D
    qo = torch.empty((T, HQ * D), dtype=q.dtype, device=q.device)
    ko = torch.empty((T, HK * D), dtype=k.dtype, device=k.device)
    if T:
        _qk_rms_norm_kernel[(T, HQ + HK)](q, k, q_weight, k_weight, qo, ko, q.stride(0), k.stride(0), eps,
                                          HQ=HQ, D=D, BLOCK=triton.next_power_of_2(D), num_warps=1 if D <= 128 else 2,
                                          **pdl(q))
    return qo, ko
