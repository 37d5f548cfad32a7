"""What zpp checks of a checkpoint before any weight loads: its tensor names against the stage's
parameters (read from the safetensors headers, before any tensor is read or copied), and its
quantization method."""
from __future__ import annotations

import json
import os
import shutil

import pytest

VOCAB = 49152


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory):
    """A tiny random LLaMA saved by HF in several safetensors files (with the index)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    out = str(tmp_path_factory.mktemp("sharded-llama"))
    LlamaForCausalLM(cfg).save_pretrained(out, max_shard_size="200KB")
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) > 2 and os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    return out


def _load(model_dir: str, pp_rank: int = 0, pp_size: int = 1):
    import torch

    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    from zpp.models.partition import partition_layers
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    start, end = partition_layers(cfg["num_hidden_layers"], pp_size)[pp_rank]
    return load_stage_model(model_dir, cfg, StageInfo(pp_rank, pp_size, start, end), torch.float32,
                            torch.device("cpu"), 64)


def _rename_in_last_file(src: str, dst: str) -> tuple[str, str]:
    """Copy ``src`` to ``dst`` with one layer tensor of its last file renamed; (old, new) name."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    last = sorted(f for f in os.listdir(dst) if f.endswith(".safetensors"))[-1]
    tensors = load_file(os.path.join(dst, last))
    old = next(k for k in sorted(tensors) if ".layers." in k)
    new = old.replace(".weight", ".weights")
    tensors[new] = tensors.pop(old)
    save_file(tensors, os.path.join(dst, last))
    return old, new


@pytest.mark.slow
def test_misnamed_tensor_refused_before_any_copy(sharded_llama, tmp_path, monkeypatch):
    """A tensor misnamed in the checkpoint's last file is refused in one line naming it (and the
    parameter left without a tensor) before a single tensor is copied: copying (load_weights) and
    reading tensor data (get_tensor) are spied on and must never be reached; the same spies do fire
    for the intact checkpoint, so they would catch a copy."""
    import safetensors

    from zpp.models.base import StageModel
    bad = str(tmp_path / "bad")
    old, new = _rename_in_last_file(sharded_llama, bad)
    reads = []
    real_open = safetensors.safe_open

    class SpyOpen:
        def __init__(self, *a, **kw):
            self.f = real_open(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            reads.append(name)
            return self.f.get_tensor(name)

    def no_copy(self, weights):
        raise AssertionError("load_weights reached: tensors would be copied")

    monkeypatch.setattr(safetensors, "safe_open", SpyOpen)
    monkeypatch.setattr(StageModel, "load_weights", no_copy)
    with pytest.raises(ValueError) as info:
        _load(bad)
    msg = str(info.value)
    assert "\n" not in msg and f"unexpected checkpoint tensors for this model: {new}" in msg
    assert f"missing tensors: {old}" in msg
    assert reads == []
    with pytest.raises(AssertionError, match="load_weights reached"):
        _load(sharded_llama)  # the spy is live: an intact checkpoint gets to the copy
    monkeypatch.undo()
    _load(sharded_llama)  # and loads


@pytest.mark.slow
def test_missing_tensor_of_another_stage_is_not_this_stages_business(sharded_llama, tmp_path):
    """The check covers only what the stage owns: a stage that does not hold the renamed layer loads."""
    bad = str(tmp_path / "bad")
    old, _ = _rename_in_last_file(sharded_llama, bad)
    layer = int(old.split(".layers.")[1].split(".")[0])
    owner = 0 if layer < 2 else 1
    with pytest.raises(ValueError, match="missing tensors"):
        _load(bad, owner, 2)
    _load(bad, 1 - owner, 2)


# --- quantized checkpoints ------------------------------------------------------------------------
QUANT_METHODS = {  # quantization_config as HF writes it -> the method named in the refusal
    "hqq": {"quant_method": "hqq", "nbits": 4},
    "gptq": {"quant_method": "gptq", "bits": 8, "group_size": 128},    # 4-bit GPTQ / AWQ / MXFP4 load: test_w4.py
    "awq": {"quant_method": "awq", "bits": 4, "version": "gemv"},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
}


def test_quantized_checkpoints_refused_for_every_family():
    """Every supported architecture refuses each quantization method zpp cannot load (FP8 loads:
    tests/models/test_fp8.py) in one line naming the method and the architecture, before looking at the
    rest of the config."""
    from zpp.errors import ConfigError
    from zpp.models.registry import resolve_model_class, supported_architectures
    for arch in supported_architectures():
        for method, q in QUANT_METHODS.items():
            with pytest.raises(ConfigError) as info:
                resolve_model_class({"architectures": [arch], "quantization_config": q})
            msg = str(info.value)
            assert "\n" not in msg and arch in msg and f"quant_method {method!r}" in msg, msg


def test_quantized_checkpoint_refused_before_any_worker(tmp_path):
    """Through the offline API: a ConfigError at start-up, nothing started (no weights read: the
    directory holds none)."""
    from transformers import Phi3Config

    from helpers import alive, descendants
    from zpp import LLM
    from zpp.errors import ConfigError
    cfg = {**Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4).to_dict(),
           "architectures": ["Phi3ForCausalLM"], "quantization_config": QUANT_METHODS["hqq"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    before = {p for p in descendants(os.getpid()) if alive(p)}
    with pytest.raises(ConfigError, match="Phi3ForCausalLM: quantized checkpoint .*'hqq'"):
        LLM(str(tmp_path), pipeline_parallel_size=2)
    assert {p for p in descendants(os.getpid()) if alive(p)} <= before
