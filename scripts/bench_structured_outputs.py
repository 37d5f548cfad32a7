"""The engine core's grammar work on the critical path, on the CPU, without a model or a GPU.

A real :class:`~zpp.engine.core.EngineCore` (scheduler, KV blocks, real xgrammar matchers for a
JSON schema on the demo model's tokenizer) drives a *simulated* pipeline of ``--pp`` stages, each
taking ``--stage-ms`` per micro-batch (asyncio timers, so the core's CPU work runs while the stages
"compute", as it does against real workers). Micro-batches go through the stages in order; the last
stage samples a batch with constrained rows only once its token bitmask is there (inline, or the
``GrammarBitmask`` sent after the batch), then takes ``--sample-ms``. Every sampled token is the
next token of one valid JSON text (the schema's array of ``{"id", "name"}`` objects, at least 1000 of
them, so no output ends), which the grammars accept.

The same ``--batch-size`` x ``--output-len`` run is done free and JSON-constrained; reported:

* out tok/s of each and their ratio (1.0: the grammar costs nothing the stages see);
* per step (one micro-batch's result applied), the core's grammar time: the batched accept and the
  bitmask fill (their CPU time, wherever they ran);
* per step, the grammar time *on the critical path*: how long the stages waited because of it:
  stage 0 idle between micro-batches beyond the free run's, and the last stage's wait for a bitmask
  after its forward (``bitmask_wait_ms``);
* the core's turnaround, medians: from taking a result to sending the next micro-batch (what
  stage 0 waits for when the pipeline runs dry) and to sending the next bitmask (what the last
  stage waits for with async scheduling, if it is longer than a forward).

    python scripts/bench_structured_outputs.py                        # PP=1, async scheduling, 256 x 128
    python scripts/bench_structured_outputs.py --pp 2 --stage-ms 6    # a two-stage pipeline, depth 3
    python scripts/bench_structured_outputs.py --no-async-scheduling  # PP=1, one micro-batch in flight

When the core's thread needs more CPU per step than a stage's step (``core_thread_cpu_ms_per_step``
above ``--stage-ms``, e.g. on a loaded 2-core machine), the core, not the grammar's place in the
step, is the bottleneck: every figure then says so.

Without async scheduling for constrained requests (zpp before this change) a PP=1 engine split
them into two half micro-batches that alternate, each a whole step long: half the throughput
whatever the grammar costs (the simulated stage's step does not depend on its batch, as a GPU's
decode step barely does). ``--stage-ms 12`` is about one H200's decode step of the Llama-3-8B shape at batch 256 (20,709 out
tok/s); the vocabulary is the demo tokenizer's (49,152; the 8B's 128,256 makes the fill ~2.6x
dearer).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zpp.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from zpp.engine.core import EngineCore  # noqa: E402
from zpp.engine.core_messages import CoreRequest, GrammarSpec  # noqa: E402
from zpp.sampling_params import SamplingParams  # noqa: E402
from zpp.trace import Trace  # noqa: E402
from zpp.transport import messages as m  # noqa: E402

SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
    "required": ["id", "name"]}}


class SimulatedStages:
    """A StageExecutor standing in for ``pp`` stages of ``stage_s`` seconds per micro-batch each.

    Sampled token of a chunk = ``text[output index]`` (the chunk's end minus the prompt length).
    Records the last stage's waits for bitmasks and stage 0's idle gaps."""

    def __init__(self, num_blocks: int, pp: int, stage_s: float, sample_s: float, text: list[int],
                 prompt_len: int, eos: int):
        self.num_blocks, self.eos_token_ids = num_blocks, {eos}
        self.stage_busy_s, self.stage_idle_s, self.trace = [0.0] * pp, [0.0] * pp, Trace("engine")
        self.pp, self.stage_s, self.sample_s, self.text, self.prompt_len = pp, stage_s, sample_s, text, prompt_len
        self.results: asyncio.Queue = asyncio.Queue()
        self.queues = [asyncio.Queue() for _ in range(pp)]
        self.bitmasks: dict[int, asyncio.Future] = {}
        self.bitmask_wait_s = 0.0
        self.stage0_idle_s = 0.0
        self.batches = 0
        self._result_at = None  # when the core took the latest result
        self.to_batch: list[float] = []  # seconds from a result taken to the next batch sent
        self.to_bitmask: list[float] = []  # ... to the next bitmask sent
        self._sent_batch = self._sent_bitmask = True
        self._tasks = [asyncio.ensure_future(self._stage(s)) for s in range(pp)]

    def _bitmask(self, batch_id: int) -> asyncio.Future:
        f = self.bitmasks.get(batch_id)
        if f is None:
            f = self.bitmasks[batch_id] = asyncio.get_running_loop().create_future()
        return f

    def send(self, batch: m.ExecuteBatch, grammar_rows=(), grammar_bitmask=b"") -> None:
        now = time.perf_counter()
        if not self._sent_batch:
            self._sent_batch = True
            self.to_batch.append(now - self._result_at)
        if grammar_rows and grammar_bitmask:
            self._bitmask(batch.batch_id).set_result(now)
        self.queues[0].put_nowait((batch, bool(grammar_rows), now))

    def send_grammar_bitmask(self, batch_id: int, bitmask) -> None:
        now = time.perf_counter()
        if not self._sent_bitmask:
            self._sent_bitmask = True
            self.to_bitmask.append(now - self._result_at)
        self._bitmask(batch_id).set_result(now)

    async def _stage(self, s: int) -> None:
        """Stage ``s``: batches in order, on planned times (a batch starts when its input is there
        and the stage is free, and takes ``stage_s``), so that waits are measured even when the
        event loop, busy with the core, wakes this coroutine late."""
        free_at = None
        while True:
            batch, constrained, ready_at = await self.queues[s].get()
            start = ready_at if free_at is None else max(ready_at, free_at)
            if s == 0 and free_at is not None:
                self.stage0_idle_s += start - free_at
            end = start + self.stage_s
            await asyncio.sleep(max(0.0, end - time.perf_counter()))
            if s + 1 < self.pp:
                free_at = end
                self.queues[s + 1].put_nowait((batch, constrained, end))
                continue
            sample_at = end
            if constrained:
                arrived = await self._bitmask(batch.batch_id)
                del self.bitmasks[batch.batch_id]
                self.bitmask_wait_s += max(0.0, arrived - end)
                sample_at = max(end, arrived)
            free_at = sample_at + self.sample_s
            await asyncio.sleep(max(0.0, free_at - time.perf_counter()))
            c = m.BatchColumns(batch)
            ends = (c.starts + c.num_tokens)[c.sample] - self.prompt_len
            self.batches += 1
            self.results.put_nowait(m.StepResult(batch.batch_id, m.pack_int32([self.text[i] for i in ends])))

    async def next_result(self):
        r = await self.results.get()
        if r is not None:
            self._result_at = time.perf_counter()
            self._sent_batch = self._sent_bitmask = False
        return r

    def interrupt(self) -> None:
        self.results.put_nowait(None)

    def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()


def _model_dir(vocab: int) -> str:
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "vocab_size": vocab, "max_position_embeddings": 8192}, f)
    return d


def run(args, spec, text, eos, constrained: bool) -> dict:
    depth = args.pipeline_depth or args.pp + 1
    n, out_len, in_len = args.batch_size, args.output_len, args.input_len
    config = EngineConfig(model=ModelConfig(_model_dir(args.vocab), load_format="dummy"),
                          scheduler=SchedulerConfig(max_num_seqs=n, pipeline_depth=depth,
                                                    max_num_batched_tokens=max(8192, n * in_len),
                                                    prefill_attention_budget=0, target_inter_token_latency=0,
                                                    async_scheduling=args.async_scheduling and args.pp == 1),
                          cache=CacheConfig(num_kv_blocks=n * ((in_len + out_len) // 16 + 2)))

    async def main():
        ex = SimulatedStages(config.cache.num_kv_blocks, args.pp, args.stage_ms / 1e3, args.sample_ms / 1e3,
                             text, in_len, eos)
        done = asyncio.Event()
        left = {f"r{i}" for i in range(n)}
        bad = []

        def emit(out):
            for d in out.deltas:
                if d.finish_reason is not None:
                    left.discard(d.req_id)
                    if d.finish_reason != "length":
                        bad.append((d.req_id, d.finish_reason))
            if not left:
                done.set()

        core = EngineCore(config, ex, emit, lambda reason: done.set())
        spent = {"accept": 0.0, "fill": 0.0}
        store = core.grammars
        for name, attr in (("accept", "accept_tokens"), ("fill", "fill_rows")):
            fn = getattr(store, attr, None)
            if fn is None:  # an engine from before the batched accept / fill (for comparisons)
                continue

            def timed(*a, _fn=fn, _name=name, **kw):
                t = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    spent[_name] += time.perf_counter() - t
            setattr(store, attr, timed)
        core._loop_task = asyncio.create_task(core._run())
        sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        prompts = [[(i * 31 + j) % 1000 + 1 for j in range(in_len)] for i in range(n)]
        t, cpu = time.perf_counter(), time.thread_time()
        core.add_requests([CoreRequest(f"r{i}", p, sp, out_len, spec if constrained else None)
                           for i, p in enumerate(prompts)])
        await done.wait()
        el, cpu = time.perf_counter() - t, time.thread_time() - cpu
        steps = ex.batches
        await core.shutdown()
        if core.dead:
            raise RuntimeError(core.dead)
        if bad:
            raise RuntimeError(f"{len(bad)} sequences did not end by length, e.g. {bad[:3]}")
        return {"seconds": el, "out_tok_s": n * out_len / el, "steps": steps,
                "core_thread_cpu_ms_per_step": 1e3 * cpu / steps,
                "accept_ms_per_step": 1e3 * spent["accept"] / steps, "fill_ms_per_step": 1e3 * spent["fill"] / steps,
                "bitmask_wait_ms_per_step": 1e3 * ex.bitmask_wait_s / steps,
                "stage0_idle_ms_per_step": 1e3 * ex.stage0_idle_s / steps,
                "result_to_next_batch_ms": 1e3 * statistics.median(ex.to_batch) if ex.to_batch else None,
                "result_to_next_bitmask_ms": 1e3 * statistics.median(ex.to_bitmask) if ex.to_bitmask else None}

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=os.path.expanduser("~/.cache/zpp/SmolLM2-135M-Instruct"))
    ap.add_argument("--pp", type=int, default=1, help="simulated stages")
    ap.add_argument("--pipeline-depth", type=int, default=None, help="default: pp + 1 (as on CUDA)")
    ap.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                    help="PP=1 without async scheduling (it is on by default at PP=1, as on CUDA)")
    ap.add_argument("--stage-ms", type=float, default=12.0, help="each stage's forward per micro-batch")
    ap.add_argument("--sample-ms", type=float, default=0.5, help="the last stage's sampling")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    import hashlib

    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    args.vocab = len(tok)
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=args.vocab, stop_token_ids=[eos])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    spec = GrammarSpec(hashlib.sha256(json.dumps(SCHEMA).encode()).hexdigest()[:32], compiled.serialize_json(),
                       info.serialize_json())
    doc = json.dumps([{"id": i, "name": f"item number {i}"} for i in range(1000)], indent=1)
    text = tok.encode(doc, add_special_tokens=False)[:args.output_len + 1]

    runs = {"free": [], "json": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(run(args, spec, text, eos, name == "json"))
    med = {name: min(rs, key=lambda r: r["seconds"]) if len(rs) < 3 else sorted(rs, key=lambda r: r["seconds"])[len(rs) // 2]
           for name, rs in runs.items()}
    free, js = med["free"], med["json"]
    result = {"date": time.strftime("%Y-%m-%d"), "pp": args.pp, "pipeline_depth": args.pipeline_depth or args.pp + 1,
              "async_scheduling": args.async_scheduling and args.pp == 1, "stage_ms": args.stage_ms,
              "sample_ms": args.sample_ms, "batch_size": args.batch_size, "output_len": args.output_len,
              "vocab": args.vocab, "free": free, "json": js, "json_over_free": js["out_tok_s"] / free["out_tok_s"],
              "critical_path_ms_per_step": js["bitmask_wait_ms_per_step"]
              + max(0.0, js["stage0_idle_ms_per_step"] - free["stage0_idle_ms_per_step"]),
              "all_runs": runs}
    print(f"simulated PP={args.pp} (depth {result['pipeline_depth']}, async scheduling "
          f"{'on' if result['async_scheduling'] else 'off'}), {args.stage_ms:g} ms per stage, "
          f"batch {args.batch_size} x {args.output_len}, vocab {args.vocab}")
    for name, r in (("free", free), ("JSON schema", js)):
        print(f"  {name:12s} {r['out_tok_s']:9.1f} out tok/s   stage 0 idle {r['stage0_idle_ms_per_step']:.2f} ms/step, "
              f"last stage waits for bitmasks {r['bitmask_wait_ms_per_step']:.2f} ms/step")
    print(f"  JSON / free: {result['json_over_free']:.3f} (on a machine with fewer free cores than the core's "
          "threads, the stages' timers run late: compare the figures below)")
    for name, r in (("free", free), ("JSON schema", js)):
        b = r["result_to_next_bitmask_ms"]
        print(f"  {name:12s} median from a result to the next batch sent {r['result_to_next_batch_ms']:.2f} ms"
              + (f", to the next bitmask sent {b:.2f} ms" if b is not None else "")
              + f"; the core's thread: {r['core_thread_cpu_ms_per_step']:.2f} ms CPU per step")
    print(f"  core grammar work per step: accept {js['accept_ms_per_step']:.2f} ms, fill "
          f"{js['fill_ms_per_step']:.2f} ms; on the critical path: {result['critical_path_ms_per_step']:.2f} ms")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
