"""The model runner's decode-graph path, on the CPU: CI has no GPU, so the part of the CUDA path
that is host logic (KV slots and block rows from the slot table, the previous step's tokens taken
on the device with async scheduling, logits in the model's dtype, the greedy result left pending
and finished after the next launch) runs here through ``EagerDecodeGraphs``, a stand-in whose
"replay" is an eager forward of exactly the inputs a graph would get (``ZPP_EAGER_GRAPHS``). Its
outputs must equal the plain eager path's at PP=1 with synchronous scheduling (which shares none of
that logic), with the stand-in at PP=1 (async scheduling on and off) and PP=2."""
from __future__ import annotations

import pytest

from zpp import LLM, SamplingParams

pytestmark = pytest.mark.slow

TEXTS = ["The capital of France is", "Once upon a time", "List three colors:", "1, 2, 3, 4,",
         "def fibonacci(n):", "Water boils at"]
PARAMS = [SamplingParams(temperature=0, max_tokens=24),
          SamplingParams(temperature=0, max_tokens=1),
          SamplingParams(temperature=0, max_tokens=12, logprobs=2),
          SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20),
          SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3),
          SamplingParams(temperature=0, max_tokens=20, stop=[" the"], ignore_eos=True)]


def _outputs(model, prompts, **kw):
    with LLM(model, device="cpu", max_num_seqs=16, **kw) as llm:
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def eager_reference(demo_model, tokenizer):
    prompts = [tokenizer.encode(t) for t in TEXTS]
    return prompts, _outputs(demo_model, prompts, pipeline_parallel_size=1, async_scheduling=False)


@pytest.mark.parametrize("pp,async_on", [(1, False), (1, True), (2, False)])
def test_decode_graph_path_equals_eager(demo_model, eager_reference, tmp_path, monkeypatch, pp, async_on):
    prompts, eager = eager_reference
    kw = dict(pipeline_parallel_size=pp, async_scheduling=async_on)
    replays = tmp_path / "replays"
    monkeypatch.setenv("ZPP_EAGER_GRAPHS", str(replays))
    graph = _outputs(demo_model, prompts, **kw)
    assert replays.exists() and len(replays.read_text().splitlines()) >= 20 * pp, "the graph path did not run"
    for i, ((t0, f0, lp0), (t1, f1, lp1)) in enumerate(zip(eager, graph)):
        assert t1 == t0 and f1 == f0, f"request {i}"
        if lp0 is not None:
            for a, b in zip(lp0, lp1):
                assert list(a) == list(b), f"request {i}: logprob entries differ"
                assert all(abs(a[k].logprob - b[k].logprob) < 1e-4 for k in a), f"request {i}"
