"""Triton kernels for FP8 (e4m3) linear layers on the GPU: activation quantization (per token, static,
or per token and 128-wide group), a W8A16 matrix-vector product for decode batches of up to 4
tokens, and the block-scaled W8A8 GEMM of DeepSeek-style checkpoints.

References: DeepSeek-V3's ``inference/kernel.py`` (``act_quant``, ``fp8_gemm``: per-128-group
activation scales times 128 x 128 weight-block scales, applied to each K-block's partial product),
vLLM's ``per_token_group_quant_fp8`` / ``w8a8_block_fp8_matmul``; the GEMV is zpp's
:func:`zpp.models.layers.triton_ops.gemv` reading float8 weights (half the bytes) and applying the
scales in float32. Never imported on the CPU path (tests run them under ``TRITON_INTERPRET=1``,
whose float8 rounding differs from the GPU's in ties and subnormals).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from zpp import envs

from zpp.models.layers.pdl import pdl, pdl_enter

FP8_MAX = 448.0


# --- activation quantization ----------------------------------------------------------------------
@triton.jit
def _per_token_quant_kernel(X, Q, S, IN_SCALE, K, stride_x, stride_q, STATIC: tl.constexpr, BLOCK: tl.constexpr,
                            USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if STATIC:
        s = tl.load(IN_SCALE)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            k = k0 + cols
            x = tl.load(X + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        s = tl.maximum(tl.max(amax, 0), 1e-10) / 448.0
    tl.store(S + row, s)
    inv = 1.0 / s
    for k0 in range(0, K, BLOCK):
        k = k0 + cols
        x = tl.load(X + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.clamp(x * inv, -448.0, 448.0)
        tl.store(Q + row * stride_q + k, q.to(Q.dtype.element_ty), mask=k < K)


def per_token_quant(x: torch.Tensor, input_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (bf16/fp16/fp32, unit stride in a row) -> (float8_e4m3fn ``[M, K]``, float32
    ``[M, 1]`` scales) with ``x ~= q * s``: ``s = amax(|x_row|) / 448`` (dynamic), or every row the
    static ``input_scale`` (``[1]`` float32) when given. One program per row, two passes over it."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        block = min(2048, triton.next_power_of_2(K))
        _per_token_quant_kernel[(M,)](x, q, s, input_scale if input_scale is not None else s, K, x.stride(0),
                                      q.stride(0), STATIC=input_scale is not None, BLOCK=block,
                                      num_warps=4 if block <= 1024 else 8, **pdl(x))
    return q, s


@triton.jit
def _silu_mul_quant_kernel(X, Q, S, N, stride_x, stride_q, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    # One program per row, the row's N products held in registers: read gate | up once, write e4m3.
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    g = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + N + cols, mask=ok, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    s = tl.maximum(tl.max(tl.abs(y), 0), 1e-10) / 448.0
    tl.store(S + row, s)
    q = tl.clamp(y * (1.0 / s), -448.0, 448.0)
    tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=ok)


SILU_MUL_QUANT_MAX_N = 32768
"""The widest ``intermediate`` :func:`silu_mul_quant` takes (a row is held in one program's registers)."""


def silu_mul_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated MLP's activation and the down projection's activation quantization in one pass:
    ``x [M, 2N]`` (gate | up; bf16/fp16/fp32, unit stride in a row) -> (float8_e4m3fn ``[M, N]``,
    float32 ``[M, 1]``) with ``q * s ~= silu(gate) * up`` and ``s = amax(|row|) / 448`` (the
    per-token scale of :func:`per_token_quant`), the product kept in float32 until it is quantized.

    Against ``per_token_quant(silu_and_mul(x))``: ``x`` is read once and only the e4m3 result written
    (the separate kernels also write and twice read the ``[M, N]`` product in ``x``'s dtype).

    Raises:
        ValueError: ``N > SILU_MUL_QUANT_MAX_N``.
    """
    M, N2 = x.shape
    N = N2 // 2
    if N > SILU_MUL_QUANT_MAX_N:
        raise ValueError(f"silu_mul_quant: intermediate size {N} > {SILU_MUL_QUANT_MAX_N}")
    q = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        block = triton.next_power_of_2(N)
        _silu_mul_quant_kernel[(M,)](x, q, s, N, x.stride(0), q.stride(0), BLOCK=block,
                                     num_warps=max(4, min(16, block // 1024)), **pdl(x))
    return q, s


@triton.jit
def _rms_norm_quant_kernel(X, R, R_OUT, NW, Q, S, K, eps, stride_x, stride_r, stride_o, stride_q,
                           HAS_RES: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    # One program per row, the row held in registers: triton_ops._rms_norm_kernel's LLaMA arithmetic
    # (sum rounded to the residual's dtype, normalise in float32, cast, multiply by the weight in the
    # model dtype), then _per_token_quant_kernel's on the normed row as the model dtype rounds it.
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        x_round = (x + tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)).to(R_OUT.dtype.element_ty)
        tl.store(R_OUT + row * stride_o + cols, x_round, mask=ok)
        x = x_round.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, 0) / K + eps)
    y = (x * rstd).to(X.dtype.element_ty)
    w = tl.load(NW + cols, mask=ok, other=0.0)
    y = (w * y).to(X.dtype.element_ty).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(y), 0), 1e-10) / 448.0
    tl.store(S + row, s)
    q = tl.clamp(y * (1.0 / s), -448.0, 448.0)
    tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=ok)


RMS_NORM_QUANT_MAX_K = 16384
"""The widest row :func:`rms_norm_quant` takes (a row is held in one program's registers)."""


def rms_norm_quant(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """A pre-norm layer's residual add and RMSNorm (LLaMA order, the weight in the model dtype) with the
    next FP8 layer's per-token activation quantization, in one pass over the row: what
    ``per_token_quant(triton_ops.rms_norm(x, norm_weight, eps, residual))`` computes, rounding for
    rounding (the normed row rounded to ``x``'s dtype before its amax and quantization).

    ``x [M, K]`` (bf16/fp16; rows with unit stride), ``residual [M, K]`` or None, ``norm_weight [K]``
    -> ``(q`` float8_e4m3fn ``[M, K]``, ``s`` float32 ``[M, 1]`` with ``q * s ~= norm(x + residual)``,
    ``s = amax / 448``, ``residual_out [M, K] = x + residual`` in the residual's dtype, None without
    ``residual)``. The normed row is never written: against the two kernels, ``[M, K]`` in the
    model dtype is neither stored nor read back twice, and one launch is gone (vLLM's
    ``rms_norm_dynamic_per_token_quant`` fuses the same pair).

    Raises:
        ValueError: ``K > RMS_NORM_QUANT_MAX_K``.
    """
    M, K = x.shape
    if K > RMS_NORM_QUANT_MAX_K:
        raise ValueError(f"rms_norm_quant: row width {K} > {RMS_NORM_QUANT_MAX_K}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        r_out = torch.empty((M, K), dtype=residual.dtype, device=x.device)
        r, o, stride_r, stride_o = residual, r_out, residual.stride(0), r_out.stride(0)
    else:
        r_out = None
        r, o, stride_r, stride_o = x, x, 0, 0
    if M:
        block = triton.next_power_of_2(K)
        _rms_norm_quant_kernel[(M,)](x, r, o, norm_weight, q, s, K, eps, x.stride(0), stride_r, stride_o,
                                     q.stride(0), HAS_RES=residual is not None, BLOCK=block,
                                     num_warps=4 if block <= 2048 else 8, **pdl(x))
    return q, s, r_out


@triton.jit
def _group_quant_kernel(X, Q, S, K, G, stride_x, stride_q, stride_s, GS: tl.constexpr, GROUPS: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)                      # [GROUPS] group indices
    c = tl.arange(0, GS)
    k = g[:, None] * GS + c[None, :]                                          # [GROUPS, GS]
    ok = (g[:, None] < G) & (k < K)
    x = tl.load(X + row * stride_x + k, mask=ok, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), 1), 1e-10) / 448.0                       # [GROUPS]
    q = tl.clamp(x / s[:, None], -448.0, 448.0)
    tl.store(Q + row * stride_q + k, q.to(Q.dtype.element_ty), mask=ok)
    tl.store(S + row * stride_s + g, s, mask=g < G)


def per_token_group_quant(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (float8_e4m3fn ``[M, K]``, float32 ``[M, ceil(K / group_size)]``): one scale per
    token and ``group_size``-wide column group (the last may be partial), ``amax / 448``
    (DeepSeek-V3's ``act_quant``). ``group_size`` a power of two."""
    M, K = x.shape
    G = -(-K // group_size)
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, G), dtype=torch.float32, device=x.device)
    if M:
        groups = 8
        _group_quant_kernel[(M, triton.cdiv(G, groups))](x, q, s, K, G, x.stride(0), q.stride(0), s.stride(0),
                                                         GS=group_size, GROUPS=groups, num_warps=4, **pdl(x))
    return q, s


# --- W8A16 matrix-vector product for decode ---------------------------------------------------------
@triton.jit
def _fp8_gemv_kernel(X, W, WS, B, Y, N, K, stride_xm, stride_wn, stride_ym, stride_ws,
                     M: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCKWISE: tl.constexpr, BN_S: tl.constexpr,
                     BK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                     SCALE_X: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    # One program: BLOCK_N output rows for all M (<= 4) inputs, the whole K. Each step's
    # [BLOCK_N, BLOCK_K] products are reduced to [BLOCK_N] at once: a [BLOCK_N, BLOCK_K] fp32
    # accumulator (triton_ops._gemv_kernel's layout) costs registers that, with float8 weights, left
    # too few loads in flight (H200, Llama-3-8B shapes at M = 1: 83.9 -> 61.5 us per layer,
    # scripts/fp8_gemv_sweep.py). Per-channel scales multiply the sums once at the end. Block scales
    # (BN_S x BK_S tiles): with SCALE_X (BLOCK_N divides BN_S, so a program's rows lie in one scale
    # row) one [BLOCK_K] scale vector multiplies the activations; else each weight element as it is
    # read, a [BLOCK_N, BLOCK_K] float32 gather per step (4x the weight's bytes through L1).
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    pdl_enter(USE_PDL)
    kk = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros([BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        if EVEN:
            w = tl.load(W + n[:, None] * stride_wn + k[None, :]).to(tl.float32)
        else:
            w = tl.load(W + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
        xs = tl.full([BLOCK_K], 1.0, tl.float32)
        if BLOCKWISE:
            if SCALE_X:  # the program's rows share one scale row: scale the K vector, not each weight
                xs = tl.load(WS + ((pid * BLOCK_N) // BN_S) * stride_ws + k // BK_S, mask=k_ok, other=0.0)
            else:
                ws = tl.load(WS + (n // BN_S)[:, None] * stride_ws + (k // BK_S)[None, :],
                             mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                w = w * ws
        x0 = tl.load(X + k, mask=k_ok, other=0.0).to(tl.float32)
        if SCALE_X:
            x0 = x0 * xs
        acc0 += tl.sum(w * x0[None, :], 1)
        if M > 1:
            x1 = tl.load(X + stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
            if SCALE_X:
                x1 = x1 * xs
            acc1 += tl.sum(w * x1[None, :], 1)
        if M > 2:
            x2 = tl.load(X + 2 * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
            if SCALE_X:
                x2 = x2 * xs
            acc2 += tl.sum(w * x2[None, :], 1)
        if M > 3:
            x3 = tl.load(X + 3 * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
            if SCALE_X:
                x3 = x3 * xs
            acc3 += tl.sum(w * x3[None, :], 1)
    scale = tl.full([BLOCK_N], 1.0, tl.float32)
    if not BLOCKWISE:
        scale = tl.load(WS + n, mask=n_ok, other=0.0)
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + n, (acc0 * scale + bias).to(Y.dtype.element_ty), mask=n_ok)
    if M > 1:
        tl.store(Y + stride_ym + n, (acc1 * scale + bias).to(Y.dtype.element_ty), mask=n_ok)
    if M > 2:
        tl.store(Y + 2 * stride_ym + n, (acc2 * scale + bias).to(Y.dtype.element_ty), mask=n_ok)
    if M > 3:
        tl.store(Y + 3 * stride_ym + n, (acc3 * scale + bias).to(Y.dtype.element_ty), mask=n_ok)


FP8_GEMV_MAX_M = 4
_GEMV_SCALE_X = envs.ZPP_FP8_GEMV_BLOCK_SCALE_X  # block scales on the activation vector (0: per weight element)


def _tuned_gemv_configs() -> dict:
    path = envs.ZPP_FP8_GEMV_CONFIG_FILE
    if not path:
        return {}
    import json
    with open(path) as f:
        return {tuple(int(v) for v in key.split(",")): dict(cfg) for key, cfg in json.load(f).items()}


_TUNED_GEMV = _tuned_gemv_configs()


def fp8_gemv_config(n: int, k: int) -> dict:
    """Launch configuration for an FP8 ``[n, k]`` weight: the file named by ``ZPP_FP8_GEMV_CONFIG_FILE``
    where it holds ``"n,k"`` (``scripts/fp8_gemv_card_sweep.py --write-config`` measures one for the
    card at hand); else 4 rows and 2048 bytes of each per step, 4 warps, the fastest for all four
    Llama-3-8B shapes at M = 1 on one H200 (in-graph sweep, ``scripts/fp8_gemv_sweep.py``: qkv 9.2
    us, o 6.4, gate_up 29.5, down 16.5; 3.5 TB/s over a layer's four products)."""
    tuned = _TUNED_GEMV.get((n, k))
    if tuned:
        return dict(tuned)
    card = _card_gemv_configs().get((n, k))
    return dict(card) if card else dict(block_n=4, block_k=2048, num_warps=4)


@functools.lru_cache(maxsize=None)
def _card_gemv_configs() -> dict:
    """Shapes whose measured fastest launch on the current CUDA card differs from the default: on an
    H100 80GB HBM3, the Llama-3-8B qkv (6144 x 4096) 10.99 us with 8 rows and 1024 bytes a step
    against 11.52 us (in a CUDA graph, ``scripts/fp8_gemv_card_sweep.py``; the other three shapes
    within 0.2 us of the default)."""
    if not torch.cuda.is_available() or "H100" not in torch.cuda.get_device_name():
        return {}
    return {(6144, 4096): dict(block_n=8, block_k=1024, num_warps=4)}


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, weight_scale: torch.Tensor, block: Optional[tuple[int, int]] = None,
             bias: Optional[torch.Tensor] = None, block_n: int = 4, block_k: int = 2048, num_warps: int = 4,
             num_stages: int = 3) -> torch.Tensor:
    """``x [M, K] @ dequant(w)^T (+ bias)`` -> ``[M, N]`` in ``x``'s dtype for M <= 4, the activations
    not quantized (W8A16): ``w [N, K]`` float8_e4m3fn with ``weight_scale`` float32 ``[N]`` (per
    channel) or, with ``block = (bn, bk)``, ``[ceil(N/bn), ceil(K/bk)]``. fp32 accumulation. Three
    rows run as four (a zero row added): the decode graphs' warm-ups build the kernel for 1, 2 and 4
    rows (their batch sizes), so an eager 3-token batch would compile a variant of its own mid-run.

    Raises ValueError for M > 4."""
    M, K = x.shape
    if M > FP8_GEMV_MAX_M:
        raise ValueError(f"fp8_gemv takes at most {FP8_GEMV_MAX_M} rows, got {M}")
    if M == 3:
        return fp8_gemv(torch.nn.functional.pad(x, (0, 0, 0, 1)), w, weight_scale, block, bias, block_n, block_k,
                        num_warps, num_stages)[:3]
    N = w.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    even = K % block_k == 0 and N % block_n == 0
    bn, bk = block if block is not None else (1, 1)
    _fp8_gemv_kernel[(triton.cdiv(N, block_n),)](
        x, w, weight_scale, bias if bias is not None else x, y, N, K, x.stride(0), w.stride(0), y.stride(0),
        weight_scale.stride(0), M=M, HAS_BIAS=bias is not None, BLOCKWISE=block is not None, BN_S=bn, BK_S=bk,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN=even, SCALE_X=block is not None and bn % block_n == 0 and _GEMV_SCALE_X,
        num_warps=num_warps, num_stages=num_stages, **pdl(w))
    return y


# --- block-scaled W8A8 GEMM -------------------------------------------------------------------------
@triton.jit
def _block_gemm_kernel(A, B, C, AS, BS, M, N, K, stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                       BN_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
    # C[M, N] = sum over K-blocks kb of (A[:, kb] @ B[:, kb]^T) * AS[:, kb] * BS[n // BN_S, kb]; BLOCK_K is
    # the scales' K-block, so each tile's product is scaled once (DeepSeek-V3 fp8_gemm).
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped order (GROUP_M rows of tiles at a time): neighbours share B tiles
    pid_m, pid_n = tl.swizzle2d(pid // num_n, pid % num_n, num_m, num_n, GROUP_M)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + kk
        k_ok = k < K
        a = tl.load(A + m[:, None].to(tl.int64) * stride_am + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(B + n[:, None].to(tl.int64) * stride_bn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(AS + m * stride_asm + kb, mask=m_ok, other=0.0)                       # [BLOCK_M]
        b_s = tl.load(BS + (n // BN_S) * stride_bsn + kb, mask=n_ok, other=0.0)             # [BLOCK_N]
        acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
    tl.store(C + m[:, None].to(tl.int64) * stride_cm + n[None, :], acc.to(C.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def block_gemm_config(M: int) -> dict:
    """Tile shape by batch size (to be tuned on the H200 with ``scripts/kernel_bench.py fp8``)."""
    if M <= 16:
        return dict(block_m=16, block_n=64, num_warps=4, num_stages=4)
    if M <= 64:
        return dict(block_m=64, block_n=128, num_warps=4, num_stages=3)
    return dict(block_m=128, block_n=128, num_warps=8, num_stages=3)


def block_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
               block: tuple[int, int], out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
               config: Optional[dict] = None) -> torch.Tensor:
    """Block-scaled FP8 GEMM: ``a [M, K]`` float8_e4m3fn with ``a_scale [M, ceil(K/bk)]`` float32 (per
    token and group, :func:`per_token_group_quant`) times ``b [N, K]`` float8_e4m3fn with ``b_scale
    [ceil(N/bn), ceil(K/bk)]`` (the checkpoint's ``weight_scale_inv``) -> ``[M, N]`` ``out_dtype``
    (+ ``bias``). ``bk`` a power of two >= 16."""
    M, K = a.shape
    N = b.shape[0]
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0:
        return c
    cfg = config or block_gemm_config(M)
    bm, bn = cfg["block_m"], cfg["block_n"]
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _block_gemm_kernel[grid](a, b, c, a_scale, b_scale, M, N, K, a.stride(0), b.stride(0), c.stride(0),
                             a_scale.stride(0), b_scale.stride(0), BN_S=block[0], BLOCK_M=bm, BLOCK_N=bn,
                             BLOCK_K=block[1], GROUP_M=8, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if bias is not None:
        c += bias
    return c
