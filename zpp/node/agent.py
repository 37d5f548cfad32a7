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
dies (it then stops the others and exits 1, saying which rank died and how), when the head is gone
(without SSH: its own connection to the head, :class:`zpp.node.head_link.HeadLink`, dropped; it
stops the workers and exits 1 within ``HEAD_GRACE_S``, naming the head), or on SIGTERM/SIGINT.
Workers die with the agent too (``PR_SET_PDEATHSIG``, also when the agent died while they were
starting: ``zpp.utils.process.watch_parent``) and exit when their connection to the head drops, so
nothing is left behind on any host.
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


HEAD_GRACE_S = 3.0
"""Seconds a node's workers get to end in order (exit 0) once its link to the head dropped: the
head's Shutdown may still be in flight when its connection closes (the workers' own grace)."""


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def run_agent(engine: str, ranks: Sequence[int], keys, log_level: str = "info", watch_stdin: bool = False,
              name: str = "zpp-node", head=None) -> int:
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
        head: a watched :class:`~zpp.node.head_link.HeadLink` to the head, or None. Once it is lost
            the workers have ``HEAD_GRACE_S`` seconds to end in order (exit 0: the head's Shutdown
            was on its way); then they are stopped and this returns 1.
    Returns:
        0 once every worker exited 0 (the engine's orderly Shutdown) or after SIGTERM / SIGINT /
        SIGHUP; 1 when a worker died or failed, or the head is gone (the others are stopped
        first, and one line on stderr names the rank and how it ended, or the head). Workers
        whose connection to the head drops exit 1 too, so a dead head ends this with 1 within
        seconds even without ``head``.
    """
    from zpp.node.head_link import HEAD_SILENCE_S
    from zpp.utils.cpu_threads import stage_env, threads_per_stage
    from zpp.utils.process import PARENT_PID_ENV
    line = keys.for_workers().encode().decode()
    level = str(getattr(logging, log_level.upper()))
    # CPU workers share this host's cores (the head only knows its own); a user's setting wins.
    # OpenMP reads its wait policy when it loads: it goes into the workers' environment.
    env = {**os.environ, **stage_env(threads_per_stage(len(ranks))), PARENT_PID_ENV: str(os.getpid())}
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
        if all(c == 0 for c in codes.values()):  # orderly shutdown by the engine
            break
        failed = {r: c for r, c in codes.items() if c not in (None, 0)}
        if head is not None and head.lost.is_set():
            # Its workers' own watches see the same drop; a failure now is the head's, not theirs.
            if failed or time.monotonic() - head.lost_at >= HEAD_GRACE_S:
                print(f"{name}: lost the head, {head.where}: its control-plane connection dropped without an "
                      f"orderly end (it died or was killed, or its host was silent for {HEAD_SILENCE_S:.0f} s); "
                      f"stopping this host's workers and exiting 1", file=sys.stderr, flush=True)
                status = 1
                break
        elif failed:
            for r, c in failed.items():
                print(f"{name}: worker rank {r} (pid {procs[r].pid}) {_describe(c)}; stopping this host's "
                      f"workers and exiting 1", file=sys.stderr, flush=True)
            status = 1
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
    if not args.keys_file:  # over SSH: the session's end is the head's end
        return run_agent(args.engine, ranks, keys, args.log_level, watch_stdin=True)
    # Started by hand or by a launcher: watch the head's control plane (from its first handshake on).
    from zpp.node.head_link import HeadLink
    head = HeadLink(args.engine, keys, f"the head at {args.engine}")
    head.watch()
    try:
        return run_agent(args.engine, ranks, keys, args.log_level, head=head)
    finally:
        head.close()


if __name__ == "__main__":
    sys.exit(main())
