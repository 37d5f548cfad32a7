"""FP8 experts on a GPU with FP8 (compute capability >= 8.9): tiny Qwen3-MoE / DeepSeek-V3 FP8
checkpoints in the releases' layouts (block 128 x 128 per-expert names; compressed-tensors per
channel) and ``--quantization fp8`` on a bf16 one keep their experts e4m3 (the grouped FP8 MoE
kernels run them); greedy tokens follow bf16 on the dequantized weights under vLLM's top-5 rule
(equal until the first divergence, where each side's token is among the other's top-5), and CUDA
graphs give exactly the eager tokens."""
from __future__ import annotations

import json
import os
import random
import shutil
import sys

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a GPU with FP8 (compute capability >= 8.9)", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from fp8_checkpoint import write_fp8_checkpoint  # noqa: E402

TOP_K = 5
VOCAB = 49152
N = 24


def _qwen3_moe_dir(root: str, demo_model: str) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=512,
                         initializer_range=0.05, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).to(torch.float32).save_pretrained(root)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(demo_model, f)):
            shutil.copy(os.path.join(demo_model, f), root)
    return root


@pytest.fixture(scope="module")
def tok_dir():
    """SmolLM2's tokenizer files: ``ZPP_TEST_TOKENIZER`` (a folder carried to a GPU machine that
    cannot convert the demo model), else the demo model."""
    from helpers import demo_model_or_skip
    return os.environ.get("ZPP_TEST_TOKENIZER") or demo_model_or_skip()


@pytest.fixture(scope="module")
def moe_src(tmp_path_factory, tok_dir):
    return _qwen3_moe_dir(str(tmp_path_factory.mktemp("qwen3moe")), tok_dir)


def _prompts():
    rng = random.Random(5)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 17, 33, 64, 9, 120, 2, 48)]


def _run(path, **kw):
    from zpp import LLM, SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=TOP_K)
    with LLM(path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, **kw) as llm:
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs)
                for o in llm.generate(_prompts(), sp, use_tqdm=False)]


def _top5_close(a_runs, b_runs, what):
    for i, ((a, alp), (b, blp)) in enumerate(zip(a_runs, b_runs)):
        n = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if n is not None:
            assert a[n] in blp[n] and b[n] in alp[n], (what, i, n)


def _kept_experts(path) -> int:
    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    cfg = json.load(open(os.path.join(path, "config.json")))
    model = load_stage_model(path, cfg, StageInfo(0, 1, 0, cfg["num_hidden_layers"]), torch.bfloat16,
                             torch.device("cuda"), 256)
    n = sum(1 for m in model.modules() if type(getattr(m, "quant_method", None)).__name__ == "Fp8MoEMethod")
    del model
    torch.cuda.empty_cache()
    return n


@pytest.mark.parametrize("layout", ["block", "ct-channel"])
def test_fp8_moe_checkpoint_follows_bf16(moe_src, tmp_path, layout):
    d, deq = str(tmp_path / "fp8"), str(tmp_path / "deq")
    write_fp8_checkpoint(moe_src, d, layout, dequantized_dst=deq)
    assert _kept_experts(d) == 3
    fp8, ref = _run(d), _run(deq)
    _top5_close(fp8, ref, layout)
    if layout == "block":
        eager = _run(d, enforce_eager=True)
        assert [t for t, _ in eager] == [t for t, _ in fp8], "CUDA graphs differ from eager"


def test_quantization_fp8_quantizes_experts(moe_src):
    fp8, ref = _run(moe_src, quantization="fp8"), _run(moe_src)
    _top5_close(fp8, ref, "--quantization fp8")


def test_deepseek_v3_fp8_block(tmp_path, tok_dir):
    """MLA and shared experts FP8 too (kv_b_proj kept in bf16), routed experts through the kernels."""
    from test_models_deepseek import _save, _v3
    src = _save(_v3, str(tmp_path / "src"), tok_dir, num_hidden_layers=3, moe_intermediate_size=256,
                hidden_size=256, initializer_range=0.05)
    d, deq = str(tmp_path / "fp8"), str(tmp_path / "deq")
    write_fp8_checkpoint(src, d, "block", dequantized_dst=deq)
    assert _kept_experts(d) == 2
    _top5_close(_run(d), _run(deq), "deepseek-v3 block")
