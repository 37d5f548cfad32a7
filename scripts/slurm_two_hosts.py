#!/usr/bin/env python
"""zpp under a real Slurm on two "hosts" of this machine, recorded (root; installs Slurm when missing).

Builds tests/two_hosts.py's two network namespaces and tests/slurm_cluster.py's cluster in them
(munged, slurmctld, one slurmd per namespace; node names zppn01, zppn02), submits
examples/slurm/zpp.sbatch with sbatch (the demo model, PP=2: stage 0 on zppn01 with the API, stage
1 on zppn02), sends greedy completions to the API, compares them with PP=1 on one host (the offline
LLM), cancels the job and checks that nothing is left. Writes the job's output, the timings and
the comparison to ``--output`` (default benchmarks/results/slurm_two_hosts_pp2.log). The same
flow runs in the test suite (tests/e2e/test_per_node.py::test_slurm_sbatch_example).

    python scripts/slurm_two_hosts.py
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from slurm_cluster import SlurmCluster, ensure_slurm  # noqa: E402
from two_hosts import TwoHosts, ensure_openssh, unavailable_reason  # noqa: E402

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time, in a small village"]
MAX_TOKENS = 16


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results", "slurm_two_hosts_pp2.log"))
    args = p.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    ensure_openssh()
    ensure_slurm()
    from zpp import LLM, SamplingParams
    from zpp.demo import prepare_demo_model
    from transformers import AutoTokenizer
    model = prepare_demo_model()
    prompts = [AutoTokenizer.from_pretrained(model).encode(t) for t in PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model, kv_cache_memory="64MiB") as llm:
        reference = [o.outputs[0].text for o in llm.generate(prompts, sp)]

    record = [f"# zpp under a real Slurm on two network namespaces ({datetime.datetime.now():%Y-%m-%d %H:%M}), "
              f"python scripts/slurm_two_hosts.py", f"# {subprocess.run(['slurmd', '-V'], capture_output=True, text=True).stdout.strip()}, "
              f"{subprocess.run(['munged', '-V'], capture_output=True, text=True).stdout.split()[0]}"]
    hosts = TwoHosts().start()
    cluster = None
    ok = False
    try:
        t0 = time.monotonic()
        cluster = SlurmCluster(hosts).start()
        record.append(f"cluster up (munged, slurmctld, slurmd x 2) in {time.monotonic() - t0:.1f} s")
        record.append("$ sinfo\n" + cluster.run(["sinfo"]).stdout.rstrip())
        keys = os.path.join(tempfile.mkdtemp(prefix="zpp-slurm-keys-"), "zpp", "run.keys")
        env = {"MODEL": model, "KEYS": keys, "PORT": "8000", "ZPP_ARGS": "--kv-cache-memory 64MiB",
               "OMP_NUM_THREADS": "1", "PATH": os.path.dirname(sys.executable) + ":" + os.environ.get("PATH", "")}
        record.append(f"$ MODEL={model} KEYS={keys} PORT=8000 ZPP_ARGS='--kv-cache-memory 64MiB' "
                      f"sbatch examples/slurm/zpp.sbatch")
        job = cluster.sbatch(os.path.join(ROOT, "examples", "slurm", "zpp.sbatch"), env)
        took = job.wait_for("zpp: serving", timeout=300)
        record.append(f"job {job.job_id}: serving {took:.1f} s after sbatch")
        body = {"prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        code = ("import json, sys, urllib.request\nreq = urllib.request.Request(sys.argv[1], sys.argv[2].encode(), "
                "{'Content-Type': 'application/json'})\nprint(urllib.request.urlopen(req, timeout=120).read().decode())")
        r = subprocess.run(["ip", "netns", "exec", hosts.head_ns, sys.executable, "-c", code,
                            "http://zppn01:8000/v1/completions", json.dumps(body)], capture_output=True, text=True,
                           timeout=180)
        choices = sorted(json.loads(r.stdout)["choices"], key=lambda c: c["index"])
        texts = [c["text"] for c in choices]
        ok = texts == reference
        record.append(f"PP=2 across zppn01 + zppn02 (Slurm) == PP=1 on one host (offline LLM), {MAX_TOKENS} greedy "
                      f"tokens x {len(prompts)} prompts: {ok}")
        for prompt, got, ref in zip(PROMPTS, texts, reference):
            record.append(f"  {prompt!r} -> {got!r}" + ("" if got == ref else f"  (PP=1: {ref!r})"))
        cancelled = job.cancel()
        deadline = time.monotonic() + 15
        while cluster.leftovers() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = cluster.leftovers()
        ok = ok and not left
        record.append(f"scancel {job.job_id}: out of squeue in {cancelled:.1f} s; processes left: {left or 'none'}")
        record.append(f"--- job output ({job.output_path}):\n{job.output().rstrip()}")
    finally:
        if cluster is not None:
            cluster.teardown()
        hosts.teardown()
    text = "\n".join(record) + f"\nRESULT: {'PASS' if ok else 'FAIL'}\n"
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        f.write(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
