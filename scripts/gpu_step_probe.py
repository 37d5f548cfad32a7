"""Where a batch-1 decode step's GPU time goes inside the worker (run on the H200): builds one stage
(dummy weights) behind a ModelRunner as the engine's worker does (KV cache, CUDA graphs), runs a
prompt then decode steps through ``ModelRunner.execute`` with async-scheduling chunks
(``from_prev``), and compares the step's device time with a bare graph replay; then prints the
kernels of a few steps from torch.profiler. With a batch size B > 1: B requests of 256-token
prompts (prefilled 32 per micro-batch), then decode steps of all B (the 1000 x 256/256 shape).

    python scripts/gpu_step_probe.py scripts/configs/llama3-8b [num_kv_blocks [B [fp8 | fp8kv]]]

``fp8``: the weights quantized as ``--quantization fp8``; ``fp8kv``: that and an FP8 KV cache.
"""
import json
import sys

import torch

from zpp.models.base import StageInfo
from zpp.models.loader import load_stage_model
from zpp.sampling_params import SamplingParams
from zpp.transport import messages as m
from zpp.workers.model_runner import ModelRunner
from zpp.workers.runner_state import PendingResult

cfg_dir = sys.argv[1]
num_blocks = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
B = int(sys.argv[3]) if len(sys.argv) > 3 else 1
quant = sys.argv[4] if len(sys.argv) > 4 else ""
cfg = json.load(open(f"{cfg_dir}/config.json"))
dev = torch.device("cuda")
max_len = int(cfg.get("max_position_embeddings", 4096))
model = load_stage_model(cfg_dir, cfg, StageInfo(0, 1, 0, cfg["num_hidden_layers"]), torch.bfloat16, dev, max_len,
                         "dummy", quantization="fp8" if quant.startswith("fp8") else None)
r = ModelRunner(model, dev, torch.bfloat16, 16, None, {0}, async_scheduling=True, max_model_len=max_len,
                max_num_seqs=max(256, B), kv_cache_dtype=torch.float8_e4m3fn if quant == "fp8kv" else None)
r.init_kv_cache(num_blocks)
r.capture_graphs(max_len, max(256, B))
if B > 1:
    sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    L, per = 256, 20  # prompt tokens, KV blocks per request (room for 64 decodes)
    ids = [f"r{i}" for i in range(B)]
    for j in range(0, B, 32):
        b = m.BatchBuilder()
        for k, slot in enumerate(range(j, min(j + 32, B))):  # request i in slot i
            b.add(slot, 0, L, m.SAMPLE)
            b.new_request(slot, ids[slot], list(range(1000 + k, 1000 + k + L)), L,
                          list(range(slot * per, (slot + 1) * per)), sp)
        res = r.execute(b.build(j))
        res = res.finish(r) if isinstance(res, PendingResult) else res
    pos = L
    bid = [10_000]

    def dstep():
        global pos
        bid[0] += 1
        b = m.BatchBuilder()
        for slot in range(B):
            b.add(slot, pos, 1, m.SAMPLE | m.FROM_PREV)
        out = r.execute(b.build(bid[0]))
        pos += 1
        return out
    for i in range(5):
        dstep()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for i in range(20):
        dstep()
    e.record()
    torch.cuda.synchronize()
    print(f"ModelRunner.execute decode step, batch {B} (from_prev, greedy): {s.elapsed_time(e) / 20:.3f} ms/step "
          f"at context ~{pos}")
    g = r.graphs
    s.record()
    for i in range(20):
        g.graphs[g.bucket(B)].replay()
    e.record()
    torch.cuda.synchronize()
    print(f"bare graph replay, batch {B} (bucket {g.bucket(B)}): {s.elapsed_time(e) / 20:.3f} ms/step")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            dstep()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    sys.exit(0)

sp = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
prompt = list(range(1000, 1128))
blocks = list(range(64))
b0 = m.BatchBuilder()
b0.add(0, 0, 128, m.SAMPLE)
b0.new_request(0, "a", prompt, 128, blocks, sp)
res = r.execute(b0.build(0))
res = res.finish(r) if isinstance(res, PendingResult) else res
pos = 128


def step(bid):
    global pos
    b = m.BatchBuilder()
    b.add(0, pos, 1, m.SAMPLE | m.FROM_PREV)
    out = r.execute(b.build(bid))
    pos += 1
    return out


for i in range(20):
    p = step(1 + i)
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
n = 100
s.record()
for i in range(n):
    p = step(100 + i)
e.record()
torch.cuda.synchronize()
print(f"ModelRunner.execute decode step (from_prev, greedy): {s.elapsed_time(e) / n:.3f} ms/step at context ~{pos}")
g = r.graphs
s.record()
for i in range(n):
    g.graphs[1].replay()
e.record()
torch.cuda.synchronize()
print(f"bare graph replay, batch 1: {s.elapsed_time(e) / n:.3f} ms/step")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for i in range(5):
        p = step(300 + i)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
