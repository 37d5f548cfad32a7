"""Serving benchmark (like vLLM's ``benchmark_serving.py``): drives a running ``zpp serve`` (or any
OpenAI-compatible server) with streaming ``/v1/completions`` requests and reports request and
token throughput and TTFT, TPOT, ITL and end-to-end latency statistics (milliseconds).

Requests come from a random dataset (token-id prompts of ``--random-input-len`` tokens, each
asking for ``--random-output-len`` tokens with ``ignore_eos``) or from a ShareGPT-format JSON
file (``[{"conversations": [{"value": prompt}, {"value": reference answer}, ...]}, ...]``). They
are sent at ``--request-rate`` per second (Poisson arrivals; ``inf`` sends all at once), with at
most ``--max-concurrency`` in flight. With ``--num-client-processes N`` > 1 the prompts (made once,
as for one process) are dealt round-robin to N child processes (``python -m zpp.bench.serve``),
each with rate / N and its share of the concurrency, started at one wall-clock time; their
per-request results are merged into one run (duration = last end - first start), so that the
load generator is not one Python process's speed at parsing streamed events.

Definitions (as in vLLM): TTFT = time to the first streamed chunk; ITL = time between
consecutive chunks; TPOT = (latency - TTFT) / (output tokens - 1) per request; E2EL = request
latency.

``vllm bench serve`` command lines work as they are where zpp can do what they ask: its flag
names (``--dataset-name random|sharegpt``, ``--dataset-path``, ``--host``/``--port``,
``--endpoint``, ``--backend openai|vllm``, ``--percentile-metrics``, ``--metric-percentiles``,
``--save-result``, ``--result-dir``, ``--result-filename``, ``--label``, ``--disable-tqdm``,
``--ignore-eos``) are accepted and the saved JSON also has vLLM's flat keys (``mean_ttft_ms``,
``p99_itl_ms``, ``duration`` ...). What zpp cannot do (other datasets, chat or other backends)
is refused with a one-line error.
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import os
import random
import sys
import time
from typing import Optional

from zpp.bench.serve_client import (METRICS, BenchRequest, _load_tokenizer, _one, _Result, _session, pct_name,
                                     random_requests, sharegpt_requests, summarize)


def add_parser(sub) -> None:
    from zpp.bench.common import fraction, positive_float, positive_int
    p = sub.add_parser("serve", help="load-test a running server (streaming /v1/completions)",
                       description="Load-test a running OpenAI-compatible server. vLLM's `vllm bench serve` "
                                   "flag names are accepted (those zpp can honour).")
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None,
                   help="server address without the endpoint (default: http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1", help="server host when --base-url is not given")
    g.add_argument("--port", type=int, default=8000, help="server port when --base-url is not given")
    g.add_argument("--endpoint", default="/v1/completions",
                   help="completions path under the base URL (chat endpoints are not supported)")
    g.add_argument("--backend", default="openai",
                   help="vLLM's request format: 'openai' or 'vllm' (both stream /v1/completions); "
                        "other backends are not supported")
    g.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g = p.add_argument_group("requests")
    g.add_argument("--dataset-name", default=None,
                   help="'random' (the default) or 'sharegpt' (with --dataset-path); vLLM's other "
                        "datasets are not supported")
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file for --dataset-name sharegpt")
    g.add_argument("--dataset", default=None,
                   help="zpp's older spelling: 'random' or a ShareGPT-format JSON file")
    g.add_argument("--num-prompts", type=positive_int, default=100, help="requests to send")
    g.add_argument("--random-input-len", type=positive_int, default=1024, help="random dataset: prompt tokens")
    g.add_argument("--random-output-len", type=positive_int, default=128, help="random dataset: tokens to generate")
    g.add_argument("--random-range-ratio", type=fraction, default=0.0,
                   help="random dataset: lengths drawn uniformly from [len * (1 - r), len * (1 + r)]")
    g.add_argument("--sharegpt-output-len", type=positive_int, default=None,
                   help="ShareGPT: generate this many tokens (default: the reference answer's length)")
    g.add_argument("--tokenizer", default=None,
                   help="ShareGPT: tokenizer directory to measure lengths (default: the served model's "
                        "directory when it exists here, else 4 characters per token)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="accepted for vLLM's command lines: zpp always sends ignore_eos, so that every "
                        "request generates its full length")
    g.add_argument("--request-rate", type=positive_float, default=float("inf"),
                   help="requests per second (Poisson arrivals); inf = all at once")
    g.add_argument("--max-concurrency", type=positive_int, default=None, help="most requests in flight at once")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--start-at", type=float, default=None, metavar="UNIX_TIME",
                   help="wait until this wall-clock time (after the set-up request) before sending the "
                        "measured requests, so that several client processes start together")
    g.add_argument("--num-client-processes", type=int, default=None, metavar="N",
                   help="send the requests from N processes (prompts dealt round-robin, each process "
                        "with --request-rate / N and its share of --max-concurrency, started together) "
                        "and report them as one run. Default: min(4, CPUs // 2) for --request-rate inf "
                        "with 256 prompts or more, else 1 (one process, no children). Capped at "
                        "--num-prompts and --max-concurrency")
    g = p.add_argument_group("results")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="comma-separated metrics to report percentiles of: ttft, tpot, itl, e2el")
    g.add_argument("--metric-percentiles", default="99",
                   help="comma-separated percentiles to report for those metrics, e.g. '50,90,99'")
    g.add_argument("--output-json", default=None, help="write the results (and per-request data) here")
    g.add_argument("--save-result", action="store_true",
                   help="also write the results to --result-dir/--result-filename (vLLM's flags)")
    g.add_argument("--result-dir", default=None, help="with --save-result: directory (default: the current one)")
    g.add_argument("--result-filename", default=None,
                   help="with --save-result: file name (default, as vLLM: "
                        "LABEL-RATEqps[-concurrencyN]-MODEL-YYYYmmdd-HHMMSS.json)")
    g.add_argument("--label", default=None, help="with --save-result: file name prefix (default: --backend)")
    g.add_argument("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true",
                   help="no progress bar")
    g.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


SUPPORTED_DATASETS = ("random", "sharegpt")


def resolve_args(args) -> None:
    """Turn vLLM's spellings into the settings used here (``args.base_url``, ``args.dataset``,
    ``args.percentiles``, ``args.metrics``). Raises ValueError with a one-line message for what zpp
    cannot do."""
    if args.base_url is None:
        args.base_url = f"http://{args.host}:{args.port}"
    args.base_url = args.base_url.rstrip("/")
    if args.backend not in ("openai", "vllm"):
        raise ValueError(f"--backend {args.backend}: not supported (zpp streams /v1/completions: 'openai' or 'vllm')")
    ep = "/" + args.endpoint.lstrip("/")
    if not ep.endswith("/completions") or ep.endswith("/chat/completions"):
        raise ValueError(f"--endpoint {args.endpoint}: not supported (zpp sends completions requests, "
                         "e.g. /v1/completions)")
    args.endpoint = ep
    name = args.dataset_name
    if name is not None:
        if name not in SUPPORTED_DATASETS:
            raise ValueError(f"--dataset-name {name}: not supported (zpp does: random, "
                             "sharegpt with --dataset-path)")
        if args.dataset is not None:
            raise ValueError("give --dataset-name (and --dataset-path) or --dataset, not both")
        if name == "sharegpt":
            if not args.dataset_path:
                raise ValueError("--dataset-name sharegpt needs --dataset-path FILE")
            args.dataset = args.dataset_path
        else:
            args.dataset = "random"
    elif args.dataset is None:
        args.dataset = args.dataset_path or "random"
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in metrics if m not in METRICS]
    if bad or not metrics:
        raise ValueError(f"--percentile-metrics {args.percentile_metrics}: choose from {','.join(METRICS)}")
    try:
        pcts = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    except ValueError:
        pcts = []
    if not pcts or not all(0 < q <= 100 for q in pcts):
        raise ValueError(f"--metric-percentiles {args.metric_percentiles}: comma-separated numbers in (0, 100]")
    args.metrics, args.percentiles = metrics, pcts
    n = getattr(args, "num_client_processes", None)
    if n is None:
        n = default_client_processes(args.request_rate, args.num_prompts, os.cpu_count())
    elif n < 1:
        raise ValueError(f"--num-client-processes {n}: must be 1 or more")
    args.num_client_processes = max(1, min(n, args.num_prompts, args.max_concurrency or n))


def default_client_processes(request_rate: float, num_prompts: int, cpu_count: Optional[int]) -> int:
    """``--num-client-processes`` when not given: one process unless every request is sent at once
    (``--request-rate inf``) and there are 256 or more of them, then ``min(4, CPUs // 2)``: a
    process parses tens of thousands of streamed events per second, and several of them keep a fast
    server from being measured against one Python process's speed, while leaving cores to a server
    on the same machine."""
    if request_rate == float("inf") and num_prompts >= 256:
        return max(1, min(4, (cpu_count or 1) // 2))
    return 1


async def _main(args) -> dict:
    from tqdm import tqdm
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with _session(args.num_prompts) as session:
        async with session.get(f"{args.base_url}/v1/models", headers=headers) as r:
            if r.status != 200:
                raise RuntimeError(f"GET {args.base_url}/v1/models: HTTP {r.status}: {(await r.text())[:200]}")
            card = (await r.json())["data"][0]
        model = args.model or card["id"]
        if args.dataset == "random":
            vocab = 32000
            tok = _load_tokenizer(card.get("root"))
            if tok is not None:
                vocab = len(tok)
            reqs = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                   args.random_range_ratio, vocab, args.seed)
        else:
            tok = _load_tokenizer(args.tokenizer or card.get("root"))
            reqs = sharegpt_requests(args.dataset, args.num_prompts, tok, args.sharegpt_output_len, args.seed)
        url = f"{args.base_url}{args.endpoint}"

        # One request first, outside the measurement: it checks the set-up and warms the server.
        probe = _Result()
        await _one(session, url, headers, model, BenchRequest(reqs[0].prompt, reqs[0].prompt_len, 4), probe)
        if not probe.ok:
            raise RuntimeError(f"the initial test request failed: {probe.error}")

        n = getattr(args, "num_client_processes", 1)
        bar = None if args.no_progress else tqdm(total=len(reqs), desc="requests", file=sys.stderr)
        on_done = None if bar is None else (lambda: bar.update(1))
        if n == 1:
            results, duration, wall_start, wall_end = await _measure(
                session, url, headers, model, reqs, args.request_rate, args.max_concurrency, args.seed + 1,
                args.start_at, on_done)
        else:
            results, duration, wall_start, wall_end = await _run_clients(args, url, headers, model, reqs, n, on_done)
        if bar is not None:
            bar.close()
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "base_url": args.base_url,
           "endpoint": args.endpoint, "backend": args.backend, "model": model, "model_id": model,
           "dataset": args.dataset, "num_prompts": len(reqs),
           "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
           "max_concurrency": args.max_concurrency, "num_client_processes": n, "command": " ".join(sys.argv),
           "start_time": wall_start, "end_time": wall_end}
    res.update(summarize(results, duration, args.percentiles, args.metrics))
    res["errors"] = [r.error for r in results if not r.ok][:10]
    res["per_request"] = {"input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
                          "ttfts_s": [r.ttft for r in results], "latencies_s": [r.latency for r in results],
                          "itls_s": [r.itl for r in results]}
    return res


async def _measure(session, url: str, headers: dict, model: str, reqs: list[BenchRequest], request_rate: float,
                   max_concurrency: Optional[int], arrival_seed: int, start_at: Optional[float],
                   on_done=None) -> tuple[list[_Result], float, float, float]:
    """The measured run of one process: wait until ``start_at`` (wall clock) when given, then send
    ``reqs`` at ``request_rate`` (Poisson arrivals drawn from ``arrival_seed``; inf = all at once)
    with at most ``max_concurrency`` in flight. Returns the results (in ``reqs``' order), the
    duration (s) and the wall-clock start and end."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results = [_Result() for _ in reqs]

    async def go(i: int, req: BenchRequest) -> None:
        if sem is not None:
            async with sem:
                await _one(session, url, headers, model, req, results[i])
        else:
            await _one(session, url, headers, model, req, results[i])
        if on_done is not None:
            on_done()

    if start_at is not None:
        await asyncio.sleep(max(0.0, start_at - time.time()))
    rng = random.Random(arrival_seed)
    tasks = []
    wall_start = time.time()
    t0 = time.perf_counter()
    for i, req in enumerate(reqs):
        tasks.append(asyncio.create_task(go(i, req)))
        if request_rate != float("inf") and i < len(reqs) - 1:
            await asyncio.sleep(rng.expovariate(request_rate))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    wall_end = time.time()
    return results, duration, wall_start, wall_end


# --- several client processes ----------------------------------------------------------------------
def client_shares(request_rate: float, max_concurrency: Optional[int], n: int) -> list[tuple[float, Optional[int]]]:
    """Each of ``n`` client processes' (request rate, max concurrency): the rate divided by ``n``
    (the union of ``n`` Poisson streams of rate r/n is one of rate r); the concurrency split so
    that the shares add up to it (the first ``C % n`` processes, which also get the longer
    round-robin parts, one more). ``n`` is at most ``max_concurrency``, so every share is >= 1."""
    rate = request_rate if request_rate == float("inf") else request_rate / n
    if max_concurrency is None:
        return [(rate, None)] * n
    return [(rate, max_concurrency // n + (1 if k < max_concurrency % n else 0)) for k in range(n)]


def merge_client_results(parts: list[dict], num_requests: int) -> tuple[list[_Result], float, float, float]:
    """One run out of the client processes' results. ``parts[k]`` is process k's
    ``{"results": [_Result fields, ...], "start_time": wall s, "end_time": wall s}``; it sent
    requests k, k + n, k + 2n, ... (round-robin). Returns the results in the requests' order, the
    duration (the last end minus the first start, over all processes) and that start and end."""
    n = len(parts)
    results: list[Optional[_Result]] = [None] * num_requests
    for k, part in enumerate(parts):
        idx = range(k, num_requests, n)
        if len(part["results"]) != len(idx):
            raise RuntimeError(f"client process {k}: {len(part['results'])} results for {len(idx)} requests")
        for i, r in zip(idx, part["results"]):
            results[i] = _Result(**r)
    start = min(p["start_time"] for p in parts)
    end = max(p["end_time"] for p in parts)
    return results, end - start, start, end


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def _run_clients(args, url: str, headers: dict, model: str, reqs: list[BenchRequest], n: int,
                       on_done=None) -> tuple[list[_Result], float, float, float]:
    """The measured run from ``n`` child processes (``python -m zpp.bench.serve JOB.json``). Each
    gets its round-robin part of ``reqs`` and its share of the rate and concurrency in a JSON file,
    says ``ready`` on stdout once set up, gets the common start time (wall clock) on stdin, prints
    one line per finished request and writes its results to a JSON file; they are merged here."""
    import tempfile
    shares = client_shares(args.request_rate, args.max_concurrency, n)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_package_root()] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    procs: list[asyncio.subprocess.Process] = []
    with tempfile.TemporaryDirectory(prefix="zpp-bench-serve-") as tmp:
        try:
            for k in range(n):
                rate, conc = shares[k]
                job = {"url": url, "headers": headers, "model": model,
                       "requests": [[r.prompt, r.prompt_len, r.output_len] for r in reqs[k::n]],
                       "request_rate": None if rate == float("inf") else rate, "max_concurrency": conc,
                       "arrival_seed": args.seed + 1 + k, "result_path": os.path.join(tmp, f"result{k}.json")}
                path = os.path.join(tmp, f"job{k}.json")
                with open(path, "w") as f:
                    json.dump(job, f)
                procs.append(await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "zpp.bench.serve", path, stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE, env=env))
            for k, p in enumerate(procs):
                if (await p.stdout.readline()).strip() != b"ready":
                    raise RuntimeError(f"client process {k} exited with {await p.wait()} before it was ready")
            # Every process is set up: all start at the same wall-clock time (or --start-at, if later).
            start_at = max(args.start_at or 0.0, time.time() + 0.2)
            for p in procs:
                p.stdin.write(f"{start_at!r}\n".encode())
                await p.stdin.drain()
                p.stdin.close()

            async def follow(k: int, p) -> dict:
                async for _ in p.stdout:
                    if on_done is not None:
                        on_done()
                rc = await p.wait()
                if rc != 0:
                    raise RuntimeError(f"client process {k} exited with {rc}")
                with open(os.path.join(tmp, f"result{k}.json")) as f:
                    return json.load(f)

            parts = await asyncio.gather(*(follow(k, p) for k, p in enumerate(procs)))
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
    return merge_client_results(list(parts), len(reqs))


def _die_with_parent() -> None:
    """A client process ends with the bench (even a SIGKILLed one: PR_SET_PDEATHSIG on Linux) and
    leaves Ctrl-C to it (the bench kills its children)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover
            pass


def _client_main(job_path: str) -> int:
    """One client process of ``--num-client-processes`` (see ``_run_clients``)."""
    _die_with_parent()
    with open(job_path) as f:
        job = json.load(f)
    reqs = [BenchRequest(p, plen, olen) for p, plen, olen in job["requests"]]
    rate = float("inf") if job["request_rate"] is None else job["request_rate"]
    import importlib
    importlib.import_module("aiohttp")  # imported before saying ready, not after the start time
    print("ready", flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 1  # the bench went away

    async def go():
        async with _session(len(reqs)) as session:
            return await _measure(session, job["url"], job["headers"], job["model"], reqs, rate,
                                  job["max_concurrency"], job["arrival_seed"], float(line),
                                  lambda: print(".", flush=True))

    results, _, wall_start, wall_end = asyncio.run(go())
    with open(job["result_path"], "w") as f:
        json.dump({"results": [dataclasses.asdict(r) for r in results], "start_time": wall_start,
                   "end_time": wall_end}, f)
    return 0


def result_path(args, model: str) -> str:
    """``--save-result``'s file: ``--result-filename`` in ``--result-dir``, the file name by default
    as ``vllm bench serve`` makes it (label, request rate, concurrency, model, date and time)."""
    name = args.result_filename
    if not name:
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        now = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"{args.label or args.backend}-{args.request_rate}qps{conc}-{model.split('/')[-1]}-{now}.json"
    return os.path.join(args.result_dir, name) if args.result_dir else name


def run(args) -> int:
    """``zpp bench serve``: print the result table; exit status 1 if any request failed."""
    from zpp.bench.common import print_table, write_json
    try:
        resolve_args(args)
        res = asyncio.run(_main(args))
    except (OSError, RuntimeError, ValueError) as e:
        print(f"zpp bench serve: error: {e}", file=sys.stderr)
        return 2
    rows = [("Successful requests", res["completed"]), ("Failed requests", res["failed"]),
            ("Maximum request concurrency", res["max_concurrency"] or "unlimited"),
            ("Request rate (req/s)", res["request_rate"]), ("Client processes", res["num_client_processes"]),
            ("Benchmark duration (s)", res["duration_s"]), ("Total input tokens", res["total_input_tokens"]),
            ("Total generated tokens", res["total_output_tokens"]),
            ("Request throughput (req/s)", res["request_throughput"]),
            ("Output token throughput (tok/s)", res["output_throughput"]),
            ("Total token throughput (tok/s)", res["total_token_throughput"])]
    for key in args.metrics:
        for stat in ["mean", "median"] + [pct_name(q) for q in args.percentiles]:
            rows.append((f"{stat.capitalize()} {key.upper()} (ms)", res[f"{key}_ms"][stat]))
    print_table("Serving Benchmark Result", rows)
    for e in res["errors"][:3]:
        print(f"error: {e}", file=sys.stderr)
    write_json(args.output_json, res)
    if args.save_result:
        path = result_path(args, res["model"])
        write_json(path, res)
        print(f"results saved to {path}", file=sys.stderr)
    return 0 if res["failed"] == 0 else 1


if __name__ == "__main__":  # a client process of --num-client-processes
    sys.exit(_client_main(sys.argv[1]))
