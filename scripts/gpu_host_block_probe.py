"""Which host call of a last stage's sampling blocks while the GPU is busy? (run on a GPU)

Queues ~150 ms of matmuls, then the calls a greedy prefill micro-batch makes after its forward
(gather the rows, LM head, argmax, copy the tokens to pinned memory) and prints the host time of
each, with a result of the previous round still pending, as in the worker:

    python scripts/gpu_host_block_probe.py
"""
import time

import torch
import torch.nn.functional as F

dev = "cuda"
W = torch.randn(128256, 4096, device=dev, dtype=torch.bfloat16)
hidden = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
a = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
b = torch.randn(4096, 14336, device=dev, dtype=torch.bfloat16)
pinned = [torch.empty(1024, dtype=torch.int64, pin_memory=True) for _ in range(2)]
pending = None
for it in range(12):
    R = 32 + 80 * it
    rows_host = torch.arange(R, dtype=torch.int64).pin_memory()
    for _ in range(60):
        torch.mm(a, b)  # ~150 ms of queued work
    t = [time.perf_counter()]
    rows = rows_host.to(dev, non_blocking=True); t.append(time.perf_counter())
    h = hidden[rows]; t.append(time.perf_counter())
    logits = F.linear(h, W); t.append(time.perf_counter())
    tok = logits.argmax(dim=-1); t.append(time.perf_counter())
    host = pinned[it % 2][:R]
    host.copy_(tok, non_blocking=True); t.append(time.perf_counter())
    ev = torch.cuda.Event(); ev.record(); t.append(time.perf_counter())
    if pending is not None:
        pending.synchronize()
    pending = ev
    ms = [f"{(y - x) * 1e3:7.2f}" for x, y in zip(t, t[1:])]
    print(f"R {R:4d}: upload {ms[0]} gather {ms[1]} lm_head {ms[2]} argmax {ms[3]} d2h {ms[4]} event {ms[5]} ms")
torch.cuda.synchronize()
