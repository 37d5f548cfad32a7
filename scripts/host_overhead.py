"""Host (CPU) time per micro-batch, without any model: what the engine and a worker spend in Python.

    python scripts/host_overhead.py [--num-seqs 500] [--repeat 3] [--profile]

Engine side: a real EngineCore (scheduler, KV block manager, output handling) with an executor
stand-in that answers every batch at once with one sampled token per request; the stand-in's own
work (reading the batch and writing the result, which workers do) is timed apart and left out.
The scheduler is configured with no prefill attention budget and no target inter-token latency
(the stand-in reports no step times, and cut prompt chunks made 1000 prompts take hundreds of
micro-batches of ~130 sequences: the figures measured the scheduler's prefill planning instead of a
decode step).

Worker side: the recorded messages replayed through real ``ModelRunner``s of both stages of a
two-stage pipeline (stage 0 embeds, the last stage samples greedily and writes the StepResult),
with the model, the CUDA graphs and the stage link stubbed out, on the CPU: message decoding, the
per-request state update, the decode step's inputs, sampling bookkeeping and the result message,
as the worker does them around its GPU work. Only micro-batches of decodes are timed (the CUDA
graph path, i.e. the steady state); the graph replay's own staging copies are not included.

Per-sequence figures divide by the sequences actually in the micro-batches timed. On a pipeline,
every micro-batch pays the engine's time between its result coming back and the next batch
leaving; the stages idle for it unless enough micro-batches are in flight.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zpp.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig  # noqa: E402
from zpp.engine.core import EngineCore  # noqa: E402
from zpp.transport.core_messages import CoreRequest  # noqa: E402
from zpp.sampling_params import SamplingParams  # noqa: E402
from zpp.trace import Trace  # noqa: E402
from zpp.transport import messages as m  # noqa: E402


class InstantExecutor:
    """Answers each batch immediately (token 7 for every sampled chunk) and records the encoded
    messages so the worker side can be replayed. ``worker_s``: time spent standing in for the last
    stage (decoding the batch, writing the result), which the engine's figure leaves out."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.eos_token_ids = {0}
        self.results: asyncio.Queue = asyncio.Queue()
        self.sent: list[bytes] = []
        self.stage_busy_s = [0.0]
        self.stage_idle_s = [0.0]
        self.trace = Trace("engine")
        self.worker_s = 0.0

    def send(self, batch: m.ExecuteBatch, result_fields=None) -> None:
        payload = m.encode(batch)  # the real executor encodes once for every stage
        self.sent.append(payload)
        t = time.perf_counter()
        b = m.to_worker_decoder.decode(payload)
        res = m.encode(m.StepResult(b.batch_id, m.pack_int32([7] * int(m.BatchColumns(b).sample.sum()))))
        self.worker_s += time.perf_counter() - t
        self.results.put_nowait(m.from_worker_decoder.decode(res))  # the executor's read loop

    async def next_result(self):
        return await self.results.get()

    def interrupt(self) -> None:
        self.results.put_nowait(None)

    def shutdown(self) -> None:
        pass


def _model_dir() -> str:
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "vocab_size": 1024, "max_position_embeddings": 4096}, f)
    return d


def engine_side(num_seqs: int, input_len: int, output_len: int, depth: int, profile: bool):
    """Returns (seconds of engine time, recorded messages)."""
    config = EngineConfig(model=ModelConfig(_model_dir(), load_format="dummy"), parallel=ParallelConfig(device="cpu"),
                          scheduler=SchedulerConfig(max_num_seqs=num_seqs, pipeline_depth=depth,
                                                    max_num_batched_tokens=max(8192, num_seqs),
                                                    prefill_attention_budget=0, target_inter_token_latency=0),
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
    return elapsed - ex.worker_s, ex.sent


# --- worker side: real ModelRunners around stubs ---------------------------------------------------

class _StubModel:
    """What ModelRunner reads of a stage model, and a forward that returns zeros of the right shape."""

    num_acts, hidden_size, num_kv_heads, head_dim, num_local_layers, vocab = 2, 8, 1, 8, 0, 16
    cfg = {"num_attention_heads": 1}

    def __init__(self, stage):
        self.stage = stage

    def __call__(self, input_ids, positions, acts, kv_caches, meta):
        import torch
        T = positions.shape[0]
        return torch.zeros(T, self.hidden_size) if self.stage.is_last else \
            torch.zeros(self.num_acts, T, self.hidden_size)

    def compute_logits(self, hidden, upcast=True):
        import torch
        return torch.zeros(hidden.shape[0], self.vocab)


class _StubGraphs:
    """DecodeGraphs' interface without a GPU: every batch size has a graph; ``run`` returns zeros."""

    def __init__(self, stage, vocab: int):
        self.stage, self.vocab = stage, vocab

    def bucket(self, b: int):
        return b if b <= 1024 else None

    def run(self, b, input_ids, positions, slots, block_tables, acts, prev=()):
        import torch
        return torch.zeros(b, self.vocab) if self.stage.is_last else torch.zeros(2, b, 8)


class _StubLink:
    def send(self, t) -> None:
        pass

    def recv(self, shape, dtype):
        import torch
        return torch.zeros(shape, dtype=dtype)


class _HostEvent:
    """Stands in for ``torch.cuda.Event`` (PendingResult records one): the host is always done."""

    def __init__(self, *a, **k):
        pass

    def record(self, *a):
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _runner(pp_rank: int, max_num_seqs: int):
    import torch
    from zpp.models.base import StageInfo
    from zpp.workers.model_runner import ModelRunner
    stage = StageInfo(pp_rank, 2, pp_rank, pp_rank + 1)
    model = _StubModel(stage)
    r = ModelRunner(model, torch.device("cpu"), torch.float32, 16, _StubLink(), {0}, max_model_len=4096,
                    max_num_seqs=max_num_seqs)
    r.graphs = _StubGraphs(stage, model.vocab)
    r._pinned = [torch.empty(1 << 16, dtype=torch.int64) for _ in range(2)]  # no pinned memory on the CPU
    return r


def worker_side(sent: list[bytes], num_seqs: int, profile: bool) -> tuple[list[float], list[float], list[int]]:
    """Replays every message through stage 0 and the last stage. Returns the seconds of each decode
    micro-batch on each stage (message decoding included; on the last stage the result's encoding
    too) and its number of sequences."""
    import torch
    from zpp.workers.runner_state import PendingResult
    torch.cuda.Event = _HostEvent
    first, last = _runner(0, num_seqs), _runner(1, num_seqs)
    t0s, t1s, sizes = [], [], []
    prof = cProfile.Profile() if profile else None
    for payload in sent:
        decode = m.to_worker_decoder.decode(payload)
        is_decode = _is_decode(decode)
        if prof and is_decode:
            prof.enable()
        t = time.perf_counter()
        first.execute(m.to_worker_decoder.decode(payload))
        t1 = time.perf_counter()
        res = last.execute(m.to_worker_decoder.decode(payload))
        if isinstance(res, PendingResult):
            res = res.finish(last)
        m.encode(res)
        t2 = time.perf_counter()
        if prof and is_decode:
            prof.disable()
        if is_decode:
            t0s.append(t1 - t)
            t1s.append(t2 - t1)
            sizes.append(_size(decode))
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return t0s, t1s, sizes


def _is_decode(batch: m.ExecuteBatch) -> bool:
    n = m.int32s(batch.num_tokens)
    return len(n) > 0 and bool((n == 1).all())


def _size(batch: m.ExecuteBatch) -> int:
    return len(batch.slots) // 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--pipeline-depth", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each side; the fastest is reported")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    engine, worker = [], []
    for k in range(a.repeat):
        elapsed, sent = engine_side(a.num_seqs, a.input_len, a.output_len, a.pipeline_depth, a.profile and k == 0)
        engine.append(elapsed)
        worker.append(worker_side(sent, a.num_seqs, a.profile and k == 0))
    n = len(sent)
    seqs = sum(_size(m.to_worker_decoder.decode(p)) for p in sent)
    print(f"{a.num_seqs} sequences, {a.input_len}/{a.output_len} tokens, depth {a.pipeline_depth}: {n} micro-batches "
          f"of {seqs / n:.0f} sequences on average; best of {a.repeat} runs (all: engine "
          f"{', '.join(f'{e / n * 1e3:.2f}' for e in engine)} ms per micro-batch)")
    el = min(engine)
    print(f"engine: {el / n * 1e3:.2f} ms per micro-batch ({el / seqs * 1e6:.2f} us per sequence)")
    t0s, t1s, sizes = min(worker, key=lambda w: sum(w[0]) + sum(w[1]))
    nd, sd = len(sizes), sum(sizes)
    print(f"worker, {nd} decode micro-batches of {sd / max(nd, 1):.0f} sequences on average: "
          f"stage 0 {sum(t0s) / nd * 1e3:.2f} ms ({sum(t0s) / sd * 1e6:.2f} us per sequence), "
          f"last stage {sum(t1s) / nd * 1e3:.2f} ms ({sum(t1s) / sd * 1e6:.2f} us per sequence); "
          f"median stage 0 {statistics.median(t0s) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
