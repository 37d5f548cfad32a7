"""``zpp bench serve`` without a model: the stream reader against a server that cuts SSE lines
across network writes, packs several events into one write and ends lines with CRLF; vLLM's flag
names (``--help``, one-line errors for what zpp cannot do, ``--save-result``'s file name). A real
run with vLLM's flags against ``zpp serve`` is in test_openai_server.py."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import aiohttp
import pytest
from aiohttp import web

from zpp.bench.serve import BenchRequest, _one, _Result, _session


def test_stream_reader_handles_split_and_packed_events():
    def event(obj) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\r\n\r\n"

    tok = event({"choices": [{"index": 0, "text": "x"}]})
    usage = event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})
    writes = [b": comment\n\n" + tok[:9], tok[9:] + tok, tok + tok[:-3], tok[-3:], tok + usage + b"data: [DONE]\n\n"]

    async def completions(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for w in writes:
            await resp.write(w)
            await asyncio.sleep(0.01)
        return resp

    async def go():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as s:
                res = _Result()
                await _one(s, f"http://127.0.0.1:{port}/v1/completions", {}, "m", BenchRequest([1, 2, 3], 3, 5), res)
                return res
        finally:
            await runner.cleanup()

    res = asyncio.run(go())
    assert res.ok, res.error
    assert res.output_tokens == 5 and res.prompt_len == 3
    assert len(res.itl) == 4 and res.ttft > 0 and res.latency >= res.ttft


def test_no_connection_pool_limit():
    """150 streams open at once through the bench's session: aiohttp's default pool (100
    connections) would hold back the last 50 until others end, and the server would never see 150."""
    n = 150

    async def go():
        seen = {"now": 0, "max": 0}
        all_in = asyncio.Event()

        async def completions(request):
            seen["now"] += 1
            seen["max"] = max(seen["max"], seen["now"])
            if seen["now"] >= n:
                all_in.set()
            try:
                await asyncio.wait_for(all_in.wait(), 10)
            except asyncio.TimeoutError:
                pass
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\ndata: [DONE]\n\n')
            seen["now"] -= 1
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with _session(n) as s:
                results = [_Result() for _ in range(n)]
                await asyncio.gather(*(_one(s, f"http://127.0.0.1:{port}/v1/completions", {}, "m",
                                            BenchRequest([1], 1, 1), r) for r in results))
            return seen["max"], results
        finally:
            await runner.cleanup()

    most, results = asyncio.run(go())
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert most == n


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zpp.cli", "bench", "serve", *args], capture_output=True,
                          text=True, timeout=120)


def test_help_lists_vllm_flag_names():
    r = _bench("--help")
    assert r.returncode == 0, r.stderr
    for flag in ("--dataset-name", "--dataset-path", "--save-result", "--result-dir", "--result-filename",
                 "--random-input-len", "--random-output-len", "--num-prompts", "--request-rate",
                 "--max-concurrency", "--base-url", "--host", "--port", "--endpoint", "--backend", "--seed",
                 "--percentile-metrics", "--metric-percentiles", "--ignore-eos", "--label", "--disable-tqdm"):
        assert flag in r.stdout, flag


@pytest.mark.parametrize("args, expected", [
    (["--dataset-name", "sonnet"], "--dataset-name sonnet: not supported (zpp does: random, sharegpt"),
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path FILE"),
    (["--endpoint", "/v1/chat/completions"], "--endpoint /v1/chat/completions: not supported"),
    (["--backend", "tgi"], "--backend tgi: not supported"),
    (["--metric-percentiles", "99,x"], "--metric-percentiles 99,x: comma-separated numbers"),
    (["--percentile-metrics", "ttft,foo"], "--percentile-metrics ttft,foo: choose from ttft,tpot,itl,e2el"),
])
def test_what_zpp_cannot_do_is_a_one_line_error(args, expected):
    """Refused before any connection (port 9 has no server): exit 2 and one line naming the flag."""
    r = _bench("--port", "9", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zpp bench serve: error: ") and expected in lines[0], r.stderr


def test_result_path_as_vllm_names_it():
    from argparse import Namespace

    from zpp.bench.serve import result_path
    a = Namespace(result_filename=None, result_dir=None, max_concurrency=None, label=None, backend="vllm",
                  request_rate=float("inf"))
    assert re.fullmatch(r"vllm-infqps-m-\d{8}-\d{6}\.json", result_path(a, "org/m"))
    a.max_concurrency, a.label, a.request_rate, a.result_dir = 4, "zpp", 2.0, "out"
    assert re.fullmatch(r"out/zpp-2\.0qps-concurrency4-m-\d{8}-\d{6}\.json", result_path(a, "m"))
    a.result_filename = "r.json"
    assert result_path(a, "m") == "out/r.json"
