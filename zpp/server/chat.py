"""``POST /v1/chat/completions``: OpenAI's chat completions, whole or streamed, with logprobs,
vLLM's ``prompt_logprobs``, structured outputs and function tools (``tool_choice`` ``"none"``,
``"auto"``, ``"required"`` or a named function; see :mod:`zpp.server.tools`).
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Optional

from aiohttp import web

from zpp.errors import RequestError
from zpp.frontend.inputs import ChatOptions
from zpp.frontend.output_processor import ChoiceDelta, StreamDeltas
from zpp.outputs import CompletionOutput
from zpp.server.endpoint import ServingContext
from zpp.server.protocol import (ChatCompletionRequest, check_max_tokens, check_unsupported_chat_fields,
                                 to_sampling_params)
from zpp.server.render import SSEWriter, TokenStrings, json_response, new_id, now, usage, usage_counts
from zpp.server.structured_outputs import structured_output_options, structured_outputs_of
from zpp.server.tools import ToolPlan, parse_tools, tool_constraint


def chat_options(ctx: ServingContext, req, plan: Optional[ToolPlan] = None) -> ChatOptions:
    """How the request's messages become its prompt (the template: the request's own only with
    --trust-request-chat-template). With tools (``plan``, unless ``tool_choice`` is ``"none"``)
    the template gets ``tools=``. A ``reasoning_effort`` is the template variable of that name,
    unless ``chat_template_kwargs`` sets that variable itself. Raises RequestError."""
    tools = plan is not None and plan.mode != "none"
    kwargs = req.chat_template_kwargs
    if req.reasoning_effort is not None:
        kwargs = {"reasoning_effort": req.reasoning_effort, **(kwargs or {})}
    return ChatOptions(template=ctx.chat_template_for(req.chat_template),
                       add_generation_prompt=req.add_generation_prompt,
                       continue_final_message=req.continue_final_message,
                       add_special_tokens=bool(req.add_special_tokens),
                       chat_template_kwargs=kwargs,
                       tools=plan.tools if tools else None,
                       tools_system_text=plan.system_text(ctx.parsers.tool.call_format) if tools else None,
                       format_tool_calls=ctx.parsers.tool.format_calls if tools else None)


def ended_whole(c: CompletionOutput) -> bool:
    """Whether tool calls parsed from ``c`` are whole, so its finish reason is ``"tool_calls"``: the
    output ended by itself (EOS, a stop token, the grammar complete), not cut off by ``max_tokens``,
    a grammar dead end or a stop string (``stop_reason`` a str), which keep their own reason."""
    return c.finish_reason == "stop" and not isinstance(c.stop_reason, str)


def finish_reason(c: CompletionOutput, called: bool, plan: Optional[ToolPlan]) -> Optional[str]:
    """A chat choice's ``finish_reason``: ``"tool_calls"`` for whole calls the model chose to make
    (``tool_choice`` auto or required); a named function's call keeps the output's own reason
    (``"stop"`` when whole), as OpenAI and vLLM answer a forced function."""
    named = plan is not None and plan.mode == "named"
    return "tool_calls" if called and not named and ended_whole(c) else c.finish_reason


async def chat_completions(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    req: ChatCompletionRequest = await ctx.read(request, ChatCompletionRequest)
    ctx.check_model(req.model)
    check_unsupported_chat_fields(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    use_mct = req.max_completion_tokens is not None
    check_max_tokens(req.max_completion_tokens if use_mct else req.max_tokens,
                     "max_completion_tokens" if use_mct else "max_tokens")
    plan = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    so, so_param = tool_constraint(plan, *structured_outputs_of(req), structured_output_options(req))
    rename = {"max_tokens": "max_completion_tokens" if use_mct else "max_tokens", "logprobs": "top_logprobs"}
    sampling = to_sampling_params(req, req.max_completion_tokens if use_mct else req.max_tokens,
                                  (req.top_logprobs or 0) if req.logprobs else None,
                                  rename=rename, structured_outputs=so, defaults=ctx.generation_defaults)
    reasons = ctx.parsers.reasoning is not None
    if ctx.parsers.keep_special_tokens(plan, reasons):
        sampling = sampling.clone(skip_special_tokens=False)
    ctx.check_logprobs(sampling, "top_logprobs")
    prepared = await ctx.engine.prepare(sampling=sampling, messages=req.messages, chat=chat_options(ctx, req, plan),
                                        grammar_param=so_param, rename={"max_tokens": rename["max_tokens"]})
    prompt_ids = prepared.prompt_token_ids
    cid, created, k = new_id("chatcmpl", ctx.request_id(request, req.request_id)), now(), req.top_logprobs or 0
    tokens = ctx.tokens
    # vLLM's: --response-role for a new message; the continued message keeps its own role
    last = req.messages[-1] if req.messages else None
    role = ctx.response_role if req.add_generation_prompt or last is None else \
        (last.get("role") if isinstance(last, dict) else last.role)
    if plan is not None and plan.mode == "none":
        plan = None
    # A grammar-constrained output reasons only if it writes <think> itself (the grammar holds
    # from its first token).
    opened = reasons and so is None and ctx.parsers.opened(ctx.tokenizer.decode(prompt_ids[-16:]))

    def message(c: CompletionOutput) -> tuple[dict, Optional[str]]:
        msg, called = ctx.parsers.message(c.text, plan, reasons, opened, req.include_reasoning)
        msg["role"] = role
        return msg, finish_reason(c, called, plan)

    if not req.stream:
        final = None
        async with aclosing(ctx.run_all([prepared], cid, stream=False, client_id=ctx.client_id(request))) as outs:
            async for _, out in outs:
                final = out
        choices = []
        for c in final.outputs:
            msg, finish = message(c)
            choices.append({"index": c.index, "message": msg,
                            "logprobs": tokens.chat_logprobs(k, c.token_ids, c.logprobs) if req.logprobs else None,
                            "finish_reason": finish, "stop_reason": c.stop_reason})
        body = {"id": cid, "object": "chat.completion", "created": created, "model": ctx.model_name,
                "choices": choices, "usage": usage([prompt_ids], [final.outputs])}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = tokens.prompt_logprobs(prompt_ids, final.prompt_logprobs)
        return json_response(body)

    sse = SSEWriter(request)
    sent = StreamDeltas()
    completion_tokens = 0
    tool_streams = ({j: ctx.parsers.stream(plan, reasons, opened, req.include_reasoning)
                     for j in range(sampling.n)} if plan is not None or reasons else {})

    continuous = bool(req.stream_options and req.stream_options.include_usage
                      and req.stream_options.continuous_usage_stats)

    def chunk(choices: list) -> dict:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
                "choices": choices}
        if continuous and choices:  # vLLM's continuous_usage_stats: the usage so far in every chunk
            body["usage"] = usage_counts(len(prompt_ids), sent.sent_tokens)
        return body

    try:
        async with aclosing(ctx.run_all([prepared], cid, client_id=ctx.client_id(request))) as outs:
            async for _, out in outs:
                if not sse.started:  # the first chunk of every choice carries the role
                    for j in range(sampling.n):
                        first = chunk([{"index": j, "delta": {"role": role, "content": ""},
                                        "logprobs": None, "finish_reason": None}])
                        if j == 0 and req.prompt_logprobs is not None:  # where the whole response has them
                            first["prompt_logprobs"] = tokens.prompt_logprobs(prompt_ids, out.prompt_logprobs)
                        await sse.send(first)
                for key, d in sent.deltas(out.outputs):
                    c = d.output
                    if tool_streams:
                        await _send_tool_deltas(tokens, sse, chunk, sent, key, d, tool_streams[c.index],
                                                req.logprobs, k, plan)
                        if c.finish_reason is not None:
                            completion_tokens += len(c.token_ids)
                        continue
                    if not d.text and c.finish_reason is None and not (req.logprobs and d.token_ids):
                        continue
                    sent.sent(key, d)
                    choice = {"index": c.index, "delta": {"content": d.text} if d.text else {},
                              "logprobs": tokens.chat_logprobs(k, d.token_ids, d.logprobs or [])
                              if req.logprobs and d.token_ids else None,
                              "finish_reason": c.finish_reason}
                    if c.finish_reason is not None:
                        completion_tokens += len(c.token_ids)
                        choice["stop_reason"] = c.stop_reason
                    await sse.send(chunk([choice]))
    except (asyncio.CancelledError, ConnectionError):
        raise  # the client went away: nothing to tell it
    except Exception as e:
        return await sse.fail(e)
    if req.stream_options and req.stream_options.include_usage:
        await sse.send({**chunk([]), "usage": usage_counts(len(prompt_ids), completion_tokens)})
    return await sse.done()


async def _send_tool_deltas(tokens: TokenStrings, sse: SSEWriter, chunk, sent: StreamDeltas, key, d: ChoiceDelta,
                            ts, logprobs: bool, k: int, plan: Optional[ToolPlan]) -> None:
    """Stream one choice of a request with tools or a reasoning parser: reasoning, content and
    ``tool_calls`` deltas from its ChatStream ``ts`` (fed the cumulative text), logprobs on the first delta of each step, the finish
    reason (:func:`finish_reason`) on the last."""
    c = d.output
    final = c.finish_reason is not None
    deltas = ts.feed(c.text, final)
    lp = tokens.chat_logprobs(k, d.token_ids, d.logprobs or []) if logprobs and d.token_ids else None
    if lp is not None and not deltas:
        deltas = [{}]
    sent.sent(key, d)
    for i, d in enumerate(deltas):
        await sse.send(chunk([{"index": c.index, "delta": d, "logprobs": lp if i == 0 else None,
                               "finish_reason": None}]))
    if final:
        reason = finish_reason(c, bool(ts.calls), plan)
        await sse.send(chunk([{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": reason,
                               "stop_reason": c.stop_reason}]))
