"""The W4A16 batch-1 GEMV on 32-bit words: ``y [M, N] = x [M, K] @ dequant(W)^T`` for decode
batches of ``M <= 4`` rows, reading the 4-bit layout of :mod:`zpp.models.quantization.w4_layout`
(``qweight`` uint8 ``[N, K // 2]``, viewed here as int32 ``[N, K // 8]``: eight codes a word,
column ``8c + j`` in bits ``4j .. 4j + 3`` of word ``c``).

Why words: the byte-wise GEMV (:func:`~zpp.models.quantization.w4a16_kernels.w4a16_gemv`'s first
kernel) spends ~16 instructions a code (its SASS: shuffles and shared-memory layout changes for the
per-step group reductions, one int -> float conversion a code). Here each thread keeps its own
``[rows, words]`` float32 accumulator -- no reduction until the loop ends -- and turns a code into
float32 without a conversion instruction:

* ``int4``: ``(w & (15 << 4p)) | 0x4B000000`` is the float ``2 ** 23 + q * 16 ** p`` (nibbles
  ``p = 0..3`` of the word's low half in place, the high half from ``w >> 16``), and one FMA
  ``f * 16 ** -p - (2 ** (23 - 4p) + 8)`` gives ``q - 8`` exactly: a LOP3 and two FMAs a code
  (this one and the product with ``x``). Zero points enter per word as ``z * sum(x)``.
* ``mxfp4``: codes ``p`` and ``p + 4`` (16 bits apart) become an fp16 pair in one register
  (sign to bit 15, exponent / mantissa to bits 9..11: ``E2M1 * 2 ** -14``, subnormals included;
  the ``2 ** 14`` goes into the group scale); fp16 -> fp32 is one ``HADD2.F32`` a code in the SASS.

The group scale multiplies each word's eight products (a group is 4 or 16 whole words). The grid
is ``(N / BLOCK_N, SPLIT_K)``: with ``SPLIT_K > 1`` each program reads a slice of ``K``, writes
float32 partial sums, and the last program of a row block to arrive (a per-stream counter, reset by
that program: no memset, CUDA-graph safe) adds them up. Loop cost in the sm_90 SASS: 4.2
instructions a code for int4, 5.2 for mxfp4 (16 rows a block). Measured (docs/benchmarks.md, "W4A16
kernels"): 1.27-1.78x faster than the byte-wise kernel over a Llama-3-70B layer's GEMVs. References: the in-register dequantization
tricks of FasterTransformer / Marlin (``lop3`` with an exponent "magic number"; Frantar et al.
2024) and Marlin's FP4 -> fp16 bit placement; written for zpp's layout.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from zpp.models.layers.pdl import pdl, pdl_enter

_MAGIC = 0x4B000000  # float32 bits of 2 ** 23


@triton.jit
def _i4(w, magic, MASK: tl.constexpr, P: tl.constexpr, OFF: tl.constexpr):
    """``q - OFF`` as float32 for the nibble ``w & MASK`` (``MASK = 15 << 4P``), exactly. ``magic``
    is ``0x4B000000`` passed at run time: in a register, mask and OR are one LOP3."""
    f = ((w & MASK) | magic).to(tl.float32, bitcast=True)
    return f * (1.0 / (16 ** P)) - (8388608.0 / (16 ** P) + OFF)


@triton.jit
def _fp4_pair(w, P: tl.constexpr, ASM: tl.constexpr):
    """E2M1 codes ``P`` and ``P + 4`` of each word as float32 ``E2M1 * 2 ** -14`` (lo, hi). ``ASM``
    (the GPU; the interpreter has no inline PTX): the two halves of the register go to
    ``cvt.f32.f16`` as they are, where Triton's truncations cost two byte permutes a pair."""
    if P == 3:
        a = w
        b = w >> 3
    else:
        a = w << (12 - 4 * P)
        b = w << (9 - 4 * P)
    h = (a & -2147450880) | (b & 0x0E000E00)          # 0x80008000 as int32: the two sign bits
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b16 l, u; mov.b32 {l, u}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, u; }",
            "=r,=r,r", [h], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo = (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = ((h >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _xj(X, xw, J: tl.constexpr, kmask, EVEN: tl.constexpr):
    """Activations of column ``8c + J`` for the step's words ``c`` (``xw = X offset of 8c``)."""
    if EVEN:
        return tl.load(X + xw + J).to(tl.float32)
    return tl.load(X + xw + J, mask=kmask, other=0.0).to(tl.float32)


@triton.jit
def _x8(X, c, kmask, VEC: tl.constexpr, EVEN: tl.constexpr):
    """The activations of the step's words ``c`` (``[BW]``): eight float32 ``[BW]`` vectors, ``x_j[i] =
    X[8 c[i] + j]``. ``VEC``: one strided load each (the words' layout holds four words a thread,
    the vectors come through shared memory); else one 16-byte load a word, split in registers (the
    layout holds one word a thread and every row of the block)."""
    if VEC:
        xw = 8 * c
        x0 = _xj(X, xw, 0, kmask, EVEN)
        x1 = _xj(X, xw, 1, kmask, EVEN)
        x2 = _xj(X, xw, 2, kmask, EVEN)
        x3 = _xj(X, xw, 3, kmask, EVEN)
        x4 = _xj(X, xw, 4, kmask, EVEN)
        x5 = _xj(X, xw, 5, kmask, EVEN)
        x6 = _xj(X, xw, 6, kmask, EVEN)
        x7 = _xj(X, xw, 7, kmask, EVEN)
    else:
        BW: tl.constexpr = c.shape[0]
        off = 8 * c[:, None] + tl.arange(0, 8)[None, :]
        if EVEN:
            xv = tl.load(X + off).to(tl.float32)                            # [BW, 8]
        else:
            xv = tl.load(X + off, mask=kmask[:, None], other=0.0).to(tl.float32)
        a, b = tl.split(xv.reshape(BW, 4, 2))                             # j even / odd
        a0, a1 = tl.split(a.reshape(BW, 2, 2))                            # j = 0, 4 / 2, 6
        b0, b1 = tl.split(b.reshape(BW, 2, 2))                            # j = 1, 5 / 3, 7
        x0, x4 = tl.split(a0)
        x2, x6 = tl.split(a1)
        x1, x5 = tl.split(b0)
        x3, x7 = tl.split(b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _row_dot(X, c, kmask, c0, c1, c2, c3, c4, c5, c6, c7, z, s, FMT: tl.constexpr, HAS_ZERO: tl.constexpr,
             VEC: tl.constexpr, EVEN: tl.constexpr):
    """One activation row's products with a step's codes ``c0..c7`` (float32, codes
    ``j`` of every word, ``[BW, BN]``: K along the first axis), scaled per word: ``[BW, BN]``."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _x8(X, c, kmask, VEC, EVEN)
    p = c0 * x0[:, None]
    p += c1 * x1[:, None]
    p += c2 * x2[:, None]
    p += c3 * x3[:, None]
    p += c4 * x4[:, None]
    p += c5 * x5[:, None]
    p += c6 * x6[:, None]
    p += c7 * x7[:, None]
    if FMT == 0:
        if HAS_ZERO:
            xs = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
            p -= z * xs[:, None]
    return p * s


@triton.jit
def _step_load(W, S, Z, w_rows, s_rows, z_rows, c, k_hi, n_ok, WPG: tl.constexpr, HAS_ZERO: tl.constexpr,
               EVEN: tl.constexpr):
    """A step's raw operands for words ``c`` (``[BW]``) of the rows: int32 words, scales and zero
    points (the scales again without zero points), ``[BW, BN]``; masked past ``k_hi`` / ``N``."""
    g = (c // WPG)[:, None]
    if EVEN:
        w = tl.load(W + w_rows + c[:, None])
        s = tl.load(S + s_rows + g)
        z = tl.load(Z + z_rows + g) if HAS_ZERO else s
    else:
        ok = n_ok[None, :] & (c < k_hi)[:, None]
        w = tl.load(W + w_rows + c[:, None], mask=ok, other=0)
        s = tl.load(S + s_rows + g, mask=ok, other=0)
        z = tl.load(Z + z_rows + g, mask=ok, other=0) if HAS_ZERO else s
    return w, s, z


@triton.jit(do_not_specialize=["stride_wu", "sixteen"])
def _w4_gemv_words_kernel(X, W, S, Z, B, Y, P, C, N, KW, magic, sixteen, stride_xm, stride_wn, stride_wu, stride_sn,
                          stride_zn, stride_ym,
                          M: tl.constexpr, FMT: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                          WPG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, SPLIT_K: tl.constexpr,
                          VEC: tl.constexpr, EVEN: tl.constexpr, PREFETCH: tl.constexpr = False, ASM: tl.constexpr = False,
                          USE_PDL: tl.constexpr = False):
    # Program (pid_n, ks): rows pid_n * BLOCK_N.. over words [ks * KWS, (ks + 1) * KWS) of each row.
    pid_n = tl.program_id(0)
    ks = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = n.to(tl.int64)[None, :]
    # VEC: the row stride as Triton specializes it (multiple of 16 words: 16-byte loads, four words
    # a thread); else the same stride unspecialized (alignment unknown: one word a thread)
    w_rows = rows * stride_wn if VEC else rows * stride_wu
    cw = tl.arange(0, BLOCK_W)
    kws = tl.cdiv(tl.cdiv(KW, SPLIT_K), BLOCK_W) * BLOCK_W     # words per split, a whole number of steps
    k_lo = ks * kws
    k_hi = tl.minimum(k_lo + kws, KW)
    pdl_enter(USE_PDL)
    acc0 = tl.zeros([BLOCK_W, BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_W, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_W, BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_W, BLOCK_N], tl.float32)
    if PREFETCH:  # registers double-buffered: the next step's loads go out before this step's math
        w, s, z = _step_load(W, S, Z, w_rows, rows * stride_sn, rows * stride_zn, k_lo + cw, k_hi, n_ok, WPG,
                             HAS_ZERO, EVEN)
    for kw in range(k_lo, k_hi, BLOCK_W):
        c = kw + cw                                                       # [BW] word index
        kmask = c < k_hi
        if PREFETCH:
            if EVEN:   # the last step loads its own words again (L2 hits) rather than masking
                cn = tl.minimum(kw + BLOCK_W, k_hi - BLOCK_W) + cw
            else:
                cn = c + BLOCK_W
            wn, sn, zn = _step_load(W, S, Z, w_rows, rows * stride_sn, rows * stride_zn, cn, k_hi, n_ok, WPG,
                                    HAS_ZERO, EVEN)
        else:
            w, s, z = _step_load(W, S, Z, w_rows, rows * stride_sn, rows * stride_zn, c, k_hi, n_ok, WPG,
                                 HAS_ZERO, EVEN)
        if FMT == 1:
            s = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0     # E8M0 * 2 ** 14
            c0, c4 = _fp4_pair(w, 0, ASM)
            c1, c5 = _fp4_pair(w, 1, ASM)
            c2, c6 = _fp4_pair(w, 2, ASM)
            c3, c7 = _fp4_pair(w, 3, ASM)
        else:
            s = s.to(tl.float32)
            OFF: tl.constexpr = 0.0 if HAS_ZERO else 8.0
            z = z.to(tl.float32)
            t = w >> sixteen                                          # run-time 16: LLVM keeps one shift a word
            c0 = _i4(w, magic, 0xF, 0, OFF)
            c1 = _i4(w, magic, 0xF0, 1, OFF)
            c2 = _i4(w, magic, 0xF00, 2, OFF)
            c3 = _i4(w, magic, 0xF000, 3, OFF)
            c4 = _i4(t, magic, 0xF, 0, OFF)
            c5 = _i4(t, magic, 0xF0, 1, OFF)
            c6 = _i4(t, magic, 0xF00, 2, OFF)
            c7 = _i4(t, magic, 0xF000, 3, OFF)
        acc0 += _row_dot(X, c, kmask, c0, c1, c2, c3, c4, c5, c6, c7, z, s, FMT, HAS_ZERO, VEC, EVEN)
        if M > 1:
            acc1 += _row_dot(X + stride_xm, c, kmask, c0, c1, c2, c3, c4, c5, c6, c7, z, s, FMT, HAS_ZERO, VEC, EVEN)
        if M > 2:
            acc2 += _row_dot(X + 2 * stride_xm, c, kmask, c0, c1, c2, c3, c4, c5, c6, c7, z, s, FMT, HAS_ZERO, VEC, EVEN)
        if M > 3:
            acc3 += _row_dot(X + 3 * stride_xm, c, kmask, c0, c1, c2, c3, c4, c5, c6, c7, z, s, FMT, HAS_ZERO, VEC, EVEN)
        if PREFETCH:
            w = wn
            s = sn
            z = zn
    y0 = tl.sum(acc0, 0)
    y1 = tl.sum(acc1, 0)
    y2 = tl.sum(acc2, 0)
    y3 = tl.sum(acc3, 0)
    if SPLIT_K > 1:
        # partial sums [SPLIT_K, M, N]; the row block's last program to arrive reduces them
        pp = P + ks * M * N + n
        tl.store(pp, y0, mask=n_ok)
        if M > 1:
            tl.store(pp + N, y1, mask=n_ok)
        if M > 2:
            tl.store(pp + 2 * N, y2, mask=n_ok)
        if M > 3:
            tl.store(pp + 3 * N, y3, mask=n_ok)
        tl.debug_barrier()
        done = tl.atomic_add(C + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            y0 = tl.zeros([BLOCK_N], tl.float32)
            y1 = tl.zeros([BLOCK_N], tl.float32)
            y2 = tl.zeros([BLOCK_N], tl.float32)
            y3 = tl.zeros([BLOCK_N], tl.float32)
            for j in tl.static_range(SPLIT_K):
                pj = P + j * M * N + n
                y0 += tl.load(pj, mask=n_ok, other=0.0, cache_modifier=".cg")
                if M > 1:
                    y1 += tl.load(pj + N, mask=n_ok, other=0.0, cache_modifier=".cg")
                if M > 2:
                    y2 += tl.load(pj + 2 * N, mask=n_ok, other=0.0, cache_modifier=".cg")
                if M > 3:
                    y3 += tl.load(pj + 3 * N, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(C + pid_n, 0)                                   # ready for the next launch
            _store_rows(B, Y, n, n_ok, y0, y1, y2, y3, stride_ym, M, HAS_BIAS)
    else:
        _store_rows(B, Y, n, n_ok, y0, y1, y2, y3, stride_ym, M, HAS_BIAS)


@triton.jit
def _store_rows(B, Y, n, n_ok, y0, y1, y2, y3, stride_ym, M: tl.constexpr, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        bias = tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)
        y0 += bias
        y1 += bias
        y2 += bias
        y3 += bias
    tl.store(Y + n, y0.to(Y.dtype.element_ty), mask=n_ok)
    if M > 1:
        tl.store(Y + stride_ym + n, y1.to(Y.dtype.element_ty), mask=n_ok)
    if M > 2:
        tl.store(Y + 2 * stride_ym + n, y2.to(Y.dtype.element_ty), mask=n_ok)
    if M > 3:
        tl.store(Y + 3 * stride_ym + n, y3.to(Y.dtype.element_ty), mask=n_ok)


_COUNTERS: dict = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters for the split-K reduction, one set per (device, stream): every launch
    leaves them zero again, so kernels of one stream (in order, PDL waits included) share them."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    c = _COUNTERS.get(key)
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[key] = c
    return c


def words_ok(qweight: torch.Tensor) -> bool:
    """Whether ``qweight`` (uint8 ``[N, K // 2]``) can be read as int32 words: ``K % 8 == 0``, row
    stride and start 4-byte aligned."""
    return (qweight.shape[-1] % 4 == 0 and qweight.stride(0) % 4 == 0 and qweight.storage_offset() % 4 == 0
            and qweight.stride(-1) == 1)


def w4a16_gemv_words(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                     group_size: int, fmt_id: int, bias: Optional[torch.Tensor] = None, block_n: int = 32,
                     block_k: int = 1024, num_warps: int = 4, num_stages: int = 1, split_k: int = 1,
                     vec: bool = False, prefetch: bool = False) -> torch.Tensor:
    """``x [M, K] @ dequant(W)^T (+ bias)`` -> ``[M, N]`` in ``x``'s dtype, ``M <= 4``, float32
    accumulation (module docstring). ``qweight`` uint8 ``[N, K // 2]`` with :func:`words_ok`;
    ``scales`` / ``zeros`` ``[N, K // group_size]`` (``fmt_id`` 0: int4, bf16 / fp16 / fp32 scales;
    1: mxfp4, uint8 E8M0 scales -- exponents above 240 overflow); ``block_k`` codes a step (a power
    of two, at least 8); ``split_k`` slices of ``K`` a row block (``>= 1``); ``vec``: four words a
    thread (16-byte loads) instead of one; ``prefetch``: registers double-buffered (the next step's
    loads issued before this step's arithmetic); ``num_stages``: Triton's pipelining. Validation is the
    caller's (:func:`~zpp.models.quantization.w4a16_kernels.w4a16_gemv`)."""
    M, K = x.shape
    N = qweight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    KW = K // 8
    bw = max(block_k // 8, 1)
    split_k = max(1, min(split_k, triton.cdiv(KW, bw)))
    kws = triton.cdiv(triton.cdiv(KW, split_k), bw) * bw
    split_k = triton.cdiv(KW, kws)                     # no empty slices
    even = N % block_n == 0 and KW % bw == 0 and (split_k == 1 or KW % kws == 0)
    grid_n = triton.cdiv(N, block_n)
    if split_k > 1:
        part = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, grid_n)
    else:
        part = cnt = y
    _w4_gemv_words_kernel[(grid_n, split_k)](
        x, qweight.view(torch.int32), scales, zeros if zeros is not None else scales, bias if bias is not None else x,
        y, part, cnt, N, KW, _MAGIC, 16, x.stride(0), qweight.stride(0) // 4, qweight.stride(0) // 4, scales.stride(0),
        zeros.stride(0) if zeros is not None else 0, y.stride(0),
        M=M, FMT=fmt_id, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None, WPG=group_size // 8,
        BLOCK_N=block_n, BLOCK_W=bw, SPLIT_K=split_k, VEC=vec, EVEN=even, PREFETCH=prefetch, ASM=x.is_cuda, num_warps=num_warps, num_stages=num_stages,
        **pdl(qweight))
    return y
