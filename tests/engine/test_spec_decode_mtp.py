"""Speculative decoding with MTP (``--speculative-config '{"method": "mtp", ...}'``) on a tiny random
DeepSeek-V3 whose checkpoint carries a multi-token-prediction layer (``model.layers.{N}.*``, written
here in the released checkpoints' layout): greedy outputs equal those without speculation at
PP = 1, 2, 3 (also under forced preemption, with prefix caching and small chunks); the drafts the
last stage makes equal an HF-style reference of the MTP module (the DeepSeek-V3 paper's equations
on HF transformers' own decoder layer, teacher-forced) at every accepted length; an MTP-less
checkpoint is refused at start in one line; ``zpp plan`` counts the MTP layer on the last stage."""
from __future__ import annotations

import os
import random
import shutil

import pytest

VOCAB = 49152  # SmolLM2's tokenizer
K = 3


def _hf_config():
    from transformers import DeepseekV3Config
    return DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
                            v_head_dim=24, max_position_embeddings=512, initializer_range=0.3, num_hidden_layers=3,
                            q_lora_rank=32, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
                            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                            num_nextn_predict_layers=1, bos_token_id=1, eos_token_id=2)


def _mtp_tensors(cfg, seed: int) -> dict:
    """The MTP layer's tensors as DeepSeek releases them: HF's own decoder layer ``N`` (MLA + MoE),
    ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.{norm,head}`` and a copy of the embedding."""
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
    n = cfg.num_hidden_layers
    torch.manual_seed(seed)
    layer = DeepseekV3DecoderLayer(cfg, layer_idx=n).float()
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            t = torch.randn(t.shape, generator=g) * 0.3
        elif t.dim() == 1:
            t = 1 + 0.1 * torch.randn(t.shape, generator=g)
        else:
            t = torch.randn(t.shape, generator=g) * 0.3
        out[f"model.layers.{n}.{name}"] = t.contiguous()
    H = cfg.hidden_size
    for part in ("enorm", "hnorm", "shared_head.norm"):
        out[f"model.layers.{n}.{part}.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    out[f"model.layers.{n}.eh_proj.weight"] = torch.randn(H, 2 * H, generator=g) * 0.2
    out[f"model.layers.{n}.shared_head.head.weight"] = torch.randn(VOCAB, H, generator=g) * 0.3
    return out


def _save(out_dir: str, demo_model: str, mtp: bool = True) -> str:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM
    cfg = _hf_config()
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, t in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                t.normal_(0.0, 0.3)
    model.save_pretrained(out_dir)
    if mtp:
        path = os.path.join(out_dir, "model.safetensors")
        tensors = load_file(path)
        extra = _mtp_tensors(cfg, 1)
        extra[f"model.layers.{cfg.num_hidden_layers}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        save_file({**tensors, **extra}, path, metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(demo_model, f)):
            shutil.copy(os.path.join(demo_model, f), out_dir)
    return out_dir


def _make_predictable(model_dir: str, scale: float) -> None:
    """Rewrite a checkpoint of :func:`_save` so that MTP drafts are often right: every layer's output
    projections (``o_proj``, the MLPs' and experts' ``down_proj``) times ``scale``, so the next token
    is mostly a function of the current one (a bigram), and the MTP layer mostly passes the embedding
    of the token after its position through (``eh_proj`` = ``[I | 0]`` plus noise) to the main model's
    norm and head: it predicts that bigram one token further. The layers still move every hidden state."""
    import torch
    from safetensors.torch import load_file, save_file
    path = os.path.join(model_dir, "model.safetensors")
    t = load_file(path)
    n, H = _hf_config().num_hidden_layers, _hf_config().hidden_size
    for k in list(t):
        if k.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            t[k] = t[k] * scale
    g = torch.Generator().manual_seed(3)
    t[f"model.layers.{n}.eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], 1) + \
        0.005 * torch.randn(H, 2 * H, generator=g)
    t[f"model.layers.{n}.enorm.weight"] = torch.ones(H)
    t[f"model.layers.{n}.shared_head.norm.weight"] = t["model.norm.weight"].clone()
    t[f"model.layers.{n}.shared_head.head.weight"] = t["lm_head.weight"].clone()
    save_file(t, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory, demo_model) -> str:
    return _save(str(tmp_path_factory.mktemp("v3_mtp")), demo_model)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    base = [rng.randrange(3, VOCAB) for _ in range(60)]
    # two share a 48-token prefix (prefix caching), one repeats itself, lengths 5 .. 61
    return [base[:53], base[:48] + [rng.randrange(3, VOCAB) for _ in range(13)], [rng.randrange(3, VOCAB) for _ in range(5)],
            base[:6] * 3, [rng.randrange(3, VOCAB) for _ in range(21)]]


# --- the engine: outputs equal, every pipeline size ---------------------------------------------------
@pytest.fixture(scope="module")
def predictable_model(tmp_path_factory, mtp_model) -> str:
    """:func:`_make_predictable` of the random checkpoint (about 60% of first drafts right)."""
    d = str(tmp_path_factory.mktemp("v3_mtp_pred"))
    shutil.copytree(mtp_model, d, dirs_exist_ok=True)
    _make_predictable(d, 0.003)
    return d


@pytest.mark.slow
def test_mtp_outputs_equal_without_at_pp_1_2_3(predictable_model):
    """Greedy token ids with MTP drafts equal those without (HF's greedy ids, which zpp's equal:
    tests/models/test_models_deepseek.py) at PP = 1 (in process: the same scheduler and last-stage
    runner without worker processes), 3 and 2; at PP=2 also with prefix caching, a KV cache small
    enough to preempt and 24-token micro-batches (chunked prompts, drafts cut to the budget). Drafts
    are accepted, and at PP=3 exactly as many as at PP=1: a draft is a function of the request's
    tokens alone, so the last stage of a pipeline must draft what one stage drafts (its hidden
    states, its MTP KV from the earlier micro-batches, its copy of the embedding)."""
    from helpers import hf_greedy
    from zpp import LLM, SamplingParams
    from zpp.engine.spec_decode import SpecDecoder
    from zpp.spec_config import SpeculativeConfig
    prompts = _prompts()
    lens = (14, 10, 16, 12, 9)
    base = [g[:n] for g, n in zip(hf_greedy(predictable_model, prompts, max(lens)), lens)]
    one = SpecDecoder(SpeculativeConfig("mtp", 2))
    got, _ = _in_process(predictable_model, one, prompts, lens)
    assert got == base, "PP=1"
    assert one.num_accepted_tokens > 0.3 * one.num_draft_tokens, vars(one)
    print(f"PP=1 k=2: {one.num_drafts} drafts, {one.num_draft_tokens} draft tokens, {one.num_accepted_tokens} "
          f"accepted, per position {one.accepted_per_pos}, mean acceptance length {one.mean_acceptance_length:.2f}")
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    for pp, k, kw in ((3, 2, {}), (2, K, dict(enable_prefix_caching=True, num_kv_blocks=12, block_size=16,
                                                max_num_batched_tokens=24))):
        with LLM(predictable_model, device="cpu", max_model_len=256, pipeline_parallel_size=pp,
                 speculative_config={"method": "mtp", "num_speculative_tokens": k}, **kw) as llm:
            outs = llm.generate(prompts, sp, use_tqdm=False)
            st = llm.engine.stats()
            assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks, "blocks leaked"
        assert [list(o.outputs[0].token_ids) for o in outs] == base, f"PP={pp}"
        assert sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens > 0, (pp, st)
        print(f"PP={pp} k={k}: {st.spec_num_drafts} drafts, {st.spec_num_draft_tokens} draft tokens, "
              f"{st.spec_num_accepted_tokens} accepted, per position {st.spec_accepted_per_pos}")
        if kw:
            assert st.num_preemptions > 0 and st.prefix_cache_hits > 0, st
        else:
            assert (st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens,
                    st.spec_accepted_per_pos) == (one.num_drafts, one.num_draft_tokens, one.num_accepted_tokens,
                                                  one.accepted_per_pos)


# --- the drafts themselves, in-process: the real scheduler and the last stage's runner, no processes ---
class _Reference:
    """The MTP module from the DeepSeek-V3 paper's equations on HF transformers' own
    ``DeepseekV3DecoderLayer`` (eager PyTorch, causal SDPA, HF's rotary tables) and the checkpoint's
    weights; the main model's hidden states from HF's ``DeepseekV3ForCausalLM`` (after its final norm)."""

    def __init__(self, model_dir: str):
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        cfg = self.hf.config
        cfg._attn_implementation = "sdpa"
        n = cfg.num_hidden_layers
        w = {k[len(f"model.layers.{n}."):]: v for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()
             if k.startswith(f"model.layers.{n}.")}
        self.layer = DeepseekV3DecoderLayer(cfg, layer_idx=n).float().eval()
        self.layer.load_state_dict({k: v for k, v in w.items() if k.split(".")[0] in (
            "self_attn", "mlp", "input_layernorm", "post_attention_layernorm")})
        self.w, self.eps = w, cfg.rms_norm_eps

    def _norm(self, x, name):
        import torch
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[f"{name}.weight"]

    def main_hidden(self, seq):
        import torch
        with torch.no_grad():
            return self.hf.model(torch.tensor([seq])).last_hidden_state[0]

    def mtp(self, next_ids, prev):
        """Rows at positions 0 .. m-1: ``next_ids [m]`` (the token after each), ``prev [m, H]`` -> the
        normed outputs ``[m, H]`` and their argmax tokens ``[m]``."""
        import torch
        with torch.no_grad():
            e = self._norm(self.hf.model.embed_tokens(torch.tensor(next_ids)), "enorm")
            x = torch.cat([e, self._norm(prev, "hnorm")], -1) @ self.w["eh_proj.weight"].T
            pos = torch.arange(len(next_ids))[None]
            y = self.layer(x[None], position_ids=pos, position_embeddings=self.hf.model.rotary_emb(x[None], pos))
            y = self._norm((y[0] if isinstance(y, tuple) else y)[0], "shared_head.norm")
            return y, (y @ self.w["shared_head.head.weight"].T).argmax(-1).tolist()


def _in_process(model_dir: str, spec, prompts, lens, runner=None):
    """PP=1 without worker processes: the real scheduler (16-token micro-batches: chunked prompts),
    KV block manager (4-token blocks, prefix caching, the MTP lookahead) and the last stage's
    ModelRunner with its MTP drafter; request 1 is added once request 0 has a token (it shares its
    cached prefix). Returns the greedy ids of every request and the runner (reused when given)."""
    import json

    import torch

    from zpp import SamplingParams
    from zpp.engine.kv_cache_manager import KVCacheManager
    from zpp.engine.request import Request
    from zpp.engine.scheduler import Scheduler
    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    from zpp.spec_config import stage_model_config
    from zpp.workers.model_runner import ModelRunner
    from zpp.workers.mtp import MTPDrafter
    if runner is None:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        L = cfg["num_hidden_layers"]
        model = load_stage_model(model_dir, stage_model_config(cfg, spec.config), StageInfo(0, 1, 0, L),
                                 torch.float32, torch.device("cpu"), 256)
        runner = ModelRunner(model, torch.device("cpu"), torch.float32, 4, None, set(), max_model_len=256,
                             max_num_seqs=8)
        runner.init_kv_cache(160)
        assert len(runner.kv_caches) == L + 1  # the MTP layer's own latent cache
    runner.forget_requests()
    runner.mtp = MTPDrafter(runner, spec.k)
    kv = KVCacheManager(160, 4, enable_prefix_caching=True)
    spec.setup_kv(kv, 256)
    sched = Scheduler(kv, 8, 16, 256, spec=spec)

    def add(i):
        sched.add_request(Request(str(i), prompts[i], SamplingParams(temperature=0, max_tokens=lens[i],
                                                                     ignore_eos=True), lens[i], {2}))
    for i in range(len(prompts)):
        if i != 1:
            add(i)
    outs = {}
    while sched.has_work() or 1 not in outs:
        if 0 in outs and 1 not in outs and "1" not in sched.requests:
            add(1)
        b = sched.schedule()
        res = runner.execute(b.batch)
        for req, _, tok in sched.update(b, res):
            if tok >= 0:
                outs.setdefault(int(req.req_id), []).append(tok)
        sched.release_finished(list(b.reqs))
    assert kv.prefix_hits > 0 and kv.num_free_blocks == kv.num_blocks
    return [outs[i] for i in range(len(prompts))], runner


@pytest.mark.slow
def test_mtp_drafts_equal_reference_at_every_accepted_length(mtp_model):
    """PP=1 in process (:func:`_in_process`): with the MTP layer's own drafts the greedy ids equal
    HF's (without speculation). Then the drafts themselves, step after step: draft 1 is the reference
    MTP module's prediction at the request's last position given the true sequence (teacher-forced),
    and drafts 2 .. k the reference chained on its own outputs -- whatever number of drafts the step
    before accepted: the scheduler is fed drafts that are the true continuation up to a chosen point
    (0 .. k accepted in turn), so the MTP layer runs after every accepted length."""
    import torch

    from helpers import hf_greedy
    from zpp.engine.spec_decode import SpecDecoder
    from zpp.spec_config import SpeculativeConfig

    prompts, lens = _prompts()[:3], [14] * 3
    truth = hf_greedy(mtp_model, prompts, 14)
    spec_cfg = SpeculativeConfig("deepseek_mtp", K)
    assert spec_cfg.method == "mtp"
    plain = SpecDecoder(spec_cfg)
    got, runner = _in_process(mtp_model, plain, prompts, lens)
    assert got == truth and plain.num_draft_tokens > 0
    records = []

    class Oracle(SpecDecoder):  # drafts: the true continuation, its first `a` right, then wrong
        turn = 0

        def propose(self, req, max_model_len, rope_switch_len=None, budget=1 << 30):
            k = min(self.k, req.max_tokens - req.num_output_tokens - 1, budget)
            if k < 1:
                return []
            cont = truth[int(req.req_id)][req.num_output_tokens:req.num_output_tokens + k]
            a, Oracle.turn = Oracle.turn % (k + 1), Oracle.turn + 1
            return [t if i < a else (t + 1) % VOCAB for i, t in enumerate(cont)]

        def store_drafts(self, req, drafts):
            records.append((int(req.req_id), req.num_tokens, list(drafts)))

    oracle = Oracle(spec_cfg)
    assert _in_process(mtp_model, oracle, prompts, lens, runner)[0] == truth and oracle.num_accepted_tokens > 0
    ref = _Reference(mtp_model)
    checked = 0
    forced = {}
    for i in range(len(prompts)):
        seq = prompts[i] + truth[i]
        H = ref.main_hidden(seq)                             # the main model's rows (causal: any prefix)
        forced[i] = seq, H, ref.mtp(seq[1:], H[:-1])         # teacher-forced MTP rows 0 .. len - 2
    for i, n, drafts in records:
        seq, H, (y, tok) = forced[i]
        assert drafts[0] == tok[n - 2], (i, n, drafts)       # at position n - 2: the token after t_{n-1}
        ids, prev = seq[1:n] + [drafts[0]], torch.cat([H[:n - 1], y[n - 2:n - 1]])
        checked += 1
        for j in range(1, K):
            if drafts[j] == -1:
                break
            yj, tj = ref.mtp(ids, prev)                      # chained: its own output and draft j
            assert drafts[j] == tj[-1], (i, n, j, drafts)
            ids, prev = ids + [drafts[j]], torch.cat([prev, yj[-1:]])
            checked += 1
    assert checked >= 2 * len(records) > 20


# --- refusals, configuration, the plan -----------------------------------------------------------------
MTP1 = {"method": "mtp", "num_speculative_tokens": 1}


def test_mtp_refused_at_start_without_mtp_layers(tmp_path, demo_model):
    """method mtp on a model without MTP layers is refused before any worker starts, in one line
    naming the flag: a Llama (the demo model), and a DeepSeek-V3 whose config.json says
    num_nextn_predict_layers=1 (HF's default) but whose checkpoint holds no model.layers.{N}.* tensors."""
    from zpp import LLM
    from zpp.errors import ConfigError
    bare = _save(str(tmp_path / "bare"), demo_model, mtp=False)
    for model, words in ((demo_model, "needs a model with multi-token-prediction layers"),
                         (bare, "holds no multi-token-prediction layer")):
        with pytest.raises(ConfigError) as e:
            LLM(model, device="cpu", speculative_config=MTP1)
        msg = str(e.value)
        assert words in msg and "--speculative-config" in msg and "\n" not in msg, msg
    with pytest.raises(ConfigError, match="--tensor-parallel-size"):
        LLM(bare, device="cpu", speculative_config=MTP1, tensor_parallel_size=2)


def test_mtp_config_alias_and_plan_counts_the_layer(tmp_path):
    """``deepseek_mtp`` is vLLM's alias of ``mtp``; ``zpp plan`` puts the MTP layer (its decoder layer,
    eh_proj, norms, shared head and the embedding it reads) and its KV cache on the last stage only."""
    import json

    import torch

    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    from zpp.plan import Target, make_plan, plan_config
    from zpp.spec_config import SpeculativeConfig, parse_speculative_config, stage_model_config
    assert parse_speculative_config('{"method": "deepseek_mtp", "num_speculative_tokens": 2}', "--speculative-config") \
        == SpeculativeConfig("mtp", 2)
    cfg = {**_hf_config().to_dict(), "architectures": ["DeepseekV3ForCausalLM"], "torch_dtype": "bfloat16"}
    d = tmp_path / "cfg"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    target = Target("cuda", (80 << 30,), (9, 0))
    spec = SpeculativeConfig("mtp", 2)
    plans = [make_plan(plan_config(str(d), pipeline_parallel_size=2, dtype="bfloat16", max_model_len=256,
                                   speculative_config=s), target, search=False) for s in (None, spec)]
    without, with_mtp = ([(p.weight_bytes, p.kv_bytes_per_token) for p in plan.stages] for plan in plans)
    last = plans[1].stages[-1].layers
    meta = load_stage_model(str(d), stage_model_config(cfg, spec), StageInfo(1, 2, *last), torch.bfloat16,
                            torch.device("meta"), 256, "dummy")
    n = cfg["num_hidden_layers"]
    mtp_bytes = sum(p.numel() * p.element_size() for name, p in meta.named_parameters()
                    if name.startswith(f"model.layers.{n}."))
    assert mtp_bytes > 2 * VOCAB * cfg["hidden_size"] * 2  # its own embedding and head at least
    assert with_mtp[0] == without[0]
    assert with_mtp[1][0] - without[1][0] == mtp_bytes
    row = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert with_mtp[1][1] - without[1][1] == row * 2  # one more latent row per token (bf16)
