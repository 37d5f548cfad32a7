"""Multi-host path on one machine (the fast path; real hosts: tests/e2e/test_multi_host.py): stages
started by `zpp-node` through an SSH stand-in give the same tokens as PP=1, and nothing is left
running after shutdown. (The session's tiny random-weight Llama, ``tiny_llama``: PP=2 against PP=1
on any weights is the check; the real model's weights only made it slower.)"""
from __future__ import annotations

import os
import time

import pytest

from helpers import TESTS_DIR, alive, descendants


@pytest.mark.slow
def test_remote_stage_via_agent(tiny_llama, tokenizer, monkeypatch):
    from zpp import LLM, SamplingParams
    monkeypatch.setenv("ZPP_SSH", os.path.join(TESTS_DIR, "fake_ssh.sh"))
    prompts = [tokenizer.encode("The capital of France is"), tokenizer.encode("1, 2, 3, 4,")]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(tiny_llama, kv_cache_memory="64MiB") as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    before = set(descendants(os.getpid()))  # processes of earlier tests in this pytest process are not ours
    llm = LLM(tiny_llama, pipeline_parallel_size=2, nodes=["localhost"], kv_cache_memory="64MiB")
    try:
        kids = [p for p in descendants(os.getpid())
                if p not in before and "resource_tracker" not in open(f"/proc/{p}/cmdline").read()]
        assert any("zpp-node" in open(f"/proc/{p}/cmdline").read() for p in kids if alive(p))
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    finally:
        llm.shutdown()
    assert got == ref
    deadline = time.monotonic() + 30  # the agent stops its worker, then itself (seconds on a busy CI machine)
    while time.monotonic() < deadline and any(alive(p) for p in kids):
        time.sleep(0.2)
    left = [p for p in kids if alive(p)]
    assert not left, "agent or remote worker left running: " + "; ".join(_cmdline(p) for p in left)


def _cmdline(pid: int) -> str:
    try:
        return f"{pid} " + open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:100]
    except OSError:
        return f"{pid} (gone)"


def test_rank_assignment():
    from zpp.node.ssh import NodeLauncher
    n = NodeLauncher(("a", "b:1"), "tcp://x:1", "k")
    head = n.assign(4)
    assert head == [0, 1]
    assert n.assignment == {"a": [2], "b": [3]}
    assert [n.local_index(r) for r in range(4)] == [0, 1, 0, 0]
