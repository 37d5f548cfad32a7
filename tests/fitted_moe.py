"""Tiny MoE checkpoints with confident logits, for end-to-end comparisons under vLLM's top-5 rule (the
tests' own helpers, independent of zpp).

Random-weight models have flat logits: many tokens within the FP8 activation rounding of the best
one, so a bf16 / FP8 pair diverges early and may pick a token outside the other's top 5 (seen on
tiny random Qwen3-MoE models, 2026-12-07). Here the weights are fitted locally instead, a few hundred
AdamW steps in float32 on a successor task: token ``x`` is followed by ``perm[x]`` for a fixed random
permutation ``perm`` of the vocabulary. The vocabulary (512) is wider than the hidden size (256), so
the embedding and LM head alone cannot hold the map (a rank-256 product cannot be a 512 x 512
permutation): the decoder layers, experts included, compute part of it, and a wrong expert output
changes the tokens. Greedy decoding then follows ``perm`` with margins of several nats.

    fitted_moe_checkpoint(family, out_dir, device) -> perm   # HF save_pretrained, float32, no tokenizer
    top5_close(a, b) -> (tokens compared, index of the first divergence or None)
"""
from __future__ import annotations

import torch

VOCAB = 512
FAMILIES = ("qwen3-moe", "deepseek-v3", "mixtral")
W4_FAMILIES = ("gpt-oss", "llama")
"""Also fitted (the 4-bit GPU tests): gpt-oss (its MXFP4 release's family: sinks, sliding window,
biased experts with the clamped SwiGLU) and a dense Llama (GPTQ / AWQ / compressed-tensors)."""


def _model(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=3, num_attention_heads=4,
                  max_position_embeddings=512, initializer_range=0.05, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    if family == "qwen3-moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, intermediate_size=512, moe_intermediate_size=256,
                                                  num_key_value_heads=2, head_dim=64, num_experts=8,
                                                  num_experts_per_tok=2, norm_topk_prob=True))
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM
        return MixtralForCausalLM(MixtralConfig(**common, intermediate_size=256, num_key_value_heads=2, head_dim=64,
                                                num_local_experts=8, num_experts_per_tok=2))
    if family == "deepseek-v3":  # MLA, shared expert, grouped noaux_tc routing, one dense layer first
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
        return DeepseekV3ForCausalLM(DeepseekV3Config(
            **common, intermediate_size=512, moe_intermediate_size=256, kv_lora_rank=64, q_lora_rank=64,
            qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64, n_routed_experts=8, n_group=2, topk_group=1,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.0))
    if family == "gpt-oss":  # 8 experts of 256 (MXFP4 blocks of 32 along both K), top-2, window 32
        from transformers import GptOssConfig, GptOssForCausalLM
        return GptOssForCausalLM(GptOssConfig(
            **common, intermediate_size=256, num_key_value_heads=2, head_dim=64, num_local_experts=8,
            num_experts_per_tok=2, sliding_window=32, layer_types=["sliding_attention", "full_attention",
                                                                   "sliding_attention"],
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 150000.0}))
    if family == "llama":  # dense: every linear layer 4-bit in GPTQ / AWQ (K = 256 and 512: groups of 128)
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(**common, intermediate_size=512, num_key_value_heads=2, head_dim=64))
    raise ValueError(f"unknown family {family!r} (one of {FAMILIES + W4_FAMILIES})")


def fitted_moe_checkpoint(family: str, out_dir: str, device: str = "cuda", steps: int = 300,
                          seed: int = 0) -> torch.Tensor:
    """Fit a tiny ``family`` model (3 layers, hidden 256, 8 experts of 256, top-2; the dense Llama an
    MLP of 512) to the successor task and ``save_pretrained`` it (float32) to ``out_dir``. Returns ``perm`` ``[VOCAB]`` (CPU):
    the next token of ``x`` is ``perm[x]`` (ids 0-2, the special ones, never start a chain but may
    appear in it)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = _model(family).to(device=device, dtype=torch.float32).train()
    perm = torch.randperm(VOCAB, generator=g)
    perm_d = perm.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    B, L = 32, 64
    for step in range(steps):
        x = torch.randint(3, VOCAB, (B, 1), generator=g).to(device)
        seq = [x]
        for _ in range(L - 1):
            seq.append(perm_d[seq[-1]])
        seq = torch.cat(seq, 1)                                                   # [B, L] chains of perm
        logits = model(input_ids=seq).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for group in opt.param_groups:                                            # linear decay
            group["lr"] = 3e-3 * (1 - (step + 1) / steps) + 1e-4
    model.eval().to("cpu").save_pretrained(out_dir)
    return perm


def chain(start: int, n: int, perm: torch.Tensor) -> list[int]:
    """``n`` tokens from ``start`` on, each ``perm`` of the one before (prompts in the fit's distribution)."""
    out = [int(start)]
    while len(out) < n:
        out.append(int(perm[out[-1]]))
    return out


def follows(tokens: list[int], prompt: list[int], perm: torch.Tensor) -> float:
    """Fraction of generated tokens that are ``perm`` of the token before them."""
    seq = list(prompt) + list(tokens)
    return sum(int(perm[a]) == b for a, b in zip(seq[len(prompt) - 1:], tokens)) / max(1, len(tokens))


def top5_close(a: tuple[list[int], list[dict]], b: tuple[list[int], list[dict]], k: int = 5):
    """vLLM's ``check_logprobs_close`` for one sequence: ``a`` / ``b`` = (token ids, per position the
    top-``k`` ``{token_id: logprob}`` of that run). Tokens are compared up to the first position where
    they differ; there each run's token must be among the other's top ``k``, and nothing after it
    is compared (the runs see different prefixes from then on). Returns ``(positions compared,
    index of the divergence or None)``; AssertionError with the position and both tokens otherwise."""
    (ta, la), (tb, lb) = a, b
    n = min(len(ta), len(tb))
    for j in range(n):
        if ta[j] != tb[j]:
            top_a, top_b = sorted(la[j], key=la[j].get, reverse=True)[:k], sorted(lb[j], key=lb[j].get, reverse=True)[:k]
            assert ta[j] in top_b, f"position {j}: token {ta[j]} of the first run not in the second's top-{k} {top_b}"
            assert tb[j] in top_a, f"position {j}: token {tb[j]} of the second run not in the first's top-{k} {top_a}"
            return j + 1, j
    return n, None
