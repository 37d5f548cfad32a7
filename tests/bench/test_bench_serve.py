"""``zpp bench serve``: the stream reader against a server that cuts SSE lines across network
writes, packs several events into one write and ends lines with CRLF; no connection pool limit;
vLLM's flag names (``--help``, one-line errors for what zpp cannot do, ``--save-result``'s file
name); ``--num-client-processes`` (the merge, the shares, the default, and one run against a real
``zpp serve`` with the demo model). A real run with vLLM's flags is in test_openai_server.py."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import aiohttp
import pytest
from aiohttp import web

from zpp.bench.serve_client import BenchRequest, _one, _Result, _session


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


@pytest.mark.slow
def test_help_lists_vllm_flag_names():
    r = _bench("--help")
    assert r.returncode == 0, r.stderr
    for flag in ("--dataset-name", "--dataset-path", "--save-result", "--result-dir", "--result-filename",
                 "--random-input-len", "--random-output-len", "--num-prompts", "--request-rate",
                 "--max-concurrency", "--base-url", "--host", "--port", "--endpoint", "--backend", "--seed",
                 "--percentile-metrics", "--metric-percentiles", "--ignore-eos", "--label", "--disable-tqdm"):
        assert flag in r.stdout, flag


@pytest.mark.slow
@pytest.mark.parametrize("args, expected", [
    (["--dataset-name", "sonnet"], "--dataset-name sonnet: not supported (zpp does: random, sharegpt"),
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path FILE"),
    (["--endpoint", "/v1/chat/completions"], "--endpoint /v1/chat/completions: not supported"),
    (["--backend", "tgi"], "--backend tgi: not supported"),
    (["--metric-percentiles", "99,x"], "--metric-percentiles 99,x: comma-separated numbers"),
    (["--percentile-metrics", "ttft,foo"], "--percentile-metrics ttft,foo: choose from ttft,tpot,itl,e2el"),
    (["--num-client-processes", "0"], "--num-client-processes 0: must be 1 or more"),
])
def test_what_zpp_cannot_do_is_a_one_line_error(args, expected):
    """Refused before any connection (port 9 has no server): exit 2 and one line naming the flag."""
    r = _bench("--port", "9", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zpp bench serve: error: ") and expected in lines[0], r.stderr


@pytest.mark.parametrize("argv, expected", [
    (["bench", "serve", "--request-rate", "0"], "argument --request-rate: '0' is not a number > 0"),
    (["bench", "serve", "--num-prompts", "0"], "argument --num-prompts: '0' is not a whole number >= 1"),
    (["bench", "serve", "--max-concurrency", "0"], "argument --max-concurrency: '0' is not a whole number >= 1"),
    (["bench", "serve", "--random-range-ratio", "1"], "argument --random-range-ratio: '1' is not a number in [0, 1)"),
    (["bench", "throughput", "--num-prompts", "0"], "argument --num-prompts: '0' is not a whole number >= 1"),
    (["bench", "throughput", "--output-len", "-3"], "argument --output-len: '-3' is not a whole number >= 1"),
    (["bench", "latency", "--num-iters", "0"], "argument --num-iters: '0' is not a whole number >= 1"),
])
def test_counts_and_rates_are_checked_before_any_load(argv, expected, capsys):
    """--request-rate 0 was a ZeroDivisionError, --num-prompts 0 an IndexError (serve) or a table
    of zeros (throughput): now one line naming the flag and the command's help, exit 2."""
    from zpp.cli import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and expected in err, err
    assert f"(see: zpp {' '.join(argv[:2])} --help)" in err


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


# --- --num-client-processes ----------------------------------------------------------------------
def test_merge_client_results_is_one_run():
    """Two processes' results (requests 0, 2, 4 and 1, 3) come back in the requests' order, the
    duration spans both, and the summary is the one of the same results from one process."""
    from dataclasses import asdict

    from zpp.bench.serve import merge_client_results
    from zpp.bench.serve_client import summarize
    one = [_Result(ok=True, prompt_len=10 + i, output_tokens=4, ttft=0.1 * (i + 1), latency=1.0 + i,
                   itl=[0.2 + i, 0.3, 0.1]) for i in range(5)]
    one[3] = _Result(ok=False, prompt_len=13, error="HTTP 500: boom")
    parts = [{"results": [asdict(r) for r in one[0::2]], "start_time": 100.5, "end_time": 110.0},
             {"results": [asdict(r) for r in one[1::2]], "start_time": 100.0, "end_time": 108.0}]
    results, duration, start, end = merge_client_results(json.loads(json.dumps(parts)), 5)
    assert results == one
    assert (start, end, duration) == (100.0, 110.0, 10.0)
    assert summarize(results, duration, (50.0, 99.0)) == summarize(one, 10.0, (50.0, 99.0))
    res = summarize(results, duration)
    assert res["completed"] == 4 and res["failed"] == 1 and res["total_input_tokens"] == 10 + 11 + 12 + 14
    assert res["output_throughput"] == 16 / 10.0
    with pytest.raises(RuntimeError, match="client process 1: 1 results for 2 requests"):
        merge_client_results([parts[0], {**parts[1], "results": parts[1]["results"][:1]}], 5)


def test_client_shares_and_default():
    from argparse import Namespace

    from zpp.bench.serve import client_shares, default_client_processes, resolve_args
    inf = float("inf")
    assert client_shares(inf, None, 3) == [(inf, None)] * 3
    assert client_shares(12.0, 7, 3) == [(4.0, 3), (4.0, 2), (4.0, 2)]  # adds up to 7
    assert default_client_processes(inf, 1000, 16) == 4
    assert default_client_processes(inf, 1000, 6) == 3
    assert default_client_processes(inf, 1000, 2) == 1 and default_client_processes(inf, 1000, None) == 1
    assert default_client_processes(inf, 255, 16) == 1 and default_client_processes(50.0, 1000, 16) == 1

    def resolved(**kw):
        a = Namespace(base_url="http://x", host=None, port=None, backend="openai", endpoint="/v1/completions",
                      dataset_name=None, dataset=None, dataset_path=None, percentile_metrics="ttft",
                      metric_percentiles="99", request_rate=inf, num_prompts=100, max_concurrency=None,
                      num_client_processes=None)
        for k, v in kw.items():
            setattr(a, k, v)
        resolve_args(a)
        return a.num_client_processes
    assert resolved() == 1 and resolved(num_client_processes=3) == 3
    assert resolved(num_client_processes=4, max_concurrency=2) == 2  # a process per unit of concurrency at most
    assert resolved(num_client_processes=4, num_prompts=3) == 3  # and a prompt per process at least


@pytest.fixture(scope="module")
def server(demo_model):
    from helpers import ServerProcess
    srv = ServerProcess([demo_model, "--max-model-len", "256", "--num-kv-blocks", "64", "--log-level", "warning"])
    yield srv
    srv.stop()


@pytest.mark.slow
def test_two_client_processes_against_zpp_serve(server, tmp_path, capsys):
    """8 prompts x 16/8 from one process and from two: both complete every request with the same
    prompts, and the two processes' results come back as one JSON with every request in it."""
    from zpp.cli import main
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"n{n}.json"
        rc = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "8", "--random-input-len", "16",
                   "--random-output-len", "8", "--random-range-ratio", "0.5", "--request-rate", "inf",
                   "--num-client-processes", str(n), "--no-progress", "--output-json", str(out)])
        table = capsys.readouterr().out
        assert rc == 0 and "Serving Benchmark Result" in table and "Client processes:" in table
        runs[n] = json.loads(out.read_text())
    one, two = runs[1], runs[2]
    assert one["num_client_processes"] == 1 and two["num_client_processes"] == 2
    assert two["completed"] == 8 and two["failed"] == 0 and two["num_prompts"] == 8
    assert two["total_input_tokens"] == one["total_input_tokens"]
    assert two["per_request"]["input_lens"] == one["per_request"]["input_lens"]  # same prompts, same order
    assert two["total_output_tokens"] == one["total_output_tokens"] == sum(one["per_request"]["output_lens"])
    pr = two["per_request"]
    assert all(len(pr[k]) == 8 for k in ("input_lens", "output_lens", "ttfts_s", "latencies_s", "itls_s"))
    assert [len(x) for x in pr["itls_s"]] == [o - 1 for o in pr["output_lens"]]
    assert all(0 < t < lat for t, lat in zip(pr["ttfts_s"], pr["latencies_s"]))
    assert two["duration"] == two["end_time"] - two["start_time"] >= 0.99 * max(pr["latencies_s"])
    assert two["output_throughput"] == two["total_output_tokens"] / two["duration"]
