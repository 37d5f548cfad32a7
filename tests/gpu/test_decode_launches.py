"""Programmatic dependent launch (``zpp.models.layers.pdl``; on by default for small decode steps,
``ZPP_PDL=0`` turns it off): zpp's Triton kernels launched with it, eagerly and replayed in a CUDA
graph, give bit-for-bit what they give launched one after another, and the engine's greedy tokens
do not change. Skipped below compute capability 9.0 (the kernels then launch without it)."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("needs a GPU of compute capability >= 9.0", allow_module_level=True)

from zpp.models.quantization import fp8_linear as F8  # noqa: E402
from zpp.models.quantization.fp8_utils import quantize_per_channel  # noqa: E402
from zpp.models.quantization import fp8_kernels as FK  # noqa: E402
from zpp.models.layers import pdl as P  # noqa: E402
from zpp.models.layers import triton_ops as T  # noqa: E402


def _chain(x, resid, norm_w, w1, s1, w2, s2, w_bf16):
    """A decoder layer's MLP at batch 1 in zpp's kernels: add + RMSNorm, the W8A16 gate_up GEMV,
    SiLU-and-mul, the down GEMV, then the bf16 GEMV; every kernel reads the one before it."""
    h, r = T.rms_norm(x, norm_w, 1e-5, resid)
    g = FK.fp8_gemv(h, w1, s1, **FK.fp8_gemv_config(*w1.shape))
    a = T.silu_and_mul(g)
    d = FK.fp8_gemv(a, w2, s2, **FK.fp8_gemv_config(*w2.shape))
    h2, r2 = T.rms_norm(d, norm_w, 1e-5, r)
    return T.gemv(h2, w_bf16, **T.gemv_config(*w_bf16.shape)), r2


def test_pdl_chain_bit_equal_eager_and_in_graph(monkeypatch):
    torch.manual_seed(0)
    H, I = 2048, 5632
    dev = "cuda"
    w1, s1 = quantize_per_channel(torch.randn(2 * I, H, device=dev) * 0.05)
    w2, s2 = quantize_per_channel(torch.randn(H, I, device=dev) * 0.05)
    w_bf16 = (torch.randn(4096, H, device=dev) * 0.05).to(torch.bfloat16)
    norm_w = (1 + 0.3 * torch.randn(H, device=dev)).to(torch.bfloat16)
    args = (norm_w, w1, s1, w2, s2, w_bf16)
    monkeypatch.setattr(P, "_active", True)
    assert P.pdl(w1) == dict(USE_PDL=True, launch_pdl=True)  # on, so the comparison below means something
    inputs = [(torch.randn(1, H, device=dev).to(torch.bfloat16), torch.randn(1, H, device=dev).to(torch.bfloat16) * 3)
              for _ in range(8)]
    monkeypatch.setattr(P, "_active", False)
    ref = [_chain(x, r, *args) for x, r in inputs]
    monkeypatch.setattr(P, "_active", True)
    eager = [_chain(x, r, *args) for x, r in inputs]
    for (y, r2), (y_ref, r2_ref) in zip(eager, ref):
        assert torch.equal(y, y_ref) and torch.equal(r2, r2_ref)
    # in a CUDA graph: the launches become programmatic edges; replay each input through static buffers
    sx, sr = (t.clone() for t in inputs[0])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _chain(sx, sr, *args)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(sx, sr, *args)
    for (x, r), (y_ref, r2_ref) in zip(inputs * 4, ref * 4):
        sx.copy_(x)
        sr.copy_(r)
        graph.replay()
        assert torch.equal(out[0], y_ref) and torch.equal(out[1], r2_ref)


def test_pdl_kernels_carry_the_wait(monkeypatch):
    """Each kernel launched with the attribute waits on its predecessor: the compiled code holds
    ``griddepcontrol.wait`` (a launch without it would race)."""
    monkeypatch.setattr(P, "_active", True)
    for kernel in (FK._fp8_gemv_kernel, T._rms_norm_kernel):  # only what this test's launches compile
        for caches in kernel.device_caches.values():
            caches[0].clear()
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    w, s = quantize_per_channel(torch.randn(256, 1024, device="cuda"))
    FK.fp8_gemv(x, w, s)
    T.rms_norm(x, torch.ones(1024, device="cuda", dtype=torch.bfloat16), 1e-5)
    for kernel in (FK._fp8_gemv_kernel, T._rms_norm_kernel):
        compiled = [k for caches in kernel.device_caches.values() for k in caches[0].values()]
        assert compiled and all("griddepcontrol.wait" in k.asm["ptx"] for k in compiled), kernel


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("llama-pdl")
    LlamaForCausalLM(cfg).save_pretrained(d)
    return str(d)


def _greedy(model, prompts, quant):
    from zpp import LLM, SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with LLM(model, device="cuda", dtype="bfloat16", kv_cache_memory="128MiB", quantization=quant) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_greedy_tokens_with_and_without_pdl(small_llama, quant, monkeypatch):
    """A small LLaMA in CUDA graphs, decode batches of 1-3, bf16 and FP8 weights: with PDL (the
    default) and with ``ZPP_PDL=0`` only the launches differ, so the greedy tokens are equal."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 8000, (n,), generator=g).tolist() for n in (1, 9, 40)]
    monkeypatch.setenv("ZPP_PDL", "1")
    base = _greedy(small_llama, prompts, quant)
    monkeypatch.setenv("ZPP_PDL", "0")  # the workers read it at import
    assert _greedy(small_llama, prompts, quant) == base


def test_decode_step_scopes_pdl(monkeypatch):
    """PDL only inside a decode step of at most PDL_MAX_TOKENS tokens (the CUDA graphs of those batch
    sizes), never outside one, and the scope is left as found even when the step raises."""
    w = torch.zeros(8, 8, device="cuda")
    monkeypatch.setattr(P, "_PDL", True)
    assert P.pdl(w) == {}
    with P.decode_step(P.PDL_MAX_TOKENS):
        assert P.pdl(w) == dict(USE_PDL=True, launch_pdl=True)
        with P.decode_step(P.PDL_MAX_TOKENS + 1):
            assert P.pdl(w) == {}
        assert P.pdl(w)
        with pytest.raises(RuntimeError), P.decode_step(1):
            raise RuntimeError
        assert P.pdl(w)
    assert P.pdl(w) == {} and P.pdl(w.cpu()) == {}
    monkeypatch.setattr(P, "_PDL", False)  # ZPP_PDL=0
    with P.decode_step(1):
        assert P.pdl(w) == {}
