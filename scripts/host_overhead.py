"""Host (CPU) time per micro-batch, without any model: what the engine and a worker spend in Python.

    python scripts/host_overhead.py [--num-seqs 500] [--steps 200] [--profile]

Engine side: a real AsyncEngine (scheduler, KV block manager, output handling) with an executor
stand-in that answers every batch at once with one sampled token per request. Worker side: decoding
the batch message, updating the per-request state and building a decode step's inputs, as
``ModelRunner`` does before it launches the GPU work. On a pipeline, every micro-batch pays the
engine's time between its result coming back and the next batch leaving; the stages idle for it
unless enough micro-batches are in flight.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zpp.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from zpp.engine.core import EngineCore  # noqa: E402
from zpp.engine.core_messages import CoreRequest  # noqa: E402
from zpp.sampling_params import SamplingParams  # noqa: E402
from zpp.trace import Trace  # noqa: E402
from zpp.transport import messages as m  # noqa: E402


class InstantExecutor:
    """Answers each batch immediately (token 7 for every sampled chunk) and records the encoded
    messages so the worker side can be replayed."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.eos_token_ids = {0}
        self.results: asyncio.Queue = asyncio.Queue()
        self.sent: list[bytes] = []
        self.stage_busy_s = [0.0]
        self.stage_idle_s = [0.0]
        self.trace = Trace("engine")

    def send(self, batch: m.ExecuteBatch, grammar_rows=(), grammar_bitmask=b"") -> None:
        payload = m.encode(batch)
        self.sent.append(payload)
        b = m.to_worker_decoder.decode(payload)
        res = m.StepResult(b.batch_id, [m.SampledOutput(c.req_id, 7) for c in b.chunks if c.sample])
        self.results.put_nowait(m.from_worker_decoder.decode(m.encode(res)))

    async def next_result(self):
        return await self.results.get()

    def interrupt(self) -> None:
        self.results.put_nowait(None)

    def shutdown(self) -> None:
        pass


def engine_side(num_seqs: int, input_len: int, output_len: int, depth: int, profile: bool):
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "vocab_size": 1024, "max_position_embeddings": 4096}, f)
    config = EngineConfig(model=ModelConfig(d, load_format="dummy"),
                          scheduler=SchedulerConfig(max_num_seqs=num_seqs, pipeline_depth=depth,
                                                    max_num_batched_tokens=max(8192, num_seqs)),
                          cache=CacheConfig(num_kv_blocks=num_seqs * ((input_len + output_len) // 16 + 2)))
    ex = InstantExecutor(config.cache.num_kv_blocks)

    async def main():
        done = asyncio.Event()
        left = {f"r{i}" for i in range(num_seqs)}

        def emit(out):
            for d in out.deltas:
                if d.finish_reason is not None:
                    left.discard(d.req_id)
            if not left:
                done.set()

        core = EngineCore(config, ex, emit, lambda reason: done.set())
        core._loop_task = asyncio.create_task(core._run())
        sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        prompts = [[(i * 31 + j) % 1000 + 1 for j in range(input_len)] for i in range(num_seqs)]
        t = time.perf_counter()
        core.add_requests([CoreRequest(f"r{i}", p, sp, output_len) for i, p in enumerate(prompts)])
        await done.wait()
        el = time.perf_counter() - t
        await core.shutdown()
        if core.dead:
            raise RuntimeError(core.dead)
        return el

    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    elapsed = asyncio.run(main())
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return elapsed, ex.sent


def worker_side(sent: list[bytes], profile: bool) -> float:
    """Decode + state update + decode-step input building for every recorded batch (no tensors
    beyond the host arrays the CUDA-graph path fills)."""
    import numpy as np
    from zpp.workers.sampler import SeqState
    seqs: dict[str, SeqState] = {}
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    t = time.perf_counter()
    for payload in sent:
        batch = m.to_worker_decoder.decode(payload)
        for rid in batch.finished_req_ids:
            seqs.pop(rid, None)
        for r in batch.new_reqs:
            seqs[r.req_id] = SeqState(list(r.token_ids), r.num_prompt_tokens, r.sampling, list(r.block_ids))
        for c in batch.cached_reqs:
            s = seqs[c.req_id]
            s.token_ids.extend(c.new_token_ids)
            s.block_ids.extend(c.new_block_ids)
        chunk_seqs = [seqs[c.req_id] for c in batch.chunks]
        starts = [c.start for c in batch.chunks]
        if all(c.num_tokens == 1 for c in batch.chunks):
            B = len(chunk_seqs)
            pos = np.asarray(starts, dtype=np.int64)
            w = int(pos.max()) // 16 + 1
            bt = np.zeros((B, w), dtype=np.int32)
            for i, s in enumerate(chunk_seqs):
                n = min(len(s.block_ids), w)
                bt[i, :n] = s.block_ids[:n]
            np.asarray([s.token_ids[p] for s, p in zip(chunk_seqs, starts)], dtype=np.int64)
    el = time.perf_counter() - t
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(15)
    return el


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--pipeline-depth", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    elapsed, sent = engine_side(a.num_seqs, a.input_len, a.output_len, a.pipeline_depth, a.profile)
    n = len(sent)
    w = worker_side(sent, a.profile)
    per_batch = a.num_seqs / a.pipeline_depth
    print(f"{a.num_seqs} sequences, {a.input_len}/{a.output_len} tokens, depth {a.pipeline_depth}: "
          f"{n} micro-batches (~{per_batch:.0f} sequences each)")
    print(f"engine: {elapsed / n * 1e3:.2f} ms per micro-batch "
          f"({elapsed / n / per_batch * 1e6:.1f} us per sequence)")
    print(f"worker: {w / n * 1e3:.2f} ms per micro-batch ({w / n / per_batch * 1e6:.1f} us per sequence)")


if __name__ == "__main__":
    main()
