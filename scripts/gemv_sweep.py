"""In-graph timing of the batch-1..4 decode matrix-vector products (run on the H200): cuBLAS
(``F.linear``) against zpp's Triton GEMV over a grid of launch configurations, Llama-3-8B shapes.

Each case captures one CUDA graph that runs the product over 32 different weight matrices (one per
layer, as a decode step does; 32 x the weights is far past the 50 MB L2), replays it, and reports
microseconds per product and bytes of weight read per second. ``do_bench`` on a single launch would
time Python's launch overhead for kernels this short, not the kernel.

    python scripts/gemv_sweep.py [M ...]        (default M = 1)
"""
import itertools
import sys

import torch
import torch.nn.functional as F

from zpp.models.layers import triton_ops as ops

dev = "cuda"
torch.manual_seed(0)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32


def graph_us(fn, ws, x, reps=10):
    """Microseconds per product: fn(x, w) over every w in one graph, replayed ``reps`` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w in ws[:2]:
            fn(x, w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in ws:
            fn(x, w)
    for _ in range(2):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / reps / len(ws)


def main():
    ms = [int(a) for a in sys.argv[1:]] or [1]
    grid = list(itertools.product((2, 4, 8), (512, 1024, 2048), (4, 8), (1, 3)))
    for M in ms:
        totals = {}
        base_total = 0.0
        for name, (n, k) in SHAPES.items():
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
            x = torch.randn(M, k, device=dev, dtype=torch.bfloat16)
            gb = n * k * 2 / 1e9
            ref = F.linear(x, ws[0]).float()
            t = graph_us(lambda x, w: F.linear(x, w), ws, x)
            base_total += t
            print(f"M={M} {name:8} cublas                 {t:7.2f} us {gb / t * 1e6:6.0f} GB/s", flush=True)
            rows = []
            for bn, bk, nw, ns in grid:
                f = lambda x, w: ops.gemv(x, w, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                try:
                    err = ((f(x, ws[0]).float() - ref).norm() / ref.norm()).item()
                    t = graph_us(f, ws, x)
                except Exception as e:  # e.g. out of registers / shared memory
                    print(f"  n{bn} k{bk} w{nw} s{ns}: {type(e).__name__}")
                    continue
                rows.append((t, bn, bk, nw, ns, err))
                totals[(bn, bk, nw, ns)] = totals.get((bn, bk, nw, ns), 0.0) + t
            rows.sort()
            for t, bn, bk, nw, ns, err in rows[:5]:
                print(f"M={M} {name:8} triton n{bn} k{bk:4d} w{nw} s{ns}  {t:7.2f} us {gb / t * 1e6:6.0f} GB/s"
                      f"  rel.err {err:.1e}", flush=True)
            del ws
            torch.cuda.empty_cache()
        best = sorted((v, c) for c, v in totals.items() if len([1 for _ in SHAPES]) == 4)[:5]
        print(f"M={M} per layer (4 products): cublas {base_total:.1f} us", flush=True)
        for v, c in best:
            print(f"M={M} per layer: triton n{c[0]} k{c[1]} w{c[2]} s{c[3]} {v:.1f} us", flush=True)


if __name__ == "__main__":
    main()
