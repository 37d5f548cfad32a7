"""IncrementalDetokenizer with the real SmolLM2 tokenizer (byte-level BPE: emoji and CJK characters
are split across several tokens)."""
from __future__ import annotations

import random

import pytest

from zpp.frontend.detokenizer import IncrementalDetokenizer

MULTIBYTE = ["😀", "你好世界", "こんにちは", "👍🏽 great", "Hi 👋, 日本語とEnglish 😀😀!", "Ünïcödé ✓ — “quotes” €5",
             "🇫🇷 Paris 🗼", "한국어 텍스트"]


def run(tok, prompt_ids, out_ids, stop=None, include_stop=False, skip_special=True):
    """Feed ``out_ids`` one at a time as the engine does; return (deltas, final text, stop string)."""
    d = IncrementalDetokenizer(tok, prompt_ids, stop, skip_special, include_stop)
    sent, deltas, reason = "", [], None
    for i, t in enumerate(out_ids):
        reason = d.add_tokens([t])
        finished = reason is not None or i == len(out_ids) - 1
        if finished and reason is None:
            d.flush()
        n, now = d.stream_cut(finished)
        assert now.startswith(sent), f"text taken back: {sent!r} -> {now!r}"
        if not finished:  # whole tokens: the text is theirs
            assert now == tok.decode(out_ids[:n], skip_special_tokens=skip_special), (n, now)
        deltas.append(now[len(sent):])
        sent = now
        if reason is not None:
            break
    return deltas, sent, reason


@pytest.mark.parametrize("text", MULTIBYTE)
def test_split_characters_never_leak_partial_bytes(tokenizer, text):
    prompt = tokenizer.encode("Say something:")
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), "no split character"
    deltas, final, _ = run(tokenizer, prompt, ids)
    assert "".join(deltas) == final == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_random_token_sequences_match_full_decode(tokenizer):
    rng = random.Random(0)
    # Mostly the byte-piece tokens that make up multi-byte characters, to split many of them.
    pieces = sorted({t for s in MULTIBYTE for t in tokenizer.encode(s)})
    for _ in range(200):
        ids = [rng.choice(pieces) if rng.random() < 0.7 else rng.randrange(3, tokenizer.vocab_size)
               for _ in range(rng.randrange(1, 12))]
        prompt = [rng.randrange(3, tokenizer.vocab_size) for _ in range(rng.randrange(0, 8))]
        deltas, final, _ = run(tokenizer, prompt, ids)
        assert "".join(deltas) == final == tokenizer.decode(ids), ids


def test_prompt_ending_mid_character_does_not_leak_into_output(tokenizer):
    full = tokenizer.encode("Answer: 你好")
    cut = next(k for k in range(len(full) - 1, 0, -1) if tokenizer.decode(full[:k]).endswith("\ufffd"))
    prompt, out = full[:cut], full[cut:] + tokenizer.encode(" ok")
    deltas, final, _ = run(tokenizer, prompt, out)
    assert final == tokenizer.decode(out)
    assert "Answer" not in final and final.endswith(" ok")


def test_stop_string_prefix_is_held_back_then_cut(tokenizer):
    ids = tokenizer.encode("The answer is 42. STOP here")
    deltas, final, reason = run(tokenizer, [], ids, stop=["STOP"])
    assert reason == "STOP" and final == "The answer is 42. "
    assert "".join(deltas) == final
    deltas, final, _ = run(tokenizer, [], ids, stop=["STOP"], include_stop=True)
    assert final == "The answer is 42. STOP"


def test_held_prefix_released_when_stop_string_does_not_follow(tokenizer):
    ids = tokenizer.encode("a ST b STO c")
    d = IncrementalDetokenizer(tokenizer, [], ["STOP"])
    seen = []
    for t in ids:
        assert d.add_tokens([t]) is None
        seen.append(d.stream_cut(False)[1])
    assert any(s.endswith("a") or s.endswith("a ") for s in seen)
    assert not any(s.endswith("ST") for s in seen)  # a possible start of "STOP" is never sent early
    d.flush()
    assert d.stream_cut(True) == (len(ids), "a ST b STO c")


def test_stop_string_made_of_multibyte_characters(tokenizer):
    ids = tokenizer.encode("你好世界, 再见")
    deltas, final, reason = run(tokenizer, [], ids, stop=["世界"])
    assert reason == "世界" and final == "你好" and "".join(deltas) == final
    assert all("\ufffd" not in d and "世" not in d for d in deltas)


def test_incomplete_character_at_the_end_is_flushed_like_a_full_decode(tokenizer):
    ids = tokenizer.encode("ok 😀")[:-1]  # the emoji's last byte never comes
    deltas, final, _ = run(tokenizer, [], ids)
    assert final == tokenizer.decode(ids) and final.endswith("\ufffd")


def test_special_tokens(tokenizer):
    ids = tokenizer.encode("hi") + [tokenizer.eos_token_id]
    assert run(tokenizer, [], ids)[1] == "hi"
    assert run(tokenizer, [], ids, skip_special=False)[1] == "hi" + tokenizer.eos_token


def test_stop_strings_wait_for_min_tokens(tokenizer):
    """As vLLM: stop strings count only from token min_tokens + 1 on; one that ended inside the
    first min_tokens tokens is not found later."""
    ids = tokenizer.encode("a STOP b STOP c")
    k = next(k for k in range(1, len(ids) + 1) if "STOP" in tokenizer.decode(ids[:k]))  # completes the first

    def final(min_tokens):
        d = IncrementalDetokenizer(tokenizer, [], ["STOP"], min_tokens=min_tokens)
        for t in ids:
            if d.add_tokens([t]) is not None:
                break
        return d.text, d.stop_reason

    assert final(0) == final(k - 1) == ("a ", "STOP")
    assert final(k) == ("a STOP b ", "STOP")


def test_short_stop_string_inside_min_tokens_is_not_found_later(tokenizer):
    """With stop strings of several lengths, each is looked for only where it could end in the new
    text: a short one that ended inside the first min_tokens tokens (already streamed) does not cut
    the text later (that would take back sent text)."""
    ids = tokenizer.encode("a X b c")
    k = next(k for k in range(1, len(ids) + 1) if "X" in tokenizer.decode(ids[:k]))
    d = IncrementalDetokenizer(tokenizer, [], ["STOP", "X"], min_tokens=k)
    sent = ""
    for t in ids:
        assert d.add_tokens([t]) is None
        now = d.stream_cut(False)[1]
        assert now.startswith(sent)
        sent = now
    assert d.text == "a X b c"
