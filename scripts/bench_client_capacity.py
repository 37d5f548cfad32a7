"""How many streamed tokens per second can one ``zpp bench serve`` process take in?

Starts a mock OpenAI server on 127.0.0.1 (a separate process; every request streams
``max_tokens`` one-token SSE chunks at once, as fast as it can write them, no model) and runs
``zpp bench serve`` against it: with one client process, then two with half the prompts each.
The one-process rate is the most the load generator can measure; two processes getting more means
one process was the limit (and the mock server, sharing the machine, limits the two).

Usage: ``python scripts/bench_client_capacity.py [--num-prompts 256 --output-len 256]``
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time


def serve_mock(port: int) -> None:
    from aiohttp import web

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "mock", "object": "model", "root": None}]})

    async def completions(request):
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = (b'data: {"id":"cmpl-1","object":"text_completion","created":0,"model":"mock",'
                 b'"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}]}\n\n')
        for i in range(n):
            await resp.write(chunk)
            if i % 16 == 15:
                await asyncio.sleep(0)  # let other streams go
        usage = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "mock", "choices": [],
                 "usage": {"prompt_tokens": len(body.get("prompt") or []), "completion_tokens": n,
                           "total_tokens": n}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def run_clients(base: str, n_proc: int, args) -> dict:
    start_at = time.time() + 10.0
    procs, files = [], []
    for i in range(n_proc):
        f = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
        f.close()
        files.append(f.name)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "zpp.cli", "bench", "serve", "--base-url", base,
             "--num-prompts", str(args.num_prompts // n_proc), "--random-input-len", str(args.input_len),
             "--random-output-len", str(args.output_len), "--seed", str(i), "--no-progress",
             "--start-at", str(start_at), "--output-json", f.name],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
    for p in procs:
        if p.wait(600) != 0:
            raise RuntimeError(f"a client exited with {p.returncode}")
    res = [json.load(open(f)) for f in files]
    for f in files:
        os.unlink(f)
    start, end = min(r["start_time"] for r in res), max(r["end_time"] for r in res)
    tokens = sum(r["total_output_tokens"] for r in res)
    return {"processes": n_proc, "output_tok_s": round(tokens / (end - start), 1), "output_tokens": tokens,
            "duration_s": round(end - start, 3), "loadavg": [round(x, 2) for x in os.getloadavg()]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--serve-mock", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    if args.serve_mock:
        serve_mock(args.serve_mock)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-mock", str(port)])
    runs = []
    try:
        time.sleep(3)
        base = f"http://127.0.0.1:{port}"
        for _ in range(args.repeat):
            for n in (1, 2):
                runs.append(run_clients(base, n, args))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        server.terminate()
        server.wait(10)
    out = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": " ".join(sys.argv), "runs": runs,
           "best_output_tok_s": {n: max(r["output_tok_s"] for r in runs if r["processes"] == n) for n in (1, 2)}}
    print(json.dumps(out["best_output_tok_s"]))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
