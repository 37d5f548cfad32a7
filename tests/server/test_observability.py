"""What an operator sees of a running ``zpp serve`` (real SmolLM2 weights, CPU): the log lines
(one per finished request with ``--enable-log-requests``, a stats line while busy; each silenced
by its vLLM flag), the served model names (``--served-model-name`` with two), the ``model_name``
label and the prefix-cache counters of /metrics, and the Grafana dashboard in ``examples/grafana``
checked against a real scrape."""
from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request

import pytest

from helpers import OBSERVED_ALIAS, OBSERVED_NAME, ROOT, ServerProcess, parse_metrics

NAME = OBSERVED_NAME  # --served-model-name: the model_name label must be the served name
DASHBOARD = os.path.join(ROOT, "examples", "grafana", "zpp_dashboard.json")
STATS_RE = re.compile(r"INFO zpp\.stats: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: "
                      r"[\d.]+ tokens/s, Running: \d+ seqs, Waiting: \d+ seqs, KV cache usage: [\d.]+%, "
                      r"Stage busy: 0: \d+%, 1: \d+%, Prefix cache hit rate: (?:[\d.]+%|n/a)")


@pytest.fixture(scope="module")
def server(shared_pp2_prefix_server):
    """PP=2 with prefix caching, default log level (info), stats every 0.5 s instead of 10 s."""
    return shared_pp2_prefix_server


def post(server, path: str, body: dict) -> dict:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def scrape(server) -> str:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        return r.read().decode()


def wait_for(pred, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


# --- logs ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_request_line_and_stats_lines_while_busy(server):
    r = post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8,
                                         "temperature": 0, "ignore_eos": True})
    plen = r["usage"]["prompt_tokens"]
    line = (f"INFO zpp.requests: Finished request {r['id']}-0: prompt_tokens={plen}, output_tokens=8, "
            f"finish_reason=length, ttft=")
    assert wait_for(lambda: line in server.output(), 10), server.output()
    assert re.search(re.escape(line) + r"[\d.]+s, elapsed=[\d.]+s", server.output())
    assert wait_for(lambda: STATS_RE.search(server.output()), 10), server.output()
    # The stats lines stop once the server is idle (at most one more, for the last interval).
    wait_for(lambda: False, 1.5)
    before = len(STATS_RE.findall(server.output()))
    wait_for(lambda: False, 2.0)  # four intervals
    assert len(STATS_RE.findall(server.output())) - before <= 1


@pytest.mark.slow
def test_aborted_request_is_logged(server):
    """A client that goes away: its request is logged with finish_reason=abort."""
    req = urllib.request.Request(server.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": "Go on forever:", "max_tokens": 400,
                                                  "ignore_eos": True}).encode())
    with pytest.raises(Exception):  # a timeout: the client gives up and closes the connection
        urllib.request.urlopen(req, timeout=1.0)
    assert wait_for(lambda: re.search(r"Finished request cmpl-\w+-0: prompt_tokens=\d+, output_tokens=\d+, "
                                      r"finish_reason=abort, ", server.output()), 10), server.output()


@pytest.mark.slow
def test_disable_log_requests_and_stats(demo_model):
    srv = ServerProcess([demo_model, "--max-model-len", "256", "--num-kv-blocks", "32", "--log-stats-interval",
                         "0.5", "--disable-log-requests", "--disable-log-stats"])
    try:
        post(srv, "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True})
        wait_for(lambda: False, 2.0)  # four stats intervals
        out = srv.output()
    finally:
        srv.stop()
    assert "INFO zpp.server.launch: serving" in out  # INFO lines do get logged
    assert "zpp.requests" not in out and "Finished request" not in out, out
    assert "zpp.stats" not in out, out
    assert "ignored" not in out  # the two flags are honoured, not "accepted with no effect"


# --- served model names --------------------------------------------------------------------------
@pytest.mark.slow
def test_every_served_model_name_is_served_and_the_first_is_reported(server):
    """``--served-model-name smol-test smol-alias``: /v1/models lists both, a request naming either
    (or none) is answered with the first name, another name is a 404 that lists them."""
    assert f"zpp: serving {NAME}, {OBSERVED_ALIAS} on http://" in server.output()  # the start-up line names both
    with urllib.request.urlopen(server.url + "/v1/models", timeout=30) as r:
        cards = json.loads(r.read())["data"]
    assert [c["id"] for c in cards] == [NAME, OBSERVED_ALIAS] and all(c["max_model_len"] == 512 for c in cards)
    with urllib.request.urlopen(server.url + "/v1/models/" + OBSERVED_ALIAS, timeout=30) as r:
        assert json.loads(r.read())["id"] == OBSERVED_ALIAS
    for model in (OBSERVED_ALIAS, NAME, None):
        body = {"prompt": "Hi", "max_tokens": 2} | ({"model": model} if model else {})
        assert post(server, "/v1/completions", body)["model"] == NAME
    chat = post(server, "/v1/chat/completions", {"model": OBSERVED_ALIAS, "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "Hi"}]})
    assert chat["model"] == NAME
    with pytest.raises(urllib.error.HTTPError) as e:
        post(server, "/v1/completions", {"model": "smol", "prompt": "Hi", "max_tokens": 2})
    err = json.loads(e.value.read())["error"]
    assert e.value.code == 404 and err["code"] == "model_not_found" and err["param"] == "model"
    assert f"this server serves {NAME!r}, {OBSERVED_ALIAS!r}" in err["message"]


# --- metrics -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_every_series_has_the_model_name_label(server):
    post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    series = [line for line in scrape(server).splitlines() if line.startswith("zpp:")]
    assert len(series) > 40
    for line in series:
        assert f'model_name="{NAME}"' in line.split("}")[0], line


@pytest.mark.slow
def test_prefix_cache_queries_and_hits(server, tokenizer):
    prompt = "Once upon a time, in a land far away, there lived a king who had three daughters. " * 2
    n = len(tokenizer.encode(prompt))
    assert n >= 33  # two full blocks of 16 tokens can be shared
    before = parse_metrics(scrape(server))
    post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    after = parse_metrics(scrape(server))
    queries = after["zpp:prefix_cache_queries_total"] - before["zpp:prefix_cache_queries_total"]
    hits = after["zpp:prefix_cache_hits_total"] - before["zpp:prefix_cache_hits_total"]
    assert queries == 2 * n
    assert hits == (n - 1) // 16 * 16  # the second request reuses every full block but the last token's


@pytest.mark.slow
def test_stage_idle_seconds(server):
    """Both stages report their idle time between micro-batches (the pipeline bubble): PP=2 with one
    request decoding leaves each stage waiting on the other every token; a pause with no requests
    does not count."""
    def idle() -> dict[str, float]:
        m = parse_metrics(scrape(server))
        return {k: v for k, v in m.items() if k.startswith("zpp:stage_idle_seconds_total")}

    def settled():  # stage 0 reports between batches (StageStats), stage 1 with every result
        a = idle()
        time.sleep(0.6)
        b = idle()
        return b if a == b and b else None

    post(server, "/v1/completions", {"prompt": "Count: one, two,", "max_tokens": 8, "ignore_eos": True})
    first = wait_for(settled)
    assert set(first) == {'zpp:stage_idle_seconds_total{stage="0"}', 'zpp:stage_idle_seconds_total{stage="1"}'}
    assert all(v > 0 for v in first.values()), first
    time.sleep(3.0)  # no requests: the stages wait, but that is no bubble
    post(server, "/v1/completions", {"prompt": "Count: one, two,", "max_tokens": 8, "ignore_eos": True})
    # every stage's figure moves (stage 0's report comes up to ~250 ms after the last result, and the
    # core pushes it to /metrics at once)
    second = wait_for(lambda: (lambda s: s if s and all(s[k] != first[k] for k in first) else None)(settled()))
    for k, v in second.items():
        assert first[k] < v < first[k] + 3.0, (k, first[k], v)


@pytest.mark.slow
def test_prompt_token_counter_agrees_with_prompt_length_histogram(server, tokenizer):
    """Every finished request's prompt counts both in ``prompt_tokens_total`` and in the
    ``request_prompt_tokens`` histogram, including one with max_tokens 0 (echo: it runs no step)."""
    prompts = ["The capital of France is", "One, two, three, four, five,"]
    before = parse_metrics(scrape(server))
    r = post(server, "/v1/completions", {"prompt": prompts[0], "max_tokens": 0, "echo": True})
    assert r["usage"]["completion_tokens"] == 0 and r["choices"][0]["text"] == prompts[0]
    post(server, "/v1/completions", {"prompt": prompts[1], "max_tokens": 2})
    after = parse_metrics(scrape(server))
    tokens = sum(len(tokenizer.encode(p)) for p in prompts)
    delta = {k: after[k] - before.get(k, 0.0) for k in ("zpp:prompt_tokens_total", "zpp:request_prompt_tokens_sum",
                                                        "zpp:request_prompt_tokens_count")}
    assert delta == {"zpp:prompt_tokens_total": tokens, "zpp:request_prompt_tokens_sum": tokens,
                     "zpp:request_prompt_tokens_count": 2}


# --- the Grafana dashboard -----------------------------------------------------------------------
_STRING = r'"(?:[^"\\]|\\.)*"'
_TOKEN = re.compile(rf'{_STRING}|\{{(?:{_STRING}|[^}}"])*\}}|\[[^\]]*\]|[A-Za-z_:][A-Za-z0-9_:]*|\S')
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
                 "topk", "quantile", "limitk", "limit_ratio"}
_KEYWORDS = _GROUPING | {"bool", "and", "or", "unless", "offset", "atan2"}


def promql_selectors(expr: str) -> list[tuple[str, str]]:
    """The (metric name, label matchers) of every vector selector in a PromQL expression: the
    names that are not functions (followed by "("), aggregations (``sum by (le) (...)``),
    keywords, or the labels of a grouping clause."""
    tokens = _TOKEN.findall(expr)
    out, i = [], 0
    while i < len(tokens):
        t = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if t in _GROUPING and nxt == "(":  # by (le): skip the label list
            i = tokens.index(")", i) + 1
            continue
        if (re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", t) and t not in _KEYWORDS and nxt != "("
                and not (t in _AGGREGATIONS and nxt in _GROUPING)):
            out.append((t, nxt if nxt.startswith("{") else ""))
        i += 1
    return out


def test_promql_selectors():
    assert promql_selectors('histogram_quantile(0.9, sum by (le) (rate(a:b_bucket{x="}"}[5m]))) / c') == \
        [("a:b_bucket", '{x="}"}'), ("c", "")]


@pytest.mark.slow
def test_grafana_dashboard_queries_exist_in_a_real_scrape(server):
    with open(DASHBOARD) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    titles = {p["title"] for p in dash["panels"]}
    assert {"Request rate", "Running / waiting", "Time to first token", "Time per output token",
            "Inter-token latency", "End-to-end request latency", "Token throughput", "KV cache usage",
            "Prefix cache hit rate", "Pipeline stage busy"} <= titles
    post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3})  # so every labelled series exists
    scraped = parse_metrics(scrape(server), keep_model_name=True)
    names = {k.split("{")[0] for k in scraped}
    used = set()
    for expr in exprs:
        selectors = promql_selectors(expr)
        assert selectors, expr
        for name, matchers in selectors:
            assert name.startswith("zpp:") and name in names, (name, expr)
            assert 'model_name="$model_name"' in matchers, expr  # the dashboard's model variable
            used.add(name)
    # Histograms through their _bucket (quantiles) and _sum / _count (means) series.
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds"):
        assert {f"zpp:{h}_bucket", f"zpp:{h}_sum", f"zpp:{h}_count"} <= used, h
    var = next(v for v in dash["templating"]["list"] if v["name"] == "model_name")
    metric, label = re.fullmatch(r"label_values\(([\w:]+), (\w+)\)", var["query"]["query"]).groups()
    assert any(k.startswith(metric + "{") and f'{label}="{NAME}"' in k for k in scraped)
