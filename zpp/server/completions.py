"""``POST /v1/completions``: OpenAI's text completions (with vLLM's extra fields), whole or
streamed, for one prompt or several (each run ``n`` times), with ``echo``, ``logprobs`` and
vLLM's ``prompt_logprobs``.
"""
from __future__ import annotations

import asyncio
import dataclasses
from contextlib import aclosing

from aiohttp import web

from zpp.errors import RequestError
from zpp.frontend.output_processor import StreamDeltas
from zpp.outputs import CompletionOutput, RequestOutput
from zpp.server.endpoint import ServingContext
from zpp.server.protocol import CompletionRequest, check_max_tokens, to_sampling_params
from zpp.server.render import SSEWriter, json_response, new_id, now, usage, usage_counts
from zpp.server.structured_outputs import structured_outputs_of

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions


def normalize_prompt(prompt) -> list:
    """OpenAI's four prompt forms -> a list of prompts (str or token-id list). Raises RequestError."""
    if prompt is None:
        raise RequestError("prompt is required", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt must not be an empty list", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        if any(len(p) == 0 for p in prompt):
            raise RequestError("prompt token lists must not be empty", "prompt")
        return list(prompt)
    raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of those", "prompt")


async def completions(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    req: CompletionRequest = await ctx.read(request, CompletionRequest)
    ctx.check_model(req.model)
    if req.suffix is not None:
        raise RequestError("suffix is not supported by this server", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise RequestError("best_of is not supported (only best_of == n)", "best_of")
    so, so_param = structured_outputs_of(req)
    prompts = normalize_prompt(req.prompt)
    # 0 only with echo (vLLM's prompt scoring: the prompt returned, nothing generated)
    check_max_tokens(req.max_tokens, "max_tokens", zero_ok=req.echo)
    max_tokens = (ctx.generation_defaults.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
                  if req.max_tokens is None else req.max_tokens)
    # echo + max_tokens 0 returns the prompt with nothing generated. SamplingParams take at least 1
    # token (vLLM's rule), so the request is checked and prepared for 1: with logprobs, that one
    # step scores the prompt (its logprobs) and the sampled token is dropped (``shown``, as vLLM
    # does); without, nothing runs (max_tokens 0 in the PreparedRequest: finished at once).
    prompt_only = req.echo and max_tokens == 0
    sampling = to_sampling_params(req, 1 if prompt_only else max_tokens, req.logprobs, structured_outputs=so,
                                  defaults=ctx.generation_defaults)
    want_prompt_lps = req.echo and req.logprobs is not None
    if want_prompt_lps:
        sampling = sampling.clone(prompt_logprobs=max(req.logprobs, sampling.prompt_logprobs or 0))
    ctx.check_logprobs(sampling, "logprobs")
    prepared = [await ctx.engine.prepare(p, sampling, grammar_param=so_param) for p in prompts]
    if prompt_only and not want_prompt_lps:
        prepared = [dataclasses.replace(p, max_tokens=0) for p in prepared]
    prompt_ids = [p.prompt_token_ids for p in prepared]
    cid, created, n = new_id("cmpl", ctx.request_id(request, req.request_id)), now(), sampling.n
    k = req.logprobs
    tokens = ctx.tokens

    def shown(c: CompletionOutput) -> CompletionOutput:
        if not prompt_only:
            return c
        return CompletionOutput(index=c.index, text="", token_ids=[], logprobs=[] if k is not None else None,
                                finish_reason="length" if c.finish_reason else None)

    def echo_text(i: int) -> str:
        if prepared[i].prompt is not None:
            return prepared[i].prompt
        return ctx.tokenizer.decode(prompt_ids[i]) if ctx.tokenizer is not None else ""

    def prompt_pairs(i: int, o: RequestOutput) -> list:
        lps = o.prompt_logprobs or [None] * len(prompt_ids[i])
        return list(zip(prompt_ids[i], lps))

    def gen_pairs(c: CompletionOutput) -> list:
        return list(zip(c.token_ids, (c.logprobs or []) + [None] * len(c.token_ids)))

    if not req.stream:
        finals: dict[int, RequestOutput] = {}
        async with aclosing(ctx.run_all(prepared, cid, stream=False, client_id=ctx.client_id(request))) as outs:
            async for i, out in outs:
                if out.finished:
                    finals[i] = out
        choices = []
        for i in range(len(prepared)):
            o = finals[i]
            head = echo_text(i) if req.echo else ""
            for c in map(shown, o.outputs):
                lp = None
                if k is not None:
                    pairs = (prompt_pairs(i, o) if req.echo else []) + gen_pairs(c)
                    lp = tokens.completion_logprobs(k, pairs, 0)
                choice = {"index": i * n + c.index, "text": head + c.text, "logprobs": lp,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = tokens.prompt_logprobs(prompt_ids[i], o.prompt_logprobs)
                choices.append(choice)
        return json_response({"id": cid, "object": "text_completion", "created": created, "model": ctx.model_name,
                              "choices": choices, "usage": usage(prompt_ids, [map(shown, finals[i].outputs)
                                                                              for i in finals])})

    sse = SSEWriter(request)
    sent = StreamDeltas()
    base: dict[tuple[int, int], int] = {}        # length of the echoed prompt text
    completion_tokens = 0

    continuous = bool(req.stream_options and req.stream_options.include_usage
                      and req.stream_options.continuous_usage_stats)
    prompt_total = sum(map(len, prompt_ids))

    def chunk(index: int, text: str, lp, finish_reason=None, stop_reason=None, prompt_lp=None) -> dict:
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
        if prompt_lp is not None:  # a choice's first chunk carries its prompt's logprobs (prompt_logprobs)
            choice["prompt_logprobs"] = prompt_lp
        body = {"id": cid, "object": "text_completion", "created": created, "model": ctx.model_name,
                "choices": [choice]}
        if continuous:  # vLLM's continuous_usage_stats: the usage so far in every chunk
            body["usage"] = usage_counts(prompt_total, sent.sent_tokens)
        return body

    try:
        async with aclosing(ctx.run_all(prepared, cid, client_id=ctx.client_id(request))) as outs:
            async for i, out in outs:
                for key, d in sent.deltas(map(shown, out.outputs), i):
                    c = d.output
                    if not c.token_ids and c.finish_reason is None:
                        continue  # nothing yet for this choice (or its prompt logprobs are not complete)
                    first_lp = None
                    if key not in base:
                        base[key] = 0
                        if req.prompt_logprobs is not None:
                            first_lp = tokens.prompt_logprobs(prompt_ids[i], out.prompt_logprobs)
                        if req.echo:
                            head = echo_text(i)
                            base[key] = len(head)
                            lp = tokens.completion_logprobs(k, prompt_pairs(i, out), 0) if k is not None else None
                            await sse.send(chunk(i * n + c.index, head, lp, prompt_lp=first_lp))
                            first_lp = None
                    lp = None
                    if k is not None:
                        lp = tokens.completion_logprobs(k, list(zip(d.token_ids, (d.logprobs or []) + [None] * len(
                            d.token_ids))), base[key] + d.text_start)
                    if not d.text and c.finish_reason is None and not (lp and lp["tokens"]) and first_lp is None:
                        continue
                    sent.sent(key, d)
                    if c.finish_reason is not None:
                        completion_tokens += len(c.token_ids)
                    await sse.send(chunk(i * n + c.index, d.text, lp, c.finish_reason, c.stop_reason, first_lp))
    except (asyncio.CancelledError, ConnectionError):
        raise  # the client went away: nothing to tell it
    except Exception as e:
        return await sse.fail(e)
    if req.stream_options and req.stream_options.include_usage:
        await sse.send({"id": cid, "object": "text_completion", "created": created, "model": ctx.model_name,
                        "choices": [], "usage": usage_counts(prompt_total, completion_tokens)})
    return await sse.done()
