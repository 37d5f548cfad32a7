"""Serving benchmark (like vLLM's benchmark_serving): drives a running ``zpp serve`` (or any
OpenAI-compatible server) over HTTP and reports request/token throughput and TTFT, TPOT, ITL and
end-to-end latency statistics."""
from __future__ import annotations

import asyncio
import datetime
import json
import random
import time
from dataclasses import dataclass, field
from typing import Optional


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="load-test a running server (streaming /v1/completions)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--dataset", default="random", help="'random' or a ShareGPT-format JSON file")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.5,
                   help="lengths drawn uniformly from [len * (1 - r), len * (1 + r)]")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="override ShareGPT output lengths")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


@dataclass
class _Result:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _sample_requests(args) -> list[tuple[object, int, int]]:
    """(prompt, prompt length, output length) per request."""
    rng = random.Random(args.seed)
    if args.dataset == "random":
        out = []
        for _ in range(args.num_prompts):
            r = args.random_range_ratio
            ilen = max(1, int(args.random_input_len * rng.uniform(1 - r, 1 + r)))
            olen = max(1, int(args.random_output_len * rng.uniform(1 - r, 1 + r)))
            out.append(([rng.randrange(100, 30000) for _ in range(ilen)], ilen, olen))
        return out
    with open(args.dataset) as f:
        data = json.load(f)
    convs = [d["conversations"] for d in data if len(d.get("conversations", [])) >= 2]
    rng.shuffle(convs)
    out = []
    for c in convs:
        prompt, completion = c[0]["value"], c[1]["value"]
        olen = args.sharegpt_output_len or max(4, min(1024, len(completion) // 4))
        out.append((prompt, max(1, len(prompt) // 4), olen))
        if len(out) >= args.num_prompts:
            break
    return out


async def _one(session, url, model, prompt, olen, result: _Result) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": olen, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = t0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    result.output_tokens = msg["usage"]["completion_tokens"]
                    result.prompt_len = msg["usage"]["prompt_tokens"]
                if msg.get("choices") and msg["choices"][0].get("text"):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - t0
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - t0
        result.ok = True
    except Exception as e:  # noqa: BLE001
        result.error = repr(e)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[k]


async def _main(args) -> dict:
    import aiohttp
    from tqdm import tqdm
    reqs = _sample_requests(args)
    rng = random.Random(args.seed + 1)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        model = args.model
        if model is None:
            async with session.get(f"{args.base_url}/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
        url = f"{args.base_url}/v1/completions"
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = None if args.no_progress else tqdm(total=len(reqs), desc="requests")
        results = [_Result() for _ in reqs]

        async def go(i, prompt, olen):
            if sem:
                async with sem:
                    await _one(session, url, model, prompt, olen, results[i])
            else:
                await _one(session, url, model, prompt, olen, results[i])
            if bar:
                bar.update(1)

        tasks = []
        t0 = time.perf_counter()
        for i, (prompt, _, olen) in enumerate(reqs):
            tasks.append(asyncio.create_task(go(i, prompt, olen)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if bar:
            bar.close()
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    ms = lambda xs: {"mean": 1000 * sum(xs) / len(xs) if xs else 0.0, "median": 1000 * _pct(xs, 50),
                     "p99": 1000 * _pct(xs, 99)}
    return {"date": datetime.date.today().isoformat(), "base_url": args.base_url, "model": model,
            "dataset": args.dataset, "num_prompts": len(reqs), "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency, "completed": len(ok), "failed": len(reqs) - len(ok),
            "errors": [r.error for r in results if not r.ok][:5], "duration_s": duration,
            "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
            "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
            "total_token_throughput": (in_tokens + out_tokens) / duration,
            "ttft_ms": ms([r.ttft for r in ok]), "tpot_ms": ms(tpots), "itl_ms": ms(itls),
            "e2el_ms": ms([r.latency for r in ok])}


def run(args) -> int:
    from zpp.bench import print_table, write_json
    res = asyncio.run(_main(args))
    rows = [("Successful requests", res["completed"]), ("Failed requests", res["failed"]),
            ("Benchmark duration (s)", res["duration_s"]), ("Total input tokens", res["total_input_tokens"]),
            ("Total generated tokens", res["total_output_tokens"]),
            ("Request throughput (req/s)", res["request_throughput"]),
            ("Output token throughput (tok/s)", res["output_throughput"]),
            ("Total token throughput (tok/s)", res["total_token_throughput"])]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {name} (ms)", res[key][stat]))
    print_table("Serving Benchmark Result", rows)
    write_json(args.output_json, res)
    return 0 if res["failed"] == 0 else 1
