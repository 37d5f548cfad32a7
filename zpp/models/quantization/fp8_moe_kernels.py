"""Grouped FP8 (e4m3) expert GEMMs for mixture-of-experts layers on the GPU (Triton).

The FP8 counterpart of :func:`zpp.models.layers.fused_moe.fused_moe`: expert weights stay e4m3 with
their scales, applied inside the kernels. Two paths, picked by the number of routed
token-assignments ``M = T * k`` (:func:`use_fp8_moe_gemv`):

* **decode (W8A16 GEMV)**, ``M <= gemv_max_assignments``: no sort, no activation quantization. One
  program per (assignment, ``BLOCK_N`` output rows) reads its expert's e4m3 rows, upcasts them in
  registers and multiplies by the bf16 activations in float32 (as the dense
  :func:`zpp.models.quantization.fp8_kernels.fp8_gemv`). Per-channel scales multiply the sums at the end;
  128 x 128 block scales multiply the activation vector (one ``[BLOCK_K]`` load per step, the
  program's ``BLOCK_N`` rows lie in one scale row). Where measured faster (``gemv_down`` in
  :data:`FP8_MOE_CONFIGS`), the down GEMV also applies the activation to the gate | up rows, the
  routing weight and the sum over each token's ``k`` experts (:func:`moe_fp8_gemv_down`: one launch
  in place of three and a reduction).
* **GEMM (W8A8)**: :func:`zpp.models.layers.fused_moe.moe_align`'s sorted-by-expert layout, the
  activations quantized per token (per token and 128-wide group for block weights), FP8 tensor-core
  dots. Per-channel: ``acc * a_scale[row] * w_scale[e, n]`` once at the end; block: each
  ``BLOCK_K = 128`` partial product scaled by ``a_scale[row, kb] * w_scale[e, n // 128, kb]``
  (DeepSeek-V3's ``fp8_gemm``, vLLM's ``fused_moe`` with ``block_shape``).

Both are launches on device tensors whose shapes depend on ``T`` only: no host synchronisation,
capturable in CUDA graphs.

Public functions (called by the FP8 ``FusedExperts`` method)::

    fused_moe_fp8(x, w_gate_up, w_down, gate_up_scale, down_scale, weights, ids, act,
                  block=None, b_gate_up=None, b_down=None, config=None) -> [T, H]
        x [T, H] bf16/fp16; w_gate_up [E, 2I, H], w_down [E, H, I] float8_e4m3fn;
        scales float32: per channel [E, N] (also [E, 1] / [E] per expert tensor or [] / [1] one
        tensor, broadcast by strides, nothing copied), or with block=(bn, bk) the grid
        [E, ceil(N/bn), ceil(K/bk)] (weight_scale_inv); weights [T, k] float32, ids [T, k] int64;
        act as fused_moe's (GatedActivation / ClampedSwiGLU or any callable [R, 2I] -> [R, I]).
    moe_fp8_gemv(x, w, w_scale, ids, out, block=None, bias=None, routing_w=None, x_row_div=1, cfg=None)
    moe_fp8_gemv_down(gate_up, w, w_scale, ids, routing_w, out, act_kind, block=None, bias=None, cfg=None)
    moe_fp8_gemm(xq, xs, w, w_scale, out, sorted_ids, block_expert, block=None, bias=None,
                 routing_w=None, a_row_div=1, cfg=None)
    fp8_moe_config(M, E, N, K, block) -> dict (tile sizes, from FP8_MOE_CONFIGS or defaults)
    use_fp8_moe_gemv(M, E, N, K, block) -> bool

Block weights need ``bk`` a power of two >= 16 (128 in every release) and, for a fused gate|up
weight, the gate's rows a whole number of ``bn`` blocks (``I % bn == 0``) so that a scale row never
spans gate and up; :func:`fused_moe_fp8` checks both.

Tile sizes per shape: :data:`FP8_MOE_CONFIGS` (as vLLM's ``fused_moe/configs/*.json``), picked on
one H100 by ``python scripts/kernel_bench.py fp8-moe`` (figures in docs/benchmarks.md).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from zpp.models.quantization.fp8_kernels import (SILU_MUL_QUANT_MAX_N, per_token_group_quant, per_token_quant,
                                                 silu_mul_quant)
from zpp import envs
from zpp.models.layers.fused_moe import bucket_config, gated_act, moe_align
from zpp.models.layers.pdl import pdl, pdl_enter

_FUSED_DOWN = envs.ZPP_FP8_MOE_FUSED_DOWN


# --- decode: W8A16 grouped GEMV ------------------------------------------------------------------
@triton.jit
def _moe_fp8_gemv_kernel(X, W, WS, Bias, Y, ids, routing_w, N, K,
                         stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_be, stride_ym,
                         X_ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_ROUTING: tl.constexpr,
                         BLOCKWISE: tl.constexpr, BN_S: tl.constexpr, BK_S: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    # Program (a, pid_n): Y[a, n] = sum_k X[a // X_ROW_DIV, k] * dequant(W[ids[a], n, k]) for BLOCK_N
    # rows n; each step's [BLOCK_N, BLOCK_K] products reduced to [BLOCK_N] at once (fp8_gemv's layout).
    a = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids + a).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    x_row = X + (a // X_ROW_DIV).to(tl.int64) * stride_xm
    w_rows = W + e * stride_we + n.to(tl.int64)[:, None] * stride_wn
    ws_row = WS + e * stride_wse + ((pid_n * BLOCK_N) // BN_S) * stride_wsn   # BLOCK_N divides BN_S
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        if EVEN:
            w = tl.load(w_rows + k[None, :]).to(tl.float32)
            x = tl.load(x_row + k).to(tl.float32)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        if BLOCKWISE:
            x = x * tl.load(ws_row + k // BK_S, mask=k_ok, other=0.0)
        acc += tl.sum(w * x[None, :], 1)
    if not BLOCKWISE:
        acc *= tl.load(WS + e * stride_wse + n * stride_wsn, mask=n_ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + e * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)
    if MUL_ROUTING:
        acc *= tl.load(routing_w + a)
    tl.store(Y + a.to(tl.int64) * stride_ym + n, acc.to(Y.dtype.element_ty), mask=n_ok)


def _scale_strides(w: torch.Tensor, s: torch.Tensor, block: Optional[tuple[int, int]]) -> tuple[int, int]:
    """``(stride over experts, stride over output rows / row blocks)`` of a weight scale; per-tensor and
    per-expert scales broadcast with stride 0. The last (K-block) stride of a block grid must be 1.

    Raises:
        ValueError: a scale whose shape fits neither layout."""
    E, N, K = w.shape
    if s.dtype != torch.float32:
        raise ValueError(f"FP8 expert scales must be float32, got {s.dtype}")
    if block is not None:
        grid = (E, -(-N // block[0]), -(-K // block[1]))
        if tuple(s.shape) != grid or s.stride(2) != 1:
            raise ValueError(f"block scale of shape {tuple(s.shape)} (strides {s.stride()}) for a weight "
                             f"{tuple(w.shape)} and block {block}: expected {grid}, unit last stride")
        return s.stride(0), s.stride(1)
    if s.numel() == 1:
        return 0, 0
    if tuple(s.shape) in ((E,), (E, 1)):
        return s.stride(0), 0
    if tuple(s.shape) in ((E, N), (E, N, 1)):
        return s.stride(0), s.stride(1)
    raise ValueError(f"per-channel scale of shape {tuple(s.shape)} for a weight {tuple(w.shape)}: expected "
                     f"[{E}, {N}], [{E}] or a single value")


def moe_fp8_gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
                 block: Optional[tuple[int, int]] = None, bias: Optional[torch.Tensor] = None,
                 routing_w: Optional[torch.Tensor] = None, x_row_div: int = 1, cfg: Optional[dict] = None) -> None:
    """W8A16 expert products for decode: ``out[a] = x[a // x_row_div] @ dequant(w[ids[a]])^T
    (+ bias[ids[a]]) (* routing_w[a])`` for every assignment ``a < out.shape[0]``, fp32 accumulation.

    ``x`` ``[R, K]`` bf16/fp16/fp32 (unit K stride), ``w`` ``[E, N, K]`` float8_e4m3fn (unit K
    stride), ``w_scale`` as :func:`fused_moe_fp8`'s, ``ids`` ``[M]`` int32/int64 experts (flattened
    ``[T, k]``), ``out`` ``[M, N]`` (unit N stride), ``bias`` ``[E, N]``, ``routing_w`` ``[M]``
    float32. ``cfg``: ``block_n`` (divides ``bn`` for block weights), ``block_k``, ``num_warps``."""
    M, N = out.shape
    E, _, K = w.shape
    if M == 0:
        return
    cfg = cfg or _gemv_default(N, K, block)
    bn_, bk_ = cfg["block_n"], cfg["block_k"]
    if block is not None and block[0] % bn_:
        raise ValueError(f"moe_fp8_gemv: block_n {bn_} must divide the scale block {block[0]}")
    sse, ssn = _scale_strides(w, w_scale, block)
    bn, bk = block if block is not None else (1, 1)
    even = K % bk_ == 0 and N % bn_ == 0
    ids = ids.reshape(-1)
    _moe_fp8_gemv_kernel[(M, triton.cdiv(N, bn_))](
        x, w, w_scale, bias if bias is not None else w_scale, out, ids, routing_w if routing_w is not None else w_scale,
        N, K, x.stride(0), w.stride(0), w.stride(1), sse, ssn, bias.stride(0) if bias is not None else 0, out.stride(0),
        X_ROW_DIV=x_row_div, HAS_BIAS=bias is not None, MUL_ROUTING=routing_w is not None,
        BLOCKWISE=block is not None, BN_S=bn, BK_S=bk, BLOCK_N=bn_, BLOCK_K=bk_, EVEN=even,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3), **pdl(w))


@triton.jit
def _moe_fp8_gemv_down_kernel(GU, W, WS, Bias, Y, ids, routing_w, N, I, alpha, limit,
                              stride_gu, stride_we, stride_wn, stride_wse, stride_wsn, stride_be, stride_ym,
                              TOPK: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                              BLOCKWISE: tl.constexpr, BN_S: tl.constexpr, BK_S: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                              USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    # Program (t, pid_n): Y[t, n] = sum_j rw[a] * (act(GU[a]) @ dequant(W[ids[a], n])^T (+ Bias[ids[a], n])),
    # a = t * TOPK + j, for BLOCK_N rows n: the activation between the expert GEMMs, the down
    # product, the routing weight and the sum over the token's TOPK experts in one launch. One loop
    # over (expert j, K step) so that the loads of all TOPK experts pipeline as one stream.
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    KB = tl.cdiv(I, BLOCK_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for it in range(0, TOPK * KB):
        j = it // KB
        k = (it - j * KB) * BLOCK_K + kk
        a = (t * TOPK + j).to(tl.int64)
        e = tl.load(ids + a).to(tl.int64)
        r = tl.load(routing_w + a)
        gu_row = GU + a * stride_gu
        w_rows = W + e * stride_we + n.to(tl.int64)[:, None] * stride_wn
        if EVEN:
            g = tl.load(gu_row + k).to(tl.float32)
            u = tl.load(gu_row + I + k).to(tl.float32)
            w = tl.load(w_rows + k[None, :]).to(tl.float32)
        else:
            k_ok = k < I
            g = tl.load(gu_row + k, mask=k_ok, other=0.0).to(tl.float32)
            u = tl.load(gu_row + I + k, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if ACT == 0:    # SiLU(gate) * up
            x = g / (1.0 + tl.exp(-g)) * u
        else:           # gpt-oss's clamped SwiGLU (fused_moe._gated_act_kernel's ACT 1)
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            x = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
        if BLOCKWISE:   # the program's rows lie in one scale row: one [BLOCK_K] scale vector
            ws_row = WS + e * stride_wse + ((pid_n * BLOCK_N) // BN_S) * stride_wsn
            if EVEN:
                x = x * (tl.load(ws_row + k // BK_S) * r)
            else:
                x = x * (tl.load(ws_row + k // BK_S, mask=k < I, other=0.0) * r)
            acc += tl.sum(w * x[None, :], 1)
        else:
            acc += tl.sum(w * x[None, :], 1) * (tl.load(WS + e * stride_wse + n * stride_wsn, mask=n_ok, other=0.0) * r)
    if HAS_BIAS:
        for j in range(0, TOPK):
            a = (t * TOPK + j).to(tl.int64)
            e = tl.load(ids + a).to(tl.int64)
            acc += tl.load(routing_w + a) * tl.load(Bias + e * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + t.to(tl.int64) * stride_ym + n, acc.to(Y.dtype.element_ty), mask=n_ok)


def moe_fp8_gemv_down(gate_up: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, ids: torch.Tensor,
                      routing_w: torch.Tensor, out: torch.Tensor, act_kind: tuple, block: Optional[tuple[int, int]] = None,
                      bias: Optional[torch.Tensor] = None, cfg: Optional[dict] = None) -> None:
    """The decode feed-forward's second half in one launch: ``out[t] = sum_j routing_w[a] *
    (act(gate_up[a]) @ dequant(w[ids[a]])^T (+ bias[ids[a]]))`` over the ``k`` assignments
    ``a = t * k + j`` of each token, fp32 accumulation (the activation in float32, never rounded).

    ``gate_up`` ``[T * k, 2I]`` bf16/fp16/fp32 (gate columns then up, unit column stride), ``w``
    ``[E, H, I]`` float8_e4m3fn (unit K stride), ``w_scale`` as :func:`fused_moe_fp8`'s, ``ids``
    ``[T, k]`` experts, ``routing_w`` ``[T * k]`` float32, ``out`` ``[T, H]`` (unit H stride),
    ``act_kind`` an activation's ``triton_kind`` ``(kind, alpha, limit)`` (see
    :func:`~zpp.models.layers.fused_moe.gated_act`), ``bias`` ``[E, H]``. ``cfg``: ``block_n``
    (divides ``bn`` for block weights), ``block_k``, ``num_warps``, ``num_stages``."""
    T, N = out.shape
    E, _, I = w.shape
    k = ids.shape[-1]
    if T == 0:
        return
    cfg = cfg or dict(block_n=8, block_k=256, num_warps=4)
    bn_, bk_ = cfg["block_n"], cfg["block_k"]
    if block is not None and block[0] % bn_:
        raise ValueError(f"moe_fp8_gemv_down: block_n {bn_} must divide the scale block {block[0]}")
    sse, ssn = _scale_strides(w, w_scale, block)
    bn, bk = block if block is not None else (1, 1)
    kind, alpha, limit = act_kind
    _moe_fp8_gemv_down_kernel[(T, triton.cdiv(N, bn_))](
        gate_up, w, w_scale, bias if bias is not None else w_scale, out, ids.reshape(-1), routing_w, N, I,
        float(alpha), float(limit), gate_up.stride(0), w.stride(0), w.stride(1), sse, ssn,
        bias.stride(0) if bias is not None else 0, out.stride(0),
        TOPK=k, ACT=kind, HAS_BIAS=bias is not None, BLOCKWISE=block is not None, BN_S=bn, BK_S=bk,
        BLOCK_N=bn_, BLOCK_K=bk_, EVEN=I % bk_ == 0 and N % bn_ == 0,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3), **pdl(w))


# --- GEMM: W8A8 on the sorted-by-expert layout -----------------------------------------------------
@triton.jit
def _moe_fp8_gemm_kernel(A, AS, W, WS, Bias, C, sorted_ids, block_expert, routing_w,
                         M, N, K, num_experts,
                         stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_be, stride_cm,
                         A_ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_ROUTING: tl.constexpr,
                         BLOCKWISE: tl.constexpr, BN_S: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One BLOCK_M x BLOCK_N tile of C[rows] = dequant(A[rows // A_ROW_DIV]) @ dequant(W[e])^T for the
    # block's expert e (fused_moe._moe_gemm_kernel with e4m3 operands); rows >= M are padding.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert + pid_m)
    if e >= num_experts:  # a block past the last expert's run
        return
    e = e.to(tl.int64)
    rows = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))      # [BM] int32
    row_ok = rows < M
    a_rows = (rows // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = A + a_rows[:, None] * stride_am + offs_k[None, :]                 # [BM, BK]
    w_ptr = W + e * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BLOCKWISE:  # BLOCK_K is the scales' K block
        as_ptr = AS + a_rows * stride_asm                                     # [BM]
        ws_ptr = WS + e * stride_wse + (offs_n // BN_S) * stride_wsn          # [BN]
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            a_s = tl.load(as_ptr + kb, mask=row_ok, other=0.0)
            w_s = tl.load(ws_ptr + kb, mask=n_ok, other=0.0)
            acc += tl.dot(a, w) * (a_s[:, None] * w_s[None, :])
            a_ptr += BLOCK_K
            w_ptr += BLOCK_K
    else:
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc)
            a_ptr += BLOCK_K
            w_ptr += BLOCK_K
        a_s = tl.load(AS + a_rows * stride_asm, mask=row_ok, other=0.0)
        w_s = tl.load(WS + e * stride_wse + offs_n * stride_wsn, mask=n_ok, other=0.0)
        acc *= a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + e * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTING:
        acc *= tl.load(routing_w + rows, mask=row_ok, other=0.0)[:, None]
    c_ptr = C + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def moe_fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor,
                 sorted_ids: torch.Tensor, block_expert: torch.Tensor, block: Optional[tuple[int, int]] = None,
                 bias: Optional[torch.Tensor] = None, routing_w: Optional[torch.Tensor] = None, a_row_div: int = 1,
                 cfg: Optional[dict] = None) -> None:
    """W8A8 grouped GEMM: ``out[a] = (xq[r] * xs[r]) @ dequant(w[e(a)])^T (+ bias[e(a)]) (* routing_w[a])``,
    ``r = a // a_row_div``, for every assignment ``a < out.shape[0]`` of ``sorted_ids`` /
    ``block_expert`` (:func:`~zpp.models.layers.fused_moe.moe_align` with ``cfg["BLOCK_M"]``).

    ``xq`` ``[R, K]`` float8_e4m3fn with ``xs`` float32 ``[R, 1]`` (per token) or, for block weights,
    ``[R, ceil(K/bk)]`` (per token and ``bk`` group); ``w`` ``[E, N, K]`` float8_e4m3fn (unit K
    stride), ``w_scale`` as :func:`fused_moe_fp8`'s; ``out`` ``[M, N]``; ``bias`` ``[E, N]``;
    ``routing_w`` ``[M]`` float32. ``cfg``: ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K`` (= ``bk`` for block
    weights), ``num_warps``, ``num_stages``."""
    M, N = out.shape
    E, _, K = w.shape
    cfg = cfg or fp8_moe_config(M, E, N, K, block)
    BM, BN, BK = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if block is not None and BK != block[1]:
        raise ValueError(f"moe_fp8_gemm: BLOCK_K {BK} must equal the scale block {block[1]}")
    sse, ssn = _scale_strides(w, w_scale, block)
    grid = (sorted_ids.numel() // BM, triton.cdiv(N, BN))
    _moe_fp8_gemm_kernel[grid](
        xq, xs, w, w_scale, bias if bias is not None else w_scale, out, sorted_ids, block_expert,
        routing_w if routing_w is not None else w_scale, M, N, K, E,
        xq.stride(0), xs.stride(0), w.stride(0), w.stride(1), sse, ssn, bias.stride(0) if bias is not None else 0,
        out.stride(0), A_ROW_DIV=a_row_div, HAS_BIAS=bias is not None, MUL_ROUTING=routing_w is not None,
        BLOCKWISE=block is not None, BN_S=block[0] if block is not None else 1,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


# --- configurations ------------------------------------------------------------------------------
FP8_MOE_GEMV_MAX_ASSIGNMENTS = 64
"""Default: batches of at most this many token-assignments (``T * k``) take the W8A16 GEMV."""

FP8_MOE_CONFIGS: dict[str, dict] = {
    "E=128,N=1536,K=2048,channel": dict(
        gemv_max=64, gemv=dict(block_n=4, block_k=1024, num_warps=4),
        gemm={
            8: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            64: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
            512: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            4096: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            32768: dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
        }),
    "E=128,N=2048,K=768,channel": dict(
        gemv_max=64, gemv=dict(block_n=16, block_k=512, num_warps=8),
        gemm={
            8: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            64: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            512: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            4096: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            32768: dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
        }),
    "E=128,N=1536,K=2048,block=128x128": dict(
        gemv_max=64, gemv=dict(block_n=8, block_k=1024, num_warps=4),
        gemm={
            8: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            64: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            512: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            4096: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            32768: dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3),
        }),
    "E=128,N=2048,K=768,block=128x128": dict(
        gemv_max=64, gemv=dict(block_n=8, block_k=1024, num_warps=4),
        gemm={
            8: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            64: dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
            512: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            4096: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
            32768: dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3),
        }),
    "E=256,N=4096,K=7168,channel": dict(
        gemv_max=64, gemv=dict(block_n=8, block_k=1024, num_warps=4),
        gemm={
            8: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            64: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            512: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            4096: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
            32768: dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
        }),
    "E=256,N=7168,K=2048,channel": dict(
        gemv_max=64, gemv=dict(block_n=4, block_k=2048, num_warps=4),
        gemm={
            8: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            64: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            512: dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3),
            4096: dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3),
            32768: dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3),
        }),
    "E=256,N=4096,K=7168,block=128x128": dict(
        gemv_max=64, gemv=dict(block_n=8, block_k=1024, num_warps=4),
        gemm={
            8: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
            64: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
            512: dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
            4096: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
            32768: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
        }),
    "E=256,N=7168,K=2048,block=128x128": dict(
        gemv_max=64, gemv=dict(block_n=8, block_k=1024, num_warps=4),
        gemv_down=dict(block_n=8, block_k=512, num_warps=4),
        gemm={
            8: dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
            64: dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
            512: dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
            4096: dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3),
            32768: dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3),
        }),
}
"""Measured tile sizes per expert-GEMM shape, keyed ``"E=..,N=..,K=..,block=..|channel"`` (``N`` /
``K`` the GEMM's output / input width, so gate_up and down of one model are two keys): ``gemv_max``
(the largest ``M`` the GEMV path takes), ``gemv`` (its launch), ``gemv_down`` (where present: the
decode path's down projection runs fused with the activation and the sum over k,
:func:`moe_fp8_gemv_down`, with this launch; measured in CUDA graphs at T = 1 on one H100 by
``python scripts/moe_decode_bench.py``, benchmarks/results/h100_issue47_decode/: at the
DeepSeek-V3 block shape 126.7 us against 128.3 unfused; at both Qwen3-30B-A3B shapes the best
fused launch lost, 26.3 / 27.4 against 25.5 / 24.8 us, so they have none), ``gemm`` (``{max M: tiles}``, the
first bucket ``>= M`` wins; past the last, the defaults). Measured on one H100 80GB HBM3 with
``python scripts/kernel_bench.py fp8-moe`` (each GEMM's fastest of 9 tiles, alone, at T = 1, 8, 64,
512, 4096 tokens, top-8; the GEMV launch fastest at T = 1; ``gemv_max`` the largest measured ``M``
where the whole GEMV feed-forward beat the GEMM one; raw output in
benchmarks/results/h100_issue47_kernels/). Inside :func:`fused_moe_fp8` the down GEMM runs with the
gate_up GEMM's ``BLOCK_M`` (one sorted layout for both)."""


def _key(E: int, N: int, K: int, block: Optional[tuple[int, int]]) -> str:
    return f"E={E},N={N},K={K},{'block=%dx%d' % tuple(block) if block is not None else 'channel'}"


def _gemv_default(N: int, K: int, block: Optional[tuple[int, int]]) -> dict:
    return dict(block_n=4, block_k=min(2048, max(128, triton.next_power_of_2(K))), num_warps=4)


def _gemm_default(M: int, E: int, block: Optional[tuple[int, int]]) -> dict:
    per_expert = M / max(1, E)
    if per_expert <= 16:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    elif per_expert <= 48:
        cfg = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)
    if block is not None:
        cfg["BLOCK_K"] = block[1]
    return cfg


def use_fp8_moe_gemv(M: int, E: int, N: int, K: int, block: Optional[tuple[int, int]]) -> bool:
    """Whether ``M`` token-assignments of an ``[E, N, K]`` expert weight take the W8A16 GEMV."""
    entry = FP8_MOE_CONFIGS.get(_key(E, N, K, block))
    limit = entry["gemv_max"] if entry and "gemv_max" in entry else FP8_MOE_GEMV_MAX_ASSIGNMENTS
    return 0 < M <= limit


def fp8_moe_config(M: int, E: int, N: int, K: int, block: Optional[tuple[int, int]]) -> dict:
    """Tile sizes of :func:`moe_fp8_gemm` for ``M`` assignments of an ``[E, N, K]`` weight:
    :data:`FP8_MOE_CONFIGS`' bucket if measured, else by rows per expert (16-row blocks for decode
    sizes, 64 for long prefills, as :func:`~zpp.models.layers.fused_moe.moe_block_config`)."""
    return bucket_config(FP8_MOE_CONFIGS.get(_key(E, N, K, block), {}).get("gemm"), M) or _gemm_default(M, E, block)


def fp8_moe_gemv_config(E: int, N: int, K: int, block: Optional[tuple[int, int]]) -> dict:
    """Launch of :func:`moe_fp8_gemv` for an ``[E, N, K]`` weight (measured, else 4 rows x 2048)."""
    entry = FP8_MOE_CONFIGS.get(_key(E, N, K, block))
    return dict(entry["gemv"]) if entry and "gemv" in entry else _gemv_default(N, K, block)


def fp8_moe_gemv_down_config(E: int, H: int, I: int, block: Optional[tuple[int, int]]) -> Optional[dict]:
    """Launch of :func:`moe_fp8_gemv_down` for an ``[E, H, I]`` down weight, or None where the decode
    path keeps the activation, down GEMV and sum over k apart: the ``gemv_down`` entry of its
    :data:`FP8_MOE_CONFIGS` key (a shape where the fused kernel was measured faster); with
    ``ZPP_FP8_MOE_FUSED_DOWN=1`` every shape (unmeasured ones: 8 rows x 256 columns, 4 warps),
    with ``=0`` none."""
    if _FUSED_DOWN is False:
        return None
    entry = FP8_MOE_CONFIGS.get(_key(E, H, I, block))
    if entry and "gemv_down" in entry:
        return dict(entry["gemv_down"])
    return dict(block_n=8, block_k=256, num_warps=4) if _FUSED_DOWN else None


# --- the MoE feed-forward --------------------------------------------------------------------------
def _quant(h: torch.Tensor, block: Optional[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return per_token_quant(h) if block is None else per_token_group_quant(h, block[1])


def fused_moe_fp8(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, gate_up_scale: torch.Tensor,
                  down_scale: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, act,
                  block: Optional[tuple[int, int]] = None, b_gate_up: Optional[torch.Tensor] = None,
                  b_down: Optional[torch.Tensor] = None, config: Optional[dict] = None) -> torch.Tensor:
    """Mixture-of-experts feed-forward with e4m3 expert weights (see the module docstring).

    Args:
        x: ``[T, H]`` tokens (bf16 / fp16).
        w_gate_up: ``[E, 2I, H]`` float8_e4m3fn, gate rows then up rows; ``w_down``: ``[E, H, I]``.
        gate_up_scale, down_scale: float32 weight scales (``w ~= w_fp8 * scale``): per output channel
            ``[E, N]`` (``[E]`` / ``[E, 1]`` per expert, ``[]`` / ``[1]`` per tensor broadcast), or
            with ``block = (bn, bk)`` ``[E, ceil(N/bn), ceil(K/bk)]``.
        weights: ``[T, k]`` float32 routing weights; ``ids``: ``[T, k]`` int64 experts.
        act: the activation between the GEMMs, as :func:`~zpp.models.layers.fused_moe.fused_moe`'s.
        block: the weights' scale block, None for per-channel / per-tensor scales.
        b_gate_up: optional ``[E, 2I]`` bias; ``b_down``: optional ``[E, H]`` (before the routing weight).
        config: force a path: ``{"gemv": bool}`` (tests, benchmarks); default
            :func:`use_fp8_moe_gemv` on ``T * k``.

    Returns:
        ``[T, H]`` in ``x.dtype``: ``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``, activations
        quantized per token (per token and ``bk`` group for block weights) on the GEMM path, in
        ``x``'s dtype on the GEMV path.

    Raises:
        ValueError: a weight not float8_e4m3fn, scales of the wrong shape, ``bk`` not a power of
            two >= 16, or a block gate|up weight whose gate rows are not whole scale blocks.
    """
    T, H = x.shape
    k = ids.shape[1]
    E, I2, _ = w_gate_up.shape
    I = I2 // 2
    if w_gate_up.dtype != torch.float8_e4m3fn or w_down.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fused_moe_fp8 takes float8_e4m3fn expert weights, got {w_gate_up.dtype} / {w_down.dtype}")
    if block is not None:
        bn, bk = block
        if bk < 16 or bk & (bk - 1):
            raise ValueError(f"fused_moe_fp8: scale block K {bk} must be a power of two >= 16")
        if I % bn:
            raise ValueError(f"fused_moe_fp8: intermediate size {I} is not a multiple of the scale block {bn} "
                             f"(a block scale row would span gate and up)")
    M = T * k
    if M == 0:
        return torch.zeros_like(x)
    x = x if x.stride(1) == 1 else x.contiguous()
    rw = weights.reshape(-1).float().contiguous()
    kind = getattr(act, "triton_kind", None)
    gemv = (config or {}).get("gemv")
    if gemv is None:
        gemv = use_fp8_moe_gemv(M, E, I2, H, block)
    if gemv:
        flat = ids.reshape(-1)
        gate_up = torch.empty((M, I2), dtype=x.dtype, device=x.device)
        moe_fp8_gemv(x, w_gate_up, gate_up_scale, flat, gate_up, block, b_gate_up, None, k,
                     fp8_moe_gemv_config(E, I2, H, block))
        down_cfg = fp8_moe_gemv_down_config(E, H, I, block) if kind is not None else None
        if down_cfg is not None and (block is None or block[0] % down_cfg["block_n"] == 0):
            y = torch.empty((T, H), dtype=x.dtype, device=x.device)
            moe_fp8_gemv_down(gate_up, w_down, down_scale, ids, rw, y, kind, block, b_down, down_cfg)
            return y
        h = gated_act(gate_up, *kind) if kind is not None else act(gate_up)       # [M, I]
        h = h if h.stride(1) == 1 else h.contiguous()
        out = torch.empty((M, H), dtype=x.dtype, device=x.device)                 # [M, H] = [T, k, H]
        moe_fp8_gemv(h, w_down, down_scale, flat, out, block, b_down, rw, 1, fp8_moe_gemv_config(E, H, I, block))
    else:
        cfg1 = fp8_moe_config(M, E, I2, H, block)
        cfg2 = fp8_moe_config(M, E, H, I, block)
        if cfg2["BLOCK_M"] != cfg1["BLOCK_M"]:  # one sorted layout for both GEMMs
            cfg2 = dict(cfg2, BLOCK_M=cfg1["BLOCK_M"])
        sorted_ids, block_expert = moe_align(ids, E, cfg1["BLOCK_M"])
        xq, xs = _quant(x, block)
        gate_up = torch.empty((M, I2), dtype=x.dtype, device=x.device)
        out = torch.empty((M, H), dtype=x.dtype, device=x.device)                 # [M, H] = [T, k, H]
        moe_fp8_gemm(xq, xs, w_gate_up, gate_up_scale, gate_up, sorted_ids, block_expert, block, b_gate_up, None,
                     k, cfg1)
        if block is None and kind is not None and kind[0] == 0 and I <= SILU_MUL_QUANT_MAX_N:
            hq, hs = silu_mul_quant(gate_up)                                      # SiLU and quantization in one pass
        else:
            h = gated_act(gate_up, *kind) if kind is not None else act(gate_up)
            hq, hs = _quant(h if h.stride(1) == 1 else h.contiguous(), block)
        moe_fp8_gemm(hq, hs, w_down, down_scale, out, sorted_ids, block_expert, block, b_down, rw, 1, cfg2)
    if k == 1:
        return out
    return out.view(T, k, H).sum(dim=1, dtype=torch.float32).to(x.dtype)          # [T, H]

