"""FP8 GEMMs of the W8A8 path (``torch._scaled_mm``) at Llama-3-8B shapes on one GPU: row-wise scales
(what ``fp8.fp8_linear_quantized`` runs: a per-token activation scale, a per-channel weight scale)
against one per-tensor scale each, each with and without ``use_fast_accum`` (FP8 tensor-core partial
sums kept in the MMA's own accumulator, not promoted to fp32 every few steps), and the bf16 product
beside them. Inputs are built once, outside the timed region; ``triton.testing.do_bench`` (median).

    python scripts/fp8_gemm_sweep.py [M ...]       (default: 1024 2048 16384)
"""
import sys

import torch
from triton.testing import do_bench

dev = "cuda"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ms = [int(a) for a in sys.argv[1:]] or [1024, 2048, 16384]
torch.manual_seed(0)
print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
print(f"{'M':>6} {'shape':8} {'bf16':>9} {'row':>9} {'row+fast':>9} {'tensor':>9} {'tens+fast':>9}  "
      f"(us; TFLOP/s of row+fast; rel.err row+fast vs row)")
tot = {}
for M in ms:
    for name, (N, K) in SHAPES.items():
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.05
        xs = x.float().abs().amax(1, keepdim=True) / 448
        ws = w.float().abs().amax(1, keepdim=True) / 448
        xq = (x.float() / xs).to(torch.float8_e4m3fn)
        wq = (w.float() / ws).to(torch.float8_e4m3fn)
        wt = wq.t()
        ws_row = ws.view(1, -1)
        xs_t, ws_t = xs.max().view(()), ws.max().view(())
        xq_t = (x.float() / xs_t).to(torch.float8_e4m3fn)
        wt_t = (w.float() / ws_t).to(torch.float8_e4m3fn).t()
        cases = {
            "bf16": lambda: x @ w.t(),
            "row": lambda: torch._scaled_mm(xq, wt, scale_a=xs, scale_b=ws_row, out_dtype=torch.bfloat16),
            "row+fast": lambda: torch._scaled_mm(xq, wt, scale_a=xs, scale_b=ws_row, out_dtype=torch.bfloat16,
                                                 use_fast_accum=True),
            "tensor": lambda: torch._scaled_mm(xq_t, wt_t, scale_a=xs_t, scale_b=ws_t, out_dtype=torch.bfloat16),
            "tens+fast": lambda: torch._scaled_mm(xq_t, wt_t, scale_a=xs_t, scale_b=ws_t, out_dtype=torch.bfloat16,
                                                  use_fast_accum=True),
        }
        t = {}
        for c, f in cases.items():
            try:
                t[c] = do_bench(f, warmup=50, rep=200) * 1e3
            except Exception as e:  # noqa: BLE001
                print(f"  {name} M={M} {c}: {type(e).__name__}: {str(e)[:120]}")
                t[c] = float("nan")
            tot[(M, c)] = tot.get((M, c), 0.0) + t[c]
        a, b = cases["row"]().float(), cases["row+fast"]().float()
        err = ((a - b).norm() / a.norm()).item()
        tf = 2 * M * N * K / (t["row+fast"] * 1e-6) / 1e12
        print(f"{M:6d} {name:8} " + " ".join(f"{t[c]:9.1f}" for c in cases) + f"  {tf:6.0f} TFLOP/s  {err:.1e}",
              flush=True)
    print(f"{M:6d} {'layer':8} " + " ".join(f"{tot[(M, c)]:9.1f}" for c in cases), flush=True)
