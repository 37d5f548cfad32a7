"""Decode attention over an FP8 (e4m3) KV cache against a bf16 one: the FP8 path with its products in
fp16 (default) or in q's bf16 (``fp8_f16=False``), over a few launch configurations; Llama-3-8B heads
(32 query / 8 KV heads of 128), 16-token blocks. The metadata tensors are built once, outside the timed
region (built per call, their host-to-device copies dominated large batches).

    python scripts/fp8_attn_sweep.py [B:C ...]     (default: 1:2048 256:384 1024:384 2048:192)
"""
import itertools
import sys

import torch
from triton.testing import do_bench

from zpp.models.layers import triton_ops as ops

dev = "cuda"
hq, hk, d, bs = 32, 8, 128, 16
torch.manual_seed(0)
shapes = [tuple(int(v) for v in a.split(":")) for a in sys.argv[1:]] or [(1, 2048), (256, 384), (1024, 384), (2048, 192)]
for B, C in shapes:
    nb = -(-(C + 1) // bs)
    kf = torch.randn(B * nb + 1, bs, hk, d, device=dev)
    vf = torch.randn(B * nb + 1, bs, hk, d, device=dev)
    q = torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    bt = torch.arange(B * nb, device=dev, dtype=torch.int32).view(B, nb)
    i32 = lambda v: torch.tensor(v, device=dev, dtype=torch.int32)
    sp = ops.decode_splits(B, hk)
    meta = (i32([C] * B), i32(list(range(B + 1))), i32(list(range(B))), i32([0] * B))
    args = lambda kc, vc: (q, kc, vc, out, bt, *meta, d ** -0.5, 16, sp)
    kb, vb = kf.bfloat16(), vf.bfloat16()
    k8, v8 = (kf * 2).to(torch.float8_e4m3fn), (vf * 2).to(torch.float8_e4m3fn)
    ref = ops.paged_attention(*args(k8.bfloat16() * 0.5, v8.bfloat16() * 0.5)).float().clone()
    t = do_bench(lambda: ops.paged_attention(*args(kb, vb)))
    byts = B * C * hk * d * 2
    print(f"B={B:5d} ctx {C:5d} splits {sp:2d} bf16 KV default          {t * 1e3:8.1f} us {byts * 2 / t / 1e6:6.0f} GB/s", flush=True)
    rows = []
    for f16, bn, ns in itertools.product((True, False), (None, 16, 64), (None, 4)):
        try:
            f = lambda: ops.paged_attention(*args(k8, v8), k_scale=0.5, v_scale=0.5, fp8_f16=f16, block_n=bn,
                                            num_stages=ns)
            err = ((f().float() - ref).norm() / ref.norm()).item()
            t8 = do_bench(f)
        except Exception as e:  # noqa: BLE001
            print(f"  fp8 fp16={f16} bn={bn} ns={ns}: {type(e).__name__}")
            continue
        rows.append((t8, f16, bn, ns, err))
    for t8, f16, bn, ns, err in sorted(rows)[:6] + [r for r in rows if r[2] is None and r[3] is None]:
        print(f"B={B:5d} ctx {C:5d} fp8 KV fp16={f16!s:5} block_n={bn!s:4} stages={ns!s:4} {t8 * 1e3:8.1f} us "
              f"{byts / t8 / 1e6:6.0f} GB/s  vs bf16 x{t / t8:4.2f}  rel.err {err:.1e}", flush=True)
