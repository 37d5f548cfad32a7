"""Latency of one batch: ``--batch-size`` random prompts of ``--input-len`` tokens generating
``--output-len`` tokens each (``ignore_eos``). Warm-up iterations, then timed ones; reports the
median end-to-end latency, the median prefill latency (a run with 1 output token) and
TPOT = (e2e - prefill) / (output_len - 1)."""
from __future__ import annotations

import statistics
import time


def add_parser(sub) -> None:
    from zpp.args import add_engine_args
    from zpp.bench.common import non_negative_int, positive_int
    p = sub.add_parser("latency", help="batch latency and time per output token")
    add_engine_args(p, model_optional=False)
    p.add_argument("--batch-size", type=positive_int, default=1)
    p.add_argument("--input-len", type=positive_int, default=128)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--num-iters-warmup", type=non_negative_int, default=2)
    p.add_argument("--num-iters", type=positive_int, default=5)
    p.add_argument("--backend", choices=["zpp", "hf"], default="zpp",
                   help="hf: HF transformers generate on the same prompts (the reference; same device and dtype)")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)


def run(args) -> int:
    from zpp import LLM, SamplingParams
    from zpp.bench.common import print_table, random_prompts, run_fields, write_json
    from zpp.args import engine_config_from_args
    config = engine_config_from_args(args, streaming=False)
    vocab = int(config.model.hf_config["vocab_size"])
    prompts = random_prompts(args.batch_size, args.input_len, vocab, args.seed)
    if args.backend == "hf":
        from zpp.bench.throughput import hf_generate, hf_model
        model = hf_model(config)

        class _HF:
            def generate(self, prompts, sp, use_tqdm=False):
                hf_generate(model, prompts, sp.max_tokens, len(prompts))

            def shutdown(self):
                pass
        llm = _HF()
    else:
        llm = LLM.from_config(config)
    try:
        def timed(max_tokens: int, iters: int) -> list[float]:
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            out = []
            for _ in range(iters):
                t0 = time.perf_counter()
                llm.generate(prompts, sp, use_tqdm=False)
                out.append(time.perf_counter() - t0)
            return out

        timed(args.output_len, args.num_iters_warmup)
        e2e = timed(args.output_len, args.num_iters)
        prefill = timed(1, max(3, args.num_iters))
    finally:
        llm.shutdown()
    e2e_med, prefill_med = statistics.median(e2e), statistics.median(prefill)
    tpot = (e2e_med - prefill_med) / max(1, args.output_len - 1)
    result = {**run_fields(config), "backend": args.backend, "enforce_eager": config.enforce_eager,
              "batch_size": args.batch_size,
              "input_len": args.input_len, "output_len": args.output_len,
              "latencies_s": e2e, "prefill_latencies_s": prefill, "median_latency_s": e2e_med,
              "median_prefill_latency_s": prefill_med, "tpot_ms": tpot * 1000}
    print_table(f"Latency ({args.backend})", [("Batch size", args.batch_size), ("Input / output len", f"{args.input_len} / {args.output_len}"),
                            ("Median e2e latency (s)", e2e_med), ("Median prefill latency (ms)", prefill_med * 1000),
                            ("TPOT (ms)", tpot * 1000)])
    write_json(args.output_json, result)
    return 0
