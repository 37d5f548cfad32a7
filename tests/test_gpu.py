"""CUDA path (skipped without a GPU): bf16 outputs against HF transformers on the GPU, and CUDA
graphs against eager mode. Weights are made locally from a small LLaMA config (no hub)."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

# bf16 tolerance, as vLLM's check_logprobs_close: greedy tokens equal HF's until the first
# divergence; there each side's token must be among the other side's top-5, and the comparison of
# that prompt stops (after one different token the sequences legitimately differ).
TOP_K = 5


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    d = tmp_path_factory.mktemp("llama-small")
    model.save_pretrained(d)
    return str(d)


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (1, 7, 33, 120)]


def _hf_greedy_with_logprobs(model_dir, prompts, n, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            toks, lps = [], []
            for _ in range(n):
                logits = model(ids).logits[0, -1].float()
                lp = torch.log_softmax(logits, -1)
                t = int(lp.argmax())
                toks.append(t)
                lps.append(lp.cpu())
                ids = torch.cat([ids, torch.tensor([[t]], device="cuda")], 1)
            out.append((toks, lps))
    return out


def test_bf16_matches_hf(small_llama):
    from zpp import LLM, SamplingParams
    prompts = _prompts()
    ref = _hf_greedy_with_logprobs(small_llama, prompts, 24)
    with LLM(small_llama, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3) as llm:
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=TOP_K))
    for (ref_toks, ref_lps), o in zip(ref, got):
        toks, lps = o.outputs[0].token_ids, o.outputs[0].logprobs
        for j, (a, b) in enumerate(zip(toks, ref_toks)):
            if a != b:
                hf_top = set(ref_lps[j].topk(TOP_K).indices.tolist())
                assert a in hf_top, f"step {j}: zpp's token {a} is not in HF's top-{TOP_K}"
                assert b in lps[j], f"step {j}: HF's token {b} is not in zpp's top-{TOP_K}"
                break


def test_fp32_equals_hf_exactly(small_llama):
    """float32 on the GPU (IEEE dots in the Triton kernels, no TF32): greedy tokens equal HF's."""
    from zpp import LLM, SamplingParams
    prompts = _prompts()
    ref = _hf_greedy_with_logprobs(small_llama, prompts, 24, torch.float32)
    with LLM(small_llama, device="cuda", dtype="float32", gpu_memory_utilization=0.3, max_num_seqs=16) as llm:
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in got] == [r[0] for r in ref]


@pytest.mark.parametrize("split", ["all", "0"])
def test_mixed_micro_batches_fp32_equal_hf(small_llama, monkeypatch, split):
    """Prompt chunks next to decodes in one micro-batch (a 48-token budget, prompts of 1 to 120
    tokens arriving together): the decodes attend in their own launch (ZPP_SPLIT_MIXED_ATTENTION=1,
    the default) or share the prefill tiles (0); float32 greedy tokens equal HF's either way. Also
    runs prompt logprobs, which take the eager path with the bf16-free upcast of the logits."""
    from zpp import LLM, SamplingParams
    monkeypatch.setenv("ZPP_SPLIT_MIXED_ATTENTION", split)
    prompts = _prompts() + [p[::-1] for p in _prompts()]
    ref = _hf_greedy_with_logprobs(small_llama, prompts, 20, torch.float32)
    with LLM(small_llama, device="cuda", dtype="float32", gpu_memory_utilization=0.3, max_num_seqs=16,
             max_num_batched_tokens=48) as llm:
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
        plp = llm.generate(prompts[3], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0].prompt_logprobs
    assert [o.outputs[0].token_ids for o in got] == [r[0] for r in ref]
    assert plp[0] is None and len(plp) == len(prompts[3])


def test_sampling_with_cuda_graphs_equals_eager(small_llama):
    """Seeded sampling and logprobs read float32 logits upcast from the graph's bf16 output: the
    same tokens as eager mode."""
    from zpp import LLM, SamplingParams
    prompts = _prompts()
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=1.2, top_k=30, seed=1, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    res = {}
    for eager in (True, False):
        with LLM(small_llama, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3,
                 enforce_eager=eager, max_num_seqs=16) as llm:
            res[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert res[True] == res[False]


def test_cuda_graphs_equal_eager(small_llama):
    from zpp import LLM, SamplingParams
    prompts = _prompts()  # 4 prompts: decode batches of 4 replay the batch-4 graph (same GEMM shapes)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    res = {}
    for eager in (True, False):
        with LLM(small_llama, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3,
                 enforce_eager=eager, max_num_seqs=16) as llm:
            res[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert res[True] == res[False]


def test_pipeline_stages_on_one_gpu_equal_pp1(small_llama, monkeypatch):
    """PP=2 and PP=3 with CUDA graphs (both stages on GPU 0, activations over gloo: ZPP_SHARE_GPU=1)
    give exactly the tokens of PP=1: graph inputs / outputs between stages never alias."""
    from zpp import LLM, SamplingParams
    monkeypatch.setenv("ZPP_SHARE_GPU", "1")
    prompts = _prompts() * 3  # 12 sequences: two micro-batches of 6 in flight
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    res = {}
    for pp in (1, 2, 3):
        with LLM(small_llama, device="cuda", dtype="bfloat16", pipeline_parallel_size=pp,
                 kv_cache_memory="1GiB", max_num_seqs=16, pipeline_depth=2) as llm:
            res[pp] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert res[2] == res[1] and res[3] == res[1]


@pytest.mark.parametrize("eager", [False, True])
def test_async_scheduling_equals_sync(small_llama, eager):
    """Async scheduling (the default here) gives the tokens, logprobs and finish reasons of
    synchronous scheduling: greedy (EOS allowed), logprobs, seeded sampling, min_tokens and
    penalties (synchronous fallback), with CUDA graphs and eagerly."""
    from zpp import LLM, SamplingParams
    prompts = _prompts() * 2
    params = [SamplingParams(temperature=0, max_tokens=40), SamplingParams(temperature=0, max_tokens=1),
              SamplingParams(temperature=0, max_tokens=17, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=30),
              SamplingParams(temperature=1.0, top_k=20, seed=9, max_tokens=25, min_tokens=20),
              SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.2),
              SamplingParams(temperature=0, max_tokens=33, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=2)]
    res = {}
    for async_on in (False, True):
        with LLM(small_llama, device="cuda", dtype="bfloat16", kv_cache_memory="1GiB", max_num_seqs=16,
                 enforce_eager=eager, async_scheduling=async_on) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            res[async_on] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
                              [sorted(d) for d in o.outputs[0].logprobs or []]) for o in outs]
    assert res[True] == res[False]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_nccl_pipeline_equals_pp1(small_llama):
    """PP=2 over NCCL on two GPUs, CUDA graphs on: exactly the tokens of PP=1."""
    from zpp import LLM, SamplingParams
    prompts = _prompts() * 3
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    res = {}
    for pp in (1, 2):
        with LLM(small_llama, device="cuda", dtype="bfloat16", pipeline_parallel_size=pp,
                 kv_cache_memory="1GiB", max_num_seqs=16, pipeline_depth=2) as llm:
            res[pp] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert res[2] == res[1]


def test_llm_device_auto_is_cuda(small_llama):
    """``LLM()`` defaults to ``device="auto"``, as ``zpp serve`` does: CUDA on a GPU machine."""
    from zpp import LLM, SamplingParams
    with LLM(small_llama, kv_cache_memory="256MiB", max_num_seqs=4, enforce_eager=True) as llm:
        assert llm.config.parallel.device == "cuda"
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_real_smollm2_bf16_pipeline_over_nccl(demo_model, tokenizer):
    """The real SmolLM2 weights in bf16: PP=2 over NCCL gives exactly PP=1's greedy tokens (same
    micro-batch shapes, so the same kernels on the same numbers), and both follow HF transformers
    bf16 on the GPU under the top-5 rule; the chat answer is the known one."""
    from zpp import LLM, SamplingParams
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    texts = ["The quick brown fox jumps over", "def fibonacci(n):", "Once upon a time, in a small village,"]
    prompts = [tokenizer.encode(chat, add_special_tokens=False)] + [tokenizer.encode(t) for t in texts]
    n = 24
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=TOP_K)
    res = {}
    for pp in (1, 2):
        with LLM(demo_model, device="cuda", dtype="bfloat16", pipeline_parallel_size=pp,
                 kv_cache_memory="1GiB", max_num_seqs=16, pipeline_depth=2) as llm:
            res[pp] = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in res[2]] == [o.outputs[0].token_ids for o in res[1]]
    assert res[2][0].outputs[0].text.startswith("The capital of France is Paris.")
    ref = _hf_greedy_with_logprobs(demo_model, prompts, n)
    for (ref_toks, ref_lps), o in zip(ref, res[2]):
        toks, lps = o.outputs[0].token_ids, o.outputs[0].logprobs
        for j, (a, b) in enumerate(zip(toks, ref_toks)):
            if a != b:
                assert a in set(ref_lps[j].topk(TOP_K).indices.tolist()), f"step {j}: {a} not in HF's top-{TOP_K}"
                assert b in lps[j], f"step {j}: HF's token {b} not in zpp's top-{TOP_K}"
                break


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per tensor-parallel rank, NCCL)")
def test_nccl_tensor_parallel_equals_tp1(small_llama):
    """TP=2 over NCCL (8 heads / 2 KV heads split 2 ways), CUDA graphs on (the all-reduces are
    captured), float32: exactly the tokens of TP=1, eager and graph-replayed decode alike."""
    from zpp import LLM, SamplingParams
    prompts = _prompts() * 3  # 12 sequences: decode replays the batch-16 graph
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    res = {}
    for tp, eager in ((1, False), (2, False), (2, True)):
        with LLM(small_llama, device="cuda", dtype="float32", tensor_parallel_size=tp, enforce_eager=eager,
                 kv_cache_memory="1GiB", max_num_seqs=16) as llm:
            res[tp, eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert res[2, False] == res[1, False]
    assert res[2, True] == res[1, False]


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs (TP=2 x PP=2, NCCL)")
def test_nccl_tensor_and_pipeline_parallel_equal_tp1(small_llama):
    """TP=2 x PP=2 on four GPUs, CUDA graphs on, float32: exactly the tokens of one GPU."""
    from zpp import LLM, SamplingParams
    prompts = _prompts() * 3
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    res = {}
    for tp, pp in ((1, 1), (2, 2)):
        with LLM(small_llama, device="cuda", dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
                 kv_cache_memory="1GiB", max_num_seqs=16, pipeline_depth=2) as llm:
            res[tp, pp] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert res[2, 2] == res[1, 1]


def test_tensor_parallel_refused_with_shared_gpu(small_llama, monkeypatch):
    """ZPP_SHARE_GPU=1 (every rank on GPU 0, gloo) is for pipeline stages only: gloo all-reduces on
    CUDA tensors cannot be captured, so TP > 1 is refused before any worker starts."""
    from zpp import LLM
    from zpp.config import ConfigError
    monkeypatch.setenv("ZPP_SHARE_GPU", "1")
    with pytest.raises(ConfigError, match="--tensor-parallel-size > 1 needs one GPU per rank"):
        LLM(small_llama, device="cuda", tensor_parallel_size=2)


# --- Phi-3 / Phi-4-mini ---------------------------------------------------------------------------
PHI3_SHAPES = {
    # Phi-4-mini in small: head 128, partial rotary 0.75 (96 rotated, half 48), tied head, LongRoPE.
    "phi4-mini-like": dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.75,
                           tie_word_embeddings=True),
    # Phi-3-mini-128k in small: head 96 (half 48, no power of two), full rotary, untied, LongRoPE.
    "phi3-mini-like": dict(hidden_size=384, num_attention_heads=4, num_key_value_heads=4),
}


@pytest.fixture(scope="module", params=list(PHI3_SHAPES))
def small_phi3(request, tmp_path_factory):
    """LongRoPE with original_max_position_embeddings 48: of ``_prompts()`` (1, 7, 33, 120 tokens)
    with 24 new tokens, two stay short, the 33-token one crosses 48 while decoding (recomputed with
    the long factors, as HF's generate does) and the 120-token one is long from the start."""
    from transformers import Phi3Config, Phi3ForCausalLM
    shape = PHI3_SHAPES[request.param]
    head = shape["hidden_size"] // shape["num_attention_heads"]
    half = int(head * shape.get("partial_rotary_factor", 1.0)) // 2
    rope = {"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.5 + 0.2 * i for i in range(half)],
            "partial_rotary_factor": shape.get("partial_rotary_factor", 1.0)}  # where every HF 5.x reads it
    cfg = Phi3Config(vocab_size=49152, intermediate_size=1024, num_hidden_layers=4, max_position_embeddings=512,
                     original_max_position_embeddings=48, initializer_range=0.2, rope_scaling=rope,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp(request.param)
    Phi3ForCausalLM(cfg).save_pretrained(d)
    return str(d)


def test_phi3_bf16_matches_hf(small_phi3):
    """bf16 on the GPU (Triton rotary with partial rotary / a 96-wide head, LongRoPE rows, decode
    graphs, async scheduling) against HF's full forward per step (which uses one factor set for the
    whole sequence, as its generate does): the top-5 rule."""
    from zpp import LLM, SamplingParams
    prompts = _prompts()
    ref = _hf_greedy_with_logprobs(small_phi3, prompts, 24)
    with LLM(small_phi3, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3) as llm:
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=TOP_K))
        assert llm.engine.scheduler.stats.num_rope_recomputes == 1
    for (ref_toks, ref_lps), o in zip(ref, got):
        toks, lps = o.outputs[0].token_ids, o.outputs[0].logprobs
        for j, (a, b) in enumerate(zip(toks, ref_toks)):
            if a != b:
                hf_top = set(ref_lps[j].topk(TOP_K).indices.tolist())
                assert a in hf_top, f"step {j}: zpp's token {a} is not in HF's top-{TOP_K}"
                assert b in lps[j], f"step {j}: HF's token {b} is not in zpp's top-{TOP_K}"
                break


def test_phi3_fp32_equals_hf_and_graphs_equal_eager(small_phi3):
    """float32: greedy tokens equal HF's exactly, with CUDA graphs and eagerly; bf16: graphs on and
    off give the same tokens (a 48-token budget cuts the long prompt into chunks next to decodes)."""
    from zpp import LLM, SamplingParams
    prompts = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = _hf_greedy_with_logprobs(small_phi3, prompts, 24, torch.float32)
    res = {}
    for dtype, eager in (("float32", False), ("float32", True), ("bfloat16", False), ("bfloat16", True)):
        with LLM(small_phi3, device="cuda", dtype=dtype, gpu_memory_utilization=0.3, enforce_eager=eager,
                 max_num_seqs=16, max_num_batched_tokens=48) as llm:
            res[dtype, eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert res["float32", False] == [r[0] for r in ref]
    assert res["float32", True] == [r[0] for r in ref]
    assert res["bfloat16", False] == res["bfloat16", True]
