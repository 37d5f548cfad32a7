"""``ServerConfig``: the settings of ``zpp serve``'s HTTP front end (not the engine's).

Each field is a ``zpp serve`` flag, made by ``zpp.args`` from the field's name, default and
docstring (``zpp.settings``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zpp.config import ConfigError, parse_size
from zpp.settings import setting, tcp_port


@dataclass(frozen=True)
class ServerConfig:
    """Where and how ``zpp serve`` answers HTTP. Raises ConfigError (one line naming the flag)."""

    host: str = "0.0.0.0"
    """address to listen on"""
    port: int = setting(8000, type=tcp_port)
    """TCP port to listen on"""
    api_key: Optional[str] = None
    """require 'Authorization: Bearer KEY' on /v1/*"""
    chat_template: Optional[str] = None
    """Jinja chat template file (overrides the tokenizer's)"""
    disable_log_requests: bool = setting(False, group="logging")
    """no INFO line per finished request (id, prompt and output tokens, finish reason, time)

    vLLM's older spelling of ``--no-enable-log-requests``; with ``--enable-log-requests`` it is a
    ConfigError."""
    enable_log_requests: Optional[bool] = setting(None, group="logging")
    """one INFO line per finished request (vLLM's newer name; --no-enable-log-requests: none) (default:
    on unless --disable-log-requests)

    zpp's default stays on (vLLM's is off since it renamed the flag): see ``ServerConfig.log_requests``."""
    api_server_count: int = setting(1, group="logging")
    """HTTP front-end processes (tokenization, detokenization, streaming) sharing the port
    (SO_REUSEPORT) and one engine core; more serve more concurrent streams"""
    disable_log_stats: bool = setting(False, group="logging")
    """no INFO stats line every 10 s while busy (throughput, queue, KV cache, stage busy)"""
    log_stats_interval: float = setting(10.0, group="logging", hidden=True)
    """seconds between stats lines (hidden: tests shorten it)"""
    max_request_body_bytes: int = setting(8 << 20, parse=parse_size, metavar="SIZE", group="limits")
    """largest request body, after any Content-Encoding is undone (e.g. 8MiB); larger ones get
    HTTP 413"""
    max_stop_sequences: int = setting(64, metavar="N", group="limits")
    """most entries `stop` and `stop_token_ids` may each hold; more get HTTP 400"""
    trust_request_chat_template: bool = setting(False, group="limits")
    """accept a `chat_template` in requests (by default they get HTTP 400: a template is a program
    the server would run)"""

    generation_config: str = setting("auto", metavar="{auto,vllm,DIR}", group="sampling")
    """sampling defaults for fields a request leaves out: auto = the model's generation_config.json
    (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), vllm = zpp's built-in
    (OpenAI's) defaults, DIR = that directory's generation_config.json"""
    enable_auto_tool_choice: bool = setting(False, group="sampling")
    """parse tool calls of tool_choice auto with --tool-call-parser (needs it; without these flags
    the hermes format is parsed, as before)"""
    tool_call_parser: Optional[str] = setting(None, choices=("deepseek_v3", "hermes", "llama3_json", "mistral"),
                                              group="sampling")
    """the model's tool-call format (unset: tool calls are read in the hermes format)"""
    reasoning_parser: Optional[str] = setting(None, choices=("deepseek_r1", "qwen3"), group="sampling")
    """split the model's <think> reasoning into reasoning_content (chat) and a reasoning output item
    (/v1/responses)"""

    root_path: str = setting("", group="http")
    """the path prefix a proxy serves this server under (e.g. /llm): routes answer both with and
    without it (vLLM's / uvicorn's --root-path)"""
    response_role: str = setting("assistant", group="http")
    """the role name of chat completion messages (with add_generation_prompt)"""
    max_logprobs: int = setting(20, group="http")
    """most logprobs / top_logprobs / prompt_logprobs a request may ask for (more: HTTP 400); 0 to
    20 (zpp's sampler returns at most 20)"""
    timeout_keep_alive: float = setting(20.0, metavar="S", group="http")
    """seconds a connection may go without a complete request head (after it opens, or after its
    last response) before it is closed: idle keep-alive connections and clients that stop sending
    headers alike (uvicorn's name)

    20 s rather than uvicorn's 5: longer than the idle expiry of the common client pools (aiohttp
    15 s, httpx 5 s), so a pooled connection is retired by its client before the server closes it;
    a server that closes first races a client sending its next request on that connection, which
    then fails with "server disconnected"."""
    timeout_request_body: float = setting(30.0, metavar="S", group="http")
    """seconds a request body may go without a byte arriving before the request gets HTTP 408 and
    its connection is closed"""
    shutdown_timeout: float = setting(0.0, metavar="S", group="http")
    """on SIGTERM / SIGINT: close the listening socket (a new request on a connection already open
    gets HTTP 503) and let those in progress finish for up to S seconds, then end the rest with an
    error (0: end them at once)"""
    uvicorn_log_level: Optional[str] = setting(None, choices=("critical", "error", "warning", "info", "debug",
                                                               "trace"), group="http")
    """level of the HTTP server's own loggers (aiohttp.*); given, each request also gets an
    access-log line (unless --disable-uvicorn-access-log), as with vLLM"""
    disable_uvicorn_access_log: bool = setting(False, group="http")
    """no access-log line per HTTP request (the default unless --uvicorn-log-level is given)"""

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: not a TCP port (0-65535)")
        if self.api_server_count < 1:
            raise ConfigError(f"--api-server-count must be >= 1, got {self.api_server_count}")
        if self.max_request_body_bytes < 1024:
            raise ConfigError(f"--max-request-body-bytes {self.max_request_body_bytes}: must be at least 1KiB")
        if self.max_stop_sequences < 0:
            raise ConfigError(f"--max-stop-sequences {self.max_stop_sequences}: must be >= 0")
        if not self.log_stats_interval > 0:
            raise ConfigError(f"--log-stats-interval {self.log_stats_interval}: must be > 0 seconds")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.rstrip("/") == ""):
            raise ConfigError(f"--root-path {self.root_path!r}: must start with / (e.g. /llm)")
        if not self.response_role.strip():
            raise ConfigError("--response-role: must not be empty")
        if not 0 <= self.max_logprobs <= 20:
            raise ConfigError(f"--max-logprobs {self.max_logprobs}: must be 0 to 20 (zpp's sampler returns at most 20 "
                              f"logprobs per token)")
        for name in ("timeout_keep_alive", "timeout_request_body"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be > 0 seconds")
        if not self.shutdown_timeout >= 0:
            raise ConfigError(f"--shutdown-timeout {self.shutdown_timeout}: must be >= 0 seconds")
        if self.enable_log_requests and self.disable_log_requests:
            raise ConfigError("--enable-log-requests and --disable-log-requests contradict each other: give one")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser NAME (hermes, llama3_json, mistral, "
                              "deepseek_v3)")

    @property
    def log_requests(self) -> bool:
        """Whether each finished request gets its INFO line: ``--enable-log-requests`` /
        ``--no-enable-log-requests`` where given, else on unless ``--disable-log-requests``."""
        if self.enable_log_requests is not None:
            return self.enable_log_requests
        return not self.disable_log_requests

    def server_options(self) -> dict:
        """The keyword arguments ``zpp.server.launch.serve`` takes for the request limits."""
        return {"max_request_body_bytes": self.max_request_body_bytes, "max_stop_sequences": self.max_stop_sequences,
                "trust_request_chat_template": self.trust_request_chat_template,
                "log_requests": self.log_requests, "generation_config": self.generation_config,
                "tool_call_parser": self.tool_call_parser, "reasoning_parser": self.reasoning_parser,
                "root_path": self.root_path.rstrip("/"), "response_role": self.response_role,
                "max_logprobs": self.max_logprobs, "timeout_request_body": self.timeout_request_body,
                # the HTTP runner's, not OpenAIServer's (zpp.server.launch._run_front_end takes them)
                "timeout_keep_alive": self.timeout_keep_alive, "shutdown_timeout": self.shutdown_timeout,
                "access_log": self.uvicorn_log_level is not None and not self.disable_uvicorn_access_log,
                "http_log_level": self.uvicorn_log_level}
