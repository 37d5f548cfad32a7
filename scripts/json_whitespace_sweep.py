"""Which whitespace bound ends SmolLM2's constrained JSON: greedy outputs of the demo model under
xgrammar's JSON grammars with any whitespace, compact, and each run of whitespace bounded to
1 ... 32 characters (``max_whitespace_cnt``), for issue 51's schema and ``json_object``.

Prints one line per (grammar, prompt, whitespace rule): tokens, ``stop`` / ``length`` (200
tokens) and whether the text is valid JSON. The figures behind ``DEFAULT_MAX_WHITESPACE_CNT``
(docs/structured-outputs.md, *Whitespace*). Runs on the CPU with HF transformers (greedy, the
same tokens zpp's engine gives) in about two minutes::

    python scripts/json_whitespace_sweep.py [MODEL_DIR]   # default: the demo model
"""
from __future__ import annotations

import json
import sys

import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM, AutoTokenizer

CITY = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
        "required": ["name", "country"]}
PROMPTS = ["Tell me about Paris", "Describe the book 1984 by George Orwell.", "What is the weather in London today?",
           "Give me a person named Anna, 31, from Paris."]
RULES = [("any (unbounded)", {}), ("compact", {"any_whitespace": False})] + \
        [(f"at most {n}", {"max_whitespace_cnt": n}) for n in (1, 2, 4, 8, 16, 32)]
MAX_TOKENS = 200


def main() -> None:
    if len(sys.argv) > 1:
        model_dir = sys.argv[1]
    else:
        from zpp.demo import prepare_demo_model
        model_dir = prepare_demo_model()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def run(prompt: str, schema, rule: dict) -> tuple[int, str, str]:
        text = json.dumps(schema) if schema else '{"type": "object"}'
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(text, strict_mode=schema is not None, **rule))
        x = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)["input_ids"]
        out, past = [], None
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                r = model(x, past_key_values=past, use_cache=True)
                past = r.past_key_values
                logits = r.logits[:, -1, :len(tok)].float()
                matcher.fill_next_token_bitmask(bitmask)
                xgr.apply_token_bitmask_inplace(logits, bitmask)
                t = int(logits.argmax())
                assert matcher.accept_token(t)
                if matcher.is_terminated():
                    break
                out.append(t)
                x = torch.tensor([[t]])
        return len(out), "stop" if matcher.is_terminated() else "length", tok.decode(out)

    for name, schema in (("City schema", CITY), ("json_object", None)):
        for prompt in PROMPTS:
            for label, rule in RULES:
                n, finish, text = run(prompt, schema, rule)
                try:
                    json.loads(text)
                    valid = "valid"
                except ValueError:
                    valid = "invalid"
                print(f"{name:11s} | {prompt[:30]:30s} | {label:15s} | {n:4d} tokens | {finish:6s} | {valid:7s} | "
                      f"{text[:60]!r}", flush=True)


if __name__ == "__main__":
    main()
