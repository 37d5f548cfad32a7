"""oneDNN-packed float32 linear layers on the CPU (``zpp.models.layers.cpu_linear``, on by default): the
same product as ``F.linear`` (to float32 rounding) for every row count a decode, verify or prefill
step gives, with and without bias, for the merged / row-parallel / LM-head modules; packed only where
it applies (float32 CPU weights; not with ``ZPP_CPU_ONEDNN_LINEAR=0``); the packed weight replaces the
dense one (one copy in memory), and the readers that need dense values get them back."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from zpp.models.layers import cpu_linear
from zpp.models.layers.cpu_linear import dense_weight
from zpp.models.layers.linear import Linear, LMHead, MergedLinear, RowParallelLinear
from zpp.models.weight_bytes import weight_bytes_by_dtype

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch without oneDNN")


def _model(bias: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.ModuleDict({"a": Linear(64, 96, bias=bias), "b": MergedLinear(64, [32, 48], bias=bias),
                             "c": RowParallelLinear(64, 40, bias=bias), "h": LMHead(500, 64)})
    for p in m.parameters():
        p.data.normal_(0, 0.1)
    return m


@pytest.fixture(autouse=True)
def _default_setting(monkeypatch):
    monkeypatch.delenv("ZPP_CPU_ONEDNN_LINEAR", raising=False)  # on by default


def test_packing_replaces_the_dense_weight():
    """After packing, each module's ``weight`` parameter is the packed tensor (same shape and dtype,
    the loader's byte count unchanged), the dense tensor it replaced is freed, and ``dense_weight``
    gives back exactly the values that were loaded; the weight loader stays on the parameter."""
    m = _model(True)
    before = {k: mod.weight.detach().clone() for k, mod in m.items()}
    bytes_before = weight_bytes_by_dtype(m)
    old = {k: weakref.ref(mod.weight) for k, mod in m.items()}
    assert cpu_linear.pack_cpu_linears(m) == 4
    gc.collect()
    for k, mod in m.items():
        assert old[k]() is None, f"{k}: the dense weight is still alive"
        assert mod.weight.is_mkldnn and mod.packed_weight is mod.weight and not mod.weight.requires_grad
        assert mod.weight.shape == before[k].shape and mod.weight.dtype == torch.float32
        assert callable(getattr(mod.weight, "weight_loader", None))
        assert torch.equal(dense_weight(mod), before[k])
    assert weight_bytes_by_dtype(m) == bytes_before
    assert [n for n, _ in m.named_parameters()] == ["a.weight", "a.bias", "b.weight", "b.bias", "c.weight",
                                                     "c.bias", "h.weight"]


def test_dense_readers_get_the_dense_weight_back():
    """``state_dict()`` holds dense weights equal to the unpacked ones; ``.to(bfloat16)`` and
    ``load_state_dict`` unpack a module, which then multiplies by its (new) dense weight."""
    m = _model(True)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    cpu_linear.pack_cpu_linears(m)
    packed_sd = m.state_dict()
    assert packed_sd.keys() == sd.keys()
    assert all(not v.is_mkldnn and torch.equal(v, sd[k]) for k, v in packed_sd.items())
    x = torch.randn(3, 64)
    b = m["b"].to(torch.bfloat16)
    assert b.packed_weight is None and b.weight.dtype == torch.bfloat16 and not b.weight.is_mkldnn
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(b(xb), F.linear(xb, b.weight, b.bias))
    new = {k: torch.randn_like(v) for k, v in sd.items()}
    m.load_state_dict(new)
    for k in ("a", "c", "h"):
        assert m[k].packed_weight is None and torch.equal(m[k].weight, new[f"{k}.weight"])
    torch.testing.assert_close(m["a"](x), F.linear(x, new["a.weight"], new["a.bias"]))


def test_in_place_write_acts_on_the_packed_weight():
    """An elementwise in-place write to a packed weight changes what ``forward`` multiplies by."""
    m = _model(True)
    w = m["a"].weight.detach().clone()
    cpu_linear.pack_cpu_linears(m)
    with torch.no_grad():
        m["a"].weight.mul_(2.0)
    x = torch.randn(3, 64)
    torch.testing.assert_close(m["a"](x), F.linear(x, 2 * w, m["a"].bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear(bias):
    m = _model(bias)
    dense = {k: mod.weight.detach().clone() for k, mod in m.items()}
    assert cpu_linear.pack_cpu_linears(m) == 4
    for rows in (0, 1, 2, 3, 4, 5, 6, 17, 300):
        x = torch.randn(rows, 64)
        for name, mod in m.items():
            assert mod.packed_weight is not None
            ref = F.linear(x, dense[name], mod.bias)
            out = mod(x)
            assert out.shape == ref.shape and out.dtype == torch.float32
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"{name}, {rows} rows")


def test_non_contiguous_input():
    m = _model(True)
    w = m["a"].weight.detach().clone()
    cpu_linear.pack_cpu_linears(m)
    x = torch.randn(5, 100)[:, 10:74]
    torch.testing.assert_close(m["a"](x), F.linear(x, w, m["a"].bias), rtol=1e-5, atol=1e-5)


def test_not_packed_off_other_dtype_or_read_outside_forward(monkeypatch):
    """Off with ``ZPP_CPU_ONEDNN_LINEAR=0``; never for bf16 weights, a layer marked ``fp8_allowed =
    False`` or named like DeepSeek's ``kv_b_proj`` (the family reads those weights itself)."""
    monkeypatch.setenv("ZPP_CPU_ONEDNN_LINEAR", "0")
    assert cpu_linear.pack_cpu_linears(_model(False)) == 0
    monkeypatch.delenv("ZPP_CPU_ONEDNN_LINEAR")
    m = _model(False).to(torch.bfloat16)
    assert cpu_linear.pack_cpu_linears(m) == 0
    assert all(mod.packed_weight is None for mod in m.values())
    m = _model(False)
    m["kv_b_proj"] = MergedLinear(64, [32])
    m["a"].fp8_allowed = False
    assert cpu_linear.pack_cpu_linears(m) == 3
    assert m["kv_b_proj"].packed_weight is None and m["a"].packed_weight is None


def test_shared_weight_packed_once():
    """Two modules holding one weight parameter hold one packed parameter after packing."""
    m = _model(False)
    m["h2"] = LMHead(500, 64)
    m["h2"].weight = m["h"].weight
    assert cpu_linear.pack_cpu_linears(m) == 5
    assert m["h2"].weight is m["h"].weight and m["h"].weight.is_mkldnn


def test_loaded_demo_stage_is_packed(demo_model):
    """A float32 CPU stage of the demo model comes out of the loader with its linear layers packed,
    holding the bytes the plan counts on the meta device; loading its weights again gives the
    dense weights back, with the same product."""
    import json
    import os

    from zpp.models.base import StageInfo
    from zpp.models.loader import iter_safetensors, load_stage_model
    cfg = json.load(open(os.path.join(demo_model, "config.json")))
    info = StageInfo(pp_rank=1, pp_size=2, layer_start=28, layer_end=30)
    model = load_stage_model(demo_model, cfg, info, torch.float32, torch.device("cpu"), 64)
    packed = [n for n, mod in model.named_modules() if getattr(mod, "packed_weight", None) is not None]
    assert "lm_head" in packed and any(n.endswith("qkv_proj") for n in packed)
    meta = load_stage_model(demo_model, cfg, info, torch.float32, torch.device("meta"), 64)
    assert weight_bytes_by_dtype(model) == weight_bytes_by_dtype(meta)
    h = torch.randn(2, model.hidden_size)
    logits = model.compute_logits(h)
    model.load_weights(iter_safetensors(demo_model, model))
    assert model.lm_head.packed_weight is None and not model.lm_head.weight.is_mkldnn
    torch.testing.assert_close(model.compute_logits(h), logits, rtol=1e-5, atol=1e-5)
