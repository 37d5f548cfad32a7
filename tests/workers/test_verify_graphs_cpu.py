"""Speculative decoding's verify batches through the (stand-in) CUDA-graph path on the CPU:
``ZPP_EAGER_GRAPHS`` gives every stage ``EagerVerifyGraphs`` (zpp/workers/verify_graphs.py), whose
"replay" is an eager forward of exactly the inputs a captured verify graph would get (static-buffer
positions, KV slots and block rows for ``b`` sequences of ``1 + k`` tokens; the last stage's logits
and hidden states of every position), so the host logic of the graphed verify path runs in CI.
Greedy ids with n-gram drafts through it equal the plain eager path without speculation at PP=2
(``[1]`` in the parametrization runs PP=1 too; left out of CI for time: one stage's verify-graph
path, first-stage ids and last-stage sampling together, runs in the MTP test's in-process PP=1
case), and with MTP (the drafter reading the graph's hidden states) on a tiny DeepSeek-V3 at PP=1
in process and PP=2 equal HF's greedy ids with the eager path's drafts; the replay log shows the
verify graphs served every stage."""
from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

from zpp import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
TEXTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
         "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
         "1, 2, 3, 1, 2, 3, 1, 2,"]


def _generate(model, prompts, max_tokens, **kw):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model, device="cpu", max_model_len=256, max_num_seqs=8, **kw) as llm:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        st = llm.engine.stats()
    return [list(o.outputs[0].token_ids) for o in outs], st


def _verify_replays(path, pp: int) -> dict[int, int]:
    """Verify-graph replays per pipeline rank, from the stand-in's log."""
    assert path.exists(), "no graph replay ran"
    per_rank = {r: 0 for r in range(pp)}
    for line in path.read_text().splitlines():
        if line.startswith("v "):
            per_rank[int(line.split()[3])] += 1
    return per_rank


def _cols(chunks):
    """BatchColumns of ``[(start, num_tokens, flags, drafts)]``, one chunk per slot."""
    from zpp.transport import messages as m
    b = m.BatchBuilder()
    for slot, (start, n, flags, drafts) in enumerate(chunks):
        b.add(slot, start, n, flags, (), (), drafts)
    return m.BatchColumns(b.build(1))


def test_uniform_q_pads_to_the_most_drafts_and_refuses_the_rest():
    from zpp.transport.messages import PROMPT_LOGPROBS, SAMPLE
    from zpp.workers.verify_graphs import uniform_q
    S = SAMPLE
    assert uniform_q(_cols([(10, 4, S, [5, 6, 7]), (20, 1, S, []), (30, 2, S, [9])]), 64) == 4
    assert uniform_q(_cols([(10, 1, S, []), (20, 1, S, [])]), 64) == 0          # no drafts: decode graphs
    assert uniform_q(_cols([(0, 3, S, []), (20, 2, S, [9])]), 64) == 0        # a prompt chunk beside it
    assert uniform_q(_cols([(10, 1, 0, []), (20, 2, S, [9])]), 64) == 0       # a chunk that does not sample
    assert uniform_q(_cols([(10, 1, S | PROMPT_LOGPROBS, []), (20, 2, S, [9])]), 64) == 0
    assert uniform_q(_cols([(61, 1, S, []), (20, 4, S, [1, 2, 3])]), 64) == 0  # padded past max_model_len
    assert uniform_q(_cols([(60, 1, S, []), (20, 4, S, [1, 2, 3])]), 64) == 4


@pytest.fixture(scope="module")
def ngram_reference(demo_model, tokenizer):
    prompts = [tokenizer.encode(t) for t in TEXTS]
    return prompts, _generate(demo_model, prompts, 20)[0]


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2])  # PP=1: the MTP test's in-process run (one stage: ids and sampling)
def test_ngram_verify_graphs_equal_eager_without_speculation(demo_model, ngram_reference, tmp_path, monkeypatch, pp):
    prompts, want = ngram_reference
    replays = tmp_path / "replays"
    monkeypatch.setenv("ZPP_EAGER_GRAPHS", str(replays))
    got, st = _generate(demo_model, prompts, 20, pipeline_parallel_size=pp, speculative_config=NGRAM)
    assert got == want
    assert st.spec_num_accepted_tokens > 0, st
    per_rank = _verify_replays(replays, pp)
    assert all(n >= 3 for n in per_rank.values()), f"the verify graphs did not serve every stage: {per_rank}"


def _mtp_helpers():
    path = os.path.join(os.path.dirname(__file__), "..", "engine", "test_spec_decode_mtp.py")
    spec = importlib.util.spec_from_file_location("_spec_decode_mtp_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _spec_stats(s) -> tuple:
    return s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens, list(s.spec_accepted_per_pos)


@pytest.mark.slow
def test_mtp_verify_graphs_equal_without_at_pp1_and_pp2(tmp_path_factory, demo_model, tmp_path, monkeypatch):
    """MTP with verify graphs (no decode graphs: 1-token steps run eagerly): greedy ids equal HF's,
    and the drafts (a function of the request's tokens alone) are those of the eager path: the same
    counts of drafts, draft tokens and accepted tokens per position. PP=1 in process (the test
    helper's scheduler and last-stage runner, once eager and once with the stand-in) and PP=2."""
    from helpers import hf_greedy
    from zpp.engine.spec_decode import SpecDecoder
    from zpp.spec_config import SpeculativeConfig
    from zpp.workers.verify_graphs import EagerVerifyGraphs
    h = _mtp_helpers()
    d = h._save(str(tmp_path_factory.mktemp("v3_mtp_vg")), demo_model)
    h._make_predictable(d, 0.003)
    prompts, lens = h._prompts()[:3], (12, 12, 12)
    want = hf_greedy(d, prompts, 12)
    eager = SpecDecoder(SpeculativeConfig("mtp", 2))
    got, runner = h._in_process(d, eager, prompts, lens)
    assert got == want, "PP=1 eager"
    ref = (eager.num_drafts, eager.num_draft_tokens, eager.num_accepted_tokens, list(eager.accepted_per_pos))
    assert ref[2] > 0, ref
    in_process = tmp_path / "in_process"
    runner.verify_graphs = EagerVerifyGraphs(runner.model, runner.kv_caches, runner.block_size, 8, eager.config,
                                             runner.scratch_slot, runner.device, runner.group, str(in_process))
    graphed = SpecDecoder(SpeculativeConfig("mtp", 2))
    got, _ = h._in_process(d, graphed, prompts, lens, runner)
    assert got == want, "PP=1 verify graphs"
    assert (graphed.num_drafts, graphed.num_draft_tokens, graphed.num_accepted_tokens,
            list(graphed.accepted_per_pos)) == ref
    assert _verify_replays(in_process, 1)[0] >= 2
    replays = tmp_path / "replays"
    monkeypatch.setenv("ZPP_EAGER_GRAPHS", str(replays))
    got, st = _generate(d, prompts, 12, pipeline_parallel_size=2,
                        speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert got == want, "PP=2 verify graphs"
    assert _spec_stats(st) == ref
    per_rank = _verify_replays(replays, 2)
    assert all(n >= 2 for n in per_rank.values()), f"the verify graphs did not serve every stage: {per_rank}"
    assert all(line.startswith("v ") for line in replays.read_text().splitlines()), "decode graphs ran with MTP"
