"""The rest of a `vllm serve` line (--config YAML, --response-role, --root-path, --max-logprobs,
the uvicorn log flags, flags accepted with a warning or refused), slow and idle clients shed by the
keep-alive / body timeouts, and SIGTERM draining with --shutdown-timeout: all on one real server
(the demo model, two front-end processes), which the last test stops."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from helpers import ServerProcess, descendants
from zpp.cli import build_parser, expand_config_file, main

pytestmark = pytest.mark.slow  # servers / engines (see tests/helpers.py)

KEEP_ALIVE_S = 2.0
BODY_S = 2.0
SHUTDOWN_S = 15.0


@pytest.fixture(scope="module")
def server(demo_model, tmp_path_factory):
    """A `vllm serve`-style command line: a YAML --config (the command line overrides its
    max-num-seqs), the vLLM flags that have a meaning here, and those accepted with a warning."""
    cfg = tmp_path_factory.mktemp("cfg") / "serve.yaml"
    cfg.write_text("max-model-len: 2048\nmax_num_seqs: 4\nenable-prefix-caching: true\n"
                   "served-model-name: smol\n")
    s = ServerProcess([demo_model, "--config", str(cfg), "--max-num-seqs", "16", "--response-role", "bot",
                       "--root-path", "/llm", "--max-logprobs", "3", "--swap-space", "4",
                       "--distributed-executor-backend", "mp", "--enable-request-id-headers", "--disable-uvicorn-access-log",
                       "--uvicorn-log-level", "warning", "--trust-remote-code", "--dtype", "float32",
                       "--kv-cache-memory", "128MiB", "--timeout-keep-alive", str(KEEP_ALIVE_S),
                       "--timeout-request-body", str(BODY_S), "--shutdown-timeout", str(SHUTDOWN_S),
                       "--api-server-count", "2", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--generation-config", "vllm"])
    yield s
    s.stop()


def _post(url: str, body: dict, timeout: float = 60):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_vllm_serve_line_serves(server):
    from openai import OpenAI
    out = server.output()
    assert out.count("--swap-space 4.0: has no effect") == 1, out
    assert out.count("--distributed-executor-backend mp: has no effect") == 1, out
    assert "--trust-remote-code" in out
    want = {"zpp::core", "zpp::stage0", "zpp::api1", "zpp::grammar"}
    deadline = time.monotonic() + 60  # front end 1 may still be importing when the first one answers
    while True:
        titles = set()
        for p in descendants(server.proc.pid):  # processes named in ps (setproctitle)
            try:
                titles.add(open(f"/proc/{p}/cmdline").read().rstrip("\0 "))
            except OSError:
                pass
        if want <= titles or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert want <= titles, titles
    # --config: the file's max-model-len and name; the command line's --max-num-seqs 16 beat the file's 4
    models = json.loads(urllib.request.urlopen(server.url + "/v1/models").read())
    assert models["data"][0]["id"] == "smol" and models["data"][0]["max_model_len"] == 2048
    # --root-path: the routes answer under the prefix (a proxy that keeps it) and without (one that strips it)
    for base in (server.url + "/llm/v1", server.url + "/v1"):
        client = OpenAI(base_url=base, api_key="x", max_retries=0)
        r = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=4,
                                      temperature=0)
        assert r.choices[0].text and r.usage.completion_tokens == 4
    assert urllib.request.urlopen(server.url + "/llm/health").status == 200
    # --response-role
    status, body = _post(server.url + "/llm/v1/chat/completions",
                         {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert status == 200 and body["choices"][0]["message"]["role"] == "bot"
    status, body = _post(server.url + "/v1/chat/completions",  # a continued message keeps its role (vLLM's)
                         {"model": "smol", "messages": [{"role": "user", "content": "Hi"},
                                                        {"role": "assistant", "content": "Hello! How"}],
                          "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 2})
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    req = urllib.request.Request(server.url + "/v1/chat/completions", json.dumps(
        {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}).encode(),
        {"Content-Type": "application/json"})
    first = json.loads(urllib.request.urlopen(req).read().decode().split("\n\n")[0][len("data: "):])
    assert first["choices"][0]["delta"]["role"] == "bot"


def test_max_logprobs(server):
    url = server.url + "/v1/completions"
    status, body = _post(url, {"model": "smol", "prompt": "Hi", "max_tokens": 1, "logprobs": 3})
    assert status == 200 and len(body["choices"][0]["logprobs"]["top_logprobs"][0]) in (3, 4)  # + the sampled one
    status, body = _post(url, {"model": "smol", "prompt": "Hi", "max_tokens": 1, "logprobs": 4})
    assert status == 400 and body["error"]["param"] == "logprobs" and "--max-logprobs" in body["error"]["message"]
    status, body = _post(url, {"model": "smol", "prompt": "Hi", "max_tokens": 1, "prompt_logprobs": 5})
    assert status == 400 and body["error"]["param"] == "prompt_logprobs"
    status, body = _post(server.url + "/v1/chat/completions",
                         {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                          "logprobs": True, "top_logprobs": 4})
    assert status == 400 and body["error"]["param"] == "top_logprobs"


def test_tool_message_needs_tool_call_id(server):
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
            {"role": "tool", "content": "sunny"}]
    status, body = _post(server.url + "/v1/chat/completions", {"model": "smol", "messages": msgs, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "messages[2].tool_call_id", body
    assert "tool_call_id" in body["error"]["message"]


def _closed_within(socks: list[socket.socket], timeout: float) -> tuple[int, list[bytes]]:
    """Wait until every socket reads EOF (or a reset); return (still open, first bytes each got)."""
    import selectors
    sel = selectors.DefaultSelector()
    got = {}
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        got[s] = b""
    open_ = set(socks)
    deadline = time.monotonic() + timeout
    while open_ and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.2):
            s = key.fileobj
            try:
                data = s.recv(65536)
            except (ConnectionResetError, BlockingIOError):
                data = b"" if s in open_ else None
                if data is None:
                    continue
            if data:
                got[s] += data
                continue
            sel.unregister(s)
            open_.discard(s)
    for s in socks:
        s.close()
    return len(open_), [got[s] for s in socks]


def test_slow_and_idle_clients_are_shed(server):
    """300 sockets that send half a request head and 50 that promise a 1 MB body and send 10 bytes
    are closed within the keep-alive (head) and body timeouts, while /health and a real completion
    keep answering; an idle keep-alive connection is closed too."""
    addr = ("127.0.0.1", server.port)
    t0 = time.monotonic()
    half = []
    for _ in range(300):
        s = socket.create_connection(addr)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        half.append(s)
    stalled = []
    for _ in range(50):
        s = socket.create_connection(addr)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000\r\n\r\n{\"prompt\":")
        stalled.append(s)
    idle = socket.create_connection(addr)
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    # the server keeps answering meanwhile (a completion can take long on a loaded machine: in a thread)
    answers = []
    t = threading.Thread(target=lambda: answers.append(_post(
        server.url + "/v1/completions", {"model": "smol", "prompt": "Hello", "max_tokens": 2}, timeout=120)))
    t.start()
    assert urllib.request.urlopen(server.url + "/health", timeout=5).status == 200
    slack = 3.0  # a loaded 2-core machine
    left, _ = _closed_within(half, t0 + KEEP_ALIVE_S + slack - time.monotonic())
    assert left == 0, f"{left} half-header sockets still open after {time.monotonic() - t0:.1f} s"
    left, got = _closed_within(stalled, t0 + BODY_S + slack - time.monotonic())
    assert left == 0, f"{left} stalled-body sockets still open after {time.monotonic() - t0:.1f} s"
    assert all(g.startswith(b"HTTP/1.1 408") for g in got), got[0]
    assert b"request body stopped arriving" in got[0]
    left, got = _closed_within([idle], t0 + KEEP_ALIVE_S + slack - time.monotonic())
    assert left == 0 and got[0].startswith(b"HTTP/1.1 200"), "an idle keep-alive connection was held"
    assert urllib.request.urlopen(server.url + "/health", timeout=5).status == 200
    t.join(120)
    assert answers and answers[0][0] == 200 and answers[0][1]["usage"]["completion_tokens"] == 2, answers


def test_cli_refusals_and_hints(capsys, tmp_path):
    for flag in ("--download-dir", "--revision"):
        assert main(["serve", flag, "x"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "zpp does not download" in err, err
    assert main(["serve", "--distributed-executor-backend", "ray"]) == 2
    assert "no Ray" in capsys.readouterr().err
    assert main(["serve", "--tokenizer-mode", "mistral"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tokenizer-mode mistral: zpp loads" in err, err
    assert build_parser().parse_args(["serve", "--tokenizer-mode", "auto"]).tokenizer_mode == "auto"
    assert main(["serve", "--load-format", "dummy", "--max-logprobs", "21"]) == 2
    assert "--max-logprobs 21: must be 0 to 20" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--no-such-flag"])
    assert e.value.code == 2 and "(see: zpp serve --help)" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("max-num-seqz: 3\n")
    assert main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "'max-num-seqz' is not a flag of `zpp serve`" in err and err.count("\n") == 1
    # the command line overrides the file, wherever --config stands
    good = tmp_path / "good.yaml"
    good.write_text("port: 9000\nmax_num_seqs: 4\nenforce-eager: true\nenable-chunked-prefill: false\n")
    p = build_parser()
    args = p.parse_args(expand_config_file(p, ["serve", "--port", "8001", "--config", str(good), "m"]))
    assert (args.port, args.max_num_seqs, args.enforce_eager, args.enable_chunked_prefill, args.model) == \
        (8001, 4, True, False, "m")


def test_sigterm_drains_open_streams(server):
    """SIGTERM with 8 open streams: no new connection is accepted, the 8 finish within
    --shutdown-timeout, a 9th that cannot finish in time ends with an error event, and the server
    exits 0. (Runs last: it stops the module's server.)"""
    results: dict[int, list[str]] = {}
    started = threading.Barrier(10)

    def stream(i: int, max_tokens: int):
        body = {"model": "smol", "prompt": str(i), "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0}
        req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        lines: list[str] = []
        results[i] = lines
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                if raw.strip():
                    if not lines:
                        started.wait(120)
                    lines.append(raw.decode().strip())

    # one-token prompts: all 9 prefill in one step, so all are open at
    # the signal; the 8 then need two steps more, the 9th cannot finish in time even on a quiet machine
    threads = [threading.Thread(target=stream, args=(i, 3), daemon=True) for i in range(8)]
    threads.append(threading.Thread(target=stream, args=(8, 2000), daemon=True))
    for t in threads:
        t.start()
    started.wait(120)  # every stream has its first event
    t0 = time.monotonic()
    os.kill(server.proc.pid, signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises((ConnectionRefusedError, urllib.error.URLError)):
        urllib.request.urlopen(server.url + "/health", timeout=2)
    assert server.proc.wait(SHUTDOWN_S + 20) == 0
    took = time.monotonic() - t0
    for t in threads:
        t.join(10)
    for i in range(8):
        events = [json.loads(x[len("data: "):]) for x in results[i][:-1]]
        assert results[i][-1] == "data: [DONE]", results[i][-3:]
        assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
    assert results[8][-1] == "data: [DONE]", results[8][-2:]
    assert json.loads(results[8][-2][len("data: "):])["error"]["message"] == "the server is shutting down"
    assert SHUTDOWN_S - 1 < took < SHUTDOWN_S + 15, took
    # both front ends drained (the streams were spread over them by SO_REUSEPORT)
    drained = [int(n) for n in re.findall(r"draining: (\d+) request\(s\) in progress", server.output())]
    assert sum(drained) == 9, server.output()[-3000:]
    # front end 1 started its grammar compile host too (it could not, as a daemonic process)
    assert "Traceback" not in server.output() and "structured outputs" not in server.output(), \
        server.output()[-3000:]
