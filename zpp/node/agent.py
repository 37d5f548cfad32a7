"""``zpp-node``: the agent the head starts over SSH on each extra host.

It starts this host's stage workers (``python -m zpp.workers.worker ADDRESS RANK``, the key passed
on stdin, never on a command line) and stays until the head goes away: when its stdin closes (the
SSH session ended) or a worker dies, it kills every worker it started and exits. Workers die with
the agent too (``PR_SET_PDEATHSIG`` in the worker), so nothing is left behind on any host.

Usage (normally run by the head, not by hand)::

    echo KEY | zpp-node --engine tcp://HEAD:PORT --ranks 2,3 [--device-offset 0]
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="zpp-node", description="zpp per-host agent: starts this host's stage workers")
    p.add_argument("--engine", required=True, help="the engine's ZeroMQ address, tcp://HOST:PORT")
    p.add_argument("--ranks", required=True, help="comma-separated global ranks to start here")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    key = sys.stdin.readline().strip()
    if not key:
        print("zpp-node: error: expected the engine key on stdin", file=sys.stderr)
        return 2
    ranks = [int(r) for r in args.ranks.split(",") if r != ""]
    env = dict(os.environ)
    env["ZPP_LOCAL_RANKS"] = args.ranks
    procs: list[subprocess.Popen] = []
    for r in ranks:
        proc = subprocess.Popen([sys.executable, "-m", "zpp.workers.worker", args.engine, str(r)],
                                stdin=subprocess.PIPE, env=env, text=True)
        proc.stdin.write(key + "\n")
        proc.stdin.close()
        procs.append(proc)
    print(f"zpp-node: started ranks {ranks} (pids {[q.pid for q in procs]})", file=sys.stderr, flush=True)

    stop = threading.Event()

    def watch_stdin():
        try:
            while sys.stdin.read(1):
                pass
        except (OSError, ValueError):
            pass
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    status = 0
    while not stop.is_set():
        if any(q.poll() is not None for q in procs):
            codes = [q.poll() for q in procs]
            if all(c == 0 for c in codes):  # orderly shutdown by the engine
                break
            if any(c not in (None, 0) for c in codes):
                print(f"zpp-node: a worker exited with {codes}; stopping", file=sys.stderr, flush=True)
                status = 1
                break
        time.sleep(0.2)
    for q in procs:
        if q.poll() is None:
            q.terminate()
    deadline = time.monotonic() + 5
    for q in procs:
        try:
            q.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            q.kill()
    return status


if __name__ == "__main__":
    sys.exit(main())
