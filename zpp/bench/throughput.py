"""Offline throughput: ``num_prompts`` random prompts of ``input_len`` tokens, ``output_len`` new tokens
each (``ignore_eos``), all submitted at once. ``--backend hf`` runs HF transformers ``generate`` on the
same prompts so the peer is measured in the same run."""
from __future__ import annotations

import time


def add_parser(sub) -> None:
    from zpp.args import add_engine_args
    from zpp.bench.common import positive_int
    p = sub.add_parser("throughput", help="offline throughput (requests/s, tokens/s)")
    add_engine_args(p, model_optional=False)
    p.add_argument("--backend", choices=["zpp", "hf"], default="zpp")
    p.add_argument("--input-len", type=positive_int, default=128)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--num-prompts", type=positive_int, default=64)
    p.add_argument("--hf-max-batch-size", type=positive_int, default=64, help="HF backend: prompts per generate call")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)


def run(args) -> int:
    from zpp.bench.common import print_table, random_prompts, run_fields, write_json
    from zpp.args import engine_config_from_args
    config = engine_config_from_args(args, streaming=False)
    vocab = int(config.model.hf_config["vocab_size"])
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    if args.backend == "hf":
        elapsed, out_tokens = _run_hf(config, prompts, args)
        busy = None
    else:
        elapsed, out_tokens, busy = _run_zpp(config, prompts, args)
    total_tokens = out_tokens + args.num_prompts * args.input_len
    result = {
        "backend": args.backend, **run_fields(config),
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "elapsed_s": elapsed, "requests_per_s": args.num_prompts / elapsed,
        "total_tokens_per_s": total_tokens / elapsed, "output_tokens_per_s": out_tokens / elapsed,
        "stage_busy_fraction": busy,
    }
    rows = [("Backend", args.backend), ("Pipeline stages", result["pipeline_parallel_size"]),
            ("Tensor-parallel ranks / stage", result["tensor_parallel_size"]),
            ("Prompts", args.num_prompts), ("Input / output len", f"{args.input_len} / {args.output_len}"),
            ("Elapsed (s)", elapsed), ("Requests/s", result["requests_per_s"]),
            ("Total tokens/s", result["total_tokens_per_s"]), ("Output tokens/s", result["output_tokens_per_s"])]
    if busy:
        rows.append(("Stage busy fraction", ", ".join(f"{b:.2f}" for b in busy)))
    print_table("Throughput", rows)
    write_json(args.output_json, result)
    return 0


def _run_zpp(config, prompts, args):
    from zpp import LLM, SamplingParams
    from zpp.frontend.async_engine import AsyncEngine
    llm = LLM.from_config(config)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        # Warm-up: one full micro-batch of prompts (the first batch of a new shape was ~0.5 s slower
        # on the H200, 3% of a 1000-prompt run), then a few decode steps.
        n_warm = max(4, min(len(prompts), config.max_num_batched_tokens // max(1, args.input_len)))
        llm.generate(prompts[:n_warm], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        engine: AsyncEngine = llm.engine
        busy0 = list(engine.stats().stage_busy_s)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=True)
        elapsed = time.perf_counter() - t0
        # Non-last stages report their busy time once a second while busy and after 250 ms idle.
        time.sleep(0.6 if config.parallel.pipeline_parallel_size > 1 else 0)
        busy = [(b - a) / elapsed for a, b in zip(busy0, engine.stats().stage_busy_s)]
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return elapsed, out_tokens, [min(1.0, b) for b in busy]
    finally:
        llm.shutdown()


def hf_model(config):
    """HF transformers' model for ``config`` on its device and dtype (random weights with
    ``--load-format dummy``): the reference of ``--backend hf``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    device = torch.device(config.parallel.device)
    dtype = config.torch_dtype
    if config.model.load_format == "dummy":
        hf_cfg = AutoConfig.from_pretrained(config.model.model)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(config.model.model, dtype=dtype).to(device)
    return model.eval()


def hf_generate(model, prompts: list[list[int]], output_len: int, batch_size: int) -> int:
    """Greedy ``generate`` of exactly ``output_len`` tokens per prompt (equal-length prompts, in
    batches of ``batch_size``); returns the tokens generated."""
    import torch
    device = next(model.parameters()).device
    pad = int(model.config.pad_token_id if model.config.pad_token_id is not None else 0)
    out_tokens = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i:i + batch_size], device=device)  # equal lengths: no padding needed
            out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
            out_tokens += (out.shape[1] - batch.shape[1]) * out.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out_tokens


def _run_hf(config, prompts, args):
    model = hf_model(config)
    t0 = time.perf_counter()
    out_tokens = hf_generate(model, prompts, args.output_len, args.hf_max_batch_size)
    return time.perf_counter() - t0, out_tokens
