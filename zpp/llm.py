"""Offline inference API, shaped like vLLM's ``LLM``.

The engine runs on a private asyncio loop in a background thread; ``generate`` submits every
prompt at once (continuous batching across them) and returns the finished outputs in order.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import inspect
import logging
import threading
import time
import weakref
from typing import Any, Callable, Optional, Sequence, Union

import torch

from zpp import config as _config
from zpp.args import engine_config, engine_settings
from zpp.config import ConfigError, EngineConfig
from zpp.errors import RequestError
from zpp.frontend.inputs import ChatOptions
from zpp.parsers.tool import HermesToolParser
from zpp.utils.process import freeze_gc
from zpp.outputs import RequestOutput
from zpp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = Union[str, list[int], dict[str, Any]]
"""A str, a list of token ids, ``{"prompt": str}`` or ``{"prompt_token_ids": [int, ...]}`` (vLLM's forms)."""

if _config.torch_threads_at_import is None:  # see cpu_threads_per_worker
    _config.torch_threads_at_import = torch.get_num_threads()

_PROMPT_FORMS = "a str, a list of token ids, {'prompt': str} or {'prompt_token_ids': [int, ...]}"


class LLM:
    """Load a model split into ``pipeline_parallel_size`` stages (each split over
    ``tensor_parallel_size`` ranks) and generate offline.

    Args:
        model: model directory (``config.json`` + safetensors + tokenizer). Default: the packaged
            demo model (SmolLM2-135M-Instruct, converted on first use).
        **settings: every engine flag of ``zpp serve`` (``zpp serve --help``), by the same name with
            underscores and with the same default; each is a field of ``zpp.config`` documented
            there, and ``help(LLM)`` lists them with their defaults. For example
            ``pipeline_parallel_size``, ``tensor_parallel_size`` (worker processes / GPUs per stage;
            workers: their product), ``device`` (``"auto"``: CUDA when available, else CPU),
            ``dtype``, ``max_model_len``, ``max_num_seqs``, ``kv_cache_memory`` (bytes or text such
            as ``"4GiB"``), ``pp_layer_partition`` (layers per stage, or ``"auto"``), ``nodes`` (extra
            hosts for ``zpp-node``), ``quantization="fp8"``, ``kv_cache_dtype="fp8"``. One difference
            from ``zpp serve``: on the CPU the default token budget per micro-batch is the offline one
            (``max_num_batched_tokens``: nobody waits between tokens here).
        generation_config: ``"auto"`` (the model's ``generation_config.json`` sampling defaults,
            used when ``generate`` / ``chat`` get no SamplingParams), ``"vllm"`` (``SamplingParams()``)
            or a directory (see :mod:`zpp.generation_config` and :meth:`get_default_sampling_params`).

    The workers stop on :meth:`shutdown`, at the end of a ``with LLM(...)`` block, when the object
    is garbage collected (``del llm``) and at interpreter exit, whichever comes first.

    Raises:
        TypeError: a keyword that is no engine setting (named).
        ConfigError: a bad setting (before any worker starts).
        WorkerDiedError: a worker failed while starting.
    """

    def __init__(self, model: Optional[str] = None, **settings: Any):
        if settings.get("node_rank"):
            raise ConfigError(f"node_rank={settings['node_rank']}: the LLM runs on node rank 0 (the head); start the "
                              f"other node ranks with `zpp serve --node-rank R`")
        self._generation_config = settings.pop("generation_config", "auto")
        _vllm_only_keywords(settings)
        self._start(engine_config(model, streaming=False, **settings))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        """Start an LLM from a ready EngineConfig (used by the CLI benchmarks)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        from zpp.frontend.async_engine import AsyncEngine, validate_startup
        from zpp.generation_config import generation_defaults, log_generation_defaults
        self.config = config
        validate_startup(config)
        source = getattr(self, "_generation_config", "auto")
        self._generation_defaults = generation_defaults(config.model.model, source)
        log_generation_defaults(self._generation_defaults, source, config.model.model)
        runtime = _Runtime()
        try:
            self.engine = runtime.engine = runtime.call(AsyncEngine.start(config))
        except BaseException:
            runtime.close()
            raise
        self._runtime = runtime
        freeze_gc()  # the engine's loop runs in this process: keep full collections short (see freeze_gc)
        runtime.froze_gc = True
        # Holds no reference to self: runs on shutdown(), on garbage collection or at exit.
        self._finalizer = weakref.finalize(self, runtime.close)

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was shut down (LLM.shutdown()): create a new LLM to generate")

    def _call(self, coro):
        """Run a coroutine on the engine's loop and wait for it (tests drive the engine this way).
        Raises RuntimeError after shutdown()."""
        self._check_open()
        return self._runtime.call(coro)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams ``generate`` and ``chat`` use when given none: ``SamplingParams()``
        with the model's recommended defaults (its ``generation_config.json``; see
        ``generation_config``) applied, as vLLM's method of that name."""
        from zpp.generation_config import default_sampling_params
        return default_sampling_params(self._generation_defaults)

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: Union[bool, Callable[..., Any]] = True) -> list[RequestOutput]:
        """Generate for every prompt, all batched together.

        Args:
            prompts: one prompt or a list of them; a prompt is a str, a list of token ids,
                ``{"prompt": str}`` or ``{"prompt_token_ids": [int, ...]}`` (vLLM's forms).
            sampling_params: one for all prompts, or one per prompt (default:
                :meth:`get_default_sampling_params`).
            use_tqdm: show a progress bar on stderr (a callable: the tqdm class to use).

        Returns one finished RequestOutput per prompt, in the order given. Ctrl-C aborts the
        prompts still running and raises KeyboardInterrupt; the LLM stays usable.

        Raises:
            TypeError: a prompt is none of the forms above.
            RequestError: a prompt breaks a limit (nothing is generated then).
            EngineDeadError: a worker died.
            RuntimeError: the LLM was shut down.
        """
        self._check_open()
        prompts = _parse_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return self._runtime.call(self._generate_all(prompts, _params_for(sampling_params, len(prompts)), use_tqdm))

    def chat(self, messages, sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: Union[bool, Callable[..., Any]] = True, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: Optional[dict] = None, tools: Optional[list] = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or to several
        (a list of such lists), formatted with the tokenizer's chat template (or ``chat_template``),
        by the same rendering as ``zpp serve``'s /v1/chat/completions (roles ``system``, ``user``,
        ``assistant``, ``tool``, ``developer``; text content parts; ``tools`` handed to the template).
        Each output's ``prompt`` is the rendered conversation. ``chat_template_kwargs`` (e.g.
        ``{"enable_thinking": False}``) go to the template, as in vLLM; the output text is returned
        as generated (no tool or reasoning parsing offline).

        Raises:
            RequestError: (a ValueError) the model has no tokenizer or no chat template, a message
                is malformed, the template fails, or a conversation breaks a limit.
            RuntimeError: the LLM was shut down.
        """
        self._check_open()
        if not messages:  # one empty conversation or none: the server's 400 for an empty list
            raise RequestError("messages must be a non-empty list (one conversation) or a list of them", "messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        opts = ChatOptions(template=chat_template, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
                           tools=tools, tools_system_text=None if tools is None else _tools_text(tools),
                           format_tool_calls=None if tools is None else HermesToolParser().format_calls)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _params_for(sampling_params, len(conversations))
        return self._runtime.call(self._generate_all(conversations, params, use_tqdm, chat=opts))

    async def _generate_all(self, prompts, params, use_tqdm, chat: Optional[ChatOptions] = None):
        engine = self.engine
        # Every check, rendering, tokenization and grammar compile, before anything is queued.
        if chat is None:
            prepared = [await engine.prepare(p, sp) for p, sp in zip(prompts, params)]
        else:
            prepared = [await engine.prepare(sampling=sp, messages=c, chat=chat) for c, sp in zip(prompts, params)]
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = (use_tqdm if callable(use_tqdm) else tqdm)(total=len(prompts), desc="Processed prompts",
                                                               dynamic_ncols=True)
        t0, tokens_in, tokens_out = time.perf_counter(), 0, 0

        async def one(req):
            nonlocal tokens_in, tokens_out
            final = None
            async for out in engine.generate(req, stream=False):
                final = out
            if bar is not None:
                tokens_in += len(final.prompt_token_ids)
                tokens_out += sum(len(c.token_ids) for c in final.outputs)
                dt = max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix_str(f"est. speed input: {tokens_in / dt:.2f} toks/s, "
                                    f"output: {tokens_out / dt:.2f} toks/s", refresh=False)
                bar.update(1)
            return final

        # Queued SUBMIT_CHUNK prompts at a time, the engine's loop running between chunks: the first
        # micro-batches start while the rest are still being queued (30,000 prompts queued at once
        # kept the GPU idle ~3 s, 2% of the run).
        tasks: list[asyncio.Future] = []
        with _frozen_while_running(len(prepared)) as freeze:
            try:
                for i in range(0, len(prepared), SUBMIT_CHUNK):
                    tasks += [asyncio.ensure_future(one(req)) for req in prepared[i:i + SUBMIT_CHUNK]]
                    await asyncio.sleep(0)  # each new task runs to its first wait: its request is queued
                    freeze()
                return list(await asyncio.gather(*tasks))
            except BaseException:  # cancelled (Ctrl-C) or failed: none of the prompts may run on
                for t in tasks:
                    t.cancel()
                raise
            finally:
                if bar is not None:
                    bar.close()

    def shutdown(self) -> None:
        """Stop the workers and the engine loop. Idempotent; afterwards ``generate`` and ``chat``
        raise RuntimeError. Also runs on garbage collection and at interpreter exit."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _signature() -> inspect.Signature:
    """``LLM.__init__``'s signature with every engine setting (for ``help(LLM)`` and editors)."""
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD), P("model", P.POSITIONAL_OR_KEYWORD, default=None,
                                                     annotation=Optional[str])]
    params += [P(s.name, P.KEYWORD_ONLY, default=s.default, annotation=s.type) for s in engine_settings()]
    return inspect.Signature(params)


LLM.__init__.__signature__ = _signature()


SUBMIT_CHUNK = 256
"""``generate`` / ``chat`` queue their prompts this many at a time (the engine schedules in between)."""
FREEZE_MIN_PROMPTS = 512
"""A ``generate`` / ``chat`` call of at least this many prompts freezes its per-prompt objects out of
the cyclic garbage collector's reach while it runs (:func:`_frozen_while_running`)."""


@contextlib.contextmanager
def _frozen_while_running(num_prompts: int):
    """Keep full garbage collections short while a large batch of prompts runs.

    Each prompt of ``generate`` is a task (its coroutine, context, prepared request, lists): 30,000
    prompts are ~200,000 objects that every full collection walked, and the engine's loop runs in
    this process, so each one stalled the GPU (H100, 30,000 x 128/128: ~20 pauses of 220-470 ms
    between a micro-batch's scheduling and its send, ``ZPP_TRACE``). They live until the call ends,
    so they are frozen (``gc.freeze``) once created: yields a function that freezes what exists now
    (called after each chunk of prompts is queued). They are still freed by reference counting as
    each prompt finishes. At the end everything is unfrozen, collected once (cycles the finished
    prompts left) and what start-up froze is frozen again (:func:`zpp.utils.process.freeze_gc`).
    Below ``FREEZE_MIN_PROMPTS`` prompts, or with the collector disabled, nothing is done."""
    if num_prompts < FREEZE_MIN_PROMPTS or not gc.isenabled():
        yield lambda: None
        return
    gc.freeze()
    try:
        yield gc.freeze  # called again as prompts are queued: their tasks' objects too
    finally:
        gc.unfreeze()
        freeze_gc()


_WAKE_S = 0.1  # how often a waiting main thread wakes to run signal handlers (Ctrl-C)


class _Runtime:
    """The private event loop (in a daemon thread) and the engine on it. Holds no reference to the
    LLM, so that the LLM's finalizer can close it."""

    def __init__(self):
        self.engine = None
        self.froze_gc = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="zpp-engine-loop", daemon=True)
        self.thread.start()

    def call(self, coro):
        """Run ``coro`` on the loop and wait for it. On Ctrl-C, cancel it (its requests are
        aborted), wait for that, and raise KeyboardInterrupt."""
        done = threading.Event()

        async def run():
            try:
                return await coro
            finally:
                done.set()

        fut = asyncio.run_coroutine_threadsafe(run(), self.loop)
        try:
            # Wait in short slices: the kernel may hand a Ctrl-C to any thread (the loop's, a
            # worker-watch thread...), and then only a main thread that wakes up runs Python's
            # handler; an untimed wait would sleep through it until generate() ended by itself.
            while True:
                try:
                    return fut.result(timeout=_WAKE_S)
                except concurrent.futures.TimeoutError:
                    if fut.done():  # the coroutine itself raised TimeoutError
                        raise
        except KeyboardInterrupt:
            fut.cancel()
            deadline = time.monotonic() + 10
            while not done.wait(_WAKE_S) and time.monotonic() < deadline:
                pass
            raise KeyboardInterrupt from None

    def close(self) -> None:
        """Stop the engine (and its workers), cancel what is left on the loop, stop and close it."""
        if self.froze_gc:  # what start-up froze may be collected again
            self.froze_gc = False
            gc.unfreeze()
        if threading.current_thread() is self.thread:  # collected on the loop thread itself
            self.loop.create_task(self._close()).add_done_callback(lambda _: self.loop.stop())
            return
        if self.thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(timeout=60)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()

    async def _close(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _vllm_only_keywords(settings: dict) -> None:
    """vLLM's ``LLM`` keywords with no meaning here, taken out of ``settings``: ``trust_remote_code``
    and ``swap_space`` (a warning each when set), ``distributed_executor_backend`` (``mp`` and
    ``uni`` warn; ``ray``: ConfigError); ``download_dir`` / ``revision``: ConfigError (zpp does not
    download models)."""
    for name in ("download_dir", "revision"):
        if settings.pop(name, None) is not None:
            raise ConfigError(f"{name}: zpp does not download models; give a local model directory")
    backend = settings.pop("distributed_executor_backend", None)
    if backend == "ray":
        raise ConfigError("distributed_executor_backend='ray': zpp has no Ray; it starts its workers itself")
    if backend is not None:
        logger.warning("distributed_executor_backend=%r: has no effect (zpp starts its workers itself)", backend)
    if settings.pop("trust_remote_code", False):
        logger.warning("trust_remote_code=True: zpp runs no code from model directories (its own model classes "
                       "only); ignored")
    if settings.pop("swap_space", None) is not None:
        logger.warning("swap_space: has no effect (zpp recomputes preempted requests; there is no CPU swap space)")


def _params_for(sampling_params, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt (default ``SamplingParams()``). Raises ValueError on a count mismatch."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if len(sampling_params) != count:
        raise ValueError(f"{len(sampling_params)} sampling params for {count} prompts")
    return list(sampling_params)


def _tools_text(tools: list) -> str:
    """The system text describing ``tools`` for a chat template that ignores them."""
    from zpp.server.tools import parse_tools
    return parse_tools(tools, "auto", None).system_text()


def _parse_prompts(prompts) -> list[Union[str, list[int]]]:
    """vLLM's prompt forms -> strings and token-id lists. Raises TypeError naming the bad prompt."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a prompt or a list of prompts ({_PROMPT_FORMS}), "
                        f"got {type(prompts).__name__}")
    return [_parse_prompt(p, i) for i, p in enumerate(prompts)]


def _parse_prompt(p, i: int) -> Union[str, list[int]]:
    if isinstance(p, dict):
        extra = sorted(set(p) - {"prompt", "prompt_token_ids"})
        if extra or not p:
            raise TypeError(f"prompt {i}: unsupported key(s) {extra or 'none'}; zpp takes {_PROMPT_FORMS}")
        if "prompt_token_ids" in p:
            if _is_token_ids(p["prompt_token_ids"]):
                return list(p["prompt_token_ids"])
            raise TypeError(f"prompt {i}: 'prompt_token_ids' must be a list of ints")
        if isinstance(p["prompt"], str):
            return p["prompt"]
        raise TypeError(f"prompt {i}: 'prompt' must be a str")
    if isinstance(p, str):
        return p
    if _is_token_ids(p):
        return list(p)
    raise TypeError(f"prompt {i} is a {type(p).__name__} ({str(p)[:40]}): give {_PROMPT_FORMS}")


def _is_token_ids(p) -> bool:
    return isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
