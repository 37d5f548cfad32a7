"""``zpp-node``: the agent that starts one host's stage workers in a multi-host run.

Normally the head starts it over SSH (``--nodes``) and hands it the run's keys on the session's
stdin: one JSON line, never on a command line or in the environment. It can also be started by a
cluster launcher or by hand, with the keys in a file only its owner can read (``--keys-file``; the
head writes that file with ``--node-keys-file``)::

    zpp-node --engine tcp://HEAD:PORT --ranks 2,3 --keys-file /etc/zpp/run.keys

``zpp serve --nnodes N --node-rank R`` (R > 0) runs the same agent (:func:`run_agent`) after
joining the head itself (``zpp.node.pernode``).

It starts one worker process per rank (``python -m zpp.workers.worker``, keys on its stdin; on the
CPU each gets ``OMP_NUM_THREADS`` = this host's available cores ÷ its workers and OpenMP's wait
settings, see ``zpp.utils.cpu_threads``, unless already set) and
stays until the run ends: when the SSH session closes its stdin (the head went away), when a worker
dies (it then stops the others and exits 1, saying which rank died and how), or on SIGTERM/SIGINT.
Workers die with the agent too (``PR_SET_PDEATHSIG``) and exit when their connection to the head
drops, so nothing is left behind on any host.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Sequence


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def run_agent(engine: str, ranks: Sequence[int], keys, log_level: str = "info", watch_stdin: bool = False,
              name: str = "zpp-node") -> int:
    """Start one worker process per rank of this host and stay until the run ends.

    Shared by ``zpp-node`` and ``zpp serve --node-rank R`` (a per-node launch, see
    ``zpp.node.pernode``).

    Args:
        engine: the head's control-plane address, ``tcp://HOST:PORT``.
        ranks: the global ranks to start here.
        keys: the run's :class:`~zpp.transport.security.RunKeys`; the workers get them without the
            server's secret, on their stdin.
        log_level: the workers' log level (``debug``, ``info``, ``warning``, ``error``).
        watch_stdin: also stop when this process's stdin closes (the SSH session that started it
            ended: the head is gone).
        name: how this process signs its lines on stderr.
    Returns:
        0 once every worker exited 0 (the engine's orderly Shutdown) or after SIGTERM / SIGINT /
        SIGHUP; 1 when a worker died or failed (the others are stopped first, and the line names
        the rank and how it ended). Workers whose connection to the head drops exit 1, so a dead
        head ends this with 1 within seconds.
    """
    from zpp.utils.cpu_threads import stage_env, threads_per_stage
    line = keys.for_workers().encode().decode()
    level = str(getattr(logging, log_level.upper()))
    # CPU workers share this host's cores (the head only knows its own); a user's setting wins.
    # OpenMP reads its wait policy when it loads: it goes into the workers' environment.
    env = {**os.environ, **stage_env(threads_per_stage(len(ranks)))}
    procs: dict[int, subprocess.Popen] = {}
    for r in ranks:
        proc = subprocess.Popen([sys.executable, "-m", "zpp.workers.worker", engine, str(r), level],
                                stdin=subprocess.PIPE, text=True, env=env)
        proc.stdin.write(line)
        proc.stdin.close()
        procs[r] = proc
    print(f"{name}: started ranks {list(ranks)} (pids {[q.pid for q in procs.values()]})", file=sys.stderr,
          flush=True)

    stop = threading.Event()

    def watch():
        try:
            while sys.stdin.read(1):
                pass
        except (OSError, ValueError):
            pass
        stop.set()

    if watch_stdin:  # started over SSH: the session's end is the head's end
        threading.Thread(target=watch, daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    status = 0
    while not stop.is_set():
        codes = {r: q.poll() for r, q in procs.items()}
        failed = {r: c for r, c in codes.items() if c not in (None, 0)}
        if failed:
            for r, c in failed.items():
                print(f"{name}: worker rank {r} (pid {procs[r].pid}) {_describe(c)}; stopping this host's "
                      f"workers", file=sys.stderr, flush=True)
            status = 1
            break
        if all(c == 0 for c in codes.values()):  # orderly shutdown by the engine
            break
        time.sleep(0.1)
    for q in procs.values():
        if q.poll() is None:
            q.terminate()
    deadline = time.monotonic() + 5
    for q in procs.values():
        try:
            q.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            q.kill()
    return status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="zpp-node", description="zpp per-host agent: starts this host's stage workers",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engine", required=True, help="the head's control-plane address, tcp://HOST:PORT")
    p.add_argument("--ranks", required=True, help="comma-separated global ranks to start here")
    p.add_argument("--keys-file", default=None,
                   help="read the run's keys from this file (mode 0600) instead of stdin; the agent then runs "
                        "until its workers exit")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    from zpp.errors import ConfigError
    from zpp.transport.security import RunKeys, read_keys_file
    try:
        if args.keys_file:
            keys = read_keys_file(args.keys_file)
        else:
            keys = RunKeys.decode(sys.stdin.readline())
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    except (ConfigError, ValueError) as e:
        print(f"zpp-node: error: {e}", file=sys.stderr, flush=True)
        return 2
    return run_agent(args.engine, ranks, keys, args.log_level, watch_stdin=not args.keys_file)


if __name__ == "__main__":
    sys.exit(main())
