"""Stages on two real hosts: a head and a node network namespace joined by a veth pair, with a real
sshd on the node (tests/two_hosts.py). The head starts `zpp-node` over SSH (`--node-command` names
the venv's agent: it is not on the node's PATH); activations cross the veth over gloo.

- PP=2 (one stage per host) and PP=3 (two stages on the node) give PP=1's greedy tokens, batched
  and alone.
- A killed remote worker or agent: the open stream gets an error naming the host and stage within
  10 s, /health says 503, the server exits non-zero, nothing is left on either host.
- A SIGKILLed head: the node is empty within 10 s.
- A ZeroMQ peer without the run's keys gets no answer, and the head logs the refusal.
- Start-up failures (unreachable host, refused key, no zpp there) end within 30 s with one line.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import free_port

pytestmark = pytest.mark.slow

AGENT = os.path.join(os.path.dirname(sys.executable), "zpp-node")
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time, in a small village"]
MAX_TOKENS = 10

# Runs in the head namespace: the offline LLM across both hosts; prints the token ids as JSON.
DRIVER = textwrap.dedent("""
    import json, sys
    from zpp import LLM, SamplingParams
    model, pp, node, agent = sys.argv[1:5]
    prompts = json.loads(sys.argv[5])
    sp = SamplingParams(temperature=0, max_tokens=int(sys.argv[6]), ignore_eos=True)
    llm = LLM(model, pipeline_parallel_size=int(pp), nodes=[node], node_command=agent, kv_cache_memory="64MiB")
    try:
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    finally:
        llm.shutdown()
    print("RESULT " + json.dumps({"batched": batched, "alone": alone}), flush=True)
""")

# Runs in the head namespace against a server there: streams one completion, says STREAMING at the
# first token, then records how the stream ends and what /health answers until the server is gone.
STREAM_CLIENT = textwrap.dedent("""
    import json, sys, threading, time, urllib.request, urllib.error
    url = sys.argv[1]
    out = {"events": [], "health": []}
    def stream():
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 2000, "stream": True,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line:
                        continue
                    if not out["events"]:
                        print("STREAMING", flush=True)
                    out["events"].append(line)
                    if "error" in line:
                        out["error_at"] = time.monotonic()
        except Exception as e:
            out["stream_exc"] = repr(e)
        out["ended_at"] = time.monotonic()
    t = threading.Thread(target=stream)
    t.start()
    sys.stdin.readline()  # the test killed something
    out["killed_at"] = time.monotonic()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                out["health"].append(r.status)
        except urllib.error.HTTPError as e:
            out["health"].append(e.code)
        except Exception:
            if "ended_at" in out:
                break
        time.sleep(0.05)
    t.join(20)
    out["events"] = out["events"][-3:]
    print("RESULT " + json.dumps(out), flush=True)
""")


def _head_env(h) -> dict:
    """The head's environment: the test's ssh, one CPU thread per worker (both "hosts" share this
    machine's cores; the fixture sets the same on the node)."""
    return dict(os.environ, ZPP_SSH=h.ssh_command, OMP_NUM_THREADS="1")


def _result(proc: subprocess.Popen, timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"no result (exit {proc.returncode}):\n{out[-3000:]}\n{err[-6000:]}")


def _wait_empty(h, ns: str, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = h.pids_in(ns)
        if not left or time.monotonic() > deadline:
            return [f"{p}: {_cmdline(p)}" for p in left]
        time.sleep(0.1)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


@pytest.fixture(scope="module")
def reference(demo_model, tokenizer):
    """PP=1 on one host: the tokens every split must give."""
    from zpp import LLM, SamplingParams
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(demo_model, kv_cache_memory="64MiB") as llm:
        return prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


@pytest.mark.parametrize("pp,node_spec", [(2, ""), (3, ":2")], ids=["pp2-one-stage-each", "pp3-two-on-node"])
def test_stages_across_hosts_equal_pp1(two_hosts, demo_model, reference, monkeypatch, pp, node_spec):
    h = two_hosts
    prompts, ref = reference
    env = _head_env(h)
    proc = h.run_in_head([sys.executable, "-c", DRIVER, demo_model, str(pp), h.node_target + node_spec, AGENT,
                          json.dumps(prompts), str(MAX_TOKENS)], env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    got = _result(proc, timeout=240)
    assert got["batched"] == ref
    assert got["alone"] == ref
    assert not _wait_empty(h, h.node_ns, 10), "processes left on the node"
    assert not _wait_empty(h, h.head_ns, 10), "processes left on the head"


class _Server:
    """`zpp serve` in the head namespace with stages on the node."""

    def __init__(self, h, model: str, *extra: str, wait: bool = True):
        self.h = h
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/zpp-multihost-{self.port}.log"
        self.log = open(self.log_path, "w+")
        env = _head_env(h)
        self.proc = h.run_in_head([sys.executable, "-m", "zpp.cli", "serve", model, "--pipeline-parallel-size", "2",
                                   "--nodes", h.node_target, "--node-command", AGENT, "--kv-cache-memory", "64MiB",
                                   "--host", "127.0.0.1", "--port", str(self.port), *extra],
                                  env=env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_serving()

    def wait_serving(self) -> None:
        deadline = time.monotonic() + 180
        while "zpp: serving" not in self.output():
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"server did not start:\n{self.output()}"
            time.sleep(0.3)

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def request(self, body: dict) -> dict:
        code = ("import json, sys, urllib.request\n"
                "req = urllib.request.Request(sys.argv[1] + '/v1/completions', sys.argv[2].encode(), "
                "{'Content-Type': 'application/json'})\n"
                "print('RESULT ' + urllib.request.urlopen(req, timeout=60).read().decode())\n")
        p = self.h.run_in_head([sys.executable, "-c", code, self.url, json.dumps(body)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        return _result(p, timeout=90)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def _node_pids(h, needle: str) -> list[int]:
    return [p for p in h.pids_in(h.node_ns) if needle in _cmdline(p)]


@pytest.mark.parametrize("victim", ["worker", "agent"])
def test_remote_death_fails_fast(two_hosts, demo_model, victim):
    h = two_hosts
    s = _Server(h, demo_model, "--max-stage-restarts", "0")
    try:
        client = h.run_in_head([sys.executable, "-c", STREAM_CLIENT, s.url], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == "STREAMING"
        needle = "zpp::" if victim == "worker" else "zpp-node"  # zpp::worker1 / zpp::stage1
        pids = _node_pids(h, needle)
        assert pids, f"no {victim} on the node: {[_cmdline(p) for p in h.pids_in(h.node_ns)]}"
        os.kill(pids[0], signal.SIGKILL)
        client.stdin.write("killed\n")
        client.stdin.flush()
        got = _result(client, timeout=60)
        assert "error_at" in got, got
        assert got["error_at"] - got["killed_at"] < 10
        error = json.loads(got["events"][-2].removeprefix("data: ")) if got["events"][-1] == "data: [DONE]" \
            else json.loads(got["events"][-1].removeprefix("data: "))
        message = error["error"]["message"]
        assert "stage 1" in message and h.node_target in message, message
        assert 503 in got["health"], got["health"]
        assert s.proc.wait(15) != 0
        assert not _wait_empty(h, h.node_ns, 10), "processes left on the node"
        assert not _wait_empty(h, h.head_ns, 10), "processes left on the head"
    finally:
        s.stop()


@pytest.fixture(scope="module")
def shared_server(two_hosts, demo_model):
    """One default server (stage 1 on the node) for the peer-without-keys test and then the head
    SIGKILL test, which ends it (one start less; they ran a server each)."""
    s = _Server(two_hosts, demo_model)
    yield s
    s.stop()


def test_peer_without_keys_is_refused_and_logged(two_hosts, shared_server):
    h = two_hosts
    s = shared_server
    before = s.request({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    line = next(t for t in s.output().splitlines() if "control plane on tcp://" in t)
    endpoint = line.split("control plane on ")[1].split()[0]
    # A DEALER with no CURVE keys, from the node (as an attacker on the network would), sends a
    # well-formed Hello claiming rank 1 and waits for any answer.
    intruder = textwrap.dedent("""
        import sys, zmq
        from zpp.transport import messages as m
        s = zmq.Context().socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, b"rank1")
        s.setsockopt(zmq.LINGER, 0)
        s.connect(sys.argv[1])
        s.send(m.encode(m.Hello(rank=1, key="0" * 32, pid=1, hostname="intruder")))
        print("RESULT " + ("true" if s.poll(3000) else "false"), flush=True)
    """)
    p = h.run_in_node([sys.executable, "-c", intruder, endpoint], stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
    assert _result(p, timeout=30) is False, "a peer without keys got an answer"
    deadline = time.monotonic() + 5
    while "refused a control-plane connection from " not in s.output():
        assert time.monotonic() < deadline, s.output()[-3000:]
        time.sleep(0.1)
    # The peer is named when its connection is still open when the monitor thread asks (ZeroMQ's
    # event carries only the file descriptor): on a loaded machine it may be gone already.
    for t in s.output().splitlines():
        if "refused a control-plane connection from " in t:
            peer = t.split("refused a control-plane connection from ")[1].split(" on ")[0]
            assert peer.startswith(h.node_ip + ":") or peer == "an unknown peer", t
    after = s.request({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert s.proc.poll() is None
    # (the server's end, and the node emptied after it: test_head_sigkill_empties_node, next)


def test_head_sigkill_empties_node(two_hosts, shared_server):
    """On the server the test above used (or a fresh one when run alone): its last user."""
    h = two_hosts
    s = shared_server
    try:
        assert s.proc.poll() is None and _node_pids(h, "zpp::")
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(10)
        assert not _wait_empty(h, h.node_ns, 10), "the node kept processes of a SIGKILLed head"
        assert not _wait_empty(h, h.head_ns, 10), "the head's workers outlived it"
    finally:
        s.stop()


def _serve_fails(h, model: str, node: str, *extra: str, env_extra: dict | None = None) -> tuple[int, str, float]:
    """(exit status, stderr, seconds from the head's first SSH attempt to its exit)."""
    env = {**_head_env(h), **(env_extra or {})}
    p = h.run_in_head([sys.executable, "-m", "zpp.cli", "serve", model, "--pipeline-parallel-size", "2",
                       "--nodes", node, "--node-command", AGENT, "--kv-cache-memory", "64MiB",
                       "--host", "127.0.0.1", "--port", str(free_port()), *extra],
                      env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t = None
    for line in p.stderr:  # the log goes to stderr; note when the head starts ssh
        if t is None and "starting zpp-node on" in line:
            t = time.monotonic()
        err = line if "zpp: error:" in line else ""
        if err:
            break
    rest = p.stderr.read()
    p.wait(30)
    assert t is not None, err + rest
    return p.returncode, err + rest, time.monotonic() - t


def _error_line(err: str) -> str:
    lines = [t for t in err.splitlines() if t.startswith("zpp: error:")]
    assert len(lines) == 1 and len(err.strip().splitlines()) == 1, err
    return lines[0]


def test_startup_failures_name_the_host(two_hosts, demo_model, tmp_path):
    h = two_hosts
    # No zpp there.
    rc, err, took = _serve_fails(h, demo_model, h.node_target, "--node-command", "/nonexistent/zpp-node")
    line = _error_line(err)
    assert rc != 0 and took < 30 and h.node_target in line and "--node-command" in line, err
    # The key is refused.
    other_key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)], check=True)
    rc, err, took = _serve_fails(h, demo_model, h.node_target,
                                 env_extra={"ZPP_SSH": h.ssh_command.replace(h.key_path, str(other_key))})
    line = _error_line(err)
    assert rc != 0 and took < 30 and h.node_target in line and "Permission denied" in line, err
    # Nobody at that address.
    absent = h.node_ip.rsplit(".", 1)[0] + ".3"
    rc, err, took = _serve_fails(h, demo_model, f"root@{absent}")
    line = _error_line(err)
    assert rc != 0 and took < 30 and absent in line and "ssh" in line, err
    assert not _wait_empty(h, h.head_ns, 10)


def test_loopback_refused_for_multi_host(demo_model):
    """Before anything starts: a loopback head address cannot serve another host."""
    r = subprocess.run([sys.executable, "-m", "zpp.cli", "serve", demo_model, "-pp", "2", "--nodes", "root@10.9.9.9",
                        "--distributed-host", "127.0.0.1", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = [t for t in r.stderr.splitlines() if t.strip()]
    assert len(lines) == 1 and "loopback" in lines[0] and "--distributed-host" in lines[0], r.stderr


def test_agent_started_by_hand_with_a_keys_file(two_hosts, demo_model, tmp_path):
    """No SSH: the head waits (--node-launcher manual) and writes the run's keys to a 0600 file;
    zpp-node started on the node with that file joins; a readable key file is refused."""
    h = two_hosts
    keys = tmp_path / "run.keys"
    port = free_port()
    s = _Server(h, demo_model, "--node-launcher", "manual", "--node-keys-file", str(keys),
                "--distributed-host", h.head_ip, "--distributed-port", str(port), wait=False)
    agent = None
    try:
        deadline = time.monotonic() + 120
        while "waiting for" not in s.output():
            assert s.proc.poll() is None and time.monotonic() < deadline, s.output()
            time.sleep(0.2)
        assert oct(os.stat(keys).st_mode & 0o777) == "0o600"
        loose = tmp_path / "loose.keys"
        loose.write_bytes(keys.read_bytes())
        loose.chmod(0o644)
        r = subprocess.run(["ip", "netns", "exec", h.node_ns, AGENT, "--engine", f"tcp://{h.head_ip}:{port}",
                            "--ranks", "1", "--keys-file", str(loose)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "chmod 600" in r.stderr, r.stderr
        agent = h.run_in_node([AGENT, "--engine", f"tcp://{h.head_ip}:{port}", "--ranks", "1",
                               "--keys-file", str(keys)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
        s.wait_serving()
        out = s.request({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        assert out["choices"][0]["text"].strip()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 0
        assert agent.wait(15) == 0, "the hand-started agent did not end with the run"
        assert not _wait_empty(h, h.node_ns, 10)
    finally:
        s.stop()
        if agent is not None and agent.poll() is None:
            agent.kill()


# Runs in the head namespace: streams the completion ``argv[2]`` (JSON body), says STREAMING at the
# first token, waits for a line on stdin (the test killed something), then reports the whole text
# and any error.
TEXT_STREAM_CLIENT = textwrap.dedent("""
    import json, sys, threading, urllib.request
    url, body = sys.argv[1], sys.argv[2].encode()
    out = {"text": "", "error": None}
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=180) as r:
            said = False
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    out["error"] = ev["error"]["message"]
                    continue
                out["text"] += ev["choices"][0]["text"]
                if not said:
                    print("STREAMING", flush=True)
                    said = True
                    sys.stdin.readline()
    except Exception as e:
        out["error"] = repr(e)
    print("RESULT " + json.dumps(out), flush=True)
""")


def test_remote_stage_restarts_in_place(two_hosts, demo_model):
    """Supervised stages across hosts: SIGKILL of the remote worker, then of the remote zpp-node ->
    the head starts that host's agent again over SSH, the stream being served pauses and completes
    with exactly the undisturbed text, and the node's processes are new ones; nothing is left after."""
    h = two_hosts
    s = _Server(h, demo_model, "--worker-heartbeat-timeout", "5")
    body = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        def run(kill=None) -> dict:
            c = h.run_in_head([sys.executable, "-c", TEXT_STREAM_CLIENT, s.url, json.dumps(body)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert c.stdout.readline().strip() == "STREAMING"
            if kill is not None:
                os.kill(kill, signal.SIGKILL)
            c.stdin.write("go\n")
            c.stdin.flush()
            return _result(c, timeout=180)

        ref = run()
        assert ref["error"] is None and ref["text"], ref
        for victim in ("zpp::", "zpp-node"):  # a worker (zpp::stage1), its agent
            workers, agents = _node_pids(h, "zpp::"), _node_pids(h, "zpp-node")
            assert workers and agents, [_cmdline(p) for p in h.pids_in(h.node_ns)]
            got = run(kill=(workers if victim == "zpp::" else agents)[0])
            assert got == ref, (victim, got, s.output()[-4000:])
            new_workers, new_agents = _node_pids(h, "zpp::"), _node_pids(h, "zpp-node")
            assert new_workers and not set(new_workers) & set(workers), (victim, workers, new_workers)
            assert new_agents and not set(new_agents) & set(agents), (victim, agents, new_agents)
        assert s.output().count("pipeline formed again") == 2, s.output()[-4000:]
    finally:
        s.stop()
    assert not _wait_empty(h, h.node_ns, 15), "processes left on the node"
    assert not _wait_empty(h, h.head_ns, 15), "processes left on the head"
