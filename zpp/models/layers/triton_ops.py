"""Triton kernels for the CUDA path: paged attention (:mod:`zpp.models.layers.paged_attention`), fused add + RMSNorm, rotary + KV-cache write,
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

# attention lives in zpp.models.layers.paged_attention; its names are re-exported here
from zpp.models.layers.paged_attention import (  # noqa: F401
    _kv_for_dot, _merge_splits_kernel, _paged_attention_kernel, attention_tiles, decode_splits, paged_attention,
    pick_block_m)
from zpp.models.layers.pdl import pdl, pdl_enter


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
