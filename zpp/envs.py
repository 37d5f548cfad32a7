"""Every ``ZPP_*`` environment variable zpp reads, with its type, default and meaning.

Read one as an attribute: ``zpp.envs.ZPP_TRACE`` parses ``os.environ`` at that moment (so a test's
``monkeypatch.setenv`` is seen by the next read); modules that decide once keep the value they
read at import. No code in ``zpp/`` reads a ``ZPP_*`` variable from ``os.environ`` directly
(``tests/test_settings.py`` greps for it). Settings a user chooses are flags (``zpp/config.py``);
these variables are for what a flag cannot reach: a child process's testing switches, kernel A/B
switches and per-host facts. The engine's workers, its ``zpp-node`` agents and the processes those
start inherit the environment, so a variable set where ``zpp serve`` starts reaches them all.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class EnvVar:
    """One ``ZPP_*`` variable: ``parse`` turns the raw value (None when unset) into the typed value."""

    name: str
    type: str
    """The parsed value's type, as written in the docs (``bool``, ``str``, ``Optional[str]``...)."""
    parse: Callable[[Optional[str]], Any]
    doc: str

    @property
    def default(self) -> Any:
        """The value when the variable is unset."""
        return self.parse(None)

    def read(self) -> Any:
        return self.parse(os.environ.get(self.name))


def _on_unless_0(raw: Optional[str]) -> bool:
    return raw != "0"


def _on_if_1(raw: Optional[str]) -> bool:
    return raw == "1"


def _text_or_none(raw: Optional[str]) -> Optional[str]:
    return raw or None


def _text(default: str) -> Callable[[Optional[str]], str]:
    return lambda raw: default if raw is None else raw


def _int_or_none(raw: Optional[str]) -> Optional[int]:
    return int(raw) if raw else None


def _tri_state(raw: Optional[str]) -> Optional[bool]:
    return {"0": False, "1": True}.get(raw or "")


VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("ZPP_CACHE", "str", _text("~/.cache/zpp"),
           "Directory of zpp's own files: the demo model converted from the packaged GGUF "
           "(``zpp prepare-demo-model``). ``~`` is expanded."),
    EnvVar("ZPP_HOST_IP", "Optional[str]", _text_or_none,
           "Multi-host: the head's address that every node reaches, when ``--distributed-host`` is not "
           "given (like vLLM's ``VLLM_HOST_IP``). Unset: the address on the route to the first node."),
    EnvVar("ZPP_SSH", "str", _text("ssh -o BatchMode=yes -o ConnectTimeout=10 -o ServerAliveInterval=5 "
                                   "-o ServerAliveCountMax=3"),
           "The command (split like a shell would) that starts ``zpp-node`` on each host of ``--nodes``; "
           "the host and the remote command are appended. Tests point it at a stand-in."),
    EnvVar("ZPP_TRACE", "Optional[str]", _text_or_none,
           "A directory: every process of the run (engine and workers) writes a Chrome-trace timeline "
           "of its steps there (``zpp.trace``). Unset: no tracing."),
    EnvVar("ZPP_SHARE_GPU", "bool", _on_if_1,
           "``1``: testing mode with every pipeline stage on GPU 0 and activations over gloo, each stage "
           "taking its share of the GPU's memory (``zpp.workers.kv_budget.cuda_kv_budget``) "
           "(``ParallelConfig.share_gpu``; read where the configuration is made)."),
    EnvVar("ZPP_ASYNC_SCHEDULING", "Optional[bool]", _tri_state,
           "``0`` / ``1``: the default of ``--async-scheduling`` when the flag is not given, off / on "
           "(tests run both ways); anything else: the normal default (on for CUDA at PP=1 and TP=1)."),
    EnvVar("ZPP_EAGER_GRAPHS", "Optional[str]", _text_or_none,
           "Testing: CPU workers run the CUDA-graph decode path eagerly (``EagerDecodeGraphs``) for the "
           "stages CUDA would capture. ``1``: on; a file path: on, and every replay appends a line to it."),
    EnvVar("ZPP_FAULT_STALL", "str", _text(""),
           "Fault injection (watchdog tests): ``RANK:BATCH`` makes that worker rank's main thread hang "
           "from micro-batch BATCH on, heartbeats still going."),
    EnvVar("ZPP_FAULT_RESTART_CRASH", "str", _text(""),
           "Fault injection (supervision tests): ``RANK`` makes that worker rank fail each time it is "
           "restarted, while loading its weights (a crash loop)."),
    EnvVar("ZPP_FAULT_KEEP_LOST", "bool", _on_if_1,
           "Fault injection (supervision tests): ``1``: the engine does not kill a lost local worker "
           "process (a stopped one stays stopped, its connections open), as with a worker on a hung host "
           "it cannot reach; the survivors must be released by the engine's abort (AbortLinks)."),
    EnvVar("ZPP_FP8_GEMV", "bool", _on_unless_0,
           "``0``: FP8 linear layers never use the W8A16 GEMV kernel for small batches (every batch "
           "through the W8A8 GEMMs), for A/B runs. Read once, at import."),
    EnvVar("ZPP_FP8_GEMV_BLOCK_SCALE_X", "bool", _on_unless_0,
           "``0``: the W8A16 GEMV multiplies each block-scaled weight element by its 128x128 block scale "
           "(the slower layout before issue 47) instead of the activation vector, for A/B runs. Read once, "
           "at import."),
    EnvVar("ZPP_MOE_FUSED_ROUTER", "bool", _on_unless_0,
           "``0``: a top-k MoE router on CUDA (Mixtral, Qwen3-MoE, gpt-oss) runs PyTorch's softmax, topk "
           "and renormalisation (four or more kernels) instead of one Triton kernel "
           "(``fused_moe.topk_route``), for A/B runs. Read once, at import."),
    EnvVar("ZPP_FP8_MOE_FUSED_DOWN", "Optional[bool]", _tri_state,
           "The W8A16 decode path of FP8 experts: ``1`` always runs the activation, the down GEMV and the sum "
           "over each token's k experts as one kernel (``fp8_moe_kernels.moe_fp8_gemv_down``), ``0`` never "
           "(three kernels and a reduction); unset: one kernel only for the expert shapes whose "
           "``FP8_MOE_CONFIGS`` entry holds a measured ``gemv_down`` launch. For A/B runs. Read once, at import."),
    EnvVar("ZPP_FP8_FUSED_QUANT", "bool", _on_unless_0,
           "``0``: the activation quantization of an FP8 layer is not fused into the kernel before it: "
           "a gated MLP runs SiLU-and-mul and the down projection's quantization as two kernels "
           "(``fp8_kernels.silu_mul_quant``), a LLaMA-family decoder layer its RMSNorm and the qkv / "
           "gate_up quantization as two (``fp8_kernels.rms_norm_quant``, batches past the W8A16 GEMV's), "
           "for A/B runs. Read once, at import."),
    EnvVar("ZPP_FP8_FAST_ACCUM", "bool", _on_unless_0,
           "``0``: the W8A8 GEMMs of FP8 layers (``torch._scaled_mm``) promote their FP8 tensor-core "
           "partial sums into fp32 every few steps instead of keeping them in the MMA's accumulator "
           "(``use_fast_accum``, what vLLM's and TensorRT-LLM's FP8 GEMMs run), for A/B runs. Read once, "
           "at import."),
    EnvVar("ZPP_PDL", "bool", _on_unless_0,
           "``0``: no programmatic dependent launch (``zpp.models.layers.pdl``). By default, on a Hopper "
           "or newer GPU, the Triton kernels of CUDA-graph decode steps of at most 4 tokens (one stage "
           "rank, no tensor parallelism) launch with it: a kernel's programs may start while the one "
           "before finishes and wait in-kernel for its writes (batch-1 FP8 decode on an H100 3.56-3.60 "
           "-> 3.38-3.40 ms per token). For A/B runs. Read once, at import."),
    EnvVar("ZPP_FP8_GEMV_CONFIG_FILE", "Optional[str]", _text_or_none,
           "A JSON file of W8A16 GEMV launches per FP8 weight shape, ``{\"N,K\": {\"block_n\": 4, "
           "\"block_k\": 2048, \"num_warps\": 4, \"num_stages\": 3}}`` (``fp8_kernels.fp8_gemv_config``; "
           "written for the card at hand by ``scripts/fp8_gemv_card_sweep.py --write-config``); shapes "
           "not in it keep the default. Read once, at import."),
    EnvVar("ZPP_API_KEY", "Optional[str]", _text_or_none,
           "``zpp serve``'s API key when ``--api-key`` is not given (vLLM's ``VLLM_API_KEY``): every "
           "``/v1/*`` request then needs ``Authorization: Bearer <key>``. Read at start-up."),
    EnvVar("ZPP_TRITON_GEMV", "bool", _on_unless_0,
           "``0``: batch-1 decode on CUDA multiplies by the weights with cuBLAS instead of zpp's Triton "
           "GEMV (``zpp.models.layers.linear``), for A/B runs. Read once, at import."),
    EnvVar("ZPP_CPU_ONEDNN_LINEAR", "bool", _on_unless_0,
           "``0``: float32 linear layers on the CPU multiply through ``F.linear`` (MKL) instead of "
           "oneDNN with weights packed at load (``zpp.models.layers.cpu_linear``, the default: a "
           "speculative verify step's 2-6 rows cost about one row's time). The packed weight replaces "
           "the dense one, so memory is unchanged (the layout's padding aside, zero for widths that are "
           "multiples of 64). For A/B runs. Read when a stage's weights are loaded."),
    EnvVar("ZPP_GRAMMAR_THREADS", "Optional[int]", _int_or_none,
           "Threads of the result rank's structured-output work (xgrammar's batched bitmask fill, and "
           "the batched accept of sampled tokens from 64 rows); unset: a quarter of the host's cores, "
           "1 to 8 (``zpp.workers.grammar.default_fill_threads``). For A/B runs."),
    EnvVar("ZPP_CPU_ADAPTIVE_THREADS", "bool", _on_unless_0,
           "``0``: a CPU stage keeps its thread count even when other processes contend for its cores "
           "(``zpp.workers.adaptive_threads``); by default it drops to the cores it really gets and "
           "tries its full count again now and then. For A/B runs."),
    EnvVar("ZPP_PARENT_PID", "Optional[int]", _int_or_none,
           "Set by zpp (a ``zpp-node`` agent) for a worker it starts: the pid the worker must have as its "
           "parent, so that one whose parent died while it started exits at once "
           "(``zpp.utils.process.expected_parent``, which removes it from the environment)."),
    EnvVar("ZPP_SPLIT_MIXED_ATTENTION", "str", _text("1"),
           "How a micro-batch mixing decodes and prompt chunks attends: ``1`` in two launches (decode "
           "and prefill tile shapes) once the decodes fill a launch of their own, ``0`` one launch, "
           "``all`` two whenever they mix (A/B runs, tests with small models). Read once, at import "
           "(``zpp.models.layers.attention``)."),
)}


def __getattr__(name: str) -> Any:
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module 'zpp.envs' has no attribute {name!r} (the ZPP_* variables: "
                             f"{', '.join(VARIABLES)})")
    return var.read()


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])
