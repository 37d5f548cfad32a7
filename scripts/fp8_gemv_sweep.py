"""In-graph timing of FP8 (e4m3, per-channel scale) decode matrix-vector products on the H200:
zpp's W8A16 GEMV against candidate kernels, Llama-3-8B shapes, M = 1 (and 4).

Candidates: ``v0`` the current ``fp8_gemv`` (fp32 [BLOCK_N, BLOCK_K] partial sums), ``v1`` the same
with the partial sums reduced each step (fewer registers), ``tc16`` tensor cores: the weight tile
converted to fp16 (one ``cvt`` per two bytes) times ``x`` (fp16, a power-of-two per-token scale
keeps it in range) padded to 16 columns, ``tcbf`` the weight's bits placed into bf16 (exponent
re-biased by a multiply) times bf16 ``x``. Each case runs over 32 weight matrices in one CUDA graph
(far past the 50 MB L2), as gemv_sweep.py.

    python scripts/fp8_gemv_sweep.py [M ...]
"""
import itertools
import sys

import torch
import triton
import triton.language as tl

from zpp.models.quantization import fp8_kernels as K8
from zpp.models.quantization.fp8_utils import quantize_per_channel

sys.path.insert(0, "scripts")
from gemv_sweep import graph_us  # noqa: E402

dev = "cuda"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32


@triton.jit
def _v1(X, W, WS, Y, N, K, stride_xm, stride_wn, stride_ym, M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        w = tl.load(W + n[:, None] * stride_wn + k[None, :]).to(tl.float32)
        x = tl.load(X + k).to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
    s = tl.load(WS + n)
    tl.store(Y + n, (acc * s).to(Y.dtype.element_ty))


@triton.jit
def _tc(X, XS, W, WS, Y, N, K, stride_xm, stride_wn, stride_ym, M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, BF: tl.constexpr):
    # y[m, n] = sum_k w[n, k] x[m, k]: acc [BLOCK_N, 16] = W tile [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, 16]
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    mm = tl.arange(0, 16)
    m_ok = mm < M
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    if BF:
        inv = tl.full([16], 1.0, tl.float32)
    else:
        inv = 1.0 / tl.load(XS + mm, mask=m_ok, other=1.0)                      # [16]
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        if BF:
            b = tl.load(W.to(tl.pointer_type(tl.uint8)) + n[:, None] * stride_wn + k[None, :]).to(tl.uint16)
            bits = ((b & 0x80) << 8) | ((b & 0x7F) << 4)
            w = bits.to(tl.bfloat16, bitcast=True) * 1.329228e36   # 2**120: e4m3's bias 7 -> bf16's 127
            w = w.to(tl.bfloat16)
            xt = tl.load(X + mm[None, :] * stride_xm + k[:, None], mask=m_ok[None, :], other=0.0)
        else:
            w = tl.load(W + n[:, None] * stride_wn + k[None, :]).to(tl.float16)
            xt = (tl.load(X + mm[None, :] * stride_xm + k[:, None], mask=m_ok[None, :], other=0.0).to(tl.float32)
                  * inv[None, :]).to(tl.float16)
        acc = tl.dot(w, xt, acc)
    s = tl.load(WS + n)
    if BF:
        out = acc * s[:, None]
    else:
        out = acc * s[:, None] * (1.0 / inv)[None, :]
    tl.store(Y + mm[None, :] * stride_ym + n[:, None], out.to(Y.dtype.element_ty), mask=m_ok[None, :])


def v1(x, w, ws, bn, bk, nw, ns):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _v1[(N // bn,)](x, w, ws, y, N, K, x.stride(0), w.stride(0), y.stride(0), M=M, BLOCK_N=bn, BLOCK_K=bk,
                    num_warps=nw, num_stages=ns)
    return y


def tc(x, w, ws, bn, bk, nw, ns, bf):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    xs = x.abs().amax(-1).float().clamp(min=1e-6) / 256.0 if not bf else ws
    _tc[(N // bn,)](x, xs, w, ws, y, N, K, x.stride(0), w.stride(0), y.stride(0), M=M, BLOCK_N=bn, BLOCK_K=bk,
                    SPLIT_K=1, BF=bf, num_warps=nw, num_stages=ns)
    return y


def defaults(ms):
    """``--defaults``: only fp8_gemv with fp8_gemv_config, per shape and M."""
    for M in ms:
        tot = 0.0
        for name, (n, k) in SHAPES.items():
            wq = [quantize_per_channel(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(LAYERS)]
            x = torch.randn(M, k, device=dev, dtype=torch.bfloat16)
            cfg = K8.fp8_gemv_config(n, k)
            t = graph_us(lambda x, w: K8.fp8_gemv(x, w[0], w[1], None, **cfg), wq, x)
            tot += t
            print(f"M={M} {name:8} fp8_gemv {cfg} {t:7.2f} us {n * k / t / 1e3:6.0f} GB/s", flush=True)
        print(f"M={M} per layer (4 products) {tot:.1f} us", flush=True)


def main():
    if "--defaults" in sys.argv:
        return defaults([int(a) for a in sys.argv[1:] if a != "--defaults"] or [1])
    ms = [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [1]
    torch.manual_seed(0)
    for M in ms:
        totals = {}
        for name, (n, k) in SHAPES.items():
            wq = [quantize_per_channel(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(LAYERS)]
            x = torch.randn(M, k, device=dev, dtype=torch.bfloat16)
            gb = n * k / 1e9
            ref = (x.float() @ (wq[0][0].float() * wq[0][1].view(-1, 1)).t())
            cases = []
            cfg = K8.fp8_gemv_config(n, k)
            cases.append(("v0 default", lambda x, w: K8.fp8_gemv(x, w[0], w[1], None, **cfg)))
            for bn, bk, nw, ns in itertools.product((1, 2, 4, 8), (1024, 2048, 4096), (2, 4, 8), (1, 3)):
                cases.append((f"v0 n{bn} k{bk} w{nw} s{ns}",
                              lambda x, w, a=(bn, bk, nw, ns): K8.fp8_gemv(x, w[0], w[1], None, block_n=a[0], block_k=a[1],
                                                                       num_warps=a[2], num_stages=a[3])))
            if M == 1 and "--candidates" in sys.argv:
                for bn, bk, nw, ns in itertools.product((4, 8), (1024, 2048), (4, 8), (3,)):
                    cases.append((f"v1 n{bn} k{bk} w{nw} s{ns}", lambda x, w, a=(bn, bk, nw, ns): v1(x, w[0], w[1], *a)))
            for bf in ((False, True) if "--candidates" in sys.argv else ()):
                for bn, bk, nw, ns in itertools.product((16, 32, 64), (256, 512), (4,), (3, 4)):
                    cases.append((f"tc{'bf' if bf else '16'} n{bn} k{bk} w{nw} s{ns}",
                                  lambda x, w, a=(bn, bk, nw, ns, bf): tc(x, w[0], w[1], *a)))
            rows = []
            for label, f in cases:
                try:
                    err = ((f(x, wq[0]).float() - ref).norm() / ref.norm()).item()
                    t = graph_us(f, wq, x)
                except Exception as e:
                    print(f"M={M} {name} {label}: {type(e).__name__} {str(e)[:80]}", flush=True)
                    continue
                rows.append((t, label, err))
                fam = label.split()[0]
                totals.setdefault(label, 0.0)
                totals[label] += t
            rows.sort()
            d = [r for r in rows if r[1] == "v0 default"]
            if d:
                print(f"M={M} {name:8} v0 default {d[0][0]:7.2f} us {gb / d[0][0] * 1e6:6.0f} GB/s", flush=True)
            for fam in ("v0", "v1", "tc16", "tcbf"):
                fr = [r for r in rows if r[1].split()[0] == fam][:3]
                for t, label, err in fr if fam != "v0" else rows[:6]:
                    print(f"M={M} {name:8} {label:28} {t:7.2f} us {gb / t * 1e6:6.0f} GB/s rel.err {err:.1e}", flush=True)
            del wq
            torch.cuda.empty_cache()
        full = sorted((v, c) for c, v in totals.items())
        print(f"M={M} best configs over the 4 shapes (sum us per layer): " +
              "; ".join(f"{c} {v:.1f}" for v, c in full[:8]), flush=True)


if __name__ == "__main__":
    main()
