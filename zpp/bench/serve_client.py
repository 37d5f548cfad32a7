"""The serving benchmark's client side (zpp.bench.serve): the request datasets (random token ids,
ShareGPT), one streamed ``/v1/completions`` request and its timings, the HTTP session, and the
statistics of a run (percentiles, :func:`summarize`'s throughput and TTFT / TPOT / ITL / E2EL
summary, with vLLM's flat keys)."""
from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Optional

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class BenchRequest:
    prompt: object          # text or token ids
    prompt_len: int         # tokens (measured or estimated)
    output_len: int         # tokens to generate (sent as max_tokens with ignore_eos)


@dataclass
class _Result:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int) -> list[BenchRequest]:
    """``num`` token-id prompts (ids in [100, vocab_size - 100)) with lengths drawn uniformly
    from ``[len * (1 - r), len * (1 + r)]`` (at least 1)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    lo, hi = min(100, vocab_size // 4), max(vocab_size - 100, vocab_size // 2)
    out = []
    for _ in range(num):
        ilen = max(1, round(input_len * rng.uniform(1 - range_ratio, 1 + range_ratio)))
        olen = max(1, round(output_len * rng.uniform(1 - range_ratio, 1 + range_ratio)))
        out.append(BenchRequest([rng.randrange(lo, hi) for _ in range(ilen)], ilen, olen))
    return out


def sharegpt_requests(path: str, num: int, tokenizer, fixed_output_len: Optional[int],
                      seed: int) -> list[BenchRequest]:
    """First-turn prompts of a ShareGPT file, shuffled; like vLLM, pairs with a prompt or answer
    under 4 tokens, a prompt over 1024 tokens or a total over 2048 are skipped.

    Raises:
        ValueError: the file holds fewer usable conversations than ``num``.
    """
    with open(path) as f:
        data = json.load(f)
    convs = [d["conversations"] for d in data if len(d.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(convs)

    def count(text: str) -> int:
        return len(tokenizer.encode(text)) if tokenizer is not None else max(1, len(text) // 4)

    out = []
    for c in convs:
        prompt, answer = c[0].get("value", ""), c[1].get("value", "")
        plen = count(prompt)
        olen = fixed_output_len or count(answer)
        if plen < 4 or (fixed_output_len is None and olen < 4) or plen > 1024 or plen + olen > 2048:
            continue
        out.append(BenchRequest(prompt, plen, olen))
        if len(out) == num:
            return out
    raise ValueError(f"{path}: only {len(out)} usable conversations, {num} requested")


async def _one(session, url: str, headers: dict, model: str, req: BenchRequest, result: _Result) -> None:
    """Stream one request. The body is read as it arrives (``iter_any``) and split into lines here:
    all the SSE events of one network read get that read's time, and the per-line ``readline`` of
    aiohttp, which took most of the client's time at tens of thousands of tokens per second, is
    not used (scripts/bench_client_capacity.py measures how many tokens/s one process takes in)."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result.prompt_len = req.prompt_len
    chunks = 0
    t0 = time.perf_counter()
    last = t0
    itl = result.itl
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            pending = b""
            done = False
            async for data in resp.content.iter_any():
                t = time.perf_counter()
                lines = (pending + data).split(b"\n")
                pending = lines.pop()  # an incomplete line waits for the next read
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    msg = _decode(payload)
                    if "error" in msg:
                        result.error = str(msg["error"].get("message"))[:200]
                        return
                    if msg.get("usage"):
                        result.output_tokens = msg["usage"]["completion_tokens"]
                        result.prompt_len = msg["usage"]["prompt_tokens"]
                    if msg.get("choices"):
                        if chunks == 0:
                            result.ttft = t - t0
                        else:
                            itl.append(t - last)
                        last = t
                        chunks += 1
                if done:
                    break
        result.latency = time.perf_counter() - t0
        if result.output_tokens == 0:  # a server that sends no usage: one chunk per token
            result.output_tokens = chunks
        result.ok = True
    except Exception as e:  # noqa: BLE001 - reported per request
        result.error = repr(e)


def _decode(payload: bytes) -> dict:
    """JSON of one SSE event (msgspec when installed: several times faster than ``json``)."""
    return _json_decode(payload)


try:
    from msgspec.json import decode as _json_decode
except ImportError:  # pragma: no cover - msgspec is a zpp dependency
    _json_decode = json.loads


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation, as numpy's default; 0 for no data."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    pos = q / 100 * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def pct_name(q: float) -> str:
    """'p99', 'p99.9': a percentile's key as vLLM writes it."""
    return f"p{int(q)}" if int(q) == q else f"p{q}"


def summarize(results: list[_Result], duration: float, percentiles=(99.0,), metrics=METRICS) -> dict:
    """Throughput (per second) and latency statistics of the results, in milliseconds.

    Each metric has ``{metric}_ms``: mean, median and each of ``percentiles`` (``p99`` ...). The
    ``metrics`` chosen (``--percentile-metrics``) also get vLLM's flat keys, as ``vllm bench serve
    --save-result`` writes them: ``mean_ttft_ms``, ``median_ttft_ms``, ``std_ttft_ms``,
    ``p99_ttft_ms``..."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    values = {"ttft": [r.ttft for r in ok],
              "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
              "itl": [x for r in ok for x in r.itl],
              "e2el": [r.latency for r in ok]}

    def ms(xs):
        out = {"mean": 1000 * sum(xs) / len(xs) if xs else 0.0, "median": 1000 * percentile(xs, 50)}
        out.update((pct_name(q), 1000 * percentile(xs, q)) for q in percentiles)
        return out

    res = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
           "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
           "request_throughput": len(ok) / duration if duration else 0.0,
           "output_throughput": out_tokens / duration if duration else 0.0,
           "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0}
    for k, xs in values.items():
        res[f"{k}_ms"] = ms(xs)
    res["duration"] = duration  # vLLM's name
    for k in metrics:
        xs, stats = values[k], res[f"{k}_ms"]
        mean = sum(xs) / len(xs) if xs else 0.0
        std = (sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5 if xs else 0.0
        res[f"mean_{k}_ms"], res[f"median_{k}_ms"], res[f"std_{k}_ms"] = stats["mean"], stats["median"], 1000 * std
        for q in percentiles:
            res[f"{pct_name(q)}_{k}_ms"] = stats[pct_name(q)]
    return res


def _load_tokenizer(path: Optional[str]):
    """The HF tokenizer in ``path``, or None when the directory holds none (random token ids then)."""
    if not path or not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                          "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def _session(num_requests: int):
    """The client session. Its connection pool has no limit: aiohttp's default of 100 connections
    would hold back every request past the 100th in flight without saying so (``--max-concurrency``
    is the limit, when one is wanted). The open-file limit is raised, where it is lower, to let one
    connection per request be open at once."""
    import aiohttp
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = num_requests + 256
        if soft != resource.RLIM_INFINITY and soft < need:
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (need if hard == resource.RLIM_INFINITY else min(need, hard), hard))
    except (ImportError, ValueError, OSError):  # pragma: no cover - not Unix, or not allowed
        pass
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                 connector=aiohttp.TCPConnector(limit=0))
