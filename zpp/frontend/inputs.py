"""Request input processing in the front end: chat rendering, tokenization and validation
against the limits, shared by ``zpp serve`` and the offline ``LLM`` (so the two cannot drift).
:meth:`zpp.frontend.async_engine.AsyncEngine.prepare` runs them, and the grammar compile, once per
request.

The one place ``max_tokens`` is resolved: omitted (None) means the room left after the prompt in
``max_model_len``, or in the KV cache when that holds fewer tokens.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from zpp.errors import RequestError
from zpp.sampling_params import SamplingParams
from zpp.transport.core_messages import GrammarSpec

PromptType = Union[str, list[int]]

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass
class ChatOptions:
    """How a list of messages becomes a prompt.

    Attributes:
        template: the Jinja chat template (None: the tokenizer's).
        add_generation_prompt / continue_final_message: the template's switches (not both).
        add_special_tokens: let the tokenizer add its special tokens (BOS) to the rendered text;
            off by default: the template writes them.
        chat_template_kwargs: more template variables.
        tools: OpenAI function tools, handed to the template as ``tools=``.
        tools_system_text: with ``tools``, a system text describing them, used instead when the
            template ignores ``tools`` (the rendering does not change with them).
        format_tool_calls: with ``tools_system_text``, writes an assistant message's earlier
            ``tool_calls`` (``[(name, arguments JSON text)]``) as that text tells the model to
            (the tool-call parser's :meth:`~zpp.parsers.tool.ToolParser.format_calls`), for a
            template that ignores ``tool_calls`` too: the text joins the message's content.
    """

    template: Optional[str] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: Optional[dict] = None
    tools: Optional[list] = None
    tools_system_text: Optional[str] = None
    format_tool_calls: Optional[Callable[[list[tuple[str, str]]], str]] = None


@dataclass
class PreparedRequest:
    """A request checked, rendered, tokenized and compiled once (by ``AsyncEngine.prepare``):
    what :meth:`~zpp.frontend.async_engine.AsyncEngine.generate` queues without checking again.

    Attributes:
        prompt: the prompt text (the rendered conversation for chat), None for token ids.
        prompt_token_ids: the prompt's token ids.
        sampling: the request's sampling parameters.
        max_tokens: the effective limit of generated tokens (``sampling.max_tokens`` resolved;
            0 only where a caller sets it: the request then finishes at once with no output,
            as the OpenAI server's completions with ``echo`` and ``max_tokens`` 0 do).
        grammar: the compiled structured-output grammar, or None.
    """

    prompt: Optional[str]
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    grammar: Optional[GrammarSpec] = None


def max_prompt_chars(tokenizer, max_model_len: int) -> Optional[int]:
    """Characters above which a text cannot fit in ``max_model_len`` tokens: no token covers more
    characters than its longest vocabulary entry is long (a byte-level BPE entry has one character
    per byte, a SentencePiece one one per character), so a text needs at least
    ``len(text) / longest`` tokens. Doubled, for normalizers that shorten text. None without a
    tokenizer."""
    if tokenizer is None:
        return None
    try:
        pieces = list(tokenizer.get_vocab())
        pieces += [str(getattr(t, "content", t)) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
        longest = max(map(len, pieces))
    except Exception:  # an unusual tokenizer: no shortcut, tokenize everything
        return None
    return 2 * max_model_len * max(longest, 1)


def text_size(obj) -> int:
    """Rough number of characters in a prompt or message list."""
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, (list, tuple)):
        return sum(text_size(x) for x in obj)
    content = obj.get("content") if isinstance(obj, dict) else getattr(obj, "content", None)
    return text_size(content) if content is not None else 0


LARGE_TEXT = 100_000
"""Characters from which a text is rendered / tokenized in a worker thread, off the event loop."""


async def off_loop_if_large(fn, *args, size: int):
    """``fn(*args)``, in a worker thread when the text is ``size >= LARGE_TEXT`` characters, so one
    huge prompt does not stall every other client (and the engine's outputs) while it is tokenized."""
    if size < LARGE_TEXT:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


CONTEXT_LENGTH = "context_length_exceeded"
"""OpenAI's error ``code`` for a prompt (and ``max_tokens``) that the context cannot hold."""


def _field(m: Any, name: str):
    return m.get(name) if isinstance(m, dict) else getattr(m, name, None)


def template_tool_calls(calls: list) -> list:
    """An assistant message's ``tool_calls`` as chat templates read them (vLLM's rendering): each
    call's ``function.arguments``, a JSON text in OpenAI's API, parsed into a mapping, so that
    templates iterating it (``arguments|items``: Qwen3-Coder's, Qwen3.5's) work and templates that
    ``tojson`` it (Qwen2.5's, Llama-3.1's) do not encode it twice; empty or missing arguments are
    ``{}``; a text that is not a JSON object stays the text. The calls are copied, not changed."""
    out = []
    for call in calls:
        fn = _field(call, "function")
        if not isinstance(call, dict) or not isinstance(fn, dict):
            out.append(call)
            continue
        args = fn.get("arguments")
        if args is None or args == "":
            args = {}
        elif isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                args = parsed
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def _calls_in_content(msgs: list[dict], format_calls, render) -> list[dict]:
    """``msgs`` with each assistant message's ``tool_calls`` written into its content by
    ``format_calls``, when the template ``render`` ignores them (renders the same without); as
    they are otherwise. Calls that are not ``{"function": {"name": str, "arguments": str}}`` are
    left out of the text."""
    if not any(m["role"] == "assistant" and m.get("tool_calls") for m in msgs):
        return msgs
    bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in msgs]
    if render(bare) != render(msgs):  # the template writes the calls itself
        return msgs
    out = []
    for orig, m in zip(msgs, bare):
        fns = [_field(c, "function") for c in (orig.get("tool_calls") or ())]
        calls = [(_field(f, "name"), _field(f, "arguments")) for f in fns if f is not None]
        calls = [(n, a if isinstance(a, str) else json.dumps(a, ensure_ascii=False)) for n, a in calls
                 if isinstance(n, str)]
        if m["role"] == "assistant" and calls:
            m = {**m, "content": (m["content"] + "\n" if m["content"] else "") + format_calls(calls)}
        out.append(m)
    return out


class InputProcessor:
    """Tokenize and check requests.

    Args:
        tokenizer: the HF tokenizer, or None (prompts must then be token ids).
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        max_model_len: prompt + generated tokens per sequence, at most.
        num_kv_blocks: KV-cache blocks in all (one sequence must fit alone).
        block_size: tokens per KV-cache block.
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, num_kv_blocks: int, block_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_prompt_chars = max_prompt_chars(tokenizer, max_model_len)

    def check_prompt_chars(self, text: str, param: str = "prompt") -> None:
        """Refuse, before tokenizing, a text that cannot fit in max_model_len tokens whatever it
        says: tokenizing megabytes would take seconds for a certain 400. Raises RequestError."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise RequestError(f"the prompt has {len(text)} characters: more than max_model_len "
                               f"({self.max_model_len}) tokens of this tokenizer can hold", param, code=CONTEXT_LENGTH)

    def check_token_ids(self, ids, param: str, label: str = "token id") -> None:
        """The one vocabulary check: raises RequestError (naming ``param``) for the first of ``ids``
        that is not an int in ``[0, vocab_size)``."""
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"{label} {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param)

    def check_stop_token_ids(self, sampling: SamplingParams) -> None:
        """Raises RequestError (``stop_token_ids``) for an id outside the vocabulary."""
        self.check_token_ids(sampling.stop_token_ids or (), "stop_token_ids", "stop_token_ids:")

    def render_chat(self, messages: list, opts: ChatOptions, check_chars: bool = True) -> str:
        """Render ``messages`` (OpenAI chat messages, as dicts or structs with ``role``, ``content``
        (a str, text parts or None), ``name``, ``tool_calls``, ``tool_call_id``, and for an assistant
        ``reasoning_content`` / ``reasoning``) with the chat template, shaped as vLLM hands them
        over: a ``developer`` message is a ``system`` one, text parts are joined with ``"\n"``,
        tool calls' arguments are mappings (:func:`template_tool_calls`), and an assistant's
        reasoning (``reasoning_content``, else ``reasoning``) is both ``reasoning_content`` (what
        Qwen3's template re-renders for the turns of the current tool loop) and ``reasoning``.
        With ``opts.tools`` the template gets ``tools=``; a template that ignores them gets
        ``opts.tools_system_text`` as (the end of) the system message instead.

        Raises:
            RequestError: (``messages``) no tokenizer or chat template, an empty list, a bad role
                or content, a template error; (``continue_final_message``) both template switches;
                (``chat_template_kwargs``) kwargs that change what the template returns; a text
                too long for max_model_len (unless not ``check_chars``: the prompt is truncated).
        """
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer, so chat is unavailable; use /v1/completions "
                               "with token ids", "messages")
        if not messages:
            raise RequestError("messages must be a non-empty list", "messages")
        if opts.continue_final_message and opts.add_generation_prompt:
            raise RequestError("cannot set both continue_final_message and add_generation_prompt to true "
                               "(set add_generation_prompt: false to continue the last message)",
                               "continue_final_message")
        template = opts.template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise RequestError("this model has no chat template, so /v1/chat/completions cannot format "
                               "messages; start the server with --chat-template FILE or use /v1/completions",
                               "messages")
        msgs = []
        for i, m in enumerate(messages):
            role, content = _field(m, "role"), _field(m, "content")
            if role not in CHAT_ROLES:
                raise RequestError(f"messages[{i}].role {role!r} is not one of {', '.join(CHAT_ROLES)}",
                                   "messages")
            if isinstance(content, list):
                parts = []
                for p in content:
                    if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise RequestError(f"messages[{i}].content: only text parts are supported", "messages")
                    parts.append(p["text"])
                content = "\n".join(parts)
            elif content is None and role != "assistant":
                raise RequestError(f"messages[{i}].content is required for role {role!r}", "messages")
            elif content is not None and not isinstance(content, str):
                raise RequestError(f"messages[{i}].content must be a string or a list of text parts", "messages")
            if role == "tool" and not _field(m, "tool_call_id"):
                raise RequestError(f"messages[{i}].tool_call_id is required for role 'tool' (the id of the "
                                   f"assistant's tool call it answers)", f"messages[{i}].tool_call_id")
            msg = {"role": "system" if role == "developer" else role, "content": content or ""}
            for name in ("name", "tool_calls", "tool_call_id"):
                if _field(m, name) is not None:
                    msg[name] = _field(m, name)
            if isinstance(msg.get("tool_calls"), list):
                msg["tool_calls"] = template_tool_calls(msg["tool_calls"])
            reasoning = _field(m, "reasoning_content")
            if reasoning is None:
                reasoning = _field(m, "reasoning")
            if role == "assistant" and reasoning is not None:
                if not isinstance(reasoning, str):
                    raise RequestError(f"messages[{i}].reasoning_content must be a string", "messages")
                msg["reasoning_content"] = msg["reasoning"] = reasoning
            msgs.append(msg)

        def render(msgs, **extra):
            return self.tokenizer.apply_chat_template(
                msgs, chat_template=template, tokenize=False, add_generation_prompt=opts.add_generation_prompt,
                continue_final_message=opts.continue_final_message, **extra, **(opts.chat_template_kwargs or {}))

        try:
            text = render(msgs)
            if opts.tools is not None:
                with_tools = render(msgs, tools=opts.tools)
                if with_tools != text:
                    text = with_tools
                else:  # the template ignores tools: describe them in the system message
                    if msgs[0]["role"] == "system":
                        msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + opts.tools_system_text}
                    else:
                        msgs.insert(0, {"role": "system", "content": opts.tools_system_text})
                    if opts.format_tool_calls is not None:
                        msgs = _calls_in_content(msgs, opts.format_tool_calls, render)
                    text = render(msgs)
        except Exception as e:  # template errors are the request's fault (e.g. role order)
            raise RequestError(f"the chat template failed on these messages: {e}", "messages") from None
        if not isinstance(text, str):  # chat_template_kwargs such as return_dict / tokenize
            raise RequestError("chat_template_kwargs must not change what the template returns",
                               "chat_template_kwargs")
        if check_chars:
            self.check_prompt_chars(text, "messages")
        return text

    def tokenize_chat(self, messages: list, opts: ChatOptions, check_chars: bool = True) -> tuple[str, list[int]]:
        """(rendered text, token ids) of a conversation (see :meth:`render_chat`); the tokenizer adds
        no special tokens unless ``opts.add_special_tokens``. Raises RequestError."""
        text = self.render_chat(messages, opts, check_chars)
        return text, self.tokenizer.encode(text, add_special_tokens=opts.add_special_tokens)

    def tokenize_prompt(self, prompt: PromptType, check_chars: bool = True) -> tuple[Optional[str], list[int]]:
        """A str or a list of token ids -> (text or None, token ids).

        Raises:
            RequestError: a text prompt for a model without tokenizer, or one too long to fit
                (unless not ``check_chars``: the prompt is truncated).
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send the prompt as token ids", "prompt")
            if check_chars:
                self.check_prompt_chars(prompt)
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def truncate(self, text: Optional[str], ids: list[int], k: int) -> tuple[Optional[str], list[int]]:
        """``truncate_prompt_tokens``: the last ``k`` of ``ids`` (``k == -1``: the last
        ``max_model_len``), and the text those tokens decode to (None without a tokenizer); both
        unchanged when the prompt is no longer."""
        k = self.max_model_len if k == -1 else k
        if len(ids) <= k:
            return text, ids
        ids = ids[-k:]
        return (self.tokenizer.decode(ids) if self.tokenizer is not None else None), ids

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> int:
        """Check a request against the limits; return its effective max_tokens.

        Rules: the prompt needs >= 1 token, every id in ``[0, vocab_size)``; ``max_tokens`` omitted
        (None) means the remaining room ``min(max_model_len, KV cache tokens) - prompt_len``; prompt +
        max_tokens must not exceed ``max_model_len`` nor the KV cache (``SamplingParams`` hold
        ``max_tokens`` >= 1, so the result is >= 1).

        Raises:
            RequestError: naming the numbers.
        """
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty: at least 1 token is needed", "prompt")
        if n >= self.max_model_len:  # before the scan below: a hostile prompt can hold millions of ids
            raise RequestError(
                f"the prompt has {n} tokens, but max_model_len is {self.max_model_len} "
                f"(the prompt must leave room for at least 1 generated token)", "prompt", code=CONTEXT_LENGTH)
        self.check_token_ids(prompt_token_ids, "prompt")
        self.check_token_ids([t for t in sampling.logit_bias or ()], "logit_bias", "logit_bias: token id")
        room = min(self.max_model_len, self.num_kv_blocks * self.block_size) - n
        if sampling.max_tokens is None and room < 1:
            raise RequestError(
                f"the prompt has {n} tokens, but the KV cache holds only {self.num_kv_blocks} blocks of "
                f"{self.block_size} tokens (room for at least 1 generated token is needed)", "prompt",
                code=CONTEXT_LENGTH)
        max_tokens = sampling.max_tokens if sampling.max_tokens is not None else room
        if n + max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                f"max_model_len {self.max_model_len}", "max_tokens", code=CONTEXT_LENGTH)
        need = -(-(n + max_tokens) // self.block_size)
        if need > self.num_kv_blocks:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks, but the cache "
                f"holds only {self.num_kv_blocks} blocks of {self.block_size} tokens", "max_tokens",
                code=CONTEXT_LENGTH)
        return max_tokens
