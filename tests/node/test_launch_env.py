"""Per-node launch settings without starting anything: Slurm host lists, the launchers' environment
variables (Slurm, LeaderWorkerSet, torchrun-style) and their precedence under the flags, the rank
split both sides compute, the head's listening address, and the one-line refusals (key files,
flag combinations)."""
from __future__ import annotations

import logging
import os
import socket
import stat
import subprocess
import sys

import pytest

from zpp.cli import build_parser, resolve_per_node
from zpp.config import ConfigError, ParallelConfig
from zpp.node.launch_env import expand_hostlist, from_lws, from_slurm, from_torchrun, launcher_env
from zpp.node.pernode import head_bind_address
from zpp.node.placement import split_ranks
from zpp.transport.security import new_run_keys, read_node_keys, write_keys_file


@pytest.mark.parametrize("text,hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("dgx-a100-[001-002]-ib", ["dgx-a100-001-ib", "dgx-a100-002-ib"]),
    ("x[3],y", ["x3", "y"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-03", "node01]", "node[3-1]", "node[a-b]", "node[]", "n[[1]]", ""])
def test_expand_hostlist_refuses(text):
    with pytest.raises(ConfigError, match="host list"):
        expand_hostlist(text)


def test_slurm_srun_task():
    env = {"SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_NTASKS": "3",
           "SLURM_PROCID": "2", "SLURM_STEP_ID": "0"}
    got = from_slurm(env)
    assert (got.source, got.nnodes, got.node_rank, got.master_addr, got.master_port) == ("Slurm", 3, 2, "gpu07", None)
    assert "SLURM_JOB_NODELIST=gpu[07-09]" in got.describe()
    # A step on part of the job's nodes: the step's own list and count.
    env.update(SLURM_STEP_NODELIST="gpu[08-09]", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="2", SLURM_NODEID="0",
               MASTER_PORT="4000")
    got = from_slurm(env)
    assert (got.nnodes, got.node_rank, got.master_addr, got.master_port) == (2, 0, "gpu08", 4000)


def test_slurm_refuses_several_tasks_per_node():
    with pytest.raises(ConfigError, match="--ntasks-per-node=1"):
        from_slurm({"SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS": "4",
                    "SLURM_STEP_ID": "0"})


def test_slurm_batch_script_is_not_a_per_node_launch(caplog):
    """The batch script runs on the first node only (no srun step): its variables are not used."""
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7"}
    assert from_slurm(env).unused.startswith("not an srun task")
    args = _serve_args("-pp", "2")
    with caplog.at_level(logging.INFO, logger="zpp.cli"):
        resolve_per_node(args, env)
    assert args.nnodes is None and "srun --ntasks-per-node=1" in caplog.text


def test_lws():
    env = {"LWS_LEADER_ADDRESS": "zpp-0.zpp.default", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1",
           "LWS_NAME": "zpp"}
    got = from_lws(env)
    assert (got.source, got.nnodes, got.node_rank, got.master_addr, got.master_port) == \
        ("LeaderWorkerSet", 2, 1, "zpp-0.zpp.default", None)


def test_torchrun_style():
    got = from_torchrun({"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert (got.nnodes, got.node_rank, got.master_addr, got.master_port) == (4, 3, "10.0.0.1", 29500)
    assert from_torchrun({"MASTER_PORT": "1"}) is None  # a port alone says nothing


def test_launcher_order_and_malformed():
    slurm = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_ID": "0"}
    lws = {"LWS_LEADER_ADDRESS": "lead", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0"}
    assert launcher_env({**slurm, **lws}).source == "LeaderWorkerSet"
    assert launcher_env({**slurm, "NNODES": "9"}).source == "Slurm"
    assert launcher_env({"PATH": "/bin"}) is None
    with pytest.raises(ConfigError, match=r"\$LWS_WORKER_INDEX='x' is not an integer"):
        launcher_env({**lws, "LWS_WORKER_INDEX": "x"})


def _serve_args(*argv):
    return build_parser().parse_args(["serve", "/m", *argv])


def test_flags_win_over_the_environment(caplog):
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_ID": "0"}
    args = _serve_args("-pp", "2", "--master-addr", "10.1.1.1")
    with caplog.at_level(logging.INFO, logger="zpp.cli"):
        resolve_per_node(args, env)
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (2, 1, "10.1.1.1", None)
    line = next(r.getMessage() for r in caplog.records if "read from Slurm" in r.getMessage())
    assert "SLURM_NODEID=1" in line and "--node-rank 1" in line and "--master-addr" not in line.split("->")[1]
    # Nothing from a launcher: the flags' defaults (one node).
    args = _serve_args("-pp", "2")
    resolve_per_node(args, {})
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (None, None, None, None)


def test_single_worker_ignores_a_multi_node_job(caplog):
    args = _serve_args()  # -pp 1 -tp 1 inside a 2-node Slurm job: a server on this host alone
    with caplog.at_level(logging.INFO, logger="zpp.cli"):
        resolve_per_node(args, {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]",
                                "SLURM_STEP_ID": "0"})
    assert args.nnodes is None and "not used" in caplog.text


@pytest.mark.parametrize("world,nnodes,split", [
    (2, 2, [[0], [1]]), (3, 2, [[0, 1], [2]]), (4, 2, [[0, 1], [2, 3]]), (5, 3, [[0, 1], [2, 3], [4]]),
])
def test_split_ranks(world, nnodes, split):
    assert split_ranks(world, [None] * nnodes) == split


def test_split_ranks_pins():
    assert split_ranks(5, [None, 3, None]) == [[0], [1, 2, 3], [4]]
    with pytest.raises(ConfigError, match="pins 6 ranks but only 5"):
        split_ranks(5, [None, 6])


def test_head_bind_address():
    assert head_bind_address("10.9.8.7") == "10.9.8.7"  # an IP: exactly that (bind errors say if it is not ours)
    assert head_bind_address("anything", distributed_host="10.1.2.3") == "10.1.2.3"
    assert head_bind_address("localhost") == "127.0.0.1"
    with pytest.raises(ConfigError, match="does not resolve"):
        head_bind_address("no-such-host.invalid")


def test_head_bind_address_not_this_host(monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(2, 1, 6, "", ("192.0.2.77", 0))])
    with pytest.raises(ConfigError, match="192.0.2.77, which is not an address of this host"):
        head_bind_address("elsewhere")


def test_head_bind_address_loopback_name(monkeypatch, caplog):
    """Debian's `127.0.1.1 <hostname>`: listen on the default route's address instead, with a warning."""
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo",
                        lambda host, *a, **k: [(2, 1, 6, "", ("127.0.1.1", 0))] if host == "myself" else real(host, *a, **k))
    import zpp.node.pernode as pn
    monkeypatch.setattr(pn, "route_source_address", lambda dest: "10.7.7.7")
    with caplog.at_level(logging.WARNING):
        assert head_bind_address("myself") == "10.7.7.7"
    assert "loopback address 127.0.1.1" in caplog.text


@pytest.mark.parametrize("kwargs,match", [
    (dict(nnodes=2, master_addr="a"), "needs --node-keys-file FILE"),
    (dict(nnodes=2, node_keys_file="k"), "needs --master-addr"),
    (dict(nnodes=3, master_addr="a", node_keys_file="k"), "every node needs at least one"),
    (dict(nnodes=2, master_addr="a", node_keys_file="k", nodes=("h",)), "cannot be combined"),
    (dict(nnodes=2, node_rank=2, master_addr="a", node_keys_file="k"), r"--node-rank 2 is not in \[0, --nnodes 2\)"),
    (dict(nnodes=2, master_addr="a", node_keys_file="k", node_launcher="manual"), "is for --nodes"),
])
def test_config_refusals(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(pipeline_parallel_size=2, **kwargs)


@pytest.mark.slow
def test_key_files(tmp_path):
    path = str(tmp_path / "run.keys")
    r = subprocess.run([sys.executable, "-m", "zpp.cli", "node-keys", path], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o400
    head = read_node_keys(path, head=True)
    node = read_node_keys(path, head=False)
    assert head.server_secret and not node.server_secret and node.client_secret == head.client_secret
    # Never overwritten.
    r = subprocess.run([sys.executable, "-m", "zpp.cli", "node-keys", path], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == f"zpp: error: zpp node-keys {path}: File exists"
    with pytest.raises(ConfigError, match=r"--node-keys-file .*missing.keys: No such file or directory; make one"):
        read_node_keys(str(tmp_path / "missing.keys"), head=True)
    loose = tmp_path / "loose.keys"
    loose.write_bytes(open(path, "rb").read())
    loose.chmod(0o640)
    with pytest.raises(ConfigError, match="mode 640 lets other users read it; chmod 600"):
        read_node_keys(str(loose), head=False)
    worker_copy = str(tmp_path / "worker.keys")
    write_keys_file(worker_copy, new_run_keys(curve=True).for_workers())
    with pytest.raises(ConfigError, match="has no server key"):
        read_node_keys(worker_copy, head=True)


@pytest.mark.slow
def test_serve_refusals_are_one_line(tmp_path, demo_model):
    """Before anything starts: no key file, a missing one, --headless on the head."""
    base = [sys.executable, "-m", "zpp.cli", "serve", demo_model, "-pp", "2", "--nnodes", "2", "--master-addr",
            "127.0.0.1", "--master-port", "1"]
    cases = [
        (["--node-rank", "1"], "needs --node-keys-file FILE"),
        (["--node-rank", "1", "--node-keys-file", str(tmp_path / "none")], "No such file or directory"),
        (["--node-rank", "0", "--headless", "--node-keys-file", str(tmp_path / "none")], "--headless is for node ranks"),
    ]
    for extra, match in cases:
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LWS_"))})
        lines = [t for t in r.stderr.splitlines() if t.strip()]
        assert r.returncode == 2 and len(lines) == 1 and match in lines[0], (extra, r.stderr)
