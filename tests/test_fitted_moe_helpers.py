"""tests/fitted_moe.py's comparison helper (vLLM's check_logprobs_close rule for one sequence) and
chain helpers: pure Python, no model."""
import pytest
import torch

from fitted_moe import chain, follows, top5_close


def _lp(*tokens):  # a position's top-k: the first token most likely
    return {t: -0.1 * i for i, t in enumerate(tokens)}


def test_equal_runs_compare_every_position():
    a = ([4, 5, 6], [_lp(4, 1), _lp(5, 1), _lp(6, 1)])
    assert top5_close(a, a) == (3, None)


def test_divergence_inside_top5_stops_the_comparison():
    a = ([4, 9, 1], [_lp(4), _lp(9, 5), _lp(1)])
    b = ([4, 5, 7], [_lp(4), _lp(5, 1, 2, 3, 9), _lp(7)])    # after position 1 nothing is compared
    assert top5_close(a, b) == (2, 1)


@pytest.mark.parametrize("which", ["first", "second"])
def test_divergence_outside_top5_fails(which):
    a = ([4, 9], [_lp(4), _lp(9, 5)])
    b = ([4, 5], [_lp(4), _lp(5, 1, 2, 3, 8, 9)])           # 9 is 6th in b: outside the top 5
    if which == "second":
        a = ([4, 9], [_lp(4), _lp(9, 1, 2, 3, 6, 5)])        # 5 is 6th in a
        b = ([4, 5], [_lp(4), _lp(5, 9)])
    with pytest.raises(AssertionError, match="position 1"):
        top5_close(a, b)


def test_chain_and_follows():
    perm = torch.tensor([1, 2, 3, 0])
    assert chain(2, 5, perm) == [2, 3, 0, 1, 2]
    assert follows([3, 0, 2], [1, 2], perm) == pytest.approx(2 / 3)
