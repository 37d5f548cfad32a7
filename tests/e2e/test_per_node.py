"""Per-node launch across two real hosts (tests/two_hosts.py: two network namespaces joined by a veth
pair; its sshd is not used): the same `zpp serve` started in each namespace, as Slurm or a
LeaderWorkerSet would, with --nnodes 2 and node rank 0 (head, API) or 1 (headless).

- PP=2 across the two gives PP=1's greedy output, whether the per-node settings come from flags,
  from Slurm's variables (SLURM_NNODES, SLURM_NODEID, a compressed SLURM_JOB_NODELIST) or from
  LeaderWorkerSet's (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX); the LeaderWorkerSet
  case runs the command lines of examples/kubernetes/zpp-lws.yaml (parsed, its $(VAR)s expanded as
  Kubernetes does, the model, TP size and key path replaced by the test's, CPU-sized).
- A stage on the head is still restarted in place (the node's stage rejoins; same output after).
- Killing either side (SIGKILL) makes the other exit non-zero within 10 s; nothing is left. A
  killed head, after start-up (Slurm's variables) or while the node's workers start (flags: the head
  named by its address; LeaderWorkerSet: by its host name), makes node rank 1 exit 1 with one line
  naming the head, and no process of the launch is left on either host within 10 s.
- A node holding another run's key file is refused in one line; the head then gives up at
  --node-join-timeout in one line naming the missing node rank and the refused connection.
- A real Slurm (tests/slurm_cluster.py: munged, slurmctld and a slurmd per namespace, from Debian's
  packages, installed when missing): examples/slurm/zpp.sbatch, submitted with sbatch, serves PP=2
  across both "hosts" with PP=1's output; scancel leaves nothing.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, free_port

pytestmark = pytest.mark.slow

EXAMPLES = os.path.join(ROOT, "examples")
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time, in a small village"]
MAX_TOKENS = 10
HOSTS = ("zppn01", "zppn02")  # names of the head and the node, in both namespaces' /etc/hosts


def _env(extra: dict) -> dict:
    """This process's environment without any launcher's variables, plus ``extra``; one CPU thread
    per worker (both "hosts" share this machine's cores)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "LWS_")) and k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _wait_empty(h, ns: str, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        left = h.pids_in(ns)
        if not left or time.monotonic() > deadline:
            return [f"{p}: {_cmdline(p)}" for p in left]
        time.sleep(0.1)


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


@pytest.fixture(scope="module")
def hosts(two_hosts):
    """The two namespaces, each with an /etc/hosts naming both (``ip netns exec`` mounts
    /etc/netns/<ns>/hosts over /etc/hosts; the fixture's teardown removes that directory)."""
    h = two_hosts
    for ns in (h.head_ns, h.node_ns):
        with open(f"/etc/netns/{ns}/hosts", "w") as f:
            f.write(f"127.0.0.1 localhost\n{h.head_ip} {HOSTS[0]}\n{h.node_ip} {HOSTS[1]}\n")
    return h


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("keys") / "run.keys")
    subprocess.run([sys.executable, "-m", "zpp.cli", "node-keys", path], check=True, capture_output=True, timeout=60)
    return path


@pytest.fixture(scope="module")
def reference(demo_model, tokenizer):
    """PP=1 on one host: the texts every per-node run must give."""
    from zpp import LLM, SamplingParams
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(demo_model, kv_cache_memory="64MiB") as llm:
        return prompts, [o.outputs[0].text for o in llm.generate(prompts, sp)]


class _Node:
    """`zpp serve MODEL -pp 2 ...` (``argv`` after ``zpp serve``) in one namespace, its output in a file."""

    def __init__(self, h, ns: str, argv: list[str], env: dict, tag: str):
        self.h = h
        self.log_path = f"/tmp/zpp-pernode-{os.getpid()}-{tag}.log"
        self.log = open(self.log_path, "w+")
        self.proc = h.run_in(ns, [sys.executable, "-m", "zpp.cli", "serve", *argv], env=env,
                             stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


MANIFEST = os.path.join(EXAMPLES, "kubernetes", "zpp-lws.yaml")
KEYS_MOUNT = "/etc/zpp/run.keys"


def _lws_argv(worker_index: int, model: str, keys: str, leader: str) -> tuple[list[str], dict]:
    """The example LeaderWorkerSet's container command for the pod of ``worker_index``: its `zpp
    serve` arguments and environment (the container's env + what LWS injects), with Kubernetes'
    ``$(VAR)`` expansion; the model, TP size and key path are the test's."""
    import re

    import yaml
    with open(MANIFEST) as f:
        lws, service = yaml.safe_load_all(f)
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    t = lws["spec"]["leaderWorkerTemplate"]
    assert t["size"] == 2 and t["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert service["spec"]["selector"] == {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
                                           **t["leaderTemplate"]["metadata"]["labels"]}
    pod = t["leaderTemplate"] if worker_index == 0 else t["workerTemplate"]
    (container,) = pod["spec"]["containers"]
    keys_volume = next(v for v in pod["spec"]["volumes"] if "secret" in v)
    assert keys_volume["secret"]["defaultMode"] == 0o400
    assert any(m["name"] == keys_volume["name"] and KEYS_MOUNT.startswith(m["mountPath"] + "/")
               for m in container["volumeMounts"])
    env = {e["name"]: e["value"] for e in container["env"]}
    env.update(MODEL=model, TP_SIZE="1", LWS_LEADER_ADDRESS=leader, LWS_GROUP_SIZE=str(t["size"]),
               LWS_WORKER_INDEX=str(worker_index), LWS_NAME=lws["metadata"]["name"])
    argv = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a)
            for a in container["command"] + container["args"]]
    assert argv[:2] == ["zpp", "serve"], argv
    return [keys if a == KEYS_MOUNT else a for a in argv[2:]], env


def _launch(h, model: str, keys: str, how: str, extra=()) -> tuple[_Node, _Node, str]:
    """Head (node rank 0) and node (node rank 1), per-node settings from flags or a launcher's
    environment (``lws``: the example manifest's command lines); returns them and the head's API URL."""
    port = 8000 if how == "lws" else free_port()  # the manifest's port (free in the namespace)
    common = [model, "-pp", "2", "--node-keys-file", keys, "--kv-cache-memory", "64MiB", "--host", "127.0.0.1",
              "--port", str(port), *extra]
    sides = []
    for rank, ns in ((1, h.node_ns), (0, h.head_ns)):  # the node first: it waits for the head
        if how == "flags":
            argv, env = common + ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", h.head_ip,
                                  "--master-port", "29511"], {}
        elif how == "slurm":
            argv, env = common, {"SLURM_NNODES": "2", "SLURM_NODEID": str(rank), "SLURM_JOB_NODELIST": "zppn[01-02]",
                                 "SLURM_NTASKS": "2", "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0"}
        else:
            argv, env = _lws_argv(rank, model, keys, HOSTS[0])
            argv += ["--kv-cache-memory", "64MiB", "--host", "127.0.0.1", *extra]  # CPU-sized; the API on the head only
        sides.append(_Node(h, ns, argv, _env(env), f"{how}-{rank}"))
    node, head = sides
    return head, node, f"http://127.0.0.1:{port}"


def _wait_serving(head: _Node, node: _Node, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while "zpp: serving" not in head.output():
        for side in (head, node):
            assert side.proc.poll() is None, f"exited {side.proc.returncode}:\n{head.output()[-4000:]}\n--- node:\n" \
                                             f"{node.output()[-3000:]}"
        assert time.monotonic() < deadline, f"not serving:\n{head.output()[-4000:]}\n--- node:\n{node.output()[-3000:]}"
        time.sleep(0.3)


def _complete(h, url: str, body: dict) -> dict:
    code = ("import json, sys, urllib.request\n"
            "req = urllib.request.Request(sys.argv[1] + '/v1/completions', sys.argv[2].encode(), "
            "{'Content-Type': 'application/json'})\n"
            "print('RESULT ' + urllib.request.urlopen(req, timeout=120).read().decode())\n")
    p = h.run_in_head([sys.executable, "-c", code, url, json.dumps(body)], stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=150)
    line = next((t for t in out.splitlines() if t.startswith("RESULT ")), None)
    assert line, f"request failed ({p.returncode}): {err[-3000:]}"
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("how,victim", [("flags", "node"), ("slurm", "head"), ("lws", "node")])
def test_per_node_pp2_equals_pp1_and_fails_together(hosts, demo_model, keys_file, reference, how, victim):
    h = hosts
    prompts, ref = reference
    head, node = None, None
    try:
        head, node, url = _launch(h, demo_model, keys_file, how)
        _wait_serving(head, node)
        if how != "flags":  # what was read from the launcher's variables is logged, on both sides
            source = {"slurm": "Slurm", "lws": "LeaderWorkerSet"}[how]
            for side, rank in ((head, 0), (node, 1)):
                line = next((t for t in side.output().splitlines() if f"read from {source}" in t), "")
                assert f"--nnodes 2 --node-rank {rank} --master-addr {HOSTS[0]}" in line, side.output()[-3000:]
        assert "all 2 nodes joined" in head.output() and "node rank 1 = " in head.output()
        got = _complete(h, url, {"prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        texts = [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])]
        assert texts == ref
        if how == "flags":  # the head's own stage restarts in place; the node's rejoins
            core = [p for p in h.pids_in(h.head_ns) if _cmdline(p).startswith(("zpp::core", "zpp::stage"))]
            (worker,) = [p for p in core if _ppid(p) in core]  # the engine core's child: stage 0's worker
            os.kill(worker, signal.SIGKILL)
            again = _complete(h, url, {"prompt": prompts[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                                       "ignore_eos": True})
            assert again["choices"][0]["text"] == ref[0]
            assert "pipeline formed again" in head.output() and node.proc.poll() is None, head.output()[-3000:]
        # Kill one side: the other exits non-zero within 10 s, and nothing is left on either host.
        if victim == "head":
            _assert_all_gone_after_head_kill(h, head, node, how)
        else:
            t0 = time.monotonic()
            os.kill(node.proc.pid, signal.SIGKILL)
            try:
                rc = head.proc.wait(10)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the head still runs 10 s after the node was killed:\n{head.output()[-3000:]}")
            assert rc != 0 and time.monotonic() - t0 < 10, head.output()[-3000:]
            assert "node rank 1" in head.output() and "its launcher restarts the group" in head.output()
            assert not _wait_empty(h, h.node_ns, 10), "processes left on the node"
            assert not _wait_empty(h, h.head_ns, 10), "processes left on the head"
    finally:
        for side in (head, node):
            if side is not None:
                side.stop()


HEAD_GONE_BOUND_S = 10.0
"""Seconds within which every process of a launch is gone once its head was SIGKILLed (the node
notices in ~3 s: zpp.node.agent.HEAD_GRACE_S)."""


def _head_named(how: str, h) -> str:
    return f"node rank 0 at {h.head_ip}:29511" if how == "flags" else f"node rank 0 at {HOSTS[0]}:29501 ({h.head_ip})"


def _assert_all_gone_after_head_kill(h, head: _Node, node: _Node, how: str) -> None:
    """SIGKILL the head's `zpp serve`; within HEAD_GONE_BOUND_S the node exits 1 with one line naming
    the head, and no process is left in either namespace (every process of the launch lives there)."""
    t0 = time.monotonic()
    os.kill(head.proc.pid, signal.SIGKILL)
    try:
        rc = node.proc.wait(HEAD_GONE_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"node rank 1 still runs {HEAD_GONE_BOUND_S:.0f} s after the head was killed:\n"
                    f"{node.output()[-3000:]}")
    assert rc == 1, node.output()[-3000:]
    lines = [t for t in node.output().splitlines() if "lost the head" in t]
    assert len(lines) == 1 and lines[0].startswith(f"zpp: node rank 1: lost the head, {_head_named(how, h)}: "), \
        node.output()[-3000:]
    left = _wait_empty(h, h.node_ns, t0 + HEAD_GONE_BOUND_S - time.monotonic())
    left += _wait_empty(h, h.head_ns, t0 + HEAD_GONE_BOUND_S - time.monotonic())
    assert not left, f"left {HEAD_GONE_BOUND_S:.0f} s after the head was killed: {left}"


# Slurm's and LeaderWorkerSet's variables only fill --nnodes, --node-rank and --master-addr (a host
# name: zpp.cli.resolve_per_node), after which both launches run the same code; the host-name case
# once (LeaderWorkerSet; Slurm's is the post-start-up kill above) next to the address one (flags).
@pytest.mark.parametrize("how", ["flags", "lws"])
def test_head_killed_while_starting_leaves_nothing(hosts, demo_model, keys_file, how):
    """SIGKILL node rank 0's `zpp serve` the moment node rank 1 has joined it (the node starts its
    workers, the head its stage 0): node rank 1 exits 1 within seconds with one line naming the head,
    and no process of the launch is left on either host. (Before, the node and its worker waited
    120 s for an InitWorker that could not come, and the head's half-started stage 0, whose parent
    died before it could watch it, outlived it too.) Killed after start-up: the test above."""
    h = hosts
    head, node = None, None
    try:
        head, node, _ = _launch(h, demo_model, keys_file, how)
        deadline = time.monotonic() + 120
        while "joined the head" not in node.output():
            for side in (head, node):
                assert side.proc.poll() is None, f"exited {side.proc.returncode}:\n{side.output()[-3000:]}"
            assert time.monotonic() < deadline, node.output()[-3000:]
            time.sleep(0.02)
        _assert_all_gone_after_head_kill(h, head, node, how)
    finally:
        for side in (head, node):
            if side is not None:
                side.stop()


# The head's --node-join-timeout here. The refused node is started first (it retries until the head
# listens, as any node does), so its `zpp serve` has imported torch before the head waits; the head
# then waits it out. (Started after the head, the node needed most of 20 s on a loaded 2-core
# machine, and the head 40.)
JOIN_S = 15


def test_wrong_keys_refused_in_one_line(hosts, demo_model, keys_file, tmp_path):
    """A node with another run's key file: its handshake is refused and it exits 2 with one line; the
    head gives up at --node-join-timeout with one line naming node rank 1 and the refusal."""
    h = hosts
    other_keys = str(tmp_path / "other.keys")
    subprocess.run([sys.executable, "-m", "zpp.cli", "node-keys", other_keys], check=True, capture_output=True,
                   timeout=60)
    port = free_port()
    r = h.run_in_node([sys.executable, "-m", "zpp.cli", "serve", demo_model, "-pp", "2", "--nnodes", "2",
                       "--node-rank", "1", "--master-addr", h.head_ip, "--master-port", "29512",
                       "--node-keys-file", other_keys, "--log-level", "warning"], env=_env({}),
                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    head = _Node(h, h.head_ns, [demo_model, "-pp", "2", "--nnodes", "2", "--node-rank", "0", "--master-addr", h.head_ip,
                                "--master-port", "29512", "--node-keys-file", keys_file, "--node-join-timeout", str(JOIN_S),
                                "--kv-cache-memory", "64MiB", "--host", "127.0.0.1", "--port", str(port)],
                 _env({}), "keys-head")
    try:
        deadline = time.monotonic() + 120
        while "waiting for node rank 1" not in head.output():
            assert head.proc.poll() is None and time.monotonic() < deadline, head.output()[-3000:]
            time.sleep(0.2)
        t0 = time.monotonic()
        out, err = r.communicate(timeout=60)
        lines = [t for t in err.splitlines() if t.strip()]
        assert r.returncode == 2 and len(lines) == 1, err
        assert lines[0].startswith("zpp: error: node rank 1: ") and "refused the control-plane handshake" in lines[0] \
            and "--node-keys-file" in lines[0], lines[0]
        assert time.monotonic() - t0 < JOIN_S, "the node was not refused while the head waited for it"
        assert head.proc.wait(JOIN_S + 60) == 1
        errors = [t for t in head.output().splitlines() if t.startswith("zpp: error:")]
        assert len(errors) == 1, head.output()[-3000:]
        assert f"node rank 1 did not join (stage 1) within {JOIN_S} s" in errors[0] \
            and "refused meanwhile" in errors[0], errors[0]
        assert not _wait_empty(h, h.node_ns, 10) and not _wait_empty(h, h.head_ns, 10)
    finally:
        head.stop()
        if r.poll() is None:
            r.kill()
            r.wait(10)


def test_slurm_sbatch_example(hosts, demo_model, reference, tmp_path):
    """examples/slurm/zpp.sbatch under a real Slurm: sbatch -> srun starts `zpp serve` on both nodes,
    which read Slurm's variables; the API on the first node answers with PP=1's output; the script
    made the key file (0400); scancel ends everything."""
    from slurm_cluster import SlurmCluster, ensure_slurm
    ensure_slurm()
    h = hosts
    prompts, ref = reference
    cluster = SlurmCluster(h).start()
    try:
        keys = tmp_path / "zpp" / "run.keys"
        env = {"MODEL": demo_model, "KEYS": str(keys), "PORT": "8000", "ZPP_ARGS": "--kv-cache-memory 64MiB",
               "OMP_NUM_THREADS": "1", "PATH": os.path.dirname(sys.executable) + ":" + os.environ.get("PATH", "")}
        job = cluster.sbatch(os.path.join(EXAMPLES, "slurm", "zpp.sbatch"), env)
        job.wait_for("zpp: serving", timeout=240)
        out = job.output()
        for rank in (0, 1):
            assert f"SLURM_NODEID={rank} SLURM_STEP_NODELIST=zppn[01-02] -> --nnodes 2 --node-rank {rank} " \
                   f"--master-addr zppn01" in out, out[-4000:]
        assert "node rank 1 = zppn02" in out and "the API will be on http://zppn01:8000" in out, out[-4000:]
        assert oct(os.stat(keys).st_mode & 0o777) == "0o400"
        got = _complete(h, "http://zppn01:8000", {"prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                   "ignore_eos": True})
        assert [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])] == ref
        job.cancel()
        deadline = time.monotonic() + 15
        while cluster.leftovers() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not cluster.leftovers(), cluster.leftovers()
    finally:
        cluster.teardown()
