"""Overhead of structured outputs: constrained vs free decoding of the same batch.

Runs ``--batch-size`` prompts of ``--input-len`` random token ids through the offline ``LLM``,
each generating exactly ``--output-len`` tokens greedily, once free and once constrained to a JSON
schema (an array of at least 1000 ``{"id": integer, "name": string}`` objects, so that no output
can complete, and end, within the budget); the runs alternate ``--repeats`` times and the median of
each is reported. Also measured: the engine core's turnaround (from taking a result to sending the
next micro-batch, free and constrained: the core does no grammar work, the result rank holds the
matchers), and alone, in this process, the result rank's grammar work per step for the whole
batch (xgrammar's batched bitmask fill and batched accept, on ``ZPP_GRAMMAR_THREADS`` or a quarter
of the cores, as the result rank runs them, overlapping the next batch's forward) and its time to
unpack the bitmask and mask the logits on the device.

Prints the figures and writes them as JSON (``--output-json``).

    python scripts/bench_structured.py                                 # CPU, demo model, batch 32
    python scripts/bench_structured.py --device cuda --model scripts/configs/llama3-8b \\
        --load-format dummy --tokenizer DIR --batch-size 256           # one GPU (DIR: a tokenizer)
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
    "required": ["id", "name"]}}


def _with_tokenizer_special_ids(model_dir: str, tokenizer_dir: str) -> str:
    """A model shape run with another model's tokenizer (``--tokenizer``) takes its BOS/EOS ids
    from that tokenizer: the shape's own ids (Llama-3's EOS 128001 with SmolLM2's 49,152-token
    tokenizer) name no token of it, and would make the grammar's vocabulary reach past the
    tokenizer to 128,002 ids (xgrammar then pays for ~79,000 ids that no grammar allows, on every
    accept and fill: a cost no real model has). Returns a temporary model directory (config.json
    only) when the ids had to change, else ``model_dir``."""
    import os
    import tempfile

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    eos = cfg.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos]
    if all(e is None or e < len(tok) for e in eos):
        return model_dir
    cfg["eos_token_id"], cfg["bos_token_id"] = tok.eos_token_id, tok.bos_token_id
    out = tempfile.mkdtemp(prefix="zpp-bench-shape-")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    print(f"{model_dir}: EOS {eos} is not a token of {tokenizer_dir} ({len(tok)} tokens): "
          f"run with the tokenizer's EOS {tok.eos_token_id}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the demo model)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    ap.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default=None, help="e.g. 256MiB (CPU default 1GiB)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    import torch

    from zpp import LLM, SamplingParams, StructuredOutputsParams
    from zpp.workers.sampler import apply_allowed, unpack_bitmask

    model = args.model
    if args.tokenizer and model:
        model = _with_tokenizer_special_ids(model, args.tokenizer)
    llm = LLM(model, pipeline_parallel_size=args.pipeline_parallel_size, device=args.device,
              load_format=args.load_format, tokenizer=args.tokenizer, kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=max(256, args.batch_size))
    engine = llm.engine
    vocab = engine.vocab_size
    rng = random.Random(0)
    tok_vocab = len(engine.tokenizer)
    prompts = [[rng.randrange(100, tok_vocab) for _ in range(args.input_len)] for _ in range(args.batch_size)]
    free = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    constrained = free.clone(structured_outputs=StructuredOutputsParams(json=SCHEMA))

    def run(sp) -> tuple[float, list]:
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t, outs

    run(free.clone(max_tokens=4))  # warm up (CUDA graphs, caches)
    t0 = time.perf_counter()
    llm._call(engine.compile_grammar(constrained))  # once; cached for every request after
    first_compile_s = time.perf_counter() - t0
    run(constrained.clone(max_tokens=4))
    # The core's turnaround (what stage 0 may wait for): from taking a result to sending the next
    # micro-batch (medians over the runs).
    core = engine.core
    ex = core.executor
    turn = {"batch": [], "at": None}
    ex_send, ex_next = ex.send, ex.next_result

    def send(batch, *a, **kw):
        if turn["at"] is not None:
            turn["batch"].append(time.perf_counter() - turn["at"])
            turn["at"] = None
        return ex_send(batch, *a, **kw)

    async def next_result():
        item = await ex_next()
        if item is not None and hasattr(item, "batch_id"):
            turn["at"] = time.perf_counter()
        return item

    ex.send, ex.next_result = send, next_result
    times = {"free": [], "json": []}
    turnaround = {"free": [], "json": []}
    for _ in range(args.repeats):
        for name, sp in (("free", free), ("json", constrained)):
            n0 = len(turn["batch"])
            dt, outs = run(sp)
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs), name
            times[name].append(dt)
            turnaround[name] += turn["batch"][n0:]
    del ex.send, ex.next_result
    sample = outs[0].outputs[0].text

    # The parts alone: the result rank's bitmask fill and accept (one step of the whole batch,
    # matchers mid-output) and its unpack + mask on the device.
    import numpy as np

    from zpp.transport import messages as m
    from zpp.workers.grammar import SlotGrammars, default_fill_threads
    from zpp.workers.slots import SlotTable
    spec = llm._call(engine.compile_grammar(constrained))
    n = args.batch_size
    store, table = SlotGrammars(n, vocab, default_fill_threads()), SlotTable(n, 16, 16)
    b = m.BatchBuilder()
    for i in range(n):
        b.new_request(i, f"r{i}", [1], 1, [0], None)
    batch = b.build(0)
    batch.grammars = [m.GrammarInit(i, spec.key, sorted(engine.eos_token_ids), spec.compiled) for i in range(n)]
    batch.grammar_tokenizer = engine.grammar.tokenizer_info_json
    table.apply(batch)
    store.apply(batch, table)
    slots = np.arange(n, dtype=np.int64)
    out_ids = outs[0].outputs[0].token_ids
    fill_s, accept_s = [], []
    for step in range(args.output_len):
        t = time.perf_counter()
        bitmask = store.fill(slots, np.full(n, step)).reshape(-1).view(np.uint8)
        fill_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert store.accept(slots, [out_ids[step]] * n) == ([], [])
        accept_s.append(time.perf_counter() - t)
    device = torch.device(args.device)
    logits = torch.randn(args.batch_size, vocab, device=device)
    rows = torch.arange(args.batch_size, device=device)
    mask_s = []
    for _ in range(20):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        apply_allowed(logits, (rows, unpack_bitmask(bitmask, args.batch_size, vocab, device)))
        if device.type == "cuda":
            torch.cuda.synchronize()
        mask_s.append(time.perf_counter() - t)
    llm.shutdown()

    free_s, json_s = statistics.median(times["free"]), statistics.median(times["json"])
    tokens = args.batch_size * args.output_len
    result = {
        "date": time.strftime("%Y-%m-%d"), "host": platform.node(), "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "model": engine.config.model.model, "load_format": args.load_format, "vocab_size": vocab,
        "pipeline_parallel_size": args.pipeline_parallel_size, "batch_size": args.batch_size,
        "input_len": args.input_len, "output_len": args.output_len, "repeats": args.repeats,
        "free_s": times["free"], "json_s": times["json"],
        "free_output_tok_s": tokens / free_s, "json_output_tok_s": tokens / json_s,
        "overhead_pct": 100.0 * (json_s - free_s) / free_s,
        "schema_compile_s": first_compile_s,
        "grammar_threads": default_fill_threads(),
        "result_rank_fill_bitmask_ms_per_step": {"median": 1e3 * statistics.median(fill_s), "max": 1e3 * max(fill_s)},
        "result_rank_accept_ms_per_step": {"median": 1e3 * statistics.median(accept_s),
                                           "max": 1e3 * max(accept_s)},
        "core_result_to_next_batch_ms": {k: 1e3 * statistics.median(v) if v else None for k, v in turnaround.items()},
        "last_stage_mask_ms_per_step": 1e3 * statistics.median(mask_s[2:]),
        "bitmask_bytes_per_step": len(bitmask),
        "sample_output": sample[:200],
    }
    print(f"batch {args.batch_size} x {args.output_len} tokens, {args.device}, PP={args.pipeline_parallel_size}, "
          f"vocab {vocab}")
    print(f"  free:        {result['free_output_tok_s']:9.1f} output tok/s  (median of {times['free']})")
    print(f"  JSON schema: {result['json_output_tok_s']:9.1f} output tok/s  (median of {times['json']})")
    print(f"  overhead:    {result['overhead_pct']:+.1f}%")
    print(f"  result rank per step ({default_fill_threads()} grammar thread(s)): bitmask fill "
          f"{result['result_rank_fill_bitmask_ms_per_step']['median']:.2f} ms ({len(bitmask)} bytes), accepting "
          f"the sampled tokens {result['result_rank_accept_ms_per_step']['median']:.2f} ms, unpack + mask "
          f"{result['last_stage_mask_ms_per_step']:.2f} ms; first compile {first_compile_s:.2f} s")
    tb = result["core_result_to_next_batch_ms"]
    print(f"  the core from a result to the next micro-batch sent (median): free {tb['free'] or 0:.2f} ms, "
          f"JSON {tb['json'] or 0:.2f} ms")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
