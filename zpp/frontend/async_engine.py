"""The asyncio engine front end: request intake, output processing, and the engine core behind it.

``AsyncEngine`` tokenizes and validates requests (:mod:`zpp.frontend.inputs`), fans ``n`` out into
sequences, hands them to the engine core (:mod:`zpp.engine.core`: scheduler, KV blocks,
executor) and turns the core's per-step deltas into each request's outputs
(:mod:`zpp.frontend.output_processor`: detokenization, stop strings, logprobs).

The core runs either on the same event loop (``in_process=True``: the offline ``LLM``, tests) or
in its own process behind ZeroMQ (``in_process=False``: ``zpp serve``, see
:mod:`zpp.frontend.core_client`), so HTTP, tokenization and detokenization never hold up the
pipeline loop. The two paths share every class but the transport.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
from typing import AsyncIterator, Optional, Union

from zpp.config import EngineConfig
from zpp.errors import ConfigError, EngineBusyError, EngineDeadError, EngineShutdownError, RequestError
from zpp.transport.core_messages import CoreRequest, EngineStats, GrammarSpec, StepOutputs
from zpp.frontend.core_client import CoreClient, CoreProcessClient, InProcessCoreClient
from zpp.frontend.inputs import ChatOptions, InputProcessor, PreparedRequest, PromptType, off_loop_if_large, text_size
from zpp.frontend.output_processor import OutputProcessor, _Group
from zpp.frontend.grammar import GrammarCompiler
from zpp.models.partition import partition_layers
from zpp.models.registry import resolve_model_class
from zpp.outputs import RequestOutput
from zpp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineBusyError", "EngineDeadError", "EngineShutdownError", "RequestError", "PromptType"]


RESTART_QUEUE_PER_SEQ = 4
"""While a stage restarts, new requests queue up to this many times ``--max-num-seqs`` waiting
sequences; past that they are refused with :class:`EngineBusyError`."""


class AsyncEngine:
    """Serve requests on a pipeline of stage workers.

    Create with ``await AsyncEngine.start(config)``; call :meth:`generate` per request; call
    :meth:`shutdown` to stop the core and every worker.
    """

    def __init__(self, config: EngineConfig, tokenizer, eos_token_ids: set[int], client: CoreClient):
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.client = client
        self.max_model_len = config.max_model_len
        self.vocab_size = int(config.model.hf_config["vocab_size"])
        self.output = OutputProcessor(tokenizer, self._abort_in_core)
        self.inputs: Optional[InputProcessor] = None
        self.grammar: Optional[GrammarCompiler] = None
        self._ids = itertools.count()
        self.dead: Optional[str] = None

    # --- lifecycle ----------------------------------------------------------------------------
    @classmethod
    async def start(cls, config: EngineConfig, in_process: bool = True, core_address: Optional[str] = None,
                    front_end_index: int = 0) -> "AsyncEngine":
        """Validate the configuration, start the engine core and its workers.

        Args:
            in_process: run the core on this event loop (True) or in its own process (False).
            core_address: join the core process already serving at this ZeroMQ address (another
                front end of ``--api-server-count``) instead of starting one.
            front_end_index: this front end's number among those sharing the core.

        Cancelling it (``zpp serve`` on SIGINT / SIGTERM during start-up) stops the core and every
        worker started so far before the CancelledError propagates.

        Raises:
            ConfigError: bad configuration (before any worker starts or weight loads).
            WorkerDiedError: a worker (or the core process) failed to start.
        """
        validate_startup(config)
        tokenizer = load_tokenizer(config)
        eos = eos_token_ids(config.model.model, config.model.hf_config, tokenizer)
        if in_process:
            client = InProcessCoreClient()
        else:
            client = CoreProcessClient(core_address, front_end_index)
        engine = cls(config, tokenizer, eos, client)
        so = config.structured_outputs
        engine.grammar = GrammarCompiler(tokenizer, engine.vocab_size, eos, so.compile_timeout, so.max_spec_bytes,
                                         so.max_grammar_bytes, so.json_whitespace)
        # Serving: the grammar compile host starts while the workers load, so that no HTTP request
        # waits for it. Offline (in process) it starts with the first structured-output request:
        # an LLM that never asks for one does not pay a process importing xgrammar.
        warm = asyncio.ensure_future(engine.grammar.warm_up() if not in_process else asyncio.sleep(0))
        try:
            await client.start(config, eos, engine._on_step, engine._on_core_dead)
            await warm
        except BaseException:  # a failed start, or cancelled (a signal): leave no core or worker behind
            warm.cancel()
            engine.grammar.close()
            await client.shutdown()
            raise
        engine.inputs = InputProcessor(tokenizer, engine.vocab_size, engine.max_model_len,
                                       client.num_kv_blocks, client.block_size)
        return engine

    async def shutdown(self) -> None:
        """Stop the core and every worker (idempotent)."""
        if self.grammar is not None:
            self.grammar.close()
        await self.client.shutdown()

    def kill(self) -> None:
        """Stop the workers now (a second Ctrl-C), without waiting for requests."""
        self.client.kill()

    @property
    def is_healthy(self) -> bool:
        return self.dead is None

    def stats(self) -> EngineStats:
        """The core's counters after its latest step (see :class:`EngineStats`)."""
        return self.client.stats()

    @property
    def metrics(self):
        return self.output.metrics

    @metrics.setter
    def metrics(self, observer) -> None:
        self.output.metrics = observer

    # The in-process core's parts, for tests and benchmarks that look inside.
    @property
    def core(self):
        core = getattr(self.client, "core", None)
        if core is None:
            raise AttributeError("the engine core runs in another process")
        return core

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv(self):
        return self.core.kv

    @property
    def executor(self):
        return self.core.executor

    def _on_core_dead(self, reason: str) -> None:
        self.dead = reason
        self.output.end_all(EngineDeadError(reason))

    def abort_all(self, reason: str = "the server is shutting down") -> None:
        """End every request in progress with :class:`EngineShutdownError` (their streams get an
        error event; each request is then aborted by its ``generate`` and its blocks freed)."""
        self.output.end_all(EngineShutdownError(reason))

    # --- requests -----------------------------------------------------------------------------
    async def prepare(self, prompt: Optional[PromptType] = None, sampling: Optional[SamplingParams] = None, *,
                      messages: Optional[list] = None, chat: Optional[ChatOptions] = None,
                      grammar_param: Optional[str] = None,
                      rename: Optional[dict[str, str]] = None) -> PreparedRequest:
        """The one way in for a request: every check, the chat rendering, the tokenization, the
        ``max_tokens`` resolution and the grammar compile, once. :meth:`generate` queues the result
        as it is.

        Args:
            prompt: a text or token ids; or ``messages`` (a conversation, rendered with ``chat``,
                default :class:`ChatOptions`), not both.
            sampling: the sampling parameters (default ``SamplingParams()``).
            grammar_param: the request field a structured-output constraint came from
                (``response_format``, ``tools``, ...): a grammar error then reads
                ``"<grammar_param>: <error>"`` and names it.
            rename: maps a parameter to the request field the client sent for it
                (``max_tokens`` -> ``max_completion_tokens``), for the errors' ``param``.

        Large texts are rendered and tokenized in a worker thread, off the event loop.

        Raises:
            RequestError: the request breaks a limit or its grammar cannot be compiled.
        """
        sampling = sampling if sampling is not None else SamplingParams()
        truncate = sampling.truncate_prompt_tokens
        try:
            if messages is not None:
                opts = chat or ChatOptions()
                text, ids = await off_loop_if_large(self.inputs.tokenize_chat, messages, opts, truncate is None,
                                                     size=text_size(messages) + 100 * len(messages))
            else:
                text, ids = await off_loop_if_large(self.inputs.tokenize_prompt, prompt, truncate is None,
                                                     size=text_size(prompt) if isinstance(prompt, str) else 0)
            if truncate is not None:
                text, ids = self.inputs.truncate(text, ids, truncate)
            self.inputs.check_stop_token_ids(sampling)
            max_tokens = self.inputs.validate(ids, sampling)
            try:
                grammar = await self.compile_grammar(sampling)
            except RequestError as e:
                if grammar_param is None:
                    raise
                raise RequestError(f"{grammar_param}: {e}", grammar_param) from None
        except RequestError as e:
            if messages is not None and e.param == "prompt":  # a chat request has no field "prompt"
                e = RequestError(str(e), "messages", e.status, e.err_type, e.code, e.unknown_fields, e.headers)
            if rename:
                raise e.renamed(rename) from None
            raise e from None
        return PreparedRequest(text, ids, sampling, max_tokens, grammar)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """See :meth:`InputProcessor.tokenize_prompt`."""
        return self.inputs.tokenize_prompt(prompt)

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> int:
        """See :meth:`InputProcessor.validate` (returns the effective max_tokens; raises RequestError)."""
        return self.inputs.validate(prompt_token_ids, sampling)

    async def compile_grammar(self, sampling: SamplingParams) -> Optional[GrammarSpec]:
        """The compiled grammar of a structured-output request (None without ``structured_outputs``);
        compiled off the event loop, cached by specification, so calling it again is cheap.

        Raises:
            RequestError: (``param`` ``"structured_outputs"``) the grammar is too large, does not
                compile (xgrammar's message) or took longer than the compile timeout.
        """
        if sampling.structured_outputs is None:
            return None
        return await self.grammar.compile(sampling.structured_outputs)

    async def generate(self, prompt: Union[PromptType, PreparedRequest], sampling: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None, stream: bool = True) -> AsyncIterator[RequestOutput]:
        """Submit a request and iterate over its outputs (cumulative; the last has finished=True).
        With ``stream=False`` only the final output is produced (cheaper for offline batches).

        ``prompt`` is a text or token ids (prepared here, with ``sampling``), or a
        :class:`PreparedRequest` from :meth:`prepare` (queued as it is; ``sampling`` unused).

        Raises:
            RequestError: the request breaks a limit, or its structured-output grammar cannot be
                compiled (before it is queued).
            EngineDeadError: a worker died.
        """
        prepared = prompt if isinstance(prompt, PreparedRequest) else await self.prepare(prompt, sampling)
        group = self.add_request(prepared, request_id, stream)
        try:
            while True:
                item = await group.queue.get()
                while not group.queue.empty() and not isinstance(item, Exception):
                    item = group.queue.get_nowait()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not group.finished:
                self.abort(group.request_id)

    def add_request(self, prepared: PreparedRequest, request_id: Optional[str] = None, stream: bool = True) -> _Group:
        """Queue a request made by :meth:`prepare`. Raises RequestError (the id is in use),
        EngineDeadError, EngineBusyError."""
        if self.dead:
            raise EngineDeadError(self.dead)
        sampling = prepared.sampling
        st = self.stats()
        cap = RESTART_QUEUE_PER_SEQ * self.config.scheduler.max_num_seqs
        if st.recovering and st.num_waiting + sampling.n > cap:
            raise EngineBusyError(f"a pipeline stage is restarting and {st.num_waiting} sequences already wait (at most "
                                  f"{cap} during a restart: {RESTART_QUEUE_PER_SEQ} x --max-num-seqs); retry shortly")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.output.groups:
            raise RequestError(f"request id {rid!r} is already in use", "request_id")
        n = sampling.n
        seq_ids = [f"{rid}#{i}" for i in range(n)] if n > 1 else [rid]
        front = getattr(self.client, "index", 0)
        if front:  # --api-server-count > 1: ids are checked per front end, so the core's are made distinct
            seq_ids = [f"{sid}@api{front}" for sid in seq_ids]
        group = self.output.new_group(rid, prepared.prompt, prepared.prompt_token_ids, sampling, seq_ids, stream)
        if prepared.max_tokens == 0:
            self.output.finish_empty(group)
            return group
        grammar = self.grammar.for_core(prepared.grammar) if prepared.grammar is not None else None
        reqs = []
        for i, sid in enumerate(seq_ids):
            sp = sampling
            if n > 1 and sampling.seed is not None:
                sp = sampling.clone(seed=(sampling.seed + i * 7919) & 0x7FFFFFFFFFFFFFFF)
            reqs.append(CoreRequest(sid, prepared.prompt_token_ids, sp, prepared.max_tokens, grammar))
        self.output.add(group)
        self.client.add(reqs)
        return group

    def abort(self, request_id: str) -> None:
        """Abort a request (client went away). Its blocks are freed once no batch in flight
        writes them; results arriving for it are dropped."""
        self._abort_in_core(self.output.abort(request_id))

    def _abort_in_core(self, seq_ids: list[str]) -> None:
        if seq_ids and not self.dead:
            self.client.abort(seq_ids)

    def _on_step(self, step: StepOutputs) -> None:
        self.output.process(step)


# --- start-up helpers -------------------------------------------------------------------------
def validate_startup(config: EngineConfig) -> None:
    """Every check that must fail before any worker starts (one-line ConfigError)."""
    config.validate()
    hf = config.model.hf_config
    cls = resolve_model_class(hf, config.parallel.tensor_parallel_size)
    partition_layers(cls.num_layers_of(hf), config.parallel.pipeline_parallel_size,
                     config.parallel.pp_layer_partition)
    model = config.model.model
    if config.model.load_format == "safetensors" and not any(f.endswith(".safetensors") for f in os.listdir(model)):
        raise ConfigError(f"model {model!r}: no *.safetensors weights in that directory "
                          "(zpp reads safetensors only; --load-format dummy for random weights)")
    if config.parallel.device == "cuda":
        import torch
        n = torch.cuda.device_count()
        if config.parallel.share_gpu and config.parallel.tensor_parallel_size > 1:
            raise ConfigError("--tensor-parallel-size > 1 needs one GPU per rank (NCCL); ZPP_SHARE_GPU=1 is for PP only")
        par = config.parallel
        if par.nnodes > 1 and not par.share_gpu:  # per-node launch: this host's own ranks
            from zpp.node.placement import split_ranks
            need = len(split_ranks(par.world_size, [None] * par.nnodes)[par.node_rank])
            if need > n:
                raise ConfigError(f"node rank {par.node_rank} runs {need} of the {par.world_size} ranks "
                                  f"(--nnodes {par.nnodes}), needing {need} GPUs, but this host has {n}")
        elif not par.nodes and par.world_size > n and not par.share_gpu:
            raise ConfigError(f"--pipeline-parallel-size x --tensor-parallel-size = {par.world_size} "
                              f"GPUs needed, but this host has {n}")
    from zpp.plan import check_fits_at_start
    check_fits_at_start(config)  # weights + margins against each stage's memory, before any worker starts


def load_tokenizer(config: EngineConfig):
    """The HF tokenizer of the model (or ``--tokenizer``); None if the directory has none.

    Raises:
        ConfigError: ``--tokenizer`` names a directory without tokenizer files, or the tokenizer
            files there do not load (the message names the directory and transformers' error).
    """
    path = config.model.tokenizer or config.model.model
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                "tokenizer.model", "vocab.json")):
        if config.model.tokenizer:
            raise ConfigError(f"--tokenizer {path!r}: no tokenizer files in that directory")
        logger.warning("no tokenizer in %s: prompts must be token ids and outputs have no text", path)
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"the tokenizer in {path!r} does not load: {type(e).__name__}: {first[:300]}") from e


def eos_token_ids(model_dir: str, hf: dict, tokenizer) -> set[int]:
    ids: set[int] = set()
    sources = [hf]
    try:
        with open(os.path.join(model_dir, "generation_config.json")) as f:
            sources.append(json.load(f))
    except (OSError, ValueError):
        pass
    for src in sources:
        e = src.get("eos_token_id")
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, list):
            ids.update(x for x in e if isinstance(x, int))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
