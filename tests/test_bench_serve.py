"""``zpp bench serve``'s stream reader without a model: a server that cuts SSE lines across
network writes, packs several events into one write and ends lines with CRLF."""
from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from zpp.bench.serve import BenchRequest, _one, _Result


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
