"""4-bit checkpoints on a GPU (compute capability >= 8.0): tiny *fitted* models (tests/fitted_moe.py:
a successor task, confident logits) written in a release's layout by tests/w4_checkpoint.py --
gpt-oss with MXFP4 experts (``*_blocks`` / ``*_scales``, as openai/gpt-oss-20b) and a dense Llama in
GPTQ (4 bit, group 128, symmetric, ``desc_act: false``) -- load 4-bit (the W4A16 methods hold the
packed codes; no bf16 copy of those weights), and

* each 4-bit layer of the loaded stage, through the W4A16 kernels (dense GEMV / GEMM, the grouped
  expert GEMV / GEMM with gpt-oss's biases and clamped SwiGLU), is within 2% (relative L2) of the
  same layer on its dequantized weights in the model dtype: the kernels only round differently
  (bf16 accumulation and output), the weights are exactly the format's values;
* end to end, vLLM's top-5 rule (``check_logprobs_close``) between the 4-bit checkpoint and its
  dequantized twin (the same weights in float32, served in bf16), CUDA graphs on;
* CUDA graphs give exactly the eager tokens on the 4-bit checkpoint.

The per-layer check runs on the CPU too (``ZPP_W4_CHECK_ON_CPU=1``: the methods are attached to
CPU layers as tests/models/test_dummy_quantized.py does, and the kernels run under
``TRITON_INTERPRET=1`` in float32); the engine tests need CUDA."""
from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch

ON_CPU = os.environ.get("ZPP_W4_CHECK_ON_CPU") == "1"
if not ON_CPU and (not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0)):
    pytest.skip("needs a CUDA GPU of compute capability >= 8.0 (the W4A16 kernels)", allow_module_level=True)

# Every test here compiles Triton kernels, which runs `ldconfig` and the compiler: the slow tier
# (tests/process_guard.py).
pytestmark = pytest.mark.slow

TESTS = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, TESTS)
if ON_CPU:
    sys.path[:0] = [os.path.join(TESTS, "models"), os.path.join(TESTS, "models", "layers")]
    import test_triton_ops  # noqa: E402,F401  (TRITON_INTERPRET=1 before any kernel is defined; its fixes)
from fitted_moe import W4_FAMILIES, chain, fitted_moe_checkpoint, follows, top5_close  # noqa: E402
from w4_checkpoint import write_w4_checkpoint  # noqa: E402

DEVICE = torch.device("cpu" if ON_CPU else "cuda")
DTYPE = torch.float32 if ON_CPU else torch.bfloat16   # of the per-layer check (the interpreter's tl.dot has no bf16)
N = 24
# family -> (format of tests/w4_checkpoint.py, group size, symmetric, 4-bit expert layers, 4-bit linear layers)
W4_LAYOUT = {"gpt-oss": ("mxfp4", 32, True, 3, 0),     # experts only (attention, router, head in bf16)
             "llama": ("gptq", 128, True, 0, 12)}      # qkv, o, gate_up, down of 3 layers


@pytest.fixture
def w4_on_cpu(monkeypatch):
    """On the CPU (``ZPP_W4_CHECK_ON_CPU=1``): the loader told the W4A16 methods run there."""
    if ON_CPU:
        from test_dummy_quantized import _w4a16_on_cpu
        from zpp.models import quantization as q
        from zpp.models.quantization import w4_base
        monkeypatch.setattr(q, "format_supported", lambda quant, device, capability=None: True)
        monkeypatch.setattr(w4_base, "w4a16_method", _w4a16_on_cpu)


def _stage(path):
    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    cfg = json.load(open(os.path.join(path, "config.json")))
    model = load_stage_model(path, cfg, StageInfo(0, 1, 0, cfg["num_hidden_layers"]), torch.bfloat16, DEVICE, 256)
    for p in model.parameters():           # (4-bit layers are kept for bf16 / fp16 models only)
        if p.dtype.is_floating_point:
            p.data = p.data.to(DTYPE)
    return model


def _check_layers(model, what, tol: float = 0.02) -> tuple[int, int]:
    """Every W4A16 layer of ``model`` through the kernels against the same layer on its dequantized
    weights (``dequantized``: the format's exact values in ``DTYPE``); returns (expert layers, linear
    layers) checked. Linear: M = 1, 4 (GEMV), 64, 300 (GEMM); experts: T = 1, 4 (GEMV), 64, 300
    (sorted GEMM) with random routings of the layer's top-k."""
    import torch.nn.functional as F

    from zpp.models.quantization.w4a16_kernels import fused_moe_w4a16, w4a16_linear
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    torch.manual_seed(0)
    n_moe = n_lin = 0
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        kind = type(qm).__name__
        if kind == "W4A16LinearMethod":
            w = qm.dequantized(mod, DTYPE)
            for M in (1, 4, 64, 300):
                x = torch.randn(M, mod.in_features, device=DEVICE, dtype=DTYPE)
                got = w4a16_linear(x, mod.qweight, mod.scales, mod.zeros, qm.group_size, qm.fmt, mod.bias)
                e = rel(got, F.linear(x, w, mod.bias))
                assert e < tol, (what, name, M, e)
            n_lin += 1
        elif kind == "W4A16MoEMethod":
            deq = qm.dequantized(mod, DTYPE)
            gu, dn = qm.weights(mod)
            for T in (1, 4, 64, 300):
                x = torch.randn(T, mod.hidden_size, device=DEVICE, dtype=DTYPE)
                ids = torch.rand(T, mod.num_experts, device=DEVICE).argsort(-1)[:, :2]
                wts = torch.rand(T, 2, device=DEVICE)
                got = fused_moe_w4a16(x, gu, dn, qm.group_size, qm.fmt, wts, ids, mod.act, mod.gate_up_proj_bias,
                                      mod._down_bias)
                e = rel(got, mod.forward_loop(x, wts, ids, deq))
                assert e < tol, (what, name, T, e)
            n_moe += 1
    return n_moe, n_lin


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """family -> (4-bit checkpoint dir, its dequantized twin, perm of the fit); fitted once per module."""
    made = {}

    def get(family: str):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            src, d = str(root / "src"), str(root / "w4")
            perm = fitted_moe_checkpoint(family, src, str(DEVICE), steps=int(os.environ.get("ZPP_W4_FIT_STEPS", 200)))
            fmt, group, sym = W4_LAYOUT[family][:3]
            names = write_w4_checkpoint(src, d, fmt, d + "-deq", group=group, symmetric=sym)
            assert names, "nothing quantized"
            made[family] = (d, d + "-deq", perm)
        return made[family]
    return get


@pytest.mark.parametrize("family", W4_FAMILIES)
def test_w4_layers_equal_their_dequantized_weights(family, fitted, w4_on_cpu):
    """The checkpoint loads 4-bit where the release is (gpt-oss: the experts of every layer; Llama
    GPTQ: every linear layer of the decoder) and each such layer's kernels agree with its
    dequantized weights."""
    d, _, _ = fitted(family)
    got = _check_layers(_stage(d), family)
    assert got == W4_LAYOUT[family][3:], f"{family}: (4-bit expert layers, 4-bit linear layers) {got}"


@pytest.mark.slow  # three engines per family
@pytest.mark.parametrize("family", W4_FAMILIES)
def test_w4a16_top5_equal_dequantized_bf16_and_graphs_equal_eager(family, fitted):
    """The 4-bit checkpoint (CUDA graphs on) against its dequantized twin served in bf16: vLLM's top-5
    rule on 8 prompts x 24 greedy tokens, at least 75% of the positions compared (few early
    divergences); the 4-bit checkpoint eager gives exactly the graphs' tokens. The fit is checked
    first (the bf16 run follows the successor map), so that a failure below is the 4-bit path's."""
    if ON_CPU:
        pytest.skip("the engine comparison runs on the GPU")
    from zpp import LLM, SamplingParams
    d, deq, perm = fitted(family)
    rng = random.Random(11)
    prompts = [chain(rng.randrange(3, 512), n, perm) for n in (1, 3, 7, 12, 2, 30, 5, 17)]
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=5)

    def run(path, **kw):
        with LLM(path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, max_num_seqs=16, **kw) as llm:
            return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in pos.items()}
                                                    for pos in o.outputs[0].logprobs])
                    for o in llm.generate(prompts, sp, use_tqdm=False)]
    ref, got, eager = run(deq), run(d), run(d, enforce_eager=True)
    fit = [follows(t, p, perm) for (t, _), p in zip(ref, prompts)]
    assert min(fit) > 0.8, f"the fit did not take: bf16 follows the successor map {fit}"
    compared = [top5_close(a, b) for a, b in zip(got, ref)]
    assert sum(n for n, _ in compared) >= 0.75 * N * len(prompts), compared
    assert [t for t, _ in eager] == [t for t, _ in got], "CUDA graphs and eager differ on the 4-bit checkpoint"
