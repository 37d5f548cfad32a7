"""Grouped expert GEMMs for the CUDA path of :class:`zpp.models.layers.moe.FusedExperts` (Triton).

A micro-batch of ``T`` tokens routed to ``k`` experts each makes ``M = T * k`` *assignments*
(assignment ``a = t * k + j`` is token ``t``'s ``j``-th expert). The experts run as two launches,
whatever the number of experts, with no host synchronisation (so they can be captured in a CUDA
graph):

1. :func:`moe_align` groups the assignments by expert (counts and in-run positions by atomics,
   run offsets by a prefix sum, then a scatter) and pads each expert's run to a multiple of
   ``BLOCK_M``, so every ``BLOCK_M``-row block belongs to one expert. It writes
   fixed-size device buffers sized for the worst case (``M + min(E, M) * (BLOCK_M - 1)`` rows), so
   their shapes depend only on ``T``, never on the routing; blocks past the last expert's run are
   marked with expert ``E`` and do nothing.
2. :func:`fused_moe` runs ``_moe_gemm_kernel`` twice: the gate/up GEMM (each block's rows gather
   their tokens of ``x`` and multiply by its expert's ``[2I, H]`` matrix, plus its bias), the
   activation (``act(gate) * up`` and variants, one elementwise kernel), then the down GEMM
   (``[H, I]`` matrix, plus bias, times the assignment's routing weight in float32), writing each
   assignment's row of a ``[T, k, H]`` buffer; the ``k`` rows of a token are summed at the end.

The approach of vLLM's ``fused_moe`` Triton kernel and SGLang's (sorted / padded token ids, one
expert id per block, the routing weight applied in the down pass; Tillet et al. for Triton,
MegaBlocks (Gale et al. 2022, "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts")
for block-sparse expert computation). Written for zpp; shapes below use ``E`` experts, ``N`` a
GEMM's output width, ``K`` its input width.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from zpp.models.layers.pdl import pdl, pdl_enter


def max_padded_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted, padded assignment list in the worst case: every expert that can receive
    assignments (at most ``min(E, M)``) wastes up to ``block_m - 1`` padding rows; rounded up to a
    whole block."""
    rows = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    return -(-rows // block_m) * block_m


@triton.jit
def _moe_count_kernel(ids, counts, rank, M, BLOCK: tl.constexpr):
    """``rank[a]`` = how many assignments of ``a``'s expert were counted before it (atomics: the
    order inside an expert's run is arbitrary, which changes no result: a GEMM row depends on
    its own inputs only)."""
    a = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = a < M
    e = tl.load(ids + a, mask=ok, other=0).to(tl.int32)
    r = tl.atomic_add(counts + e, tl.full([BLOCK], 1, tl.int32), mask=ok)
    tl.store(rank + a, r, mask=ok)


@triton.jit
def _moe_offsets_kernel(counts, run_start, block_expert, sorted_ids, M, E, P,
                        BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr):
    """One program: each expert's first padded row, the expert of every block (``E`` past the
    end) and every row of ``sorted_ids`` set to the invalid ``M`` (the scatter fills the rest)."""
    e = tl.arange(0, BLOCK_E)
    c = tl.load(counts + e, mask=e < E, other=0)
    padded = (c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    tl.store(run_start + e, pad_end - padded, mask=e < E)
    pad_end = tl.where(e < E, pad_end, 2147483647)
    for b0 in range(0, P // BLOCK_M, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        owner = tl.sum((pad_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)  # experts ended before
        tl.store(block_expert + b, owner, mask=b < P // BLOCK_M)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        tl.store(sorted_ids + p, tl.full([BLOCK_P], 0, tl.int32) + M, mask=p < P)


@triton.jit
def _moe_scatter_kernel(ids, rank, run_start, sorted_ids, M, BLOCK: tl.constexpr):
    a = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = a < M
    e = tl.load(ids + a, mask=ok, other=0)
    dest = tl.load(run_start + e, mask=ok, other=0) + tl.load(rank + a, mask=ok, other=0)
    tl.store(sorted_ids + dest, a.to(tl.int32), mask=ok)


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort assignments by expert into ``block_m``-row blocks, each block one expert's.

    Args:
        ids: ``[T, k]`` int64 expert of each assignment (values in ``[0, E)``).
        num_experts: ``E``.
        block_m: rows per block of the GEMM kernel.

    Returns:
        ``sorted_ids`` ``[P]`` int32: assignment index (``t * k + j``) of each row, experts in
        increasing order (inside an expert's run in no particular order), runs padded to a
        multiple of ``block_m`` with ``M = T * k`` (an invalid row); ``P`` = :func:`max_padded_rows`.
        ``block_expert`` ``[P / block_m]`` int32: the expert of each block, ``E`` for blocks past
        the end. Device tensors only: a memset and three small Triton launches, no host
        synchronisation.
    """
    device = ids.device
    flat = ids.reshape(-1)                                                   # [M]
    M = flat.numel()
    P = max_padded_rows(M, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(M, dtype=torch.int32, device=device)
    run_start = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(P, dtype=torch.int32, device=device)
    block_expert = torch.empty(P // block_m, dtype=torch.int32, device=device)
    BLOCK = 256
    grid = (triton.cdiv(M, BLOCK),)
    _moe_count_kernel[grid](flat, counts, rank, M, BLOCK=BLOCK, num_warps=4)
    BLOCK_E = triton.next_power_of_2(num_experts + 1)
    _moe_offsets_kernel[(1,)](counts, run_start, block_expert, sorted_ids, M, num_experts, P, BLOCK_M=block_m,
                              BLOCK_E=BLOCK_E, BLOCK_B=max(1, min(64, 8192 // BLOCK_E)), BLOCK_P=1024, num_warps=4)
    _moe_scatter_kernel[grid](flat, rank, run_start, sorted_ids, M, BLOCK=BLOCK, num_warps=4)
    return sorted_ids, block_expert


@triton.jit
def _moe_gemm_kernel(A, W, Bias, C, sorted_ids, block_expert, routing_w,
                     M, N, K, num_experts,
                     stride_am, stride_we, stride_wn, stride_wk, stride_be, stride_cm,
                     A_ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_ROUTING: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """One ``BLOCK_M x BLOCK_N`` tile of ``C[rows] = A[rows // A_ROW_DIV] @ W[e]^T (+ Bias[e])
    (* routing_w[rows])`` for the block's expert ``e``; rows are assignment indices, ``>= M`` padding."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert + pid_m)
    if e >= num_experts:  # a block past the last expert's run
        return
    rows = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))      # [BM] int32
    row_ok = rows < M
    a_rows = (rows // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = A + a_rows[:, None] * stride_am + offs_k[None, :]                 # [BM, BK]
    w_ptr = W + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PREC)
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(Bias + e.to(tl.int64) * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTING:
        acc *= tl.load(routing_w + rows, mask=row_ok, other=0.0)[:, None]
    c_ptr = C + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def bucket_config(buckets: Optional[dict], rows: int) -> Optional[dict]:
    """A measured launch table's entry for ``rows`` (``{max rows: launch}``: the first bucket
    ``>= rows`` wins), a copy; None past the last bucket or without a table."""
    for bound in sorted(buckets or ()):
        if rows <= bound:
            return dict(buckets[bound])
    return None


def moe_block_config(num_assignments: int, num_experts: int) -> dict:
    """Tile sizes for :func:`fused_moe` from the routing's average rows per expert (a shape, known
    without looking at the routing): 16-row blocks for decode-sized batches (a block of one expert
    holds few tokens; less padding), 64 for long prefill chunks."""
    per_expert = num_assignments / max(1, num_experts)
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    if per_expert <= 48:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def moe_gemm(a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
             sorted_ids: torch.Tensor, block_expert: torch.Tensor, routing_w: Optional[torch.Tensor],
             a_row_div: int, cfg: dict) -> None:
    """``out[a] = a[a // a_row_div] @ w[e(a)]^T (+ bias[e(a)]) (* routing_w[a])`` for every
    assignment ``a < out.shape[0]`` (see :func:`moe_align`). ``a`` ``[R, K]``, ``w`` ``[E, N, K]``
    (any strides with a unit K stride for ``a``), ``bias`` ``[E, N]``, ``out`` ``[M, N]`` (unit N
    stride), ``routing_w`` ``[M]`` float32."""
    M, N = out.shape
    E, _, K = w.shape
    BM, BN, BK = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    prec = "ieee" if a.dtype == torch.float32 else "tf32"
    grid = (sorted_ids.numel() // BM, triton.cdiv(N, BN))
    _moe_gemm_kernel[grid](
        a, w, bias if bias is not None else w, out, sorted_ids, block_expert,
        routing_w if routing_w is not None else out, M, N, K, E,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), bias.stride(0) if bias is not None else 0,
        out.stride(0), A_ROW_DIV=a_row_div, HAS_BIAS=bias is not None, MUL_ROUTING=routing_w is not None,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, PREC=prec, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


# --- routing -------------------------------------------------------------------------------------
@triton.jit
def _topk_route_kernel(L, Wout, Iout, E, stride_l, TOPK: tl.constexpr, SCORING: tl.constexpr,
                       RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    """One token's row of router logits -> its ``TOPK`` (weight, expert) pairs, largest first.
    SCORING 0: softmax over the ``E`` logits in float32, top ``TOPK`` of the probabilities
    (renormalised to sum 1 if RENORM); 1: top ``TOPK`` of the logits, softmax over those."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    x = tl.load(L + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    if SCORING == 0:
        p = tl.exp(x - tl.max(x, 0))
        p = tl.where(ok, p, 0.0)
        v = p / tl.sum(p, 0)
    else:
        v = x
    v = tl.where(ok, v, float("-inf"))
    slot = tl.arange(0, BLOCK_K)
    top_v = tl.zeros([BLOCK_K], tl.float32)
    top_i = tl.zeros([BLOCK_K], tl.int64)
    for j in tl.static_range(TOPK):
        m = tl.max(v, 0)
        i = tl.minimum(tl.min(tl.where(v == m, e, BLOCK_E), 0), E - 1)   # the lowest expert among equals
        top_v = tl.where(slot == j, m, top_v)
        top_i = tl.where(slot == j, i.to(tl.int64), top_i)
        v = tl.where(e == i, float("-inf"), v)
    used = slot < TOPK
    if SCORING == 1:
        q = tl.where(used, tl.exp(top_v - tl.max(tl.where(used, top_v, float("-inf")), 0)), 0.0)
        top_v = q / tl.sum(q, 0)
    elif RENORM:
        top_v = top_v / tl.sum(tl.where(used, top_v, 0.0), 0)
    tl.store(Wout + t * TOPK + slot, top_v, mask=used)
    tl.store(Iout + t * TOPK + slot, top_i, mask=used)


def topk_route(logits: torch.Tensor, top_k: int, scoring: str = "softmax",
               renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k router's selection in one launch (vLLM's ``topk_softmax`` kernel does the same in CUDA):
    ``logits [T, E]`` (any float dtype, unit E stride) -> ``(weights [T, k] float32, ids [T, k]
    int64)``, the k largest first. ``scoring`` as :class:`~zpp.models.layers.moe.TopKRouter`'s:
    ``"softmax"`` (float32 softmax over all E, top k, divided by their sum if ``renormalize``) or
    ``"topk_softmax"`` (top k of the logits, then a float32 softmax over those). Equal values go
    to the lowest expert id. ``E <= 4096``; ValueError otherwise or for ``top_k`` outside ``[1, E]``."""
    T, E = logits.shape
    if not 1 <= top_k <= E or E > 4096:
        raise ValueError(f"topk_route: top_k={top_k} with {E} experts (1 <= top_k <= E <= 4096)")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    w = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    if T:
        BLOCK_E = max(16, triton.next_power_of_2(E))
        _topk_route_kernel[(T,)](logits, w, ids, E, logits.stride(0), TOPK=top_k,
                                 SCORING=0 if scoring == "softmax" else 1, RENORM=bool(renormalize),
                                 BLOCK_E=BLOCK_E, BLOCK_K=max(2, triton.next_power_of_2(top_k)),
                                 num_warps=1 if BLOCK_E <= 256 else 4, **pdl(logits))
    return w, ids


# --- activations between the two GEMMs ----------------------------------------------------------
@triton.jit
def _gated_act_kernel(X, Y, stride_x, stride_y, N, alpha, limit, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """``Y[r] = act(gate) * up`` for ``X[r] = gate | up`` (``N`` columns each). ACT 0: SiLU; 1: the
    clamped SwiGLU of gpt-oss (gate clamped above at ``limit``, up to ``[-limit, limit]``,
    ``(up + 1) * gate * sigmoid(alpha * gate)``)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        y = g / (1.0 + tl.exp(-g)) * u
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        y = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def gated_act(x: torch.Tensor, kind: int, alpha: float = 1.0, limit: float = 0.0) -> torch.Tensor:
    """``x [R, 2N]`` (gate | up) -> ``[R, N]`` in ``x.dtype``; ``kind`` as ``_gated_act_kernel``'s ACT."""
    R, N2 = x.shape
    N = N2 // 2
    y = torch.empty((R, N), dtype=x.dtype, device=x.device)
    BLOCK = min(1024, triton.next_power_of_2(N))
    _gated_act_kernel[(R, triton.cdiv(N, BLOCK))](x, y, x.stride(0), y.stride(0), N, float(alpha), float(limit),
                                                  ACT=kind, BLOCK=BLOCK, num_warps=4)
    return y


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, act, b_gate_up: Optional[torch.Tensor] = None,
              b_down: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mixture-of-experts feed-forward with grouped GEMMs (see the module docstring).

    Args:
        x: ``[T, H]`` tokens (bf16 / fp16 / fp32).
        w_gate_up: ``[E, 2I, H]``, gate rows then up rows of each expert; ``w_down``: ``[E, H, I]``.
        weights: ``[T, k]`` float32 routing weights; ``ids``: ``[T, k]`` int64 experts.
        act: the activation between the GEMMs, ``[R, 2I]`` -> ``[R, I]``; objects with a
            ``triton_kind`` attribute (``(kind, alpha, limit)``, see :func:`gated_act`) run in one
            Triton kernel, others are called as they are.
        b_gate_up: optional ``[E, 2I]`` bias; ``b_down``: optional ``[E, H]`` bias (added before the
            routing weight multiplies, as HF's gpt-oss).

    Returns:
        ``[T, H]`` in ``x.dtype``: ``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``.
    """
    T, H = x.shape
    k = ids.shape[1]
    E, I2, _ = w_gate_up.shape
    M = T * k
    if M == 0:
        return torch.zeros_like(x)
    cfg = moe_block_config(M, E)
    sorted_ids, block_expert = moe_align(ids, E, cfg["BLOCK_M"])
    x = x if x.stride(1) == 1 else x.contiguous()
    gate_up = torch.empty((M, I2), dtype=x.dtype, device=x.device)                # [M, 2I]
    moe_gemm(x, w_gate_up, b_gate_up, gate_up, sorted_ids, block_expert, None, k, cfg)
    kind = getattr(act, "triton_kind", None)
    h = gated_act(gate_up, *kind) if kind is not None else act(gate_up)           # [M, I]
    out = torch.empty((M, H), dtype=x.dtype, device=x.device)                     # [M, H] = [T, k, H]
    moe_gemm(h, w_down, b_down, out, sorted_ids, block_expert, weights.reshape(-1).float().contiguous(), 1, cfg)
    if k == 1:
        return out
    return out.view(T, k, H).sum(dim=1, dtype=torch.float32).to(x.dtype)         # [T, H]
