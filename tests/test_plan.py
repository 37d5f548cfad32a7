"""``zpp plan`` and the fit check at start (``zpp.plan``): per-stage bytes against HF's own model on
the meta device, KV bytes per token, verdicts, the memory-aware split, bad input, and (slow) an
oversized model refused under an address-space limit and the plan against a real CPU start-up."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import pytest
import torch

from zpp.errors import ConfigError
from zpp.plan import Target, make_plan, parse_memory_list, plan_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "scripts", "configs")
GiB = 1 << 30
H100 = Target("cuda", (80 * GiB,), (9, 0))


def write_config(tmp_path, name: str, **cfg) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=1024, intermediate_size=2816,
             num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
             max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16")
QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=512, intermediate_size=1536,
                 moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[], vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, torch_dtype="bfloat16")
DEEPSEEK_V3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=512,
                   intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4, first_k_dense_replace=1,
                   num_attention_heads=8, num_key_value_heads=8, n_routed_experts=8, n_shared_experts=1,
                   num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                   scoring_func="sigmoid", topk_method="noaux_tc", q_lora_rank=192, kv_lora_rank=128,
                   qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, vocab_size=32000,
                   max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000, tie_word_embeddings=False,
                   torch_dtype="bfloat16")
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def hf_stage_bytes(model_dir: str, ranges, fp8_block=None) -> list[int]:
    """Independent count: HF transformers' own model for config.json on the meta device, its
    parameters split by HF's names (embedding on the first stage; final norm and LM head on the last).
    ``fp8_block``: the decoder layers' linear weights counted as FP8 (1 byte) plus float32 block scales."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(model_dir)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    linear = {f"{n}.weight" for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)}
    out = [0] * len(ranges)
    for name, p in hf.named_parameters(remove_duplicate=False):
        n = p.numel() * 2
        if fp8_block and name in linear and ".layers." in name and ".mlp.gate." not in name:
            bn, bk = fp8_block
            n = p.numel() + -(-p.shape[0] // bn) * -(-p.shape[1] // bk) * 4
        elif fp8_block and ".experts." in name and p.dim() == 3:  # fused routed experts [E, N, K]
            bn, bk = fp8_block
            n = p.numel() + p.shape[0] * -(-p.shape[1] // bn) * -(-p.shape[2] // bk) * 4
        if ".layers." in name:
            i = int(name.split(".layers.")[1].split(".")[0])
            out[next(s for s, (a, b) in enumerate(ranges) if a <= i < b)] += n
        elif "embed_tokens" in name:
            out[0] += n
        else:
            out[-1] += n
    return out


def assert_close(got: list[int], want: list[int], rel: float) -> None:
    for g, w in zip(got, want):
        assert abs(g - w) <= rel * w, (got, want)


@pytest.mark.parametrize("base,pp", [(LLAMA, 2), (LLAMA, 3), (QWEN3_MOE, 2), (DEEPSEEK_V3, 2)])
def test_bf16_stage_weights_match_hf_meta(tmp_path, base, pp):
    d = write_config(tmp_path, "m", **base)
    plan = make_plan(plan_config(d, pipeline_parallel_size=pp, dtype="bfloat16", max_model_len=1024), H100)
    ranges = [p.layers for p in plan.stages]
    assert ranges[0][0] == 0 and ranges[-1][1] == base["num_hidden_layers"]
    assert_close([p.weight_bytes for p in plan.stages], hf_stage_bytes(d, ranges), 0.02)
    for p in plan.stages:
        assert p.weight_bytes == sum(p.weight_bytes_by_dtype.values())
        assert p.weight_bytes_by_dtype.get("bfloat16", 0) > 0.95 * p.weight_bytes


def test_tied_head_counted_where_held(tmp_path):
    d = write_config(tmp_path, "m", **{**LLAMA, "tie_word_embeddings": True})
    plan = make_plan(plan_config(d, pipeline_parallel_size=2, dtype="bfloat16", max_model_len=1024), H100)
    embed = LLAMA["vocab_size"] * LLAMA["hidden_size"] * 2
    untied = make_plan(plan_config(write_config(tmp_path, "u", **LLAMA), pipeline_parallel_size=2, dtype="bfloat16",
                                   max_model_len=1024), H100)
    # Both stages hold the matrix (the first to embed, the last for its LM head), as untied.
    assert [p.weight_bytes for p in plan.stages] == [p.weight_bytes for p in untied.stages]
    assert plan.stages[-1].weight_bytes > embed


def test_fp8_block_config_fp8_on_9_0_bf16_on_8_0(tmp_path):
    d = write_config(tmp_path, "fp8", **{**LLAMA, "quantization_config": FP8_BLOCK})
    cfg = plan_config(d, pipeline_parallel_size=2, max_model_len=1024)
    hopper = make_plan(cfg, Target("cuda", (80 * GiB,), (9, 0)))
    ranges = [p.layers for p in hopper.stages]
    assert_close([p.weight_bytes for p in hopper.stages], hf_stage_bytes(d, ranges, fp8_block=(128, 128)), 0.03)
    assert all(p.weight_bytes_by_dtype.get("float8_e4m3fn", 0) > 0 for p in hopper.stages)
    ampere = make_plan(cfg, Target("cuda", (80 * GiB,), (8, 0)))
    assert_close([p.weight_bytes for p in ampere.stages], hf_stage_bytes(d, ranges), 0.03)
    assert all("float8_e4m3fn" not in p.weight_bytes_by_dtype for p in ampere.stages)


def test_fp8_block_moe_config_counts_experts_as_fp8_on_9_0(tmp_path):
    """DeepSeek-V3 (MLA, shared and routed experts) with its block FP8 config: on capability 9.0 the
    routed experts are held in e4m3 with their block scales, as the loader keeps them."""
    d = write_config(tmp_path, "dsv3fp8", **{**DEEPSEEK_V3, "quantization_config": FP8_BLOCK})
    cfg = plan_config(d, pipeline_parallel_size=2, max_model_len=1024)
    hopper = make_plan(cfg, Target("cuda", (80 * GiB,), (9, 0)))
    ranges = [p.layers for p in hopper.stages]
    assert_close([p.weight_bytes for p in hopper.stages], hf_stage_bytes(d, ranges, fp8_block=(128, 128)), 0.03)
    ampere = make_plan(cfg, Target("cuda", (80 * GiB,), (8, 0)))
    assert_close([p.weight_bytes for p in ampere.stages], hf_stage_bytes(d, ranges), 0.03)
    c = DEEPSEEK_V3  # the routed experts alone (3 MoE layers x 8 experts x gate, up, down) are e4m3
    routed = (c["num_hidden_layers"] - c["first_k_dense_replace"]) * c["n_routed_experts"] * 3 \
        * c["moe_intermediate_size"] * c["hidden_size"]
    assert sum(p.weight_bytes_by_dtype.get("float8_e4m3fn", 0) for p in hopper.stages) > routed


def test_quantization_fp8_flag_halves_linear_bytes(tmp_path):
    d = write_config(tmp_path, "m", **LLAMA)
    bf16 = make_plan(plan_config(d, dtype="bfloat16", max_model_len=1024), H100).stages[0]
    fp8 = make_plan(plan_config(d, dtype="bfloat16", quantization="fp8", max_model_len=1024), H100).stages[0]
    assert fp8.weight_bytes_by_dtype["float8_e4m3fn"] > 0
    assert 0.5 * bf16.weight_bytes < fp8.weight_bytes < 0.75 * bf16.weight_bytes


def test_kv_bytes_per_token_gqa_and_mla(tmp_path):
    d = write_config(tmp_path, "gqa", **LLAMA)
    hd = LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
    plan = make_plan(plan_config(d, pipeline_parallel_size=2, dtype="bfloat16", max_model_len=1024), H100)
    for p in plan.stages:  # K and V of every KV head, per layer
        assert p.kv_bytes_per_token == 2 * LLAMA["num_key_value_heads"] * hd * 2 * (p.layers[1] - p.layers[0])
    fp8 = make_plan(plan_config(d, dtype="bfloat16", kv_cache_dtype="fp8", max_model_len=1024), H100)
    assert fp8.stages[0].kv_bytes_per_token == 2 * LLAMA["num_key_value_heads"] * hd * LLAMA["num_hidden_layers"]
    tp = make_plan(plan_config(d, dtype="bfloat16", tensor_parallel_size=2, max_model_len=1024), H100)
    assert tp.stages[0].kv_bytes_per_token == 2 * 2 * hd * 2 * LLAMA["num_hidden_layers"]  # this rank's 2 heads
    m = write_config(tmp_path, "mla", **DEEPSEEK_V3)
    mla = make_plan(plan_config(m, dtype="bfloat16", max_model_len=1024), H100)
    latent = DEEPSEEK_V3["kv_lora_rank"] + DEEPSEEK_V3["qk_rope_head_dim"]  # one latent row per token and layer
    assert mla.stages[0].kv_bytes_per_token == latent * 2 * DEEPSEEK_V3["num_hidden_layers"]


def test_verdicts_and_smallest_split():
    d = os.path.join(CONFIGS, "llama3-70b")
    one = make_plan(plan_config(d), H100)  # 141 GB of bf16 weights on one 80 GiB card
    assert not one.fits and not one.stages[0].fits
    assert one.min_pipeline_parallel_size == 2 and one.to_json()["min_pipeline_parallel_size"] == 2
    assert one.min_tp_pp == (2, 1)  # two GPUs either way (TP 2 divides the 64 and 8 heads)
    two = make_plan(plan_config(d, pipeline_parallel_size=2), H100)
    assert two.fits and all(p.fits for p in two.stages) and two.min_pipeline_parallel_size == 2
    small = make_plan(plan_config(d, pipeline_parallel_size=2), Target("cuda", (24 * GiB,), (9, 0)))
    assert not small.fits and small.min_pipeline_parallel_size == 7
    assert all(p.kv_tokens > 0 for p in two.stages)


def test_mixed_80_and_24_gib_auto_gives_the_small_card_fewer_layers():
    for name, kw in (("llama3-8b", {}), ("llama3-70b", {"quantization": "fp8"})):
        cfg = plan_config(os.path.join(CONFIGS, name), pipeline_parallel_size=2, pp_layer_partition="auto", **kw)
        plan = make_plan(cfg, Target("cuda", parse_memory_list("80GiB,24GiB"), (9, 0)))
        (a0, b0), (a1, b1) = (p.layers for p in plan.stages)
        assert b1 - a1 < b0 - a0, (name, plan.stages)
        assert plan.fits
    # an even split of the 70B FP8 model does not fit the 24 GiB card
    even = make_plan(plan_config(os.path.join(CONFIGS, "llama3-70b"), pipeline_parallel_size=2, quantization="fp8"),
                     Target("cuda", parse_memory_list("80,24"), (9, 0)))
    assert even.stages[0].fits and not even.stages[1].fits


def test_start_up_auto_split_weighs_the_stages_gpu_memory():
    """The engine's ``--pp-layer-partition auto`` with the memory each GPU worker reports (StageCost):
    equally fast stages, 80 GiB and 24 GiB cards."""
    from zpp.engine.executor import Executor
    from zpp.transport import messages as m
    cfg = plan_config(os.path.join(CONFIGS, "llama3-8b"), pipeline_parallel_size=2, pp_layer_partition="auto")
    ex = Executor(cfg, set())
    usable = [int(80 * GiB * 0.9) - GiB, int(24 * GiB * 0.9) - GiB]
    big, small = ex._memory_aware_sizes(usable, [1e-3, 1e-3], [0.0, 0.0])
    assert small < big and big + small == 32
    assert ex._memory_aware_sizes([GiB, GiB], [1e-3, 1e-3], [0.0, 0.0]) is None  # nothing fits: time alone
    old = m.StageCost(rank=0, layer_s=[1.0], extra_s=0.0, num_tokens=4)  # CPU workers report no memory
    assert msgspec_roundtrip(old).memory_bytes == 0


def msgspec_roundtrip(msg):
    import msgspec

    from zpp.transport import messages as m
    return msgspec.msgpack.Decoder(m.StageCost).decode(msgspec.msgpack.encode(msg))


def test_json_has_exactly_the_issue_keys(capsys):
    from zpp.cli import main
    rc = main(["plan", os.path.join(CONFIGS, "llama3-8b"), "-pp", "2", "--gpu-memory", "80GiB", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert set(out) == {"fits", "min_pipeline_parallel_size", "stages"}
    assert out["fits"] is True and out["min_pipeline_parallel_size"] == 1  # 16 GB also fits one card
    for i, s in enumerate(out["stages"]):
        assert set(s) == {"stage", "layers", "weight_bytes", "weight_bytes_by_dtype", "kv_bytes_per_token",
                          "kv_tokens", "fits"}
        assert s["stage"] == i and isinstance(s["layers"], list) and len(s["layers"]) == 2
    assert out["stages"][0]["layers"] == [0, 16] and out["stages"][1]["layers"] == [16, 32]
    rc = main(["plan", os.path.join(CONFIGS, "llama3-70b"), "--gpu-memory", "80GiB"])
    text = capsys.readouterr().out
    assert rc == 3 and "fits: NO" in text and "-pp 2" in text


def test_a_kv_cache_short_of_max_model_len_is_named_with_the_length_that_fits(capsys):
    """gpt-oss-120b MXFP4 on one 80 GiB card: the weights fit, but the KV cache of its default
    131,072-token context does not; the verdict says so and names a --max-model-len that fits
    (that length then fits), not only a bigger split."""
    import re

    from zpp.cli import main
    model = os.path.join(CONFIGS, "gpt-oss-120b")
    rc = main(["plan", model, "--gpu-memory", "80GiB"])
    text = capsys.readouterr().out
    assert rc == 3 and "its KV cache holds" in text and "--max-model-len 131,072 sequence" in text, text
    room = int(re.search(r"--max-model-len ([0-9,]+) or less fits", text).group(1).replace(",", ""))
    assert 0 < room < 131072
    assert main(["plan", model, "--gpu-memory", "80GiB", "--max-model-len", str(room)]) == 0
    assert "fits: yes" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["no-config", "unknown-arch", "bad-size", "bad-count", "bad-capability",
                                  "too-long"])
def test_bad_input_is_one_line(tmp_path, capsys, case):
    from zpp.cli import main
    llama = os.path.join(CONFIGS, "llama3-8b")
    argv = {"no-config": ["plan", str(tmp_path)],
            "unknown-arch": ["plan", write_config(tmp_path, "x", architectures=["FooForCausalLM"], model_type="foo",
                                                  num_hidden_layers=2)],
            "bad-size": ["plan", llama, "--gpu-memory", "80GB,lots"],
            "bad-count": ["plan", llama, "-pp", "2", "--gpu-memory", "80,24,24"],
            "bad-capability": ["plan", llama, "--gpu-capability", "hopper"],
            "too-long": ["plan", llama, "--max-model-len", "9999999999"]}[case]  # as `zpp serve` refuses it
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("zpp: error:"), err
    word = {"no-config": "config.json", "unknown-arch": "FooForCausalLM", "bad-size": "lots",
            "bad-count": "--gpu-memory", "bad-capability": "--gpu-capability", "too-long": "--max-model-len"}[case]
    assert word in err


def test_fit_check_refuses_before_any_worker(monkeypatch):
    from zpp import plan as zplan
    from zpp.frontend.async_engine import validate_startup
    monkeypatch.setattr(zplan, "_cpu_target", lambda: Target("cpu", (24 * GiB,), None, shared=True))
    monkeypatch.setattr(zplan, "detect_target", lambda *a: zplan._cpu_target())
    from zpp.args import engine_config
    cfg = engine_config(os.path.join(CONFIGS, "llama3-70b"), load_format="dummy", device="cpu", streaming=False)
    with pytest.raises(ConfigError) as e:
        validate_startup(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("stage 0 ") and "24.00 GiB" in msg
    ok = engine_config(os.path.join(CONFIGS, "smollm2-135m"), load_format="dummy", device="cpu", streaming=False)
    validate_startup(ok)


def _limited(limit_bytes: int):
    def pre():
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    return pre


@pytest.mark.slow
def test_oversized_model_refused_in_one_line_under_an_address_space_limit(tmp_path):
    """``zpp serve`` on Llama-3-70B (282 GB of float32 weights on the CPU) under a 6 GiB address-space
    limit: one line, in seconds, a small peak."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    t = time.monotonic()
    # A fresh wrapper process runs the command and prints its child's peak RSS: this process's own
    # RUSAGE_CHILDREN holds the largest child any earlier test of the session waited for.
    wrap = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    proc = subprocess.run([sys.executable, "-c", wrap, sys.executable, "-m", "zpp.cli", "serve",
                           os.path.join(CONFIGS, "llama3-70b"), "--load-format", "dummy", "--device", "cpu",
                           "--port", "0"],
                          capture_output=True, text=True, env=env, timeout=120, preexec_fn=_limited(6 * GiB),
                          cwd=str(tmp_path))
    took = time.monotonic() - t
    peak_kib = int(proc.stdout.split()[-1])
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(err) == 1 and err[0].startswith("zpp: error: stage 0 ") and "smallest split" in err[0], proc.stderr
    assert took < 60
    assert peak_kib < 1.5 * GiB / 1024, peak_kib


@pytest.mark.slow
def test_plan_matches_what_a_cpu_start_up_allocates(tmp_path):
    """Each stage's planned bytes against the growth of a real start-up's resident memory when the
    worker's loader builds and fills that stage (random weights saved with transformers, read back
    from safetensors on the CPU; float32, so the linear layers are packed for oneDNN, which frees
    their dense copies), and the KV cache the model runner allocates against the plan's bytes per
    token. oneDNN's one-time set-up in a process (about 6 MiB: its code and kernels, whatever the
    model) happens before the measurement, as torch's import does: it is not the stage's memory."""
    d = write_config(tmp_path, "m", **{**LLAMA, "num_hidden_layers": 6, "hidden_size": 1024, "intermediate_size": 2816,
                                       "num_attention_heads": 16, "num_key_value_heads": 4})
    save = f"""
import torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained({d!r}), dtype=torch.float32).save_pretrained({d!r})
"""
    script = f"""
import json, os, sys, torch
from zpp.plan import Target, make_plan, plan_config
from zpp.models.base import StageInfo
from zpp.models.loader import load_stage_model
from zpp.models.registry import normalize_config
from zpp.workers.model_runner import ModelRunner
from zpp.utils.host_memory import available_bytes
plan = make_plan(plan_config({d!r}, pipeline_parallel_size=2, max_model_len=1024), Target("cpu", (available_bytes(),), None, shared=True))
hf = normalize_config(json.load(open(os.path.join({d!r}, "config.json"))))
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
from zpp.models.layers import cpu_linear
if torch.backends.mkldnn.is_available():
    cpu_linear.pack_weight(torch.zeros(64, 64))  # oneDNN's one-time set-up, outside the measurement
packed = []
out, keep = [], []
for p in plan.stages:
    a, b = p.layers
    before = rss()
    model = load_stage_model({d!r}, hf, StageInfo(p.stage, 2, a, b), torch.float32, torch.device("cpu"), 1024)
    grew = rss() - before
    packed.append(sum(m.packed_weight is not None for m in model.modules() if isinstance(m, cpu_linear.PackableWeight)))
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, 16, None, set(), max_model_len=1024, max_num_seqs=4)
    runner.init_kv_cache(64)
    kv = sum(t.numel() * t.element_size() for t in runner.kv_caches) // (65 * 16)
    out.append((p.weight_bytes, grew, p.kv_bytes_per_token, kv))
    keep.append((runner, model))  # alive, so the next stage cannot reuse its pages
print(json.dumps(packed), flush=True)
print(json.dumps(out), flush=True)
os._exit(0)  # the last stage's runner started a background import thread
"""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", save], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    packed, rows = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    if torch.backends.mkldnn.is_available():  # 3 layers x 4 linears, + the LM head on the last stage
        assert packed == [12, 13], packed
    for planned, grew, kv_plan, kv_real in rows:
        assert abs(grew - planned) <= 0.03 * planned, rows
        assert kv_plan == kv_real, rows
    print("planned bytes, resident growth, KV bytes per token planned, allocated:", rows)
