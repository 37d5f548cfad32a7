"""PP=2 across two real hosts vs PP=2 on one host, same call (CPU, the packaged SmolLM2).

Builds the two-host setup of the tests (tests/two_hosts.py: a head and a node network namespace
joined by a veth pair, sshd on the node; needs root and ``ip netns``), then runs
``zpp bench throughput`` twice from the head namespace: both stages on the head, then stage 1 on
the node (started over SSH, activations over gloo across the veth). Prints both results and the
ratio; writes ``benchmarks/results/cpu_two_hosts_pp2.json``.

Usage: ``python scripts/bench_two_hosts.py [--num-prompts 32 --input-len 64 --output-len 32]``
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from two_hosts import TwoHosts, ensure_openssh, unavailable_reason  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--output-json", default=os.path.join(ROOT, "benchmarks/results/cpu_two_hosts_pp2.json"))
    args = p.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    ensure_openssh()
    from zpp.demo import prepare_demo_model
    model = prepare_demo_model()
    agent = os.path.join(os.path.dirname(sys.executable), "zpp-node")
    # Both "hosts" share this machine's cores: one thread per worker on each side (the node's
    # sessions get OMP_NUM_THREADS through sshd), so neither run oversubscribes the cores.
    remote_env = {"OMP_NUM_THREADS": "1"}
    if os.environ.get("PYTHONPATH"):
        remote_env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    hosts = TwoHosts(remote_env=remote_env)
    results = {}
    try:
        hosts.start()
        env = dict(os.environ, ZPP_SSH=hosts.ssh_command, OMP_NUM_THREADS="1")
        common = ["--model", model, "--device", "cpu", "-pp", "2", "--num-prompts", str(args.num_prompts),
                  "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--log-level", "warning"]
        runs = {"one_host": [], "two_hosts": ["--nodes", hosts.node_target, "--node-command", agent]}
        for name, extra in runs.items():
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, "-m", "zpp.cli", "bench", "throughput", *common, *extra, "--output-json", f.name]
                proc = hosts.run_in_head(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True)
                out, _ = proc.communicate(timeout=900)
                print(f"### {name}\n{out.strip()}", flush=True)
                if proc.returncode != 0:
                    return proc.returncode
                results[name] = json.load(open(f.name))
    finally:
        hosts.teardown()
    ratio = results["two_hosts"]["output_tokens_per_s"] / results["one_host"]["output_tokens_per_s"]
    summary = {"one_host": results["one_host"], "two_hosts": results["two_hosts"],
               "two_hosts_over_one_host": ratio, "date": datetime.date.today().isoformat(),
               "link": "veth between two network namespaces on one 2-core machine (gloo over TCP)"}
    print(f"two hosts / one host, output tok/s: {ratio:.3f} "
          f"({results['two_hosts']['output_tokens_per_s']:.1f} vs {results['one_host']['output_tokens_per_s']:.1f}); "
          f"stage busy: one host {results['one_host']['stage_busy_fraction']}, "
          f"two hosts {results['two_hosts']['stage_busy_fraction']}")
    with open(args.output_json, "w") as f:
        json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
