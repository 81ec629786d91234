"""Server settings: command-line flags, each also read from a MINILLM_* environment variable
(the container and Helm configure the server that way)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields

from engine.config import EngineConfig
from engine.errors import InvalidRequestError

ENV_PREFIX = "MINILLM_"
PREFIX_CACHE_ISOLATION = ("none", "api-key")
# --tool-call-parser's values: app.tools.TOOL_FORMATS' names, here so that `serve`'s checks need not import it.
TOOL_CALL_PARSERS = ("hermes", "mistral", "llama3", "generic")

_ENGINE_HELP = {
    "model": "'default' (the embedded SmolLM2-135M-Instruct), a Hugging Face model directory, or random:<shape>",
    "tokenizer": "a directory holding the tokenizer to use instead of the model's (default: the model's own; 'default': the embedded model's); random:<shape> models have none of their own",
    "dtype": "auto, float32, bfloat16 or float16 (auto: bfloat16 on CUDA, float32 on CPU)",
    "device": "auto, cpu or cuda[:N]",
    "weights_seed": "seed of the weights of random:<shape> models",
    "quantization": "fp8: quantize a float checkpoint's linear weights to FP8 (per output channel) as it loads; quantized checkpoints (AWQ, FP8) need no flag",
    "block_size": "tokens per KV-cache block",
    "kv_cache_memory": "bytes for the KV cache, e.g. 2GiB (default: 1GiB on CPU; on GPU what --gpu-memory-utilization leaves)",
    "gpu_memory_utilization": "share of GPU memory for weights, activations and KV blocks (the rest of a profiled largest step goes to KV)",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "most tokens computed in one step; longer prompts are prefilled in chunks (default: 8192 on a GPU of 70 GiB or more, 2048 on smaller GPUs, 512 on CPU)",
    "max_model_len": "context length (default: the model's, capped by what the KV cache holds)",
    "enable_prefix_caching": "reuse the KV of shared prompt prefixes (true/false)",
    "tensor_parallel_size": "GPUs each layer is split over, one process each (on CPU: processes, with gloo)",
    "speculative_method": "ngram: speculative decoding with drafts looked up in each sequence's prompt and output, verified in one forward (outputs unchanged, seeded ones too); suffix: drafts from the longest earlier match of the sequence's suffix, in its own text or in recent requests'; draft: drafts sampled from a small model, --speculative-model; default: off",
    "speculative_model": "the draft model of --speculative-method draft, named as --model is ('default', a directory or random:<shape>), with the model's tokenizer; its KV pool comes out of the KV budget (tensor parallel size 1 only)",
    "num_speculative_tokens": "most draft tokens a sequence carries in one step (with --speculative-method)",
    "speculative_max_batch": "running sequences up to which steps carry drafts (default: 16 on a GPU, 1 on CPU, where verifying drafts beside a batch costs more than it saves)",
    "speculative_gate": "time decode steps with drafts and without, per batch size of 2 and more, and pause drafting where it is slower (true/false, default true; a sequence alone always may draft, backing off by itself)",
    "speculative_overlap": "launch a step before the step with drafts in flight is read, as if its drafts were all accepted, where the measured time that saves outweighs the steps that turn out stale (true/false, default false; ngram and suffix only)",
}


@dataclass
class ServerSettings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = None  # the name clients send; default: the model's directory name
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None  # comma-separated keys; none means no auth
    max_queue: int = 256  # waiting requests beyond this get 429
    max_body_bytes: int = 10 * 2**20
    max_connections: int = 2048  # requests served at once (probes aside); more get 503
    header_timeout: float = 30.0  # seconds a connection gets to send a request's headers
    body_timeout: float = 60.0  # seconds a request's whole body gets to arrive
    write_timeout: float = 30.0  # seconds one write may wait for a client that stopped reading
    shutdown_grace: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    log_level: str = "info"
    tool_call_parser: str | None = None  # the tool-call format; default: recognised from the chat template
    responses_store_size: int = 1024  # stored Responses API responses (LRU, in this process only)
    prefix_cache_isolation: str = "none"  # one of PREFIX_CACHE_ISOLATION

    def __post_init__(self) -> None:
        if self.prefix_cache_isolation not in PREFIX_CACHE_ISOLATION:  # a typo must not turn isolation off
            raise InvalidRequestError(f"--prefix-cache-isolation must be {' or '.join(PREFIX_CACHE_ISOLATION)}, "
                                      f"not {self.prefix_cache_isolation!r}.", param="prefix_cache_isolation")

    @property
    def api_keys(self) -> list[str]:
        return [k.strip() for k in (self.api_key or "").split(",") if k.strip()]

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        model = self.engine.model
        return "SmolLM2-135M-Instruct" if model == "default" else model.rstrip("/").rsplit("/", 1)[-1]


_HELP = {
    "served_model_name": "the model name clients use (default: the model directory's name)",
    "host": "address to listen on",
    "port": "port to listen on",
    "api_key": "API key(s), comma-separated; when set, /v1/* and the tokenizer routes need 'Authorization: Bearer <key>'",
    "max_queue": "most sequences (prompts × n) waiting for the engine; more get 429 with Retry-After, and a call larger than this alone gets 400",
    "max_body_bytes": "largest request body accepted (413 above)",
    "max_connections": "most requests served at once, probes aside: more get 503 with Retry-After; Granian accepts 64 connections more (probes, the refusals), the rest wait in the listen backlog",
    "header_timeout": "seconds a connection gets to send a request's headers, idle keep-alive time included; then it is closed",
    "body_timeout": "seconds a request's whole body gets to arrive (408 and the connection closed after)",
    "write_timeout": "seconds one write to a client may wait while it reads nothing; then its stream is aborted as if it had left",
    "shutdown_grace": "seconds that in-flight requests get to finish after SIGTERM",
    "log_level": "debug, info, warning or error",
    "tool_call_parser": f"tool-call format: {', '.join(TOOL_CALL_PARSERS)} (default: recognised from the chat template)",
    "responses_store_size": "most Responses API responses kept for previous_response_id and GET (LRU, per server process; 0: none)",
    "prefix_cache_isolation": "none: every request may reuse any cached prompt prefix (a request's cache_salt still keeps it apart); api-key: only requests with the same Authorization header share cached blocks, so one tenant cannot tell from its time to first token whether another sent a prompt",
}


def _parse_bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


def _kind(annotation: str):
    if "str" in annotation:  # e.g. kv_cache_memory: "2GiB" or a number of bytes
        return str
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    if annotation.startswith("bool"):
        return _parse_bool
    return str


def _env_default(name: str, default, kind):
    raw = os.environ.get(ENV_PREFIX + name.upper())
    return default if raw is None else kind(raw)


def with_default(text: str, default: object) -> str:
    """A flag's help that ends by showing its default, unless the text already says what it is."""
    if "(default" in text:
        return text
    return text + (" (default: unset)" if default is None else " (default: %(default)s)")


def add_arguments(parser: argparse.ArgumentParser, server: bool = True) -> None:
    """Flags for the engine (and the server); each defaults to its MINILLM_* variable if set."""
    groups = [(EngineConfig, _ENGINE_HELP)] + ([(ServerSettings, _HELP)] if server else [])
    for settings_class, help_texts in groups:
        for f in fields(settings_class):
            if f.name in help_texts:
                kind = _kind(str(f.type))
                default = _env_default(f.name, f.default, kind)
                env = ENV_PREFIX + f.name.upper()
                parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=default,
                                    help=f"{with_default(help_texts[f.name], default)} [env {env}]")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)})


def server_settings(args: argparse.Namespace) -> ServerSettings:
    values = {f.name: getattr(args, f.name) for f in fields(ServerSettings) if f.name != "engine" and hasattr(args, f.name)}
    return ServerSettings(engine=engine_config(args), **values)


def to_env(settings: ServerSettings) -> dict[str, str]:
    """The settings as MINILLM_* variables: how the CLI hands them to Granian's worker process."""
    env = {}
    for f in fields(EngineConfig):
        value = getattr(settings.engine, f.name)
        if value is not None:
            env[ENV_PREFIX + f.name.upper()] = str(value)
    for f in fields(ServerSettings):
        value = getattr(settings, f.name)
        if f.name != "engine" and value is not None:
            env[ENV_PREFIX + f.name.upper()] = str(value)
    return env


def from_env() -> ServerSettings:
    """The settings from MINILLM_* variables alone (in the worker process)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return server_settings(parser.parse_args([]))
