"""oneDNN-packed float32 linear layers on the CPU (``zpp.models.layers.cpu_linear``): the same product
as ``F.linear`` (to float32 rounding) for every row count a decode, verify or prefill step gives,
with and without bias, for the merged / row-parallel / LM-head modules; packed only where it
applies (float32 CPU weights; not with ``ZPP_CPU_ONEDNN_LINEAR=0``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zpp.models.layers import cpu_linear
from zpp.models.layers.linear import Linear, LMHead, MergedLinear, RowParallelLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch without oneDNN")


def _model(bias: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.ModuleDict({"a": Linear(64, 96, bias=bias), "b": MergedLinear(64, [32, 48], bias=bias),
                             "c": RowParallelLinear(64, 40, bias=bias), "h": LMHead(500, 64)})
    for p in m.parameters():
        p.data.normal_(0, 0.1)
    return m


@pytest.fixture(autouse=True)
def _onednn_on(monkeypatch):
    monkeypatch.setenv("ZPP_CPU_ONEDNN_LINEAR", "1")  # off by default


def test_packed_copy_not_used_once_the_weight_changed():
    """A packed module cast to bf16, or whose weight was written in place after packing, multiplies
    by its current weight (F.linear), not by the stale packed copy."""
    m = _model(True)
    assert cpu_linear.pack_cpu_linears(m) == 4
    x = torch.randn(3, 64)
    with torch.no_grad():
        m["a"].weight.mul_(2.0)
    torch.testing.assert_close(m["a"](x), F.linear(x, m["a"].weight, m["a"].bias), rtol=1e-5, atol=1e-5)
    b = m["b"].to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(b(xb), F.linear(xb, b.weight, b.bias))


@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear(bias):
    m = _model(bias)
    assert cpu_linear.pack_cpu_linears(m) == 4
    for rows in (0, 1, 2, 3, 4, 5, 6, 17, 300):
        x = torch.randn(rows, 64)
        for name, mod in m.items():
            assert mod.packed_weight is not None
            ref = F.linear(x, mod.weight, mod.bias)
            out = mod(x)
            assert out.shape == ref.shape and out.dtype == torch.float32
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"{name}, {rows} rows")


def test_non_contiguous_input():
    m = _model(True)
    cpu_linear.pack_cpu_linears(m)
    x = torch.randn(5, 100)[:, 10:74]
    torch.testing.assert_close(m["a"](x), F.linear(x, m["a"].weight, m["a"].bias), rtol=1e-5, atol=1e-5)


def test_not_packed_off_or_other_dtype(monkeypatch):
    monkeypatch.delenv("ZPP_CPU_ONEDNN_LINEAR", raising=False)  # off by default
    assert cpu_linear.pack_cpu_linears(_model(False)) == 0
    monkeypatch.setenv("ZPP_CPU_ONEDNN_LINEAR", "0")
    assert cpu_linear.pack_cpu_linears(_model(False)) == 0
    monkeypatch.setenv("ZPP_CPU_ONEDNN_LINEAR", "1")
    m = _model(False).to(torch.bfloat16)
    assert cpu_linear.pack_cpu_linears(m) == 0
    assert all(mod.packed_weight is None for mod in m.values())


def test_loaded_demo_stage_is_packed(demo_model, monkeypatch):
    """With ``ZPP_CPU_ONEDNN_LINEAR=1`` a float32 CPU stage of the demo model comes out of the loader
    with its linear layers packed."""
    monkeypatch.setenv("ZPP_CPU_ONEDNN_LINEAR", "1")
    import json
    import os

    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    cfg = json.load(open(os.path.join(demo_model, "config.json")))
    model = load_stage_model(demo_model, cfg, StageInfo(pp_rank=1, pp_size=2, layer_start=28, layer_end=30),
                             torch.float32, torch.device("cpu"), 64)
    packed = [n for n, mod in model.named_modules() if getattr(mod, "packed_weight", None) is not None]
    assert "lm_head" in packed and any(n.endswith("qkv_proj") for n in packed)
