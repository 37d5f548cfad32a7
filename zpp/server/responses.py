"""OpenAI's Responses API, ``POST /v1/responses``, without server-side state.

The server keeps no responses: every request carries the whole conversation in ``input``.
``store`` absent or false is served, and the response says ``"store": false``; ``store: true``,
``previous_response_id``, ``conversation``, ``background`` and ``item_reference`` items need stored
state and are refused with HTTP 400 naming the field.

A request becomes a chat completion request (:func:`to_chat_request`) and runs on the chat path's
pieces: the chat template with tools, the tool plan and its output parsing (zpp.server.tools), the
structured-output mapping and the sampling-parameter mapping (zpp.server.protocol). So a Responses
request and the equivalent chat request see the same prompt tokens and sample the same text.

* ``input``: a string (one user message) or a list of items: messages (``role`` user, system,
  developer or assistant; ``content`` a string or ``input_text`` / ``output_text`` / ``refusal``
  parts), ``function_call`` items (replayed calls), ``function_call_output`` items (their
  results, as ``tool`` messages) and ``reasoning`` items (an earlier response's, sent back with
  its output: accepted, left out of the prompt). ``instructions`` becomes a first system message.
* ``tools``: function tools ``{"type": "function", "name", "description", "parameters", "strict"}``;
  ``tool_choice`` ``"none"`` / ``"auto"`` / ``"required"`` / ``{"type": "function", "name": N}``.
  Calls come back as ``function_call`` output items (``call_id``, ``name``, ``arguments``);
  ``auto`` outputs are read by the server's ``--tool-call-parser``, as on the chat path.
* ``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
  "name", "schema", "strict"}``: the output is constrained by the grammar of that format. With a
  ``tool_choice`` that forces a call (``"required"`` or a named function) the call's grammar wins
  and ``text.format`` is ignored for the request (echoed as sent), as on the chat path
  (:func:`zpp.server.tools.tool_constraint`).
* Reasoning (``--reasoning-parser``): the output's reasoning, split off as on the chat path
  (:class:`zpp.parsers.chat.ChatParsers`), is a first output item ``{"type": "reasoning", "id":
  "rs_...", "summary": [], "content": [{"type": "reasoning_text", "text": ...}], "status"}``,
  before the message (the rest of the output, without the reasoning; ``output_text`` is that
  message's text) and the calls. An output cut off inside its reasoning is the reasoning item
  alone (``"incomplete"``); no message item follows a reasoning item when no text does.
  ``reasoning.effort`` (``"none"``, ``"minimal"``, ``"low"``, ``"medium"``, ``"high"``) is the
  chat template's variable ``reasoning_effort``, as chat's ``reasoning_effort`` field (templates
  of reasoning models such as gpt-oss read it, others ignore it), and is echoed in the response's
  ``reasoning``; ``reasoning.summary`` is accepted (echoed) and no summary is written.
* ``max_output_tokens`` (an output cut by it has ``status: "incomplete"`` and
  ``incomplete_details.reason: "max_output_tokens"``, as OpenAI's), ``temperature``, ``top_p`` and
  vLLM's ``top_k``, ``min_p``, ``repetition_penalty``, ``seed``.
* ``stream: true``: server-sent events with ``event:`` lines and OpenAI's event types, numbered by
  ``sequence_number``: ``response.created``, ``response.in_progress``, then per output item
  ``response.output_item.added``, for a message ``response.content_part.added``,
  ``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``,
  for a call ``response.function_call_arguments.delta``..., ``response.function_call_arguments.done``,
  for reasoning ``response.content_part.added`` (a ``reasoning_text`` part),
  ``response.reasoning_text.delta``..., ``response.reasoning_text.done``,
  ``response.content_part.done``, then ``response.output_item.done``; last
  ``response.completed``, also when ``max_output_tokens`` cut the output (the response inside
  then has ``status: "incomplete"``; OpenAI sends ``response.incomplete`` there, on which the
  openai client's ``responses.stream`` helper raises "Didn't receive a `response.completed`
  event"; vLLM sends ``response.completed`` too). An engine failure after the first event sends
  an ``error`` event and ``response.failed``.
* ``usage``: ``input_tokens``, ``output_tokens``, ``total_tokens`` (and the detail objects, zero:
  no cached-token accounting; ``reasoning_tokens`` is not counted, the reasoning's tokens are in
  ``output_tokens``).
* Items closed before the output ended are ``"completed"``; the last one is ``"incomplete"`` when
  ``max_output_tokens`` cut the output, streamed or not.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing
from typing import Optional

from aiohttp import web

from zpp.errors import EngineDeadError, RequestError
from zpp.parsers.chat import ChatParsers
from zpp.sampling_params import SamplingParamsError
from zpp.server.protocol import ProtocolError, check_max_tokens, to_sampling_params
from zpp.server.render import error_message
from zpp.server.responses_protocol import (_PARAMS, ResponsesRequest, ResponsesStreamOptions, _check_stateless,
                                           input_messages, reasoning_effort, to_chat_request)
from zpp.server.structured_outputs import structured_output_options, structured_outputs_of
from zpp.server.tools import ToolPlan, parse_tools, tool_constraint

logger = logging.getLogger(__name__)

__all__ = ["ResponsesAPI", "ResponsesRequest", "ResponsesStreamOptions", "input_messages", "to_chat_request"]

_LARGE_TEXT = 100_000  # characters of input above which the prompt is rendered off the event loop


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: Optional[str], status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if text is None else [_text_part(text)]}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def _reasoning_item(item_id: str, text: Optional[str], status: str) -> dict:
    """A ``reasoning`` output item: the reasoning parser's text as one ``reasoning_text`` content
    part (no summary: ``summary`` is empty), as vLLM reports it."""
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [] if text is None else [_reasoning_part(text)], "status": status}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _status(finish_reason: Optional[str]) -> tuple[str, Optional[dict]]:
    """(response status, incomplete_details) for a finished output's finish_reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


class ResponsesAPI:
    """The ``POST /v1/responses`` handler over the endpoints' shared
    :class:`~zpp.server.endpoint.ServingContext`: its body reading and model check, the chat
    options of ``/v1/chat/completions`` (:func:`zpp.server.chat.chat_options`), the engine's one way
    in (:meth:`~zpp.frontend.async_engine.AsyncEngine.prepare`) and its ``run_all``."""

    def __init__(self, ctx):
        self.ctx = ctx

    async def create(self, request: web.Request) -> web.StreamResponse:
        from zpp.server.chat import chat_options
        ctx = self.ctx
        req: ResponsesRequest = await ctx.read(request, ResponsesRequest)
        ctx.check_model(req.model)
        _check_stateless(req)
        reasons = ctx.parsers.reasoning is not None
        check_max_tokens(req.max_output_tokens, "max_output_tokens")  # as chat's max_completion_tokens
        try:
            chat = to_chat_request(req)
            plan = parse_tools(chat.tools, chat.tool_choice, chat.parallel_tool_calls)
            # a forced call's grammar wins over text.format (ignored then), as on the chat path
            so, so_param = tool_constraint(plan, *structured_outputs_of(chat), structured_output_options(chat))
            sampling = to_sampling_params(chat, chat.max_completion_tokens, None,
                                          rename={"max_tokens": "max_output_tokens"}, structured_outputs=so,
                                          defaults=ctx.generation_defaults)
            if ctx.parsers.keep_special_tokens(plan, reasons):
                sampling = sampling.clone(skip_special_tokens=False)
            prepared = await ctx.engine.prepare(sampling=sampling, messages=chat.messages,
                                                chat=chat_options(ctx, chat, plan), grammar_param=so_param,
                                                rename={"max_tokens": "max_output_tokens"})
        except ProtocolError as e:
            raise e.renamed(_PARAMS) from None
        prompt_ids = prepared.prompt_token_ids
        if plan is not None and plan.mode == "none":
            plan = None
        # As on the chat path: a grammar-constrained output reasons only if it writes <think> itself.
        opened = reasons and so is None and ctx.parsers.opened(ctx.tokenizer.decode(prompt_ids[-16:]))
        run = _Run(ctx, req, plan, prompt_ids, sampling, reasons, opened)
        # Echoed X-Request-Id, else the response's own id (without "resp_"): the header does not
        # name the response (the response keeps its fresh resp_ id).
        ctx.request_id(request, run.id[5:], use_header=False)
        if not req.stream:
            final = None
            async with aclosing(ctx.run_all([prepared], run.engine_id, stream=False)) as outs:
                async for _, out in outs:
                    final = out
            return web.Response(body=json.dumps(run.finish(final.outputs[0]), ensure_ascii=False),
                                content_type="application/json")
        return await run.stream(request, ctx.run_all([prepared], run.engine_id))


class _Run:
    """One Responses request's response object, built whole or as stream events."""

    def __init__(self, server, req: ResponsesRequest, plan: Optional[ToolPlan], prompt_ids: list[int], sampling,
                 reasons: bool = False, opened: bool = False):
        self.req, self.plan, self.prompt_ids, self.sampling = req, plan, prompt_ids, sampling
        self.model = server.model_name
        # the server's parsers (--tool-call-parser, --reasoning-parser); hermes and none without
        self.parsers = getattr(server, "parsers", None) or ChatParsers()
        self.reasons, self.opened = reasons and self.parsers.reasoning is not None, opened
        self.id = _new_id("resp")
        self.engine_id = "resp-" + self.id[5:]
        self.created = int(time.time())
        self.seq = 0

    def response(self, status: str, output: list, usage: Optional[dict] = None,
                 incomplete: Optional[dict] = None, error: Optional[dict] = None) -> dict:
        r = self.req
        fmt = (r.text or {}).get("format") or {"type": "text"}
        effort = reasoning_effort(r)
        summary = (r.reasoning or {}).get("summary")
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None,
                "error": error, "incomplete_details": incomplete, "instructions": r.instructions,
                "max_output_tokens": r.max_output_tokens, "model": self.model, "output": output,
                "parallel_tool_calls": r.parallel_tool_calls is not False,
                "previous_response_id": None, "store": False,
                "reasoning": None if effort is None and summary is None else {"effort": effort, "summary": summary},
                "temperature": self.sampling.temperature, "top_p": self.sampling.top_p, "text": {"format": fmt},
                "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
                "tools": r.tools or [], "truncation": "disabled", "usage": usage, "metadata": r.metadata or {},
                "user": r.user, "background": False, "service_tier": r.service_tier}

    def finish(self, c) -> dict:
        """The finished response object for the final CompletionOutput ``c`` (not streamed)."""
        status, incomplete = _status(c.finish_reason)
        msg, _ = self.parsers.message(c.text, self.plan, self.reasons, self.opened)
        reasoning, content, calls = msg.get("reasoning_content"), msg["content"], msg.get("tool_calls", [])
        output = []
        if reasoning:
            output.append(_reasoning_item(_new_id("rs"), reasoning, "completed"))
        if content or not (calls or reasoning):
            output.append(_message_item(_new_id("msg"), content or "", "completed"))
        for call in calls:
            output.append(_call_item(_new_id("fc"), _new_id("call"), call["function"]["name"],
                                     call["function"]["arguments"], "completed"))
        if status == "incomplete":  # the item the output was cut in, as the stream closes it
            output[-1]["status"] = "incomplete"
        return self.response(status, output, _usage(len(self.prompt_ids), len(c.token_ids)), incomplete)

    # --- streaming ----------------------------------------------------------------------------
    async def stream(self, request: web.Request, outs) -> web.StreamResponse:
        self.resp: Optional[web.StreamResponse] = None
        self.request = request
        self.items: list[dict] = []   # output items so far (the open one last)
        self.open: Optional[dict] = None  # the item being streamed
        ts = (self.parsers.stream(self.plan, self.reasons, self.opened)
              if self.plan is not None or self.reasons else None)
        sent = 0
        last = None
        try:
            async with aclosing(outs) as it:
                async for _, out in it:
                    if self.resp is None:
                        await self._send("response.created", response=self.response("in_progress", []))
                        await self._send("response.in_progress", response=self.response("in_progress", []))
                    c = out.outputs[0]
                    last = c
                    final = c.finish_reason is not None
                    if ts is None:
                        if len(c.text) > sent:
                            await self._text(c.text[sent:])
                            sent = len(c.text)
                    else:
                        for d in ts.feed(c.text, final):
                            if d.get("reasoning_content"):
                                await self._reasoning(d["reasoning_content"])
                            if "content" in d:
                                await self._text(d["content"])
                            for tc in d.get("tool_calls", ()):
                                if "id" in tc:
                                    await self._open_call(tc["function"]["name"])
                                if tc["function"].get("arguments"):
                                    await self._arguments(tc["function"]["arguments"])
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client went away: nothing to tell it
        except Exception as e:
            if self.resp is None:
                raise  # before any event: an ordinary JSON error response
            return await self._fail(e)
        status, incomplete = _status(last.finish_reason)
        item_status = "incomplete" if status == "incomplete" else "completed"
        if not self.items:  # no reasoning, text or call: an empty message, as the whole response has
            await self._text("")
        await self._close(item_status)
        usage = _usage(len(self.prompt_ids), len(last.token_ids))
        # response.completed also for an output cut by max_output_tokens (status "incomplete" inside),
        # as vLLM does: OpenAI sends response.incomplete there, on which the openai client's
        # responses.stream(...).get_final_response() raises.
        await self._send("response.completed", response=self.response(status, self.items, usage, incomplete))
        await self.resp.write_eof()
        return self.resp

    async def _send(self, kind: str, **fields) -> None:
        if self.resp is None:
            self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                    "X-Accel-Buffering": "no"})
            await self.resp.prepare(self.request)
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        await self.resp.write(f"event: {kind}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode()
                              + b"\n\n")

    async def _text(self, delta: str) -> None:
        o = self.open
        if o is None or o["type"] != "message":
            await self._close("completed")
            o = self.open = _message_item(_new_id("msg"), None, "in_progress")
            self.items.append(o)
            await self._send("response.output_item.added", output_index=len(self.items) - 1, item=o)
            o["content"].append(_text_part(""))
            await self._send("response.content_part.added", item_id=o["id"], output_index=len(self.items) - 1,
                             content_index=0, part=_text_part(""))
        if delta:
            o["content"][0]["text"] += delta
            await self._send("response.output_text.delta", item_id=o["id"], output_index=len(self.items) - 1,
                             content_index=0, delta=delta, logprobs=[])

    async def _reasoning(self, delta: str) -> None:
        o = self.open
        k = len(self.items) - 1
        if o is None or o["type"] != "reasoning":
            await self._close("completed")
            o = self.open = _reasoning_item(_new_id("rs"), None, "in_progress")
            self.items.append(o)
            k = len(self.items) - 1
            await self._send("response.output_item.added", output_index=k, item=o)
            o["content"].append(_reasoning_part(""))
            await self._send("response.content_part.added", item_id=o["id"], output_index=k, content_index=0,
                             part=_reasoning_part(""))
        o["content"][0]["text"] += delta
        await self._send("response.reasoning_text.delta", item_id=o["id"], output_index=k, content_index=0,
                         delta=delta)

    async def _open_call(self, name: str) -> None:
        await self._close("completed")
        o = self.open = _call_item(_new_id("fc"), _new_id("call"), name, "", "in_progress")
        self.items.append(o)
        await self._send("response.output_item.added", output_index=len(self.items) - 1, item=dict(o))

    async def _arguments(self, delta: str) -> None:
        o = self.open
        o["arguments"] += delta
        await self._send("response.function_call_arguments.delta", item_id=o["id"], output_index=len(self.items) - 1,
                         delta=delta)

    async def _close(self, status: str) -> None:
        """Finish the open item (its done events), if any."""
        o, self.open = self.open, None
        if o is None:
            return
        k = len(self.items) - 1
        if o["type"] == "message":
            part = o["content"][0]
            await self._send("response.output_text.done", item_id=o["id"], output_index=k, content_index=0,
                             text=part["text"], logprobs=[])
            await self._send("response.content_part.done", item_id=o["id"], output_index=k, content_index=0,
                             part=part)
        elif o["type"] == "reasoning":
            part = o["content"][0]
            await self._send("response.reasoning_text.done", item_id=o["id"], output_index=k, content_index=0,
                             text=part["text"])
            await self._send("response.content_part.done", item_id=o["id"], output_index=k, content_index=0,
                             part=part)
        else:
            await self._send("response.function_call_arguments.done", item_id=o["id"], output_index=k,
                             name=o["name"], arguments=o["arguments"])
        o["status"] = status
        await self._send("response.output_item.done", output_index=k, item=o)

    async def _fail(self, e: Exception) -> web.StreamResponse:
        if isinstance(e, (ProtocolError, RequestError, SamplingParamsError)):
            message, code = str(e), "invalid_request_error"
        elif isinstance(e, EngineDeadError):  # the words chat's and completions' streams use (a drain too)
            message, code = error_message(e), "server_error"
        else:
            logger.exception("error while streaming %s", self.request.path)
            message, code = f"internal error: {type(e).__name__}: {e}", "server_error"
        await self._send("error", code=code, message=message, param=getattr(e, "param", None))
        await self._send("response.failed", response=self.response("failed", self.items, error={
            "code": "server_error", "message": message}))
        await self.resp.write_eof()
        return self.resp

