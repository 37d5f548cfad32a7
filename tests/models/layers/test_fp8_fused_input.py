"""The gated MLP's FP8 down projection fed an input its producer already quantized
(``RowParallelLinear.forward_fp8_input``, after ``fp8_kernels.silu_mul_quant`` on CUDA): the same
product as the layer quantizing its input itself, and the rule for when a producer may
(``fp8.fuses_input_quant``). On the CPU: PyTorch's ``_scaled_mm`` runs the row-wise FP8 product."""
import types

import torch

from zpp.models.quantization import fp8_linear as F8
from zpp.models.quantization.fp8_utils import FP8_DTYPE, FP8_MAX, quantize_per_channel
from zpp.models.layers.linear import RowParallelLinear
from zpp.models.quantization.fp8 import Fp8Params


def _fp8_layer(n, k, seed=0):
    torch.manual_seed(seed)
    layer = RowParallelLinear(k, n, bias=True)
    w, ws = quantize_per_channel(torch.randn(n, k) * 0.05)
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    layer.bias.data.normal_()
    layer.fp8 = Fp8Params(ws)
    return layer


def test_prequantized_input_gives_the_layers_own_product():
    layer = _fp8_layer(48, 160)
    x = torch.randn(7, 160, dtype=torch.bfloat16) * 2
    xf = x.float()
    xs = xf.abs().amax(1, keepdim=True) / FP8_MAX
    xq = (xf / xs).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    got = layer.forward_fp8_input(xq, xs, torch.bfloat16)
    want = F8.fp8_linear_reference(x, layer.weight, layer.fp8, layer.bias)  # quantizes x the same way
    assert got.dtype == torch.bfloat16 and got.shape == (7, 48)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    # the scales are applied, not ignored: a wrong one shows
    wrong = layer.forward_fp8_input(xq, xs * 2, torch.bfloat16)
    assert (wrong.float() - want.float()).abs().max() > 0.5


def test_who_may_hand_over_a_quantized_input():
    ws = torch.ones(8)
    cuda = types.SimpleNamespace(is_cuda=True)
    cpu = types.SimpleNamespace(is_cuda=False)
    assert F8.fuses_input_quant(Fp8Params(ws), 5, cuda)
    assert F8.fuses_input_quant(Fp8Params(ws), 4096, cuda)
    assert not F8.fuses_input_quant(Fp8Params(ws), 4, cuda)                 # W8A16 GEMV: bf16 input
    assert not F8.fuses_input_quant(Fp8Params(ws), 5, cpu)
    assert not F8.fuses_input_quant(None, 5, cuda)                          # not an FP8 layer
    assert not F8.fuses_input_quant(Fp8Params(ws, block=(128, 128)), 5, cuda)  # per-group scales
    assert not F8.fuses_input_quant(Fp8Params(ws, input_scale=torch.ones(1)), 5, cuda)  # static scale
