"""`zpp serve` start-up as a vLLM user meets it, through a subprocess: accurate help with defaults,
vLLM's spellings accepted, and every start-up error one line ``zpp: error: ...`` naming the flag or
file (a traceback only with ``--log-level debug``). Most cases fail before torch is imported, so
those runs take well under a second."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def zpp(*args: str, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zpp.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env={**os.environ, **env} if env else None)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    (d / "badjson").mkdir()
    (d / "badjson" / "config.json").write_text('{"architectures": [')
    (d / "noweights").mkdir()
    (d / "noweights" / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 49152, "max_position_embeddings": 256}))
    (d / "noweights" / "pytorch_model.bin").write_bytes(b"")
    return d


def test_help_shows_defaults_and_is_accurate():
    r = zpp("serve", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())  # argparse wraps lines
    assert "TCP port to listen on (default: 8000)" in text
    assert "(default: the number of stages; stages + 1 on CUDA)" in text
    assert "most requests running at once (default: 256)" in text
    assert "--model MODEL" in text and "--trust-remote-code" in text
    assert "--disable-log-requests no INFO line per finished request" in text
    assert "--log-stats-interval" not in text  # hidden (tests shorten the interval with it)


def _one_line_error(r: subprocess.CompletedProcess) -> str:
    lines = [l for l in r.stderr.splitlines() if "WARNING" not in l]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("zpp: error: "), r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


@pytest.mark.parametrize("args, expected", [
    (["--port", "99999"], "argument --port: 99999 is not a TCP port (0-65535)"),
    (["{d}/badjson"], "badjson/config.json: not valid JSON"),
    (["{d}/noweights"], "noweights': no *.safetensors weights in that directory"),
    (["HuggingFaceTB/SmolLM2-135M-Instruct"], "zpp does not download models: give a local directory "
                                              "(config.json + safetensors + tokenizer)"),
    (["{d}/missing"], "missing': no such directory; zpp does not download models"),
    (["{d}/noweights", "--device", "cpu", "--load-format", "dummy", "--nodes", "user@host"],
     "--nodes needs more than one worker"),
])
def test_start_up_errors_are_one_line(dirs, args, expected):
    r = zpp("serve", *[a.format(d=dirs) for a in args])
    assert expected in _one_line_error(r)


def test_model_flag_and_vllm_flags_accepted():
    """vLLM's command line: ``--model`` (here a hub id, refused with the download message, which
    shows the flag was read), ``--trust-remote-code`` accepted with a one-line warning, and the
    two logging flags zpp honours (no warning)."""
    r = zpp("serve", "--model", "org/model", "--trust-remote-code", "--disable-log-requests", "--disable-log-stats")
    assert "model 'org/model': no such directory; zpp does not download models" in _one_line_error(r)
    warnings = [l for l in r.stderr.splitlines() if "WARNING" in l]
    assert len(warnings) == 1 and "--trust-remote-code" in warnings[0] and "ignored" in warnings[0], r.stderr
    assert "two models given" in _one_line_error(zpp("serve", "a", "--model", "b"))


def test_traceback_only_with_log_level_debug(dirs):
    r = zpp("serve", str(dirs / "badjson"), "--log-level", "debug")
    assert r.returncode == 2
    assert "Traceback" in r.stderr and r.stderr.strip().splitlines()[-1].startswith("zpp: error: ")


def test_no_room_for_kv_cache_is_one_line_with_no_worker_error(demo_model, private_tmpdir):
    """The engine gives up after the workers loaded the model (1 KiB holds no KV block) and sends
    them Shutdown: that is an orderly exit for a worker still setting up, so stderr holds only the
    engine's one-line error (no ``ERROR [worker 0] worker failed: ...`` before it). The failed
    start leaves no socket file behind."""
    from helpers import ipc_socket_files
    r = zpp("serve", demo_model, "--kv-cache-memory", "1KiB", "--port", "0", "--log-level", "warning", env={"TMPDIR": private_tmpdir})
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        "zpp: error: no memory left for the KV cache (not one block fits): raise --kv-cache-memory / "
        "--gpu-memory-utilization"], r.stderr
    assert ipc_socket_files(private_tmpdir) == []


def test_kv_cache_larger_than_host_memory_is_one_line(demo_model):
    """A CPU stage's KV cache takes its pages only as blocks fill, so the worker checks the setting
    against the host's available memory before mapping it: one line naming the setting, exit 2."""
    r = zpp("serve", demo_model, "--kv-cache-memory", "1000TiB", "--port", "0", "--log-level", "warning")
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.splitlines()
    assert line.startswith("zpp: error: --kv-cache-memory: 1024000.00 GiB per stage, but ") and \
        line.endswith(" of memory available: lower it"), r.stderr


@pytest.mark.parametrize("args, expected", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser NAME"),
    (["--generation-config", "{d}/missing"], "--generation-config '{d}/missing': not 'auto', 'vllm' or a directory"),
    (["--generation-config", "{d}/noweights"], "no generation_config.json in that directory"),
])
def test_parser_and_generation_config_errors_are_one_line(demo_model, dirs, args, expected):
    r = zpp("serve", demo_model, "--port", "0", *[a.format(d=dirs) for a in args])
    assert expected.format(d=dirs) in _one_line_error(r)
    r = zpp("serve", "--tool-call-parser", "pythonic")
    assert r.returncode == 2 and "argument --tool-call-parser: invalid choice: 'pythonic'" in r.stderr


def test_serve_api_key_falls_back_to_zpp_api_key(monkeypatch):
    """``--api-key`` wins; without it ``ZPP_API_KEY`` is the key (vLLM reads ``VLLM_API_KEY``); with
    neither there is none. The demo's hint asks for the header whenever the server will want one."""
    from zpp.args import add_serve_args, server_config_from_args
    from zpp.cli import serve_api_key
    from zpp.demo import demo_hint

    def server(*argv):
        p = argparse.ArgumentParser()
        add_serve_args(p)
        return server_config_from_args(p.parse_args(list(argv)))

    monkeypatch.delenv("ZPP_API_KEY", raising=False)
    assert serve_api_key(server()) is None
    assert "Authorization" not in demo_hint(8000)
    assert serve_api_key(server("--api-key", "flag-key")) == "flag-key"
    monkeypatch.setenv("ZPP_API_KEY", "env-key")
    assert serve_api_key(server()) == "env-key"
    assert serve_api_key(server("--api-key", "flag-key")) == "flag-key"
    hint = demo_hint(8000)
    assert 'Authorization: Bearer $ZPP_API_KEY' in hint and "env-key" not in hint
