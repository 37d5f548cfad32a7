"""A LLaMA-family decoder layer's RMSNorm fused with the FP8 projection after it (``fp8.fuses_norm``,
``LlamaDecoderLayer.fuses_norm``): with the per-token activation quantization for batches past the
W8A16 GEMV's (unless ``ZPP_FP8_FUSED_QUANT=0``, ``fp8_kernels.rms_norm_quant``), not for the GEMV's
batches of up to 4 tokens: which layers and batches take the fused path, and, on the CPU under
TRITON_INTERPRET=1 with the CUDA check stood in, that a decoder layer taking it computes what the
unfused layer computes."""
from __future__ import annotations

import types

import pytest
import torch

from test_triton_ops import DEV, ON_GPU  # noqa: F401  (sets TRITON_INTERPRET on the CPU)
import test_fp8_kernels  # noqa: F401  (on the CPU: the interpreter's float32 -> e4m3 rounding mended)

from zpp.models import llama
from zpp.models.quantization import fp8_linear as F8
from zpp.models.quantization.fp8_utils import FP8_DTYPE, FP8_MAX, quantize_per_channel
from zpp.models.layers.norm import GemmaRMSNorm
from zpp.models.quantization.fp8 import Fp8Params
from zpp.models.qwen3 import Qwen3Attention

CFG = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-5,
           num_hidden_layers=1, vocab_size=32)


def _fp8(layer, seed, **kw):
    torch.manual_seed(seed)
    w, ws = quantize_per_channel(torch.randn(layer.weight.shape) * 0.1)
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    layer.fp8 = Fp8Params(ws, **kw)


def _layer(attn=None, mlp=None, bias=False):
    layer = llama.LlamaDecoderLayer(CFG, 64, bias, attn=attn, mlp=mlp)
    for i, lin in enumerate((layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                             layer.mlp.down_proj)):
        _fp8(lin, i)
        if lin.bias is not None:
            lin.bias.data.normal_()
    for i, norm in enumerate((layer.input_layernorm, layer.post_attention_layernorm)):
        torch.manual_seed(10 + i)
        norm.weight.data = 1 + 0.3 * torch.randn(CFG["hidden_size"])
    return layer


def _cuda(m):
    return types.SimpleNamespace(is_cuda=True, shape=(m, CFG["hidden_size"]))


def test_which_layers_and_batches_fuse(monkeypatch):
    monkeypatch.setattr(F8, "_FP8_GEMV", True)
    monkeypatch.setattr(F8, "_FUSED_QUANT", True)
    layer = _layer()
    for m in (5, 64, 2048):                                                # past the GEMV's rows: the quantization
        assert layer.fuses_norm("attn", _cuda(m)) and layer.fuses_norm("mlp", _cuda(m))
    for m in (0, 1, 2, 3, 4):                                              # none, or the GEMV's: the norm alone
        assert not layer.fuses_norm("attn", _cuda(m)) and not layer.fuses_norm("mlp", _cuda(m))
    monkeypatch.setattr(F8, "_FUSED_QUANT", False)                         # ZPP_FP8_FUSED_QUANT=0
    for m in (1, 4, 5, 64):
        assert not layer.fuses_norm("attn", _cuda(m)) and not layer.fuses_norm("mlp", _cuda(m))
    monkeypatch.setattr(F8, "_FUSED_QUANT", True)
    assert not layer.fuses_norm("attn", torch.zeros(5, 64))                # the CPU
    qwen3 = _layer(attn=Qwen3Attention(CFG, 64, False))
    assert qwen3.fuses_norm("attn", _cuda(5))

    class Phi3Like(llama.LlamaAttention):                                  # a subclass not opted in
        pass

    class MoELike(torch.nn.Module):                                        # Mixtral's place: not a GatedMLP
        def __init__(self):
            super().__init__()
            self.gate_up_proj = layer.mlp.gate_up_proj

    other = llama.LlamaDecoderLayer(CFG, 64, False, attn=Phi3Like(CFG, 64, False), mlp=MoELike())
    other.self_attn.qkv_proj = layer.self_attn.qkv_proj
    assert not other.fuses_norm("attn", _cuda(5)) and not other.fuses_norm("mlp", _cuda(5))
    # the norm: LLaMA's only (not the float32-weight one, not Gemma's)
    layer.input_layernorm.weight_in_float32 = True
    assert not layer.fuses_norm("attn", _cuda(5))
    layer.post_attention_layernorm = GemmaRMSNorm(64)
    assert not layer.fuses_norm("mlp", _cuda(5))
    # the projection: per-channel FP8 weights with dynamic activation scales only
    fresh = _layer()
    ws = fresh.self_attn.qkv_proj.fp8.weight_scale
    fresh.self_attn.qkv_proj.fp8 = Fp8Params(ws, input_scale=torch.ones(1))
    assert not fresh.fuses_norm("attn", _cuda(5))
    fresh.self_attn.qkv_proj.fp8 = Fp8Params(ws, block=(16, 16))
    assert not fresh.fuses_norm("attn", _cuda(5))
    fresh.mlp.gate_up_proj.fp8 = None
    assert not fresh.fuses_norm("mlp", _cuda(5))
    # the switches: the W8A16 GEMV off (ZPP_FP8_GEMV=0: every batch quantized, so the norm fuses with
    # the quantization), and ZPP_FP8_FUSED_QUANT=0
    monkeypatch.setattr(F8, "_FP8_GEMV", False)
    assert _layer().fuses_norm("mlp", _cuda(1))
    monkeypatch.setattr(F8, "_FUSED_QUANT", False)
    assert not _layer().fuses_norm("mlp", _cuda(1))


@pytest.mark.slow  # the kernel under the Triton interpreter on the CPU
@pytest.mark.parametrize("attn_cls", [llama.LlamaAttention, Qwen3Attention])
@pytest.mark.parametrize("m", [1, 3, 4, 6])
def test_decoder_layer_fused_equals_unfused(monkeypatch, attn_cls, m):
    """One decoder layer (FP8 weights, qkv bias) with both norms fused into their projections' activation
    quantization against the same layer unfused, first layer (no residual) and later ones: m = 6 past
    the W8A16 GEMV's rows; m <= 4 the GEMV's, which run the norm unfused unless the GEMV is off
    (``ZPP_FP8_GEMV=0``, as here). On the CPU the layer's CUDA check is stood in and the kernel runs
    under the interpreter, the unfused layer on PyTorch's path (every W8A8 product, fused or not, in
    PyTorch's CPU ``_scaled_mm`` with bf16 out, as on the GPU)."""
    from zpp.models.layers.attention import build_attention_metadata
    layer = _layer(attn=attn_cls(CFG, 64, True) if attn_cls is Qwen3Attention else None, bias=True)
    hk, d, bs = 2, 16, 16
    torch.manual_seed(m)
    x = torch.randn(m, 64) * 2
    pos = torch.arange(m)
    resid = torch.randn(m, 64) * 3
    real = F8.fuses_norm
    monkeypatch.setattr(llama, "fuses_norm", lambda norm, lin, t: real(norm, lin, types.SimpleNamespace(
        is_cuda=True, shape=t.shape)))
    monkeypatch.setattr(F8, "_FP8_GEMV", True)
    monkeypatch.setattr(F8, "_FUSED_QUANT", True)
    if m <= 4:  # the W8A16 GEMV's batch: the norm runs on its own, unless the GEMV is off
        assert not layer.fuses_norm("attn", x) and not layer.fuses_norm("mlp", x)
        monkeypatch.setattr(F8, "_FP8_GEMV", False)

    # the unfused W8A8 layers as on the GPU: per-token quantization, then _scaled_mm (bf16 out)
    def gpu_like(x, w, p, bias=None):
        xf = x.float()
        xs = xf.abs().amax(1, keepdim=True).clamp_min(1e-10) / FP8_MAX
        xq = (xf * (1.0 / xs)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # as the kernels round
        return F8.fp8_linear_quantized(xq, xs, w, p, bias, x.dtype)
    monkeypatch.setattr(F8, "fp8_linear_reference", gpu_like)
    taken = []
    kernel = F8.rms_norm_fp8_linear
    monkeypatch.setattr(llama, "rms_norm_fp8_linear", lambda *a: taken.append(1) or kernel(*a))
    outs = {}
    for fused in (True, False):
        monkeypatch.setattr(F8, "_FUSED_QUANT", fused)
        for r in (None, resid):
            meta = build_attention_metadata([0], [m], [[0]], bs, torch.device("cpu"), 2)
            with torch.no_grad():
                outs[fused, r is None] = layer(pos, x, r, torch.zeros(2, 1, bs, hk, d), meta)
    assert len(taken) == 4                                                 # 2 norms x 2 calls, fused only
    # float32 noise of the norm's statistics; with the W8A8 products it moves a row's scale by an ulp,
    # which may flip a bf16 rounding of the products' output (one bf16 step)
    tol = 2 ** -8
    for first in (True, False):
        (y, res), (y_ref, res_ref) = outs[True, first], outs[False, first]
        # the residual after attention holds the attention's output
        assert ((res - res_ref).abs().max() / res_ref.abs().max()).item() < tol
        assert ((y - y_ref).abs().max() / y_ref.abs().max()).item() < tol
