"""``zpp serve --speculative-config`` at PP=2: each request, streamed and whole, gives the same text,
finish reason and token count as the same request to the PP=2 server without speculation (greedy,
a stop string, seeded sampling), drafts are accepted, and ``/metrics`` shows the counters."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import pytest

from helpers import ServerProcess, parse_metrics
from server.test_serving import _complete

pytestmark = pytest.mark.slow

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick"
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"


@pytest.fixture(scope="module")
def spec_server(demo_model):
    srv = ServerProcess([demo_model, "--pipeline-parallel-size", "2", "--max-model-len", "1024", "--num-kv-blocks",
                         "128", "--log-level", "warning", "--speculative-config", SPEC])
    yield srv
    srv.stop()


def test_same_text_streamed_and_whole_with_and_without(shared_pp2_server, spec_server):
    bodies = [{"prompt": TEXT, "max_tokens": 32, "temperature": 0},
              {"prompt": CODE, "max_tokens": 32, "temperature": 0, "stop": ["mul"]},
              {"prompt": TEXT, "max_tokens": 24, "temperature": 0.8, "seed": 3}]

    async def run(url):
        async with aiohttp.ClientSession() as s:
            usage = {"stream_options": {"include_usage": True}}
            return await asyncio.gather(*(_complete(s, url, {**b, "stream": stream, **(usage if stream else {})})
                                          for b in bodies for stream in (False, True)))

    base = asyncio.run(run(shared_pp2_server.url))
    spec = asyncio.run(run(spec_server.url))
    assert spec == base
    assert all(base[2 * i] == base[2 * i + 1] for i in range(len(bodies)))  # streamed == whole
    with urllib.request.urlopen(spec_server.url + "/metrics", timeout=30) as r:
        metrics = parse_metrics(r.read().decode())
    assert metrics["zpp:spec_decode_num_accepted_tokens_total"] > 0
    assert metrics["zpp:spec_decode_num_drafts_total"] > 0
