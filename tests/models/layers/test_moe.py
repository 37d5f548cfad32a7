"""The mixture-of-experts layers (``zpp.models.layers.moe``) against HF transformers' modules with
random weights -- Mixtral's and Qwen3-MoE's routers, gpt-oss's router, experts (biases, clamped
SwiGLU, interleaved transposed checkpoint layout) and whole MLP -- and the grouped Triton GEMMs of
the CUDA path (``zpp.models.layers.fused_moe``) against the PyTorch path: on CUDA, or on the CPU
under TRITON_INTERPRET=1 (slow but exact), over several expert counts, k, empty experts, biases
and both fused activations. Also: the expert tensor-parallel split (partial sums add up to the
whole) and Qwen3's per-head QK RMSNorm kernel."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.slow  # HF's MoE modules and the fused-MoE kernel under the Triton interpreter: minutes

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # run the kernels in Triton's CPU interpreter

DEV = "cuda" if ON_GPU else "cpu"


def _interpreter_fix():
    """Triton 3.6's interpreter converts loaded scalars (numpy shape (1,)) with int(), which numpy 2
    refuses (as in tests/models/layers/test_triton_ops.py)."""
    import triton.runtime.interpreter as ti
    if getattr(ti, "_zpp_index_fix", False):
        return
    orig = ti._patch_lang_tensor

    def patch(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = patch
    ti._zpp_index_fix = True


@pytest.fixture(scope="module")
def triton_ops():
    pytest.importorskip("triton")
    if not ON_GPU:
        _interpreter_fix()
    from zpp.models.layers import fused_moe, triton_ops
    return fused_moe, triton_ops


def _experts(E, H, I, act="silu", bias=False, seed=0, **kw):
    from zpp.models.layers.moe import FusedExperts
    torch.manual_seed(seed)
    ex = FusedExperts(E, H, I, act, bias=bias, **kw)
    for p in ex.parameters():
        p.data.normal_(0, 0.5)
    return ex


def _routing(T, E, k, seed=0, skip=()):
    """Distinct experts per token, never those in ``skip`` (empty experts), weights summing to 1."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in skip])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(T)])
    w = torch.rand(T, k, generator=g) + 0.1
    return w / w.sum(-1, keepdim=True), ids


# --- routers against HF -----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen3_moe_norm", "gpt_oss"])
def test_router_matches_hf(family):
    from zpp.models.layers.moe import TopKRouter
    torch.manual_seed(0)
    H, E, k, T = 32, 8, 3, 20
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as cls
        hf_cfg = MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=k)
        ours = TopKRouter(H, E, k, renormalize=True)
    elif family.startswith("qwen3_moe"):
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as cls
        norm = family.endswith("norm")
        hf_cfg = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=k, norm_topk_prob=norm)
        ours = TopKRouter(H, E, k, renormalize=norm)
    else:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter as cls
        hf_cfg = GptOssConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=k)
        ours = TopKRouter(H, E, k, scoring="topk_softmax", bias=True)
    hf = cls(hf_cfg)
    for p in hf.parameters():
        p.data.normal_()
    for name, p in ours.named_parameters():
        p.weight_loader(p, dict(hf.named_parameters())[name].detach())
    x = torch.randn(T, H)
    _, ref_w, ref_ids = hf(x)
    w, ids = ours(x)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (T, k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w.float(), rtol=1e-6, atol=1e-7)


def test_router_refuses_bad_arguments():
    from zpp.models.layers.moe import TopKRouter
    with pytest.raises(ValueError, match="scoring 'sigmoid'"):
        TopKRouter(8, 4, 2, scoring="sigmoid")
    with pytest.raises(ValueError, match="top_k=5"):
        TopKRouter(8, 4, 5)


# --- gpt-oss experts against HF ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_oss_mlp():
    """HF ``GptOssMLP`` (router with bias + experts with biases and the clamped SwiGLU) with random
    weights large enough that the clamp at 7 is reached."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    cfg = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2)
    torch.manual_seed(0)
    mlp = GptOssMLP(cfg).eval()
    for name, p in mlp.named_parameters():
        p.data.normal_(0, 1.0 if "experts" in name else 0.5)
    return cfg, mlp


def _gpt_oss_ours(cfg, mlp, tp_rank=0, tp_size=1):
    from zpp.models.layers.moe import ClampedSwiGLU, FusedExperts, TopKRouter
    router = TopKRouter(cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok, scoring="topk_softmax",
                        bias=True)
    experts = FusedExperts(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size,
                           ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit), bias=True, tp_rank=tp_rank,
                           tp_size=tp_size, checkpoint_layout="gpt_oss")
    hf = dict(mlp.named_parameters())
    for mod, prefix in ((router, "router."), (experts, "experts.")):
        for name, p in mod.named_parameters():
            p.weight_loader(p, hf[prefix + name].detach())  # shard None: the fused HF tensors
    return router, experts


def test_gpt_oss_experts_match_hf(gpt_oss_mlp):
    """Same routing into HF ``GptOssExperts`` and ours (loaded from its interleaved, transposed
    tensors): equal outputs; the clamp is exercised."""
    cfg, mlp = gpt_oss_mlp
    _, experts = _gpt_oss_ours(cfg, mlp)
    x = torch.randn(40, cfg.hidden_size) * 2
    w, ids = _routing(40, cfg.num_local_experts, cfg.num_experts_per_tok, skip=(4,))
    with torch.no_grad():
        ref = mlp.experts(x, ids, w)
        gate_up = x @ mlp.experts.gate_up_proj[0] + mlp.experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > cfg.swiglu_limit).any(), "the clamp is not reached: the test is too weak"
    torch.testing.assert_close(experts(x, w, ids), ref, rtol=1e-5, atol=1e-5)


def test_gpt_oss_mlp_matches_hf(gpt_oss_mlp):
    """HF ``GptOssMLP`` (router + experts) against ``TopKRouter(scoring="topk_softmax", bias=True)``
    + ``FusedExperts``."""
    cfg, mlp = gpt_oss_mlp
    router, experts = _gpt_oss_ours(cfg, mlp)
    x = torch.randn(3, 11, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, _ = mlp(x)
    flat = x.reshape(-1, cfg.hidden_size)
    out = experts(flat, *router(flat))
    # float32 sums in another order: outputs of magnitude ~5 differ by a few ulps (6e-5 seen in CI
    # with unseeded inputs), so the bound is relative to the output's scale
    torch.testing.assert_close(out.view_as(ref), ref, rtol=1e-4, atol=1e-4)


def test_gpt_oss_tensor_parallel_partials_add_up(gpt_oss_mlp):
    """Two TP ranks' partial sums (``reduce=False``; the down bias only on rank 0) add up to the
    whole; each rank holds its half of the de-interleaved gate and up rows."""
    cfg, mlp = gpt_oss_mlp
    _, full = _gpt_oss_ours(cfg, mlp)
    parts = [_gpt_oss_ours(cfg, mlp, r, 2)[1] for r in range(2)]
    x = torch.randn(17, cfg.hidden_size)
    w, ids = _routing(17, cfg.num_local_experts, cfg.num_experts_per_tok, seed=3)
    total = sum(p(x, w, ids, reduce=False) for p in parts)
    torch.testing.assert_close(total, full(x, w, ids), rtol=1e-5, atol=1e-5)
    I = cfg.intermediate_size
    gate = torch.cat([p.gate_up_proj.data[:, :I // 2] for p in parts], 1)
    assert torch.equal(gate, full.gate_up_proj.data[:, :I])
    assert torch.equal(gate[0], mlp.experts.gate_up_proj.data[0, :, 0::2].t())


@pytest.mark.parametrize("bias", [False, True])
def test_experts_tensor_parallel_partials_add_up(bias):
    from zpp.models.layers.moe import FusedExperts
    full = _experts(5, 16, 24, bias=bias)
    parts = []
    for r in range(3):
        part = FusedExperts(5, 16, 24, bias=bias, tp_rank=r, tp_size=3)
        for name, p in part.named_parameters():
            p.weight_loader(p, dict(full.named_parameters())[name].detach())
        parts.append(part)
    x = torch.randn(9, 16)
    w, ids = _routing(9, 5, 2, seed=1)
    torch.testing.assert_close(sum(p(x, w, ids, reduce=False) for p in parts), full(x, w, ids),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not divisible"):
        FusedExperts(5, 16, 24, tp_size=5)


# --- the grouped Triton GEMMs against the PyTorch path --------------------------------------------------
@pytest.mark.parametrize("E, k, T, BM", [(6, 2, 11, 4), (64, 4, 150, 16), (3, 1, 300, 64)])
def test_moe_align(triton_ops, E, k, T, BM):
    """Every assignment appears once, in its expert's run, runs in expert order, each block one
    expert's, empty experts own no block; buffer sizes depend only on the shape (the worst case)."""
    fused_moe, _ = triton_ops
    w, ids = _routing(T, E, k, seed=5, skip=(2,))
    sorted_ids, block_expert = fused_moe.moe_align(ids.to(DEV), E, BM)
    M = ids.numel()
    P = fused_moe.max_padded_rows(M, E, BM)
    assert sorted_ids.shape == (P,) and block_expert.shape == (P // BM,)
    s, be = sorted_ids.cpu(), block_expert.cpu()
    valid = s[s < M]
    assert sorted(valid.tolist()) == list(range(M))
    flat = ids.reshape(-1)
    for b in range(P // BM):
        rows = s[b * BM:(b + 1) * BM]
        rows = rows[rows < M]
        if int(be[b]) == E:
            assert len(rows) == 0
        else:
            assert (flat[rows] == be[b]).all()
    experts_in_order = flat[valid]
    assert torch.equal(experts_in_order, experts_in_order.sort().values)
    assert 2 not in be.tolist() and be.tolist() == sorted(be.tolist())
    used = [b for b in range(P // BM) if int(be[b]) < E]
    assert used == list(range(len(used)))  # the runs are packed from row 0


CASES = [  # (experts, k, tokens, bias, activation, empty experts)
    (4, 2, 5, False, "silu", ()),
    (8, 2, 33, False, "silu", (3, 5)),
    (3, 1, 20, False, "silu", ()),
    (16, 4, 3, True, "silu", ()),
    (8, 3, 70, True, "clamped", (0,)),
    (1, 1, 9, False, "silu", ()),
    (6, 6, 2, True, "gelu", ()),  # an activation without a Triton kernel: PyTorch between the GEMMs
    (16, 4, 90, False, "silu", (1, 7)),  # 360 assignments: several counting programs
]


@pytest.mark.parametrize("E, k, T, bias, act, skip", CASES)
def test_fused_moe_matches_pytorch_path(triton_ops, E, k, T, bias, act, skip):
    from zpp.models.layers.moe import ClampedSwiGLU
    fused_moe, _ = triton_ops
    ex = _experts(E, 32, 48, ClampedSwiGLU() if act == "clamped" else act, bias=bias).to(DEV)
    x = torch.randn(T, 32, device=DEV)
    w, ids = _routing(T, E, k, seed=T, skip=skip)
    w, ids = w.to(DEV), ids.to(DEV)
    out = fused_moe.fused_moe(x, ex.gate_up_proj, ex.down_proj, w, ids, ex.act, ex.gate_up_proj_bias,
                              ex.down_proj_bias)
    ref = ex.forward_loop(x, w, ids)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_fused_moe_block_sizes(triton_ops, monkeypatch):
    """Larger blocks (the prefill configurations) give the same result."""
    fused_moe, _ = triton_ops
    ex = _experts(4, 32, 40).to(DEV)
    x = torch.randn(30, 32, device=DEV)
    w, ids = _routing(30, 4, 2, seed=9)
    w, ids = w.to(DEV), ids.to(DEV)
    ref = ex.forward_loop(x, w, ids)
    for bm, bn, bk in ((32, 32, 32), (64, 64, 16)):
        monkeypatch.setattr(fused_moe, "moe_block_config",
                            lambda m, e: dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=2))
        out = fused_moe.fused_moe(x, ex.gate_up_proj, ex.down_proj, w, ids, ex.act)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_sparse_block_takes_another_router():
    """A router written elsewhere (here a fixed one) plugs into SparseMoeBlock."""
    from zpp.models.layers.moe import SparseMoeBlock
    w, ids = _routing(7, 4, 2, seed=2)

    class Fixed(torch.nn.Module):
        def forward(self, x):
            return w, ids

    block = SparseMoeBlock(16, 24, 4, 2, router=Fixed())
    for p in block.parameters():
        p.data.normal_()
    x = torch.randn(7, 16)
    torch.testing.assert_close(block(x), block.experts(x, w, ids))


def test_qk_rms_norm_kernel(triton_ops):
    """Per-head RMSNorm of q and k read from a fused qkv output (strided rows), as HF Qwen3RMSNorm."""
    _, ops = triton_ops
    T, hq, hk, d = 5, 4, 2, 32
    qkv = torch.randn(T, (hq + 2 * hk) * d, device=DEV)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    wq, wk = torch.randn(d, device=DEV), torch.randn(d, device=DEV)

    def ref(x, w, h):
        x = x.reshape(T, h, d)
        return (w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))).reshape(T, h * d)
    qo, ko = ops.qk_rms_norm(q, k, wq, wk, 1e-6, d)
    torch.testing.assert_close(qo, ref(q, wq, hq), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ko, ref(k, wk, hk), rtol=1e-5, atol=1e-5)
