"""What an MTP draft costs on the last stage (issue 50): DeepSeek-V3's shape cut to a few layers
(``scripts/configs/deepseek-v3-5l-fp8``: 3 dense + 2 MoE layers, FP8 block-scaled, dummy weights)
plus its multi-token-prediction layer (``num_nextn_predict_layers: 1``), one GPU, batch 1.

The engine's own pieces run in process (the scheduler, the KV block manager, the last stage's
ModelRunner; no worker processes): a 256-token prompt, then decode steps. Three figures, every step
timed with a device sync around ``ModelRunner.execute`` (eager: MTP runs without CUDA graphs):

* a plain decode step (no speculation): the reference;
* with ``--speculative-config '{"method": "mtp", "num_speculative_tokens": k}'``: the verify step
  (1 + k tokens through the 5 layers, sampling) and, inside it, the MTP drafting (the MTP layer on
  the step's positions, then k - 1 chained one-token steps), timed on its own: its cost per draft
  token against the plain decode step.

    python scripts/gpu_mtp_draft_cost.py [config_dir] [k ...]

Prints one line per figure and a JSON summary line. ``--tiny`` shrinks the shape (a CPU check).
"""
import json
import sys
import time

import torch

from zpp import SamplingParams
from zpp.engine.kv_cache_manager import KVCacheManager
from zpp.engine.request import Request
from zpp.engine.scheduler import Scheduler
from zpp.engine.spec_decode import SpecDecoder
from zpp.models.base import StageInfo
from zpp.models.loader import load_stage_model
from zpp.spec_config import SpeculativeConfig, stage_model_config
from zpp.workers.model_runner import ModelRunner
from zpp.workers.mtp import MTPDrafter
from zpp.workers.runner_state import PendingResult

args = [a for a in sys.argv[1:] if not a.startswith("--")]
tiny = "--tiny" in sys.argv
cfg_dir = args[0] if args else "scripts/configs/deepseek-v3-5l-fp8"
ks = [int(a) for a in args[1:]] or [1, 2, 3]
cfg = json.load(open(f"{cfg_dir}/config.json"))
cfg["num_nextn_predict_layers"] = 1
if tiny:
    cfg.pop("quantization_config", None)
    cfg.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=64, n_routed_experts=16, n_group=4,
               topk_group=2, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, vocab_size=4096)
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
L = cfg["num_hidden_layers"]
MAX_LEN, BS, BLOCKS, PROMPT, STEPS, WARM = 1024, 16, 512, 256, 40, 10
model = load_stage_model(cfg_dir, stage_model_config(cfg, SpeculativeConfig("mtp", 1)), StageInfo(0, 1, 0, L), dtype,
                         dev, MAX_LEN, "dummy")
runner = ModelRunner(model, dev, dtype, BS, None, set(), max_model_len=MAX_LEN, max_num_seqs=4)
runner.init_kv_cache(BLOCKS)
if dev.type == "cuda":  # no expert warm-up: each run's first WARM steps (one token count each) are not timed
    print(torch.cuda.get_device_name(), f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB allocated", flush=True)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


draft_s: list[float] = []


def run(k: int) -> dict:
    """One request: the prompt, then decode steps; per-step seconds (after WARM) and drafting seconds."""
    runner.forget_requests()
    kv = KVCacheManager(BLOCKS, BS)
    spec = None
    runner.mtp = None
    if k:
        spec = SpecDecoder(SpeculativeConfig("mtp", k))
        spec.setup_kv(kv, MAX_LEN)
        runner.mtp = MTPDrafter(runner, k)
        inner = runner.mtp.draft

        def timed(*a, **kw):
            sync()
            t = time.perf_counter()
            inner(*a, **kw)
            sync()
            draft_s.append(time.perf_counter() - t)
        runner.mtp.draft = timed
    sched = Scheduler(kv, 4, 2048, MAX_LEN, spec=spec)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, int(cfg["vocab_size"]), (PROMPT,), generator=g).tolist()
    sched.add_request(Request("r", prompt, SamplingParams(temperature=0, max_tokens=STEPS * 4, ignore_eos=True),
                              STEPS * 4, set()))
    steps, tokens, drafts = [], [], []
    while len(steps) < STEPS + WARM + 1 and sched.has_work():
        b = sched.schedule()
        draft_s.clear()
        sync()
        t = time.perf_counter()
        res = runner.execute(b.batch)
        if isinstance(res, PendingResult):
            res = res.finish(runner)
        sync()
        steps.append(time.perf_counter() - t)
        drafts.append(sum(draft_s))
        tokens.append(len(sched.update(b, res)))
    steps, tokens, drafts = steps[1 + WARM:], tokens[1 + WARM:], drafts[1 + WARM:]  # the prompt, warm-up
    n = len(steps)
    return {"k": k, "step_ms": 1e3 * sum(steps) / n, "draft_ms": 1e3 * sum(drafts) / n,
            "tokens_per_step": sum(tokens) / n, "steps": n}


first = run(0)  # a whole run to warm up (the first one on the CPU was 20-40x slower than the next)
print(f"plain decode step, warm-up run: {first['step_ms']:.3f} ms", flush=True)
base = run(0)
print(f"plain decode step: {base['step_ms']:.3f} ms ({base['steps']} steps)", flush=True)
out = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "config": cfg_dir, "tiny": tiny,
       "plain_decode_ms": base["step_ms"], "mtp": []}
for k in ks:
    r = run(k)
    per = r["draft_ms"] / k
    r.update(draft_ms_per_token=per, draft_per_token_vs_decode=per / base["step_ms"],
             verify_ms=r["step_ms"] - r["draft_ms"], verify_vs_decode=(r["step_ms"] - r["draft_ms"]) / base["step_ms"])
    out["mtp"].append(r)
    print(f"k={k}: step {r['step_ms']:.3f} ms = verify {r['verify_ms']:.3f} ms ({r['verify_vs_decode']:.2f}x a decode "
          f"step) + MTP drafting {r['draft_ms']:.3f} ms ({per:.3f} ms per draft token, "
          f"{r['draft_per_token_vs_decode']:.3f}x a decode step); {r['tokens_per_step']:.2f} tokens per step "
          f"(random weights: acceptance is not the point)", flush=True)
again = run(0)
out["plain_decode_ms_again"] = again["step_ms"]
print(f"plain decode step again: {again['step_ms']:.3f} ms (ratios above use the first)", flush=True)
print(json.dumps(out))
