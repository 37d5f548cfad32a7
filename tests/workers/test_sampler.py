"""The last stage's sampler on crafted logits: each processing step does what its reference says."""
from __future__ import annotations

import math

import pytest
import torch

from zpp.sampling_params import SamplingParams
from zpp.workers.sampler import Sampler, SeqState

V = 8


def seq(sp: SamplingParams, tokens=(1, 2), prompt_len=2) -> SeqState:
    return SeqState(list(tokens), prompt_len, sp)


def sample(logits, seqs, eos=frozenset({7}), seed=0):
    return Sampler(torch.device("cpu"), seed)(torch.tensor(logits, dtype=torch.float32), seqs, set(eos))


def test_greedy_and_top_k_1_pick_argmax():
    row = [0.1, 2.0, 0.3, 1.9, 0.0, 0.0, 0.0, 0.0]
    toks, _ = sample([row, row], [seq(SamplingParams(temperature=0)), seq(SamplingParams(top_k=1, seed=3))])
    assert toks == [1, 1]


def test_top_p_keeps_the_nucleus_only():
    # probabilities ~ [0.6, 0.3, 0.1 spread]: top_p=0.5 keeps only token 0
    row = [math.log(0.6), math.log(0.3)] + [math.log(0.1 / 6)] * 6
    toks, _ = sample([row] * 200, [seq(SamplingParams(top_p=0.5)) for _ in range(200)])
    assert set(toks) == {0}
    toks, _ = sample([row] * 400, [seq(SamplingParams(top_p=0.85)) for _ in range(400)])
    assert set(toks) == {0, 1}


def test_min_p_drops_unlikely_tokens():
    row = [math.log(0.5), math.log(0.3), math.log(0.04)] + [math.log(0.16 / 5)] * 5
    toks, _ = sample([row] * 400, [seq(SamplingParams(min_p=0.2)) for _ in range(400)])
    assert set(toks) == {0, 1}  # 0.04 / 0.5 < 0.2


def test_repetition_penalty_ctrl_rule():
    # token 1 (positive logit, seen) is divided, token 3 (negative, seen) multiplied
    row = [1.0, 1.5, 0.0, -0.2, 0.0, 0.0, 0.0, 0.0]
    toks, _ = sample([row], [seq(SamplingParams(temperature=0, repetition_penalty=2.0), tokens=(1, 3))])
    assert toks == [0]  # 1.5 / 2 = 0.75 < 1.0


def test_frequency_and_presence_penalties_count_output_tokens_only():
    row = [1.0, 1.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    # token 1 appears twice in the output: 1.3 - 2 * 0.2 = 0.9 < 1.0
    s = seq(SamplingParams(temperature=0, frequency_penalty=0.2), tokens=(5, 1, 1), prompt_len=1)
    assert sample([row], [s])[0] == [0]
    # in the prompt only: no frequency penalty
    s = seq(SamplingParams(temperature=0, frequency_penalty=0.2), tokens=(1, 1, 5), prompt_len=3)
    assert sample([row], [s])[0] == [1]
    s = seq(SamplingParams(temperature=0, presence_penalty=0.5), tokens=(5, 1), prompt_len=1)
    assert sample([row], [s])[0] == [0]


def test_min_tokens_suppresses_eos_and_stop_tokens():
    row = [0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 0.0, 5.0]  # EOS (7) best, stop token 5 next
    sp = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5])
    assert sample([row], [seq(sp, tokens=(1, 2, 3), prompt_len=2)])[0] == [0]  # 1 output so far < 2
    assert sample([row], [seq(sp, tokens=(1, 2, 3, 4), prompt_len=2)])[0] == [7]


def test_seed_is_a_function_of_seed_and_position_only():
    row = [0.0] * V
    a = sample([row, row], [seq(SamplingParams(seed=11)), seq(SamplingParams(seed=11))], seed=1)[0]
    b = sample([row], [seq(SamplingParams(seed=11))], seed=99)[0]
    assert a[0] == a[1] == b[0]
    draws = {sample([row], [seq(SamplingParams(seed=11), tokens=(1,) * (2 + k))], seed=k)[0][0] for k in range(30)}
    assert len(draws) > 3  # later positions draw fresh noise


def test_logprobs_are_raw_log_softmax_with_rank():
    row = [0.5, 2.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0]
    toks, lps = sample([row], [seq(SamplingParams(temperature=0, logprobs=2))])
    ref = torch.log_softmax(torch.tensor(row), -1)
    lp = lps[0]
    assert toks == [1] and lp.token_id == 1 and lp.rank == 1
    assert lp.logprob == pytest.approx(float(ref[1]))
    assert lp.top_ids == [1, 2] and lp.top_logprobs == pytest.approx([float(ref[1]), float(ref[2])])


@pytest.mark.parametrize("mode", [dict(temperature=0), dict(temperature=1.0, seed=5), dict(temperature=0.7, top_k=3),
                                  dict(temperature=1.0, top_p=0.5, seed=1), dict(temperature=1.0, min_p=0.5),
                                  dict(temperature=0, repetition_penalty=1.3, logprobs=2)])
def test_logit_bias_forces_and_forbids_in_every_mode(mode):
    row = [0.1, 5.0, 0.3, 4.9, 0.0, 0.0, -3.0, 0.0]  # token 1 is the greedy pick, token 6 the least likely
    for seed in range(5):
        forced, _ = sample([row], [seq(SamplingParams(**mode, logit_bias={6: 100}))], seed=seed)
        assert forced == [6]
        banned, _ = sample([row, row], [seq(SamplingParams(**mode, logit_bias={1: -100, 3: -100})),
                                        seq(SamplingParams(**mode))], seed=seed)
        assert banned[0] not in (1, 3)
    # Only the biased row changes; logprobs stay the model's own.
    (tok, plain), lps = sample([row, row], [seq(SamplingParams(temperature=0, logprobs=1, logit_bias={6: 100})),
                                            seq(SamplingParams(temperature=0))])
    assert (tok, plain) == (6, 1) and lps[0].logprob == pytest.approx(torch.log_softmax(torch.tensor(row), 0)[6].item())


@pytest.mark.parametrize("bias", [{1: 100.5}, {1: -101}, {-1: 1.0}, {"1": 1.0}, {1: float("nan")}])
def test_logit_bias_out_of_range_is_refused(bias):
    with pytest.raises(ValueError) as info:
        SamplingParams(logit_bias=bias)
    assert info.value.param == "logit_bias"
