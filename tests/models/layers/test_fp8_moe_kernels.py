"""Grouped FP8 MoE kernels (zpp.models.quantization.fp8_moe_kernels) against float32 references that
dequantize the e4m3 experts: the W8A8 GEMM on moe_align's sorted layout and the W8A16 decode GEMV,
each with per-channel, per-expert, per-tensor and 128 x 128 block scales, biases and routing
weights; fused_moe_fp8 on both paths. On the CPU under TRITON_INTERPRET=1 (test_fp8_kernels' float8
conversion fix applies), on CUDA as they are."""
from __future__ import annotations

import pytest
import torch

from test_fp8_kernels import DEV, DT, EXACT, ON_GPU, rel_err  # noqa: F401  (interpreter + float8 fixes)

triton = pytest.importorskip("triton")

from zpp.models.quantization import fp8_kernels as K  # noqa: E402
from zpp.models.quantization import fp8_moe_kernels as M8  # noqa: E402
from zpp.models.quantization.fp8_utils import FP8_DTYPE, dequantize, quantize_block, quantize_per_channel  # noqa: E402
from zpp.models.quantization.fp8_utils import quantize_per_tensor  # noqa: E402
from zpp.models.quantization.fp8_utils import fused_moe_fp8_reference  # noqa: E402
from zpp.models.layers.fused_moe import moe_align  # noqa: E402
from zpp.models.layers.moe import GatedActivation  # noqa: E402

pytestmark = pytest.mark.slow  # the kernels under the Triton interpreter on the CPU: tens of seconds

B128 = (128, 128)
LAYOUTS = ["block", "channel", "expert", "tensor"]
# GEMM path against the reference with the same activation quantization: an intermediate near an
# e4m3 rounding boundary may round the other way (on the GPU the bf16 gate_up output adds rounding:
# 0.013 seen on one H100)
GEMM_TOL = 3e-2 if ON_GPU else 1e-2


def _experts_fp8(E, N, K_, layout, seed):
    """``[E, N, K]`` e4m3 weights made from random ones the way each checkpoint layout quantizes them,
    and the scale in :func:`fused_moe_fp8`'s shape for it."""
    torch.manual_seed(seed)
    w = torch.randn(E, N, K_, device=DEV) * 0.05 * torch.linspace(0.5, 2, E, device=DEV)[:, None, None]
    if layout == "block":
        qs = [quantize_block(w[e], B128) for e in range(E)]
    elif layout == "channel":
        qs = [quantize_per_channel(w[e]) for e in range(E)]
    else:
        qs = [quantize_per_tensor(w[e]) for e in range(E)]
    q = torch.stack([a for a, _ in qs])
    s = torch.stack([b for _, b in qs]).float()                         # [E, ...]; [E] per expert tensor
    if layout == "tensor":                                              # one scale for all experts
        s = s.max()
        q = torch.stack([(w[e] / s).clamp(-448, 448).to(FP8_DTYPE) for e in range(E)])
    return q, s, (B128 if layout == "block" else None)


def _deq(q, s, block):
    E, N = q.shape[:2]
    if block is None and s.numel() > 1:
        s = s.reshape(E, -1).expand(E, N)
    return dequantize(q, s, block, torch.float32)


def _routing(T, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEV)
    w = torch.rand(T, k, generator=g).to(DEV) + 0.1
    return w / w.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("T,k,bias", [(1, 2, False), (9, 2, True)])
def test_moe_fp8_gemm_equals_dequantized_product(layout, T, k, bias):
    """Given quantized activations, the GEMM equals the float32 product of the dequantized operands,
    times the routing weight, row for row (padding rows never written: poisoned output checked)."""
    E, N, Kd = 4, 200, 192                                              # partial N and K scale blocks
    w, s, block = _experts_fp8(E, N, Kd, layout, seed=T)
    x = torch.randn(T, Kd, device=DEV, dtype=DT)
    xq, xs = K.per_token_quant(x) if block is None else K.per_token_group_quant(x, 128)
    rw, ids = _routing(T, E, k, seed=T)
    b = torch.randn(E, N, device=DEV, dtype=DT) if bias else None
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=2)
    sorted_ids, block_expert = moe_align(ids, E, 16)
    out = torch.full((T * k, N), float("nan"), device=DEV, dtype=DT)
    M8.moe_fp8_gemm(xq, xs, w, s, out, sorted_ids, block_expert, block, b, rw.reshape(-1).contiguous(), k, cfg)
    xf = xq.float() * (xs if block is None else xs.repeat_interleave(128, 1)[:, :Kd])
    wf = _deq(w, s, block)
    ref = torch.stack([xf[a // k] @ wf[ids.reshape(-1)[a]].t() for a in range(T * k)])
    if bias:
        ref = ref + b.float()[ids.reshape(-1)]
    ref = ref * rw.reshape(-1, 1)
    assert not out.isnan().any()
    assert rel_err(out, ref) < EXACT


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("T,k,bias,row_div", [(1, 3, False, True), (3, 2, True, False)])
def test_moe_fp8_gemv_equals_dequantized_product(layout, T, k, bias, row_div):
    """The W8A16 GEMV: unquantized activations times the dequantized expert of each assignment."""
    E, N, Kd = 4, 136, 200
    w, s, block = _experts_fp8(E, N, Kd, layout, seed=10 + T)
    M = T * k
    x = torch.randn(T if row_div else M, Kd, device=DEV, dtype=DT)
    rw, ids = _routing(T, E, k, seed=T)
    b = torch.randn(E, N, device=DEV, dtype=DT) if bias else None
    out = torch.full((M, N), float("nan"), device=DEV, dtype=DT)
    M8.moe_fp8_gemv(x, w, s, ids.reshape(-1), out, block, b, rw.reshape(-1).contiguous(), k if row_div else 1,
                    dict(block_n=8, block_k=64, num_warps=4))
    wf = _deq(w, s, block)
    flat = ids.reshape(-1)
    ref = torch.stack([x[a // k if row_div else a].float() @ wf[flat[a]].t() for a in range(M)])
    if bias:
        ref = ref + b.float()[flat]
    assert not out.isnan().any()
    assert rel_err(out, ref * rw.reshape(-1, 1)) < EXACT


@pytest.mark.parametrize("layout", ["block", "channel"])
@pytest.mark.parametrize("gemv", [True, False])
def test_fused_moe_fp8_matches_reference(layout, gemv, monkeypatch):
    """Both paths of fused_moe_fp8 against the float32 loop over experts with the same activation
    numerics (W8A16 for the GEMV, per-token / group quantization for the GEMM), and against the
    unquantized-activation product within e4m3's error; the GEMV launch taken from FP8_MOE_CONFIGS
    (16 rows per program: a quarter of the default's programs under the interpreter)."""
    E, H, I, T, k = 4, 192, 128, 5, 2
    block_ = B128 if layout == "block" else None
    for n, kd in ((2 * I, H), (H, I)):
        monkeypatch.setitem(M8.FP8_MOE_CONFIGS, M8._key(E, n, kd, block_), dict(gemv=dict(block_n=16, block_k=128)))
    wg, sg, block = _experts_fp8(E, 2 * I, H, layout, seed=1)
    wd, sd, _ = _experts_fp8(E, H, I, layout, seed=2)
    x = torch.randn(T, H, device=DEV, dtype=DT)
    rw, ids = _routing(T, E, k, seed=3)
    act = GatedActivation("silu")
    out = M8.fused_moe_fp8(x, wg, wd, sg, sd, rw, ids, act, block, config=dict(gemv=gemv))
    ref = fused_moe_fp8_reference(x, wg, wd, sg, sd, rw, ids, act, block, quantize_activations=not gemv)
    assert out.shape == (T, H) and out.dtype == x.dtype
    assert rel_err(out, ref) < (EXACT if gemv else GEMM_TOL)
    exact_acts = fused_moe_fp8_reference(x, wg, wd, sg, sd, rw, ids, act, block, quantize_activations=False)
    assert rel_err(out, exact_acts) < 0.06


def test_fused_moe_fp8_biases_and_other_activation():
    """gpt-oss-style experts (clamped SwiGLU, biases) on the GEMM path, per-channel scales."""
    from zpp.models.layers.moe import ClampedSwiGLU
    E, H, I, T, k = 3, 64, 32, 4, 2
    wg, sg, _ = _experts_fp8(E, 2 * I, H, "channel", seed=4)
    wd, sd, _ = _experts_fp8(E, H, I, "channel", seed=5)
    bg, bd = torch.randn(E, 2 * I, device=DEV, dtype=DT) * 0.1, torch.randn(E, H, device=DEV, dtype=DT) * 0.1
    x = torch.randn(T, H, device=DEV, dtype=DT)
    rw, ids = _routing(T, E, k, seed=6)
    act = ClampedSwiGLU()
    for gemv in (False, True):
        out = M8.fused_moe_fp8(x, wg, wd, sg, sd, rw, ids, act, None, bg, bd, config=dict(gemv=gemv))
        ref = fused_moe_fp8_reference(x, wg, wd, sg, sd, rw, ids, act, None, bg, bd, quantize_activations=not gemv)
        assert rel_err(out, ref) < (EXACT if gemv else GEMM_TOL)


def test_fused_moe_fp8_refuses_bad_input():
    E, H, I = 2, 128, 64
    wg, sg, _ = _experts_fp8(E, 2 * I, H, "channel", seed=7)
    wd, sd, _ = _experts_fp8(E, H, I, "channel", seed=8)
    x = torch.randn(2, H, device=DEV, dtype=DT)
    rw, ids = _routing(2, E, 1, seed=9)
    act = GatedActivation("silu")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        M8.fused_moe_fp8(x, wg.float(), wd, sg, sd, rw, ids, act)
    with pytest.raises(ValueError, match="per-channel scale of shape"):
        M8.fused_moe_fp8(x, wg, wd, sg[:, :5], sd, rw, ids, act)
    with pytest.raises(ValueError, match="not a multiple of the scale block"):   # I = 64 < 128: gate|up mixed
        M8.fused_moe_fp8(x, wg, wd, torch.ones(E, 1, 1, device=DEV), sd, rw, ids, act, B128)
    with pytest.raises(ValueError, match="power of two"):
        M8.fused_moe_fp8(x, wg, wd, sg, sd, rw, ids, act, (64, 100))


def test_path_choice_and_configs(monkeypatch):
    """The GEMV path up to the measured (or default) number of assignments; measured tiles by bucket;
    block weights always get BLOCK_K = the scale block."""
    assert M8.use_fp8_moe_gemv(8, 128, 1536, 2048, None) and not M8.use_fp8_moe_gemv(0, 128, 1536, 2048, None)
    assert not M8.use_fp8_moe_gemv(M8.FP8_MOE_GEMV_MAX_ASSIGNMENTS + 1, 7, 96, 64, None)
    key = M8._key(7, 96, 64, B128)
    monkeypatch.setitem(M8.FP8_MOE_CONFIGS, key, dict(gemv_max=16, gemm={64: dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128,
                                                                                      num_warps=4, num_stages=2)}))
    assert M8.use_fp8_moe_gemv(16, 7, 96, 64, B128) and not M8.use_fp8_moe_gemv(17, 7, 96, 64, B128)
    assert M8.fp8_moe_config(40, 7, 96, 64, B128)["BLOCK_N"] == 32
    assert M8.fp8_moe_config(4096, 7, 96, 64, B128)["BLOCK_K"] == 128        # past the buckets: default
