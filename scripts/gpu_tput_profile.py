"""Where a 1000 x 256/256 throughput run spends the GPU (run on the H200): one stage built
in-process (dummy weights, no engine), then
  - a decode step at batch B (default 1000) and context C (default 384): CUDA-graph replay time and
    the kernel-time table of one replay;
  - a prefill micro-batch of P prompts x L tokens (default 32 x 256 = 8192 tokens), eager: time and
    kernel table.
Matmul FLOPs are printed next to each so the table reads as TFLOP/s.

    python scripts/gpu_tput_profile.py scripts/configs/llama3-8b [B C P L] [--fp8] [--kv-fp8]

--fp8 quantizes the linear weights at load (``--quantization fp8``); --kv-fp8 makes the KV cache
float8_e4m3fn (``--kv-cache-dtype fp8``). The 30,000 x 128/128 run's decode steps: B 2048, C 192.
"""
import json
import sys

import numpy as np
import torch

from zpp.models.base import StageInfo
from zpp.models.layers.attention import build_attention_metadata
from zpp.models.loader import load_stage_model
from zpp.workers.cuda_graphs import DecodeGraphs

flags = {a for a in sys.argv[1:] if a.startswith("--")}
args = [a for a in sys.argv[1:] if not a.startswith("--")]
cfg_dir = args[0]
B, C, P, L = (int(a) for a in (args[1:5] if len(args) >= 5 else (1000, 384, 32, 256)))
kv_dtype = torch.float8_e4m3fn if "--kv-fp8" in flags else torch.bfloat16
cfg = json.load(open(f"{cfg_dir}/config.json"))
dev = torch.device("cuda")
n_layers = cfg["num_hidden_layers"]
model = load_stage_model(cfg_dir, cfg, StageInfo(0, 1, 0, n_layers), torch.bfloat16, dev, 4096, "dummy",
                          quantization="fp8" if "--fp8" in flags else None)
bs = 16
blocks_per_seq = -(-(C + 1) // bs)            # a decode sequence's blocks
prefill_blocks = -(-(L + 1) // bs)            # a prompt's
num_blocks = max(B * blocks_per_seq, P * prefill_blocks)
kv = [torch.zeros(2, num_blocks + 1, bs, model.num_kv_heads, model.head_dim, dtype=kv_dtype, device=dev)
      for _ in range(n_layers)]
group = cfg["num_attention_heads"] // model.num_kv_heads
params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)
H, V = cfg["hidden_size"], cfg["vocab_size"]
lm = H * V
print(f"matmul params per token (no embedding, no LM head): {(params - lm) / 1e9:.2f} B; LM head {lm / 1e9:.2f} B")


def table(prof, rows=24):
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows))


# --- decode at batch B --------------------------------------------------------------------------
g = DecodeGraphs(model, kv, bs, 4096, B, num_blocks * bs, torch.bfloat16, dev, group)
g.capture()
pos = np.full(B, C, dtype=np.int64)
bt = np.arange(B * blocks_per_seq, dtype=np.int32).reshape(B, blocks_per_seq)
rng = np.random.default_rng(0)
bt = rng.permutation(bt.reshape(-1)).reshape(B, blocks_per_seq).astype(np.int32)  # scattered, as in a run
slots = bt[:, C // bs].astype(np.int64) * bs + C % bs
ids = np.ones(B, dtype=np.int64)
for _ in range(3):
    g.run(B, ids, pos, slots, bt, None)
torch.cuda.synchronize()
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a.record()
for _ in range(10):
    g.graphs[g.bucket(B)].replay()
b.record()
torch.cuda.synchronize()
ms = a.elapsed_time(b) / 10
flop = 2 * B * params
kvb = B * (C + 1) * model.num_kv_heads * model.head_dim * 2 * kv[0].element_size() * n_layers
print(f"decode graph: batch {B} context {C}: {ms:.2f} ms/step; matmul {flop / 1e12:.1f} TFLOP "
      f"({flop / ms / 1e9:.0f} TFLOP/s if it were all), KV read {kvb / 1e9:.1f} GB")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    g.graphs[g.bucket(B)].replay()
    torch.cuda.synchronize()
table(prof)
del g
torch.cuda.empty_cache()

# --- prefill P x L ------------------------------------------------------------------------------
tables = [list(range(i * prefill_blocks, (i + 1) * prefill_blocks)) for i in range(P)]
meta = build_attention_metadata([0] * P, [L] * P, tables, bs, dev, group)
ids = torch.ones(P * L, dtype=torch.int64, device=dev)
post = torch.arange(L, device=dev).repeat(P)
last = torch.arange(P, device=dev) * L + L - 1
with torch.inference_mode():
    def step():
        h = model(ids, post, None, kv, meta)
        return model.compute_logits(h[last])
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    a.record()
    for _ in range(5):
        step()
    b.record()
    torch.cuda.synchronize()
    ms = a.elapsed_time(b) / 5
    flop = 2 * P * L * (params - lm) + 2 * P * lm
    print(f"prefill eager: {P} x {L} tokens: {ms:.2f} ms; matmul {flop / 1e12:.1f} TFLOP ({flop / ms / 1e9:.0f} TFLOP/s if it were all)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
table(prof)
