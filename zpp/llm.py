"""Offline inference API, shaped like vLLM's ``LLM``.

The engine runs on a private asyncio loop in a background thread; ``generate`` submits every
prompt at once (continuous batching across them) and returns the finished outputs in order.
"""
from __future__ import annotations

import asyncio
import atexit
import threading
from typing import Optional, Sequence, Union

from zpp.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, parse_size
from zpp.outputs import RequestOutput
from zpp.sampling_params import SamplingParams

Prompt = Union[str, list[int]]


class LLM:
    """Load a model split into ``pipeline_parallel_size`` stages (each split over
    ``tensor_parallel_size`` ranks) and generate offline.

    Args:
        model: model directory (``config.json`` + safetensors + tokenizer). Default: the packaged
            demo model (SmolLM2-135M-Instruct, converted on first use).
        pipeline_parallel_size: number of stages.
        tensor_parallel_size: worker processes (GPUs) per stage, Megatron-LM tensor parallelism
            (LLaMA family only; must divide the attention and KV heads). Workers:
            ``pipeline_parallel_size * tensor_parallel_size``.
        device: ``"cpu"`` or ``"cuda"``.
        dtype: ``"auto"`` (float32 on CPU, bfloat16 on CUDA), ``"float32"``, ``"bfloat16"``, ``"float16"``.
        Other keyword arguments map to the CLI flags of ``zpp serve`` (``max_model_len``,
        ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``, ``num_kv_blocks``,
        ``kv_cache_memory``, ``enable_prefix_caching``, ``enable_chunked_prefill``,
        ``pp_layer_partition``, ``pipeline_depth``, ``load_format``, ``seed``, ``tokenizer``,
        ``gpu_memory_utilization``, ``enforce_eager``, ``nodes``: extra hosts for ``zpp-node``,
        ``distributed_host``, ``node_command``).

    Raises:
        ConfigError: a bad setting (before any worker starts).
        WorkerDiedError: a worker failed while starting.
    """

    def __init__(self, model: Optional[str] = None, *, pipeline_parallel_size: int = 1,
                 tensor_parallel_size: int = 1, device: str = "cpu", dtype: str = "auto",
                 max_model_len: Optional[int] = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: Optional[int] = None, block_size: int = 16,
                 num_kv_blocks: Optional[int] = None, kv_cache_memory=None,
                 gpu_memory_utilization: float = 0.9, enable_prefix_caching: bool = False,
                 enable_chunked_prefill: bool = True, pp_layer_partition: Optional[Sequence[int]] = None,
                 pipeline_depth: Optional[int] = None, load_format: str = "safetensors", seed: int = 0,
                 tokenizer: Optional[str] = None, enforce_eager: bool = False, nodes: Sequence[str] = (),
                 distributed_host: Optional[str] = None, node_command: str = "zpp-node"):
        if model is None:
            from zpp.demo import prepare_demo_model
            model = prepare_demo_model()
        self.config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, tokenizer=tokenizer,
                              load_format=load_format, seed=seed),
            parallel=ParallelConfig(pipeline_parallel_size=pipeline_parallel_size,
                                    tensor_parallel_size=tensor_parallel_size, device=device, nodes=tuple(nodes),
                                    distributed_host=distributed_host, node_command=node_command,
                                    pp_layer_partition=tuple(pp_layer_partition) if pp_layer_partition else None),
            cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                              kv_cache_memory=parse_size(kv_cache_memory),
                              gpu_memory_utilization=gpu_memory_utilization,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      enable_chunked_prefill=enable_chunked_prefill,
                                      pipeline_depth=pipeline_depth),
            enforce_eager=enforce_eager)
        self._start(self.config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        """Start an LLM from a ready EngineConfig (used by the CLI benchmarks)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        from zpp.engine.async_engine import AsyncEngine, validate_startup
        self.config = config
        self._closed = True
        validate_startup(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="zpp-engine-loop", daemon=True)
        self._thread.start()
        try:
            self.engine = self._call(AsyncEngine.start(config))
        except BaseException:
            self._stop_loop()
            raise
        self._closed = False
        atexit.register(self.shutdown)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists), all batched together.

        Returns one finished RequestOutput per prompt, in the order given.

        Raises:
            RequestError: a prompt breaks a limit (nothing is generated then).
            EngineDeadError: a worker died.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        return self._call(self._generate_all(prompts, list(sampling_params), use_tqdm))

    def chat(self, messages, sampling_params: Optional[SamplingParams] = None, use_tqdm: bool = False,
             chat_template: Optional[str] = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or to several
        (a list of such lists), formatted with the tokenizer's chat template (or ``chat_template``).

        Raises:
            ValueError: the model has no tokenizer or no chat template.
        """
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so chat() cannot format messages")
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template; pass chat_template=...")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [tok.encode(tok.apply_chat_template(c, chat_template=chat_template, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt),
                              add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    async def _generate_all(self, prompts, params, use_tqdm):
        engine = self.engine
        for p, sp in zip(prompts, params):  # validate everything before queuing anything
            engine.validate(engine.tokenize_prompt(p)[1], sp)
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(prompts), desc="Processed prompts")

        async def one(p, sp):
            final = None
            async for out in engine.generate(p, sp, stream=False):
                final = out
            if bar is not None:
                bar.update(1)
            return final

        try:
            return list(await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params))))
        finally:
            if bar is not None:
                bar.close()

    def shutdown(self) -> None:
        """Stop the workers and the engine loop. Idempotent; also runs at interpreter exit."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            self._call(self.engine.shutdown())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
