"""GPU step-time probe (run on the H200): builds one stage in-process (dummy weights), captures the
decode CUDA graphs and times graph replays at several batch sizes (pure GPU time per decode step,
no engine), then prints a kernel-time breakdown of one eager decode step from torch.profiler.

    python scripts/gpu_profile.py scripts/configs/llama3-8b [context_len]
"""
import json
import sys

import torch

from zpp.models.base import StageInfo
from zpp.models.loader import load_stage_model
from zpp.workers.cuda_graphs import DecodeGraphs

cfg_dir = sys.argv[1]
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 256
cfg = json.load(open(f"{cfg_dir}/config.json"))
dev = torch.device("cuda")
n_layers = cfg["num_hidden_layers"]
model = load_stage_model(cfg_dir, cfg, StageInfo(0, 1, 0, n_layers), torch.bfloat16, dev, 4096, "dummy")
bs, max_seqs = 16, 512
blocks_per_seq = -(-(ctx + 1) // bs)
num_blocks = max_seqs * blocks_per_seq
kv = [torch.zeros(2, num_blocks + 1, bs, model.num_kv_heads, model.head_dim, dtype=torch.bfloat16, device=dev)
      for _ in range(n_layers)]
group = cfg["num_attention_heads"] // model.num_kv_heads
g = DecodeGraphs(model, kv, bs, 4096, max_seqs, num_blocks * bs, torch.bfloat16, dev, group)
g.capture()
import numpy as np
for b in (1, 8, 64, 256, 512):
    pos = np.full(b, ctx, dtype=np.int64)
    bt = np.arange(b * blocks_per_seq, dtype=np.int32).reshape(b, blocks_per_seq)
    slots = (bt[:, ctx // bs].astype(np.int64) * bs + ctx % bs)
    ids = np.ones(b, dtype=np.int64)
    for _ in range(3):
        g.run(b, ids, pos, slots, bt, None)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 20
    start.record()
    for _ in range(n):
        g.graphs[g.bucket(b)].replay()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / n
    print(f"decode graph replay: batch {b:4d}, context {ctx}: {ms:.3f} ms/step, {b / ms * 1000:.0f} tokens/s")

# kernel breakdown of one eager decode step at batch 1
from zpp.models.layers.attention import build_attention_metadata
meta = build_attention_metadata([ctx], [1], [list(range(blocks_per_seq))], bs, dev, group)
ids = torch.ones(1, dtype=torch.int64, device=dev)
post = torch.tensor([ctx], device=dev)
with torch.inference_mode():
    for _ in range(3):
        model.compute_logits(model(ids, post, None, kv, meta))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        model.compute_logits(model(ids, post, None, kv, meta))
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))
