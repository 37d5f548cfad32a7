"""CPU benchmark of n-gram speculative decoding (``--speculative-config``) on the demo model.

    python scripts/cpu_spec_bench.py [--pp 2] [--repeat 3] [--k 3] [--streams 32] [--configs 3:2-4,4:3-5] [--dense]

Two offline ``LLM``s of the demo model (SmolLM2-135M-Instruct) at ``--pp`` stages, one without
speculation and one with ``{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
"prompt_lookup_min": 2}`` (``--k``, ``--lookup-max``, ``--lookup-min``), alive together; runs
alternate between them (A/B interleaved: the development VM's 2 cores are shared, so load changes
during a run hit both alike).

* Batch 1: copy-heavy chat prompts ("repeat this text", "rename this function and write the code
  again"), greedy, one request at a time. TPOT = (time of the whole request - time of the same
  request with max_tokens 1) / (tokens - 1). Prints each mode's median TPOT, the speed-up (also per
  prompt), the mean acceptance length (1 + accepted drafts per verify chunk), the tokens per decode
  step, and the token-weighted TPOT (all requests' decode time over their decode tokens: long,
  hard-to-copy outputs weigh more than in the median).
* ``--streams`` concurrent requests (the same prompts and ordinary questions, greedy, 64 tokens):
  output tokens per second of the whole batch, each mode, and the ratio; ``--repeat`` - 1 rounds,
  the modes in reverse order every other round (ABBA).

The outputs of the two modes are checked equal (greedy).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zpp import LLM, SamplingParams  # noqa: E402

TEXT = ("Pipeline parallelism splits a model's layers into stages. Each stage runs in its own process and "
        "sends its activations to the next one, so that several micro-batches are in flight at once and "
        "every stage stays busy.")
CODE = ("def moving_average(values, window):\n    out = []\n    total = 0.0\n    for i, v in enumerate(values):\n"
        "        total += v\n        if i >= window:\n            total -= values[i - window]\n"
        "        out.append(total / min(i + 1, window))\n    return out\n")
COPY_PROMPTS = [
    "Repeat this text exactly, word for word:\n\n" + TEXT,
    "Rename the function moving_average to rolling_mean and write the code again:\n\n" + CODE,
    "Repeat this code exactly:\n\n" + CODE,
    "Rewrite this text with 'stages' replaced by 'parts', changing nothing else:\n\n" + TEXT,
]
OTHER_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers.",
                 "Explain what a CPU cache is in two sentences."]


def chat(llm, prompts, max_tokens):
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    return llm.chat(msgs, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--streams", type=int, default=32, help="0: skip the concurrent run")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--configs", default=None,
                    help="several n-gram settings side by side, 'k:min-max[:disable_by_batch_size],...' (e.g. "
                         "'3:2-4,4:3-5,3:2-4:8'); each gets its own LLM, alive with the others, runs interleaved "
                         "(overrides --k and --lookup-*)")
    ap.add_argument("--batch1", type=int, default=1, help="0: skip the batch-1 runs")
    ap.add_argument("--dense", action="store_true",
                    help="also run 'off' and the first n-gram setting with ZPP_CPU_ONEDNN_LINEAR=0 (MKL's F.linear, "
                         "the CPU linear path before oneDNN packing), interleaved with the others; each n-gram mode "
                         "is compared with the 'off' of its own linear path")
    args = ap.parse_args()
    configs = [(args.k, args.lookup_min, args.lookup_max, None)]
    if args.configs:
        configs = []
        for c in args.configs.split(","):
            parts = c.split(":")
            configs.append((int(parts[0]), *map(int, parts[1].split("-")), int(parts[2]) if len(parts) > 2 else None))
    kw = dict(device="cpu", pipeline_parallel_size=args.pp, max_model_len=1024)
    # zpp's default CPU linears (oneDNN, packed weights); ZPP_CPU_ONEDNN_LINEAR=0 in the environment
    # measures MKL's F.linear instead
    llms = {"off": LLM(**kw)}
    for k, lo, hi, limit in configs:
        llms[f"k={k} {lo}-{hi}" + (f" disable_by_batch_size={limit}" if limit else "")] = LLM(**kw, speculative_config={
            "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": hi, "prompt_lookup_min": lo,
            "disable_by_batch_size": limit})
    if args.dense:  # the same two modes with MKL's F.linear (the workers read the variable when they load)
        linear = os.environ.get("ZPP_CPU_ONEDNN_LINEAR")
        os.environ["ZPP_CPU_ONEDNN_LINEAR"] = "0"
        try:
            llms["off dense"] = LLM(**kw)
            k, lo, hi, limit = configs[0]
            llms[f"k={k} {lo}-{hi} dense"] = LLM(**kw, speculative_config={
                "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": hi, "prompt_lookup_min": lo,
                "disable_by_batch_size": limit})
        finally:
            if linear is None:
                del os.environ["ZPP_CPU_ONEDNN_LINEAR"]
            else:
                os.environ["ZPP_CPU_ONEDNN_LINEAR"] = linear
    tpot: dict[str, list[float]] = {m: [] for m in llms}
    texts: dict[str, list] = {m: [] for m in llms}
    decode_s = {m: 0.0 for m in llms}  # all requests' decode seconds and tokens: the token-weighted TPOT
    decode_n = {m: 0 for m in llms}
    for _ in range(args.repeat if args.batch1 else 0):
        for p in COPY_PROMPTS:
            for mode, llm in llms.items():
                t = time.perf_counter()
                chat(llm, [p], 1)
                t1 = time.perf_counter() - t
                t = time.perf_counter()
                out = chat(llm, [p], args.max_tokens)[0].outputs[0]
                tn = time.perf_counter() - t
                if len(out.token_ids) > 1:
                    tpot[mode].append((tn - t1) / (len(out.token_ids) - 1))
                    decode_s[mode] += tn - t1
                    decode_n[mode] += len(out.token_ids) - 1
                texts[mode].append(out.token_ids)
    med = {m: statistics.median(v) for m, v in tpot.items()} if args.batch1 else {}
    n_prompts = len(COPY_PROMPTS)
    for mode, llm in llms.items():
        if not args.batch1:
            continue
        base = "off dense" if mode.endswith(" dense") else "off"
        if mode == base:
            if mode != "off":
                print(f"batch 1, PP={args.pp}: TPOT off (oneDNN) {1e3 * med['off']:.1f} ms, off dense "
                      f"{1e3 * med[mode]:.1f} ms (dense / oneDNN {med[mode] / med['off']:.2f}x)", flush=True)
            continue
        st = llm.engine.stats()
        mal = 1 + st.spec_num_accepted_tokens / max(st.spec_num_drafts, 1)
        # per prompt: the median over its repeats of TPOT off / TPOT ngram (runs are prompt-major)
        per = [statistics.median(a / b for a, b in zip(tpot[base][i::n_prompts], tpot[mode][i::n_prompts]))
               for i in range(n_prompts)]
        out_tokens = sum(len(t) - 1 for t in texts[mode])  # decode tokens (the first is the prefill's)
        steps = out_tokens - st.spec_num_accepted_tokens
        print(f"batch 1, PP={args.pp}, {mode}, {len(tpot['off'])} requests per mode: TPOT {base} "
              f"{1e3 * med[base]:.1f} ms, ngram {1e3 * med[mode]:.1f} ms, speed-up {med[base] / med[mode]:.2f}x "
              f"(per prompt {', '.join(f'{x:.2f}x' for x in per)}); mean acceptance length {mal:.2f} "
              f"({st.spec_num_accepted_tokens} of {st.spec_num_draft_tokens} drafts accepted, {st.spec_num_drafts} "
              f"verify chunks); tokens per decode step {out_tokens / max(steps, 1):.2f} (the speed-up if a verify "
              f"step cost a decode step's); token-weighted TPOT (all decode time over all decode tokens) "
              f"{base} {1e3 * decode_s[base] / decode_n[base]:.1f} ms, ngram {1e3 * decode_s[mode] / decode_n[mode]:.1f} "
              f"ms, speed-up {decode_s[base] / decode_n[base] / (decode_s[mode] / decode_n[mode]):.2f}x; outputs equal: "
              f"{texts[base] == texts[mode]}", flush=True)
    print(f"load average: {os.getloadavg()}", flush=True)

    if not args.streams:
        return
    prompts = [(COPY_PROMPTS + OTHER_PROMPTS)[i % 8] for i in range(args.streams)]
    tput: dict[str, list[float]] = {m: [] for m in llms}
    same = True
    for rnd in range(max(1, args.repeat - 1)):
        outs = {}
        order = list(llms.items())  # ABBA: every other round in reverse, so that a load rising or falling
        for mode, llm in (order if rnd % 2 == 0 else order[::-1]):  # within a round favours no mode
            t = time.perf_counter()
            outs[mode] = chat(llm, prompts, 64)
            dt = time.perf_counter() - t
            tput[mode].append(sum(len(o.outputs[0].token_ids) for o in outs[mode]) / dt)
        for mode in llms:
            base = "off dense" if mode.endswith(" dense") else "off"
            same &= [o.outputs[0].token_ids for o in outs[base]] == [o.outputs[0].token_ids for o in outs[mode]]
    m = {k: statistics.median(v) for k, v in tput.items()}
    for mode in llms:
        base = "off dense" if mode.endswith(" dense") else "off"
        if mode != base:
            print(f"{args.streams} streams, PP={args.pp}, {mode}: throughput {base} {m[base]:.1f} tok/s, ngram "
                  f"{m[mode]:.1f} tok/s, ratio {m[mode] / m[base]:.3f} (runs: {base} {[round(x, 1) for x in tput[base]]}, "
                  f"ngram {[round(x, 1) for x in tput[mode]]}); outputs equal: {same}", flush=True)
        elif mode != "off":
            print(f"{args.streams} streams, PP={args.pp}: off (oneDNN) {m['off']:.1f} tok/s, off dense {m[mode]:.1f} "
                  f"tok/s", flush=True)
    print(f"load average: {os.getloadavg()}", flush=True)
    for llm in llms.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
