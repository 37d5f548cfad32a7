"""W4A16 Triton kernels: bf16/fp16 activations times 4-bit weights held in the one 4-bit layout
(:mod:`zpp.models.quantization.w4_layout`), dequantized in registers -- no copy of a weight in the
activation dtype is ever written to memory.

Weights (``N`` output rows, ``K`` input columns, group size ``G`` of 32 or 128; experts add a
leading ``E``): ``qweight`` uint8 ``[.., N, K // 2]`` (column ``2j`` in the low nibble),
``scales`` ``[.., N, K // G]`` and, for ``int4`` only, optional ``zeros`` uint8 ``[.., N, K // G]``
(None: the symmetric zero point 8). Two formats (``fmt``):

* ``int4``: ``w = (q - zero) * scale``, ``scale`` bf16 / fp16 / fp32;
* ``mxfp4``: ``w = E2M1[q] * 2 ** (s - 127)``, ``s`` the uint8 E8M0 exponent (OCP MX v1.0). The
  e2m1 code becomes an fp16 bit pattern (sign to bit 15, exponent and mantissa to bits 11..9: an
  fp16 of ``2 ** -14`` times the e2m1 value, subnormals included), the E8M0 byte an fp32 exponent
  (``s << 23``): exact, no table.

Kernels (every launch's shape depends on the token count only; no host synchronisation, so all of
them are captured in CUDA graphs; any GPU Triton supports, sm80+):

* :func:`w4a16_gemv` -- decode batches of ``M <= 4`` rows. By default (``words=True`` in the
  measured launches) the word-wise kernel of :mod:`~zpp.models.quantization.w4a16_gemv`; the
  byte-wise one below where the weight cannot be read as int32 words or ``words=False``: one
  program per ``BLOCK_N`` output rows
  streams its rows' packed bytes once (``BLOCK_K / 2`` bytes of each row a step) and reuses the
  unpacked codes for every row of ``x``. The group scale multiplies a group's partial sum, not each
  weight; the ``int4`` zero point enters as ``zero * sum(x over the group)`` (one ``[K / G]`` vector
  per step, shared by all rows), so the inner loop is one conversion and one FMA a code.
* :func:`w4a16_gemm` -- larger batches (prefill): ``BLOCK_M x BLOCK_N`` tiles, each K step's
  ``[BLOCK_N, BLOCK_K]`` weight tile unpacked and scaled in registers (the groups of a tile by a
  ``[BLOCK_N, BLOCK_K / G]`` scale load), cast to the activation dtype and fed to ``tl.dot``
  (tensor cores), fp32 accumulation.
* :func:`moe_w4a16_gemv` / :func:`moe_w4a16_gemm` -- the grouped expert products on
  :func:`~zpp.models.layers.fused_moe.moe_align`'s sorted-by-expert layout (the GEMM) or per
  assignment (the decode GEMV), with per-expert biases and the routing weight;
  :func:`fused_moe_w4a16` -- the whole MoE feed-forward (gate_up, the activation of
  :func:`~zpp.models.layers.fused_moe.gated_act` -- SiLU or gpt-oss's clamped SwiGLU --, down).

References: the dequantize-in-the-GEMM scheme of Marlin (Frantar et al. 2024, "MARLIN: Mixed-Precision
Auto-Regressive Parallel Inference on Large Language Models") and of vLLM's Triton ``fused_moe``
``int4_w4a16`` path; the group-sum trick for zero points as in GPTQ's and AWQ's GEMV kernels. Written
for zpp (the layouts and launch code are its own). Launch configurations: :data:`W4A16_CONFIGS`,
measured by ``python scripts/kernel_bench.py w4a16``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from zpp.models.layers.pdl import pdl, pdl_enter
from zpp.models.quantization.w4a16_gemv import w4a16_gemv_words, words_ok
from zpp.models.quantization.w4_layout import FORMATS
from zpp.models.quantization.w4a16_configs import (  # noqa: F401  (the launch tables, re-exported)
    W4_MOE_CONFIGS, W4_MOE_GEMV_DEFAULT, W4_MOE_GEMV_MAX_ASSIGNMENTS, W4A16_CONFIGS, W4A16_GEMV_BYTEWISE,
    W4A16_GEMV_DEFAULT, W4A16_GEMV_MAX_M, use_w4_moe_gemv, w4_moe_gemm_config, w4_moe_gemv_config, w4a16_gemm_config,
    w4a16_gemv_config)



def _fmt_id(fmt: str) -> int:
    if fmt not in FORMATS:
        raise ValueError(f"unknown 4-bit format {fmt!r} (one of {', '.join(FORMATS)})")
    return FORMATS.index(fmt)  # 0: int4, 1: mxfp4


# --- shared device helpers -------------------------------------------------------------------------
@triton.jit
def _e2m1(q):
    """int32 e2m1 codes (0..15) -> float32 values (exact)."""
    bits = ((q & 8) << 12) | ((q & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _codes_f32(q, FAST_CVT: tl.constexpr):
    """int32 codes 0..15 -> float32. ``FAST_CVT``: the bits of ``2 ** 23 + q`` (exponent 150) minus
    ``2 ** 23``, exact, an integer OR and a float add in place of the int-to-float ``cvt`` (which
    issues at a fraction of the FMA rate)."""
    if FAST_CVT:
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    else:
        return q.to(tl.float32)


@triton.jit
def _e8m0(s):
    """uint8 E8M0 exponents -> float32 ``2 ** (s - 127)`` (0 for ``s = 0``)."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _group_scale(S, Z, s_off, z_off, ok, FMT: tl.constexpr, HAS_ZERO: tl.constexpr, MASKED: tl.constexpr = True):
    """(scale, zero point) float32 of the groups at offsets ``s_off`` / ``z_off`` (masked by ``ok``
    unless not ``MASKED``)."""
    if MASKED:
        s = tl.load(S + s_off, mask=ok, other=0)
    else:
        s = tl.load(S + s_off)
    if FMT == 1:
        sf = _e8m0(s)
        z = tl.zeros_like(sf)
    else:
        sf = s.to(tl.float32)
        if HAS_ZERO:
            if MASKED:
                z = tl.load(Z + z_off, mask=ok, other=0).to(tl.float32)
            else:
                z = tl.load(Z + z_off).to(tl.float32)
        else:
            z = tl.full(sf.shape, 8.0, tl.float32)
    return sf, z


@triton.jit
def _dequant_tile(W, S, Z, w_base, s_base, z_base, n, n_ok, k0, K, stride_wn, stride_sn, stride_zn,
                  FMT: tl.constexpr, HAS_ZERO: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FAST_CVT: tl.constexpr = False):
    """The weight tile ``[BLOCK_K, BLOCK_N]`` (rows ``n``, columns ``k0 .. k0 + BLOCK_K``) in float32,
    read as ``BLOCK_N x BLOCK_K / 2`` packed bytes; columns past ``K`` and rows not ``n_ok`` are 0."""
    j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    g = k0 // G + tl.arange(0, BLOCK_K // G)
    rows = n.to(tl.int64)[:, None]
    if EVEN_K:
        ok = n_ok[:, None]
        gok = n_ok[:, None]
    else:
        ok = n_ok[:, None] & (j[None, :] < K // 2)
        gok = n_ok[:, None] & (g[None, :] < K // G)
    b = tl.load(W + w_base + rows * stride_wn + j[None, :], mask=ok, other=0).to(tl.int32)   # [BN, BK/2]
    q = tl.join(b & 15, b >> 4).reshape(BLOCK_N, BLOCK_K)                                   # column order
    s, z = _group_scale(S, Z, s_base + rows * stride_sn + g[None, :], z_base + rows * stride_zn + g[None, :],
                        gok, FMT, HAS_ZERO)                                                  # [BN, BK/G]
    if FMT == 1:
        v = _e2m1(q).reshape(BLOCK_N, BLOCK_K // G, G) * s[:, :, None]
    else:
        v = (_codes_f32(q, FAST_CVT).reshape(BLOCK_N, BLOCK_K // G, G) - z[:, :, None]) * s[:, :, None]
    return tl.trans(v.reshape(BLOCK_N, BLOCK_K))


@triton.jit
def _gemv_row(X, k0, K, lo, hi, s, z, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr,
              FMT: tl.constexpr, EVEN_K: tl.constexpr, X_SPLIT: tl.constexpr = False):
    """One K step's ``[BLOCK_N]`` partial products with one activation row ``X`` (``lo`` / ``hi``:
    the even / odd columns' codes as float32 -- values for mxfp4 --, ``[BLOCK_N, BLOCK_K / 2]``;
    ``s`` / ``z`` the groups' scales and zero points ``[BLOCK_N, BLOCK_K / G]``)."""
    if X_SPLIT:  # one contiguous load, split into even / odd columns in registers
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            xv = tl.load(X + k).to(tl.float32)
        else:
            xv = tl.load(X + k, mask=k < K, other=0.0).to(tl.float32)
        xe, xo = tl.split(xv.reshape(BLOCK_K // 2, 2))
    else:        # two strided loads
        kk = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        if EVEN_K:
            xe = tl.load(X + kk).to(tl.float32)
            xo = tl.load(X + kk + 1).to(tl.float32)
        else:
            xe = tl.load(X + kk, mask=kk < K, other=0.0).to(tl.float32)
            xo = tl.load(X + kk + 1, mask=kk < K, other=0.0).to(tl.float32)
    p = lo * xe[None, :] + hi * xo[None, :]                                   # [BN, BK/2]
    pg = tl.sum(p.reshape(BLOCK_N, BLOCK_K // G, G // 2), 2)                  # [BN, BK/G]
    if FMT == 0:
        xs = tl.sum((xe + xo).reshape(BLOCK_K // G, G // 2), 1)               # [BK/G]
        pg = pg - z * xs[None, :]
    return tl.sum(pg * s, 1)


@triton.jit
def _gemv_codes(W, S, Z, w_rows, s_rows, z_rows, n_ok, k0, K, FMT: tl.constexpr, HAS_ZERO: tl.constexpr,
                G: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, FAST_CVT: tl.constexpr = False):
    """A GEMV step's unpacked codes (``lo``, ``hi`` float32 ``[BN, BK/2]``) and group scales / zeros."""
    j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    g = k0 // G + tl.arange(0, BLOCK_K // G)
    if EVEN:
        b = tl.load(W + w_rows + j[None, :]).to(tl.int32)
        s, z = _group_scale(S, Z, s_rows + g[None, :], z_rows + g[None, :], None, FMT, HAS_ZERO, False)
    else:
        b = tl.load(W + w_rows + j[None, :], mask=n_ok[:, None] & (j[None, :] < K // 2), other=0).to(tl.int32)
        s, z = _group_scale(S, Z, s_rows + g[None, :], z_rows + g[None, :], n_ok[:, None] & (g[None, :] < K // G),
                            FMT, HAS_ZERO)
    if FMT == 1:
        lo = _e2m1(b & 15)
        hi = _e2m1(b >> 4)
    else:
        lo = _codes_f32(b & 15, FAST_CVT)
        hi = _codes_f32(b >> 4, FAST_CVT)
    return lo, hi, s, z


# --- dense GEMV (decode) ---------------------------------------------------------------------------
@triton.jit
def _w4_gemv_kernel(X, W, S, Z, B, Y, N, K, stride_xm, stride_wn, stride_sn, stride_zn, stride_ym,
                    M: tl.constexpr, FMT: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                    G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                    X_SPLIT: tl.constexpr = False, FAST_CVT: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    # One program: BLOCK_N output rows for all M (<= 4) activation rows over the whole K; each step
    # reads BLOCK_N x BLOCK_K / 2 packed bytes and reduces them at once (fp8_gemv's layout).
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = n.to(tl.int64)[:, None]
    w_rows = rows * stride_wn
    s_rows = rows * stride_sn
    z_rows = rows * stride_zn
    pdl_enter(USE_PDL)
    acc0 = tl.zeros([BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        lo, hi, s, z = _gemv_codes(W, S, Z, w_rows, s_rows, z_rows, n_ok, k0, K, FMT, HAS_ZERO, G, BLOCK_K, EVEN,
                                   FAST_CVT)
        acc0 += _gemv_row(X, k0, K, lo, hi, s, z, BLOCK_N, BLOCK_K, G, FMT, EVEN, X_SPLIT)
        if M > 1:
            acc1 += _gemv_row(X + stride_xm, k0, K, lo, hi, s, z, BLOCK_N, BLOCK_K, G, FMT, EVEN, X_SPLIT)
        if M > 2:
            acc2 += _gemv_row(X + 2 * stride_xm, k0, K, lo, hi, s, z, BLOCK_N, BLOCK_K, G, FMT, EVEN, X_SPLIT)
        if M > 3:
            acc3 += _gemv_row(X + 3 * stride_xm, k0, K, lo, hi, s, z, BLOCK_N, BLOCK_K, G, FMT, EVEN, X_SPLIT)
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + n, (acc0 + bias).to(Y.dtype.element_ty), mask=n_ok)
    if M > 1:
        tl.store(Y + stride_ym + n, (acc1 + bias).to(Y.dtype.element_ty), mask=n_ok)
    if M > 2:
        tl.store(Y + 2 * stride_ym + n, (acc2 + bias).to(Y.dtype.element_ty), mask=n_ok)
    if M > 3:
        tl.store(Y + 3 * stride_ym + n, (acc3 + bias).to(Y.dtype.element_ty), mask=n_ok)


def _check(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], group_size: int,
           fmt: str) -> int:
    """Validate a weight's tensors; returns the format id."""
    f = _fmt_id(fmt)
    if group_size not in (32, 64, 128):
        raise ValueError(f"W4A16 group size must be 32, 64 or 128, got {group_size}")
    if qweight.dtype != torch.uint8:
        raise ValueError(f"W4A16 qweight must be uint8, got {qweight.dtype}")
    K = qweight.shape[-1] * 2
    if K % group_size or tuple(scales.shape) != tuple(qweight.shape[:-1]) + (K // group_size,):
        raise ValueError(f"W4A16 scales {tuple(scales.shape)} do not match qweight {tuple(qweight.shape)} "
                         f"with group size {group_size}")
    if f == 1 and (scales.dtype != torch.uint8 or zeros is not None):
        raise ValueError("mxfp4 takes uint8 E8M0 scales and no zero points")
    if f == 0 and scales.dtype == torch.uint8:
        raise ValueError("int4 scales must be floating point (bf16 / fp16 / fp32)")
    if zeros is not None and (zeros.dtype != torch.uint8 or zeros.shape != scales.shape):
        raise ValueError(f"W4A16 zeros must be uint8 of the scales' shape {tuple(scales.shape)}")
    if qweight.stride(-1) != 1 or scales.stride(-1) != 1 or (zeros is not None and zeros.stride(-1) != 1):
        raise ValueError("W4A16 weight tensors need a unit last stride")
    return f


def _block_k(cfg_bk: int, group_size: int) -> int:
    return max(cfg_bk, group_size)


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
               group_size: int, fmt: str, bias: Optional[torch.Tensor] = None, block_n: int = 4,
               block_k: int = 1024, num_warps: int = 4, num_stages: int = 3, x_split: bool = False,
               fast_cvt: bool = False, words: bool = False, split_k: int = 1, vec: bool = False,
               prefetch: bool = False) -> torch.Tensor:
    """``x [M, K] @ dequant(W)^T (+ bias)`` -> ``[M, N]`` in ``x``'s dtype for ``M <= 4`` (decode):
    ``qweight`` uint8 ``[N, K // 2]``, ``scales`` / ``zeros`` ``[N, K // group_size]`` (module
    docstring), ``bias [N]``; fp32 accumulation. ``block_k`` a power of two >= ``group_size``.
    ``x_split``: each step's activations read in one contiguous load and split into even / odd
    columns in registers (else two strided loads). ``fast_cvt``: int4 codes to float32 by an OR and
    a subtraction (exact) instead of the ``cvt`` instruction; not yet measured, off by default (every
    launch configuration takes it). ``words``: the word-wise kernel of
    :mod:`~zpp.models.quantization.w4a16_gemv` (no per-step reductions, codes to float without a
    conversion instruction; ``split_k`` slices of K, ``vec`` its four-words-a-thread layout,
    ``prefetch`` the next step's loads issued before this step's arithmetic) where
    the weight can be read as int32 words (:func:`~zpp.models.quantization.w4a16_gemv.words_ok`);
    ``x_split`` / ``fast_cvt`` belong to the byte-wise kernel. Three rows run as
    four (the graphs' warm-ups build the 1, 2 and 4-row kernels).

    Raises:
        ValueError: ``M > 4``, or tensors that do not fit the layout (:func:`_check`).
    """
    M, K = x.shape
    if M > W4A16_GEMV_MAX_M:
        raise ValueError(f"w4a16_gemv takes at most {W4A16_GEMV_MAX_M} rows, got {M}")
    f = _check(qweight, scales, zeros, group_size, fmt)
    if qweight.shape[-1] * 2 != K:
        raise ValueError(f"w4a16_gemv: x has {K} columns, the weight {qweight.shape[-1] * 2}")
    if M == 3:
        return w4a16_gemv(torch.nn.functional.pad(x, (0, 0, 0, 1)), qweight, scales, zeros, group_size, fmt, bias,
                          block_n, block_k, num_warps, num_stages, x_split, fast_cvt, words, split_k, vec,
                          prefetch)[:3]
    x = x if x.stride(-1) == 1 else x.contiguous()
    if words and words_ok(qweight):
        return w4a16_gemv_words(x, qweight, scales, zeros, group_size, f, bias, block_n, max(block_k, 8), num_warps,
                                num_stages, split_k, vec, prefetch)
    N = qweight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    bk = _block_k(block_k, group_size)
    even = K % bk == 0 and N % block_n == 0
    _w4_gemv_kernel[(triton.cdiv(N, block_n),)](
        x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else x, y, N, K,
        x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0) if zeros is not None else 0, y.stride(0),
        M=M, FMT=f, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None, G=group_size, BLOCK_N=block_n,
        BLOCK_K=bk, EVEN=even, X_SPLIT=x_split, FAST_CVT=fast_cvt, num_warps=num_warps, num_stages=num_stages, **pdl(qweight))
    return y


# --- dense GEMM (prefill) --------------------------------------------------------------------------
@triton.jit
def _w4_gemm_kernel(A, W, S, Z, B, C, M, N, K, stride_am, stride_wn, stride_sn, stride_zn, stride_cm,
                    FMT: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, G: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    EVEN_K: tl.constexpr, FAST_CVT: tl.constexpr = False):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped order (GROUP_M rows of tiles at a time): neighbours share W tiles
    pid_m, pid_n = tl.swizzle2d(pid // num_n, pid % num_n, num_m, num_n, GROUP_M)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    a_ptr = A + m.to(tl.int64)[:, None] * stride_am + kk[None, :]
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr, mask=m_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptr, mask=m_ok[:, None] & (kk[None, :] < K - k0), other=0.0)
        w = _dequant_tile(W, S, Z, 0, 0, 0, n, n_ok, k0, K, stride_wn, stride_sn, stride_zn, FMT, HAS_ZERO, G,
                          BLOCK_N, BLOCK_K, EVEN_K, FAST_CVT)
        acc = tl.dot(a, w.to(a.dtype), acc)
        a_ptr += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(C + m.to(tl.int64)[:, None] * stride_cm + n[None, :], acc.to(C.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
               group_size: int, fmt: str, bias: Optional[torch.Tensor] = None,
               config: Optional[dict] = None) -> torch.Tensor:
    """``x [M, K] @ dequant(W)^T (+ bias)`` -> ``[M, N]`` in ``x``'s dtype (bf16 / fp16), any ``M``:
    tensor-core tiles of the weight dequantized in registers (see the module docstring). ``config``:
    ``block_m``, ``block_n``, ``block_k`` (a power of two; at least ``group_size`` is used),
    ``num_warps``, ``num_stages`` (default :func:`w4a16_gemm_config`)."""
    M, K = x.shape
    _check(qweight, scales, zeros, group_size, fmt)
    if qweight.shape[-1] * 2 != K:
        raise ValueError(f"w4a16_gemm: x has {K} columns, the weight {qweight.shape[-1] * 2}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    N = qweight.shape[0]
    c = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return c
    cfg = config or w4a16_gemm_config(M, N, K)
    bm, bn, bk = cfg["block_m"], cfg["block_n"], _block_k(cfg["block_k"], group_size)
    _w4_gemm_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
        x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else x, c, M, N, K,
        x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0) if zeros is not None else 0, c.stride(0),
        FMT=_fmt_id(fmt), HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None, G=group_size, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, EVEN_K=K % bk == 0, FAST_CVT=cfg.get("fast_cvt", False),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return c


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                 group_size: int, fmt: str, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [M, K]`` times the 4-bit weight -> ``[M, N]`` in ``x``'s dtype (+ ``bias``): the GEMV for
    ``M <= 4``, else the GEMM. CUDA tensors (the CPU dequantizes: :mod:`zpp.models.quantization.w4a16`)."""
    N = qweight.shape[0]
    K = x.shape[1]
    if 0 < x.shape[0] <= W4A16_GEMV_MAX_M:
        return w4a16_gemv(x, qweight, scales, zeros, group_size, fmt, bias,
                          **w4a16_gemv_config(N, K, fmt, x.shape[0], zeros is not None))
    return w4a16_gemm(x, qweight, scales, zeros, group_size, fmt, bias)


# --- grouped expert products ----------------------------------------------------------------------
@triton.jit
def _moe_w4_gemv_kernel(X, W, S, Z, Bias, Y, ids, routing_w, N, K,
                        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ze, stride_zn,
                        stride_be, stride_ym,
                        X_ROW_DIV: tl.constexpr, FMT: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                        MUL_ROUTING: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN: tl.constexpr, FAST_CVT: tl.constexpr = False):
    # Program (a, pid_n): Y[a, n] = sum_k X[a // X_ROW_DIV, k] * dequant(W[ids[a], n, k]).
    a = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids + a).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = n.to(tl.int64)[:, None]
    w_rows = e * stride_we + rows * stride_wn
    s_rows = e * stride_se + rows * stride_sn
    z_rows = e * stride_ze + rows * stride_zn
    x_row = X + (a // X_ROW_DIV).to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        lo, hi, s, z = _gemv_codes(W, S, Z, w_rows, s_rows, z_rows, n_ok, k0, K, FMT, HAS_ZERO, G, BLOCK_K, EVEN,
                                   FAST_CVT)
        acc += _gemv_row(x_row, k0, K, lo, hi, s, z, BLOCK_N, BLOCK_K, G, FMT, EVEN)
    if HAS_BIAS:
        acc += tl.load(Bias + e * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)
    if MUL_ROUTING:
        acc *= tl.load(routing_w + a)
    tl.store(Y + a.to(tl.int64) * stride_ym + n, acc.to(Y.dtype.element_ty), mask=n_ok)


def _zstrides(zeros: Optional[torch.Tensor]) -> tuple[int, int]:
    return (zeros.stride(0), zeros.stride(1)) if zeros is not None else (0, 0)


def moe_w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                   group_size: int, fmt: str, ids: torch.Tensor, out: torch.Tensor,
                   bias: Optional[torch.Tensor] = None, routing_w: Optional[torch.Tensor] = None,
                   x_row_div: int = 1, cfg: Optional[dict] = None) -> None:
    """Expert products for decode: ``out[a] = x[a // x_row_div] @ dequant(W[ids[a]])^T (+ bias[ids[a]])
    (* routing_w[a])`` for every assignment ``a < out.shape[0]``, fp32 accumulation. ``qweight``
    ``[E, N, K // 2]``, ``scales`` / ``zeros`` ``[E, N, K // G]``, ``x [R, K]`` (unit K stride),
    ``ids [M]``, ``out [M, N]``, ``bias [E, N]``, ``routing_w [M]`` float32. ``cfg``: ``block_n``,
    ``block_k``, ``num_warps``, ``num_stages``."""
    M, N = out.shape
    K = qweight.shape[-1] * 2
    f = _check(qweight, scales, zeros, group_size, fmt)
    if M == 0:
        return
    cfg = cfg or dict(W4_MOE_GEMV_DEFAULT)
    bn, bk = cfg["block_n"], _block_k(cfg["block_k"], group_size)
    even = K % bk == 0 and N % bn == 0
    sze, szn = _zstrides(zeros)
    _moe_w4_gemv_kernel[(M, triton.cdiv(N, bn))](
        x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, out,
        ids.reshape(-1), routing_w if routing_w is not None else out, N, K,
        x.stride(0), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1), sze, szn,
        bias.stride(0) if bias is not None else 0, out.stride(0),
        X_ROW_DIV=x_row_div, FMT=f, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None,
        MUL_ROUTING=routing_w is not None, G=group_size, BLOCK_N=bn, BLOCK_K=bk, EVEN=even,
        FAST_CVT=cfg.get("fast_cvt", False),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3))


@triton.jit
def _moe_w4_gemm_kernel(A, W, S, Z, Bias, C, sorted_ids, block_expert, routing_w, M, N, K, num_experts,
                        stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ze, stride_zn, stride_be,
                        stride_cm,
                        A_ROW_DIV: tl.constexpr, FMT: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                        MUL_ROUTING: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FAST_CVT: tl.constexpr = False):
    # One BLOCK_M x BLOCK_N tile of C[rows] = A[rows // A_ROW_DIV] @ dequant(W[e])^T for the block's
    # expert e (fused_moe._moe_gemm_kernel with the weight tile dequantized in registers).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert + pid_m)
    if e >= num_experts:  # a block past the last expert's run
        return
    e = e.to(tl.int64)
    rows = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))      # [BM] int32
    row_ok = rows < M
    a_rows = (rows // A_ROW_DIV).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    a_ptr = A + a_rows[:, None] * stride_am + kk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptr, mask=row_ok[:, None] & (kk[None, :] < K - k0), other=0.0)
        w = _dequant_tile(W, S, Z, e * stride_we, e * stride_se, e * stride_ze, n, n_ok, k0, K, stride_wn,
                          stride_sn, stride_zn, FMT, HAS_ZERO, G, BLOCK_N, BLOCK_K, EVEN_K, FAST_CVT)
        acc = tl.dot(a, w.to(a.dtype), acc)
        a_ptr += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(Bias + e * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTING:
        acc *= tl.load(routing_w + rows, mask=row_ok, other=0.0)[:, None]
    tl.store(C + rows.to(tl.int64)[:, None] * stride_cm + n[None, :], acc.to(C.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


def moe_w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                   group_size: int, fmt: str, out: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                   bias: Optional[torch.Tensor] = None, routing_w: Optional[torch.Tensor] = None,
                   a_row_div: int = 1, cfg: Optional[dict] = None) -> None:
    """Grouped GEMM on the sorted layout (:func:`~zpp.models.layers.fused_moe.moe_align` with
    ``cfg["BLOCK_M"]``): ``out[a] = x[a // a_row_div] @ dequant(W[e(a)])^T (+ bias[e(a)])
    (* routing_w[a])``. Shapes as :func:`moe_w4a16_gemv`'s; ``cfg``: ``BLOCK_M``, ``BLOCK_N``,
    ``BLOCK_K``, ``num_warps``, ``num_stages``."""
    M, N = out.shape
    E = qweight.shape[0]
    K = qweight.shape[-1] * 2
    f = _check(qweight, scales, zeros, group_size, fmt)
    cfg = cfg or w4_moe_gemm_config(M, E, N, K)
    BM, BN, BK = cfg["BLOCK_M"], cfg["BLOCK_N"], _block_k(cfg["BLOCK_K"], group_size)
    sze, szn = _zstrides(zeros)
    grid = (sorted_ids.numel() // BM, triton.cdiv(N, BN))
    _moe_w4_gemm_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, out,
        sorted_ids, block_expert, routing_w if routing_w is not None else out, M, N, K, E,
        x.stride(0), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1), sze, szn,
        bias.stride(0) if bias is not None else 0, out.stride(0),
        A_ROW_DIV=a_row_div, FMT=f, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None,
        MUL_ROUTING=routing_w is not None, G=group_size, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, EVEN_K=K % BK == 0,
        FAST_CVT=cfg.get("fast_cvt", False),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def fused_moe_w4a16(x: torch.Tensor, gate_up: tuple, down: tuple, group_size: int, fmt: str,
                    weights: torch.Tensor, ids: torch.Tensor, act, b_gate_up: Optional[torch.Tensor] = None,
                    b_down: Optional[torch.Tensor] = None, config: Optional[dict] = None) -> torch.Tensor:
    """Mixture-of-experts feed-forward with 4-bit expert weights.

    Args:
        x: ``[T, H]`` tokens (bf16 / fp16).
        gate_up: ``(qweight [E, 2I, H // 2], scales [E, 2I, H // G], zeros or None)``, gate rows then
            up rows; ``down``: ``(qweight [E, H, I // 2], scales [E, H, I // G], zeros or None)``.
        group_size, fmt: the layout's (module docstring).
        weights: ``[T, k]`` float32 routing weights; ``ids``: ``[T, k]`` int64 experts.
        act: as :func:`~zpp.models.layers.fused_moe.fused_moe`'s (objects with ``triton_kind`` --
            SiLU, gpt-oss's clamped SwiGLU -- in one Triton kernel).
        b_gate_up: optional ``[E, 2I]``; ``b_down``: optional ``[E, H]`` (before the routing weight).
        config: ``{"gemv": bool}`` forces a path (tests, benchmarks); default :func:`use_w4_moe_gemv`.

    Returns:
        ``[T, H]`` in ``x.dtype``: ``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``.
    """
    from zpp.models.layers.fused_moe import gated_act, moe_align
    T, H = x.shape
    k = ids.shape[1]
    E, I2 = gate_up[0].shape[:2]
    I = I2 // 2
    M = T * k
    if M == 0:
        return torch.zeros_like(x)
    x = x if x.stride(1) == 1 else x.contiguous()
    rw = weights.reshape(-1).float().contiguous()
    kind = getattr(act, "triton_kind", None)
    gemv = (config or {}).get("gemv")
    if gemv is None:
        gemv = use_w4_moe_gemv(M, E, I2, H)
    h_gu = torch.empty((M, I2), dtype=x.dtype, device=x.device)
    out = torch.empty((M, H), dtype=x.dtype, device=x.device)                     # [M, H] = [T, k, H]
    if gemv:
        flat = ids.reshape(-1)
        moe_w4a16_gemv(x, *gate_up, group_size, fmt, flat, h_gu, b_gate_up, None, k, w4_moe_gemv_config(E, I2, H))
        h = gated_act(h_gu, *kind) if kind is not None else act(h_gu)
        h = h if h.stride(1) == 1 else h.contiguous()
        moe_w4a16_gemv(h, *down, group_size, fmt, flat, out, b_down, rw, 1, w4_moe_gemv_config(E, H, I))
    else:
        cfg1 = w4_moe_gemm_config(M, E, I2, H)
        cfg2 = dict(w4_moe_gemm_config(M, E, H, I), BLOCK_M=cfg1["BLOCK_M"])      # one sorted layout for both
        sorted_ids, block_expert = moe_align(ids, E, cfg1["BLOCK_M"])
        moe_w4a16_gemm(x, *gate_up, group_size, fmt, h_gu, sorted_ids, block_expert, b_gate_up, None, k, cfg1)
        h = gated_act(h_gu, *kind) if kind is not None else act(h_gu)
        h = h if h.stride(1) == 1 else h.contiguous()
        moe_w4a16_gemm(h, *down, group_size, fmt, out, sorted_ids, block_expert, b_down, rw, 1, cfg2)
    if k == 1:
        return out
    return out.view(T, k, H).sum(dim=1, dtype=torch.float32).to(x.dtype)          # [T, H]
