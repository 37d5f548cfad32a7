"""The MoE decode-step fusions (issue 47): the one-launch top-k router (fused_moe.topk_route) against
PyTorch's softmax / topk / renormalisation, and the FP8 W8A16 down GEMV that applies the activation,
the routing weight and the sum over each token's experts in one launch
(fp8_moe_kernels.moe_fp8_gemv_down) against float32 references on the dequantized experts. On the
CPU under TRITON_INTERPRET=1, on CUDA as they are."""
from __future__ import annotations

import pytest
import torch

from test_fp8_kernels import DEV, DT, EXACT, ON_GPU, rel_err  # noqa: F401  (interpreter + float8 fixes)

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.slow  # kernels under the Triton interpreter on the CPU: ~15 s

from test_fp8_moe_kernels import B128, _deq, _experts_fp8, _routing  # noqa: E402
from zpp.models.layers.fused_moe import topk_route  # noqa: E402
from zpp.models.layers.moe import ClampedSwiGLU, GatedActivation, TopKRouter  # noqa: E402
from zpp.models.quantization import fp8_moe_kernels as M8  # noqa: E402
from zpp.models.quantization.fp8_utils import fused_moe_fp8_reference  # noqa: E402


@pytest.mark.parametrize("E,k,scoring,renorm", [(128, 8, "softmax", True), (128, 8, "softmax", False),
                                                (8, 2, "softmax", True), (32, 4, "topk_softmax", True),
                                                (60, 3, "softmax", True)])
def test_topk_route_equals_pytorch(E, k, scoring, renorm):
    """Same experts in the same order (distinct logits) and the same weights as TopKRouter's PyTorch
    path, for Qwen3-MoE (128 / 8, with and without norm_topk_prob), Mixtral (8 / 2), gpt-oss's
    top-k-then-softmax and an E that is no power of two (masked lanes)."""
    torch.manual_seed(E + k)
    T = 5
    # distinct values in bf16 (multiples of 0.05 up to 3.2, where bf16's spacing is 1/64): no ties,
    # whose order torch.topk leaves unspecified
    logits = torch.stack([(torch.randperm(E) - E // 2).float() * 0.05 for _ in range(T)]).to(DEV, torch.bfloat16)
    w, ids = topk_route(logits, k, scoring, renorm)
    if scoring == "softmax":
        p = torch.softmax(logits.float(), -1)
        ref_w, ref_i = torch.topk(p, k, -1)
        if renorm:
            ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    else:
        top, ref_i = torch.topk(logits, k, -1)
        ref_w = torch.softmax(top.float(), -1)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and w.shape == (T, k)
    assert torch.equal(ids, ref_i)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


def test_topk_route_ties_and_errors():
    """Equal logits go to the lowest expert id; bad top_k is refused; an empty batch is fine."""
    logits = torch.zeros(2, 16, device=DEV)
    logits[1, 5] = logits[1, 9] = 1.0
    w, ids = topk_route(logits, 3, "softmax", True)
    assert ids[0].tolist() == [0, 1, 2] and ids[1].tolist() == [5, 9, 0]
    torch.testing.assert_close(w.sum(-1), torch.ones(2, device=DEV))
    with pytest.raises(ValueError, match="top_k"):
        topk_route(logits, 17)
    assert topk_route(logits[:0], 2)[1].shape == (0, 2)


def test_router_module_uses_the_kernel_on_cuda_only():
    """TopKRouter's output is the same whichever path runs (the kernel on CUDA, PyTorch on the CPU)."""
    r = TopKRouter(64, 16, 4, renormalize=True).to(DEV)
    torch.nn.init.normal_(r.weight, std=0.2)
    x = torch.randn(3, 64, device=DEV)
    w, ids = r(x)
    p = torch.softmax(torch.nn.functional.linear(x, r.weight).float(), -1)
    ref_w, ref_i = torch.topk(p, 4, -1)
    assert torch.equal(ids, ref_i)
    torch.testing.assert_close(w, ref_w / ref_w.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)


def _down_reference(gate_up, wf, ids, rw, act, bias):
    T, k = ids.shape
    out = torch.zeros(T, wf.shape[1], dtype=torch.float32, device=gate_up.device)
    for t in range(T):
        for j in range(k):
            a, e = t * k + j, int(ids[t, j])
            y = act(gate_up[a:a + 1].float())[0] @ wf[e].t()
            if bias is not None:
                y = y + bias[e].float()
            out[t] += float(rw[t, j]) * y
    return out


@pytest.mark.parametrize("layout", ["block", "channel", "expert", "tensor"])
@pytest.mark.parametrize("T,k,bias,clamped", [(1, 3, False, False), (2, 2, True, True)])
def test_moe_fp8_gemv_down_equals_reference(layout, T, k, bias, clamped):
    """act(gate | up) times each assignment's dequantized down expert, times its routing weight,
    summed over the token's experts; a partial K step (I = 160, block_k 64) and partial N block."""
    E, H, I = 4, 136, 160
    w, s, block = _experts_fp8(E, H, I, layout, seed=20 + T)
    rw, ids = _routing(T, E, k, seed=30 + T)
    gate_up = torch.randn(T * k, 2 * I, device=DEV, dtype=DT)
    act = ClampedSwiGLU() if clamped else GatedActivation("silu")
    b = torch.randn(E, H, device=DEV, dtype=DT) if bias else None
    out = torch.full((T, H), float("nan"), device=DEV, dtype=DT)
    M8.moe_fp8_gemv_down(gate_up, w, s, ids, rw.reshape(-1).contiguous(), out, act.triton_kind, block, b,
                         dict(block_n=8, block_k=64, num_warps=4))
    ref = _down_reference(gate_up, _deq(w, s, block), ids, rw, act, b)
    assert not out.isnan().any()
    assert rel_err(out, ref) < EXACT


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_fused_moe_fp8_gemv_fused_down_equals_unfused(layout, monkeypatch):
    """fused_moe_fp8's decode path with the fused down GEMV equals the three-kernel one (activation,
    down GEMV per assignment, sum over k) and the float32 reference; with an activation no Triton
    kernel implements the unfused path still runs."""
    E, H, I, T, k = 4, 192, 128, 2, 2
    block_ = B128 if layout == "block" else None
    monkeypatch.setitem(M8.FP8_MOE_CONFIGS, M8._key(E, 2 * I, H, block_), dict(gemv=dict(block_n=16, block_k=128)))
    monkeypatch.setitem(M8.FP8_MOE_CONFIGS, M8._key(E, H, I, block_),
                        dict(gemv=dict(block_n=16, block_k=128), gemv_down=dict(block_n=16, block_k=128)))
    wg, sg, block = _experts_fp8(E, 2 * I, H, layout, seed=41)
    wd, sd, _ = _experts_fp8(E, H, I, layout, seed=42)
    x = torch.randn(T, H, device=DEV, dtype=DT)
    rw, ids = _routing(T, E, k, seed=43)
    act = GatedActivation("silu")
    fused = M8.fused_moe_fp8(x, wg, wd, sg, sd, rw, ids, act, block, config=dict(gemv=True))
    monkeypatch.setattr(M8, "_FUSED_DOWN", False)
    unfused = M8.fused_moe_fp8(x, wg, wd, sg, sd, rw, ids, act, block, config=dict(gemv=True))
    ref = fused_moe_fp8_reference(x, wg, wd, sg, sd, rw, ids, act, block, quantize_activations=False)
    assert rel_err(fused, ref) < EXACT and rel_err(fused, unfused) < EXACT


def test_fused_down_only_where_measured(monkeypatch):
    """Unset ZPP_FP8_MOE_FUSED_DOWN: the fused down GEMV for shapes with a measured ``gemv_down``
    launch only (DeepSeek-V3's block experts; not Qwen3-30B-A3B's, where it measured slower);
    ``1`` every shape, ``0`` none."""
    ds, qw = (256, 7168, 2048, B128), (128, 2048, 768, None)
    monkeypatch.setattr(M8, "_FUSED_DOWN", None)
    assert M8.fp8_moe_gemv_down_config(*ds) == dict(block_n=8, block_k=512, num_warps=4)
    assert M8.fp8_moe_gemv_down_config(*qw) is None
    monkeypatch.setattr(M8, "_FUSED_DOWN", True)
    assert M8.fp8_moe_gemv_down_config(*qw)["block_n"] == 8
    monkeypatch.setattr(M8, "_FUSED_DOWN", False)
    assert M8.fp8_moe_gemv_down_config(*ds) is None
