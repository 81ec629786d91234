"""`minillm`: the command line. `generate` for a quick try, `chat` to talk to a model."""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from engine.config import EngineConfig
from engine.errors import MinillmError
from engine.llm_engine import LLMEngine, Prompt
from engine.sampling_params import SamplingParams

_ENGINE_FLAGS = {
    "model": "'default' (the embedded SmolLM2-135M-Instruct), a Hugging Face model directory, or random:<shape>",
    "dtype": "auto, float32, bfloat16 or float16 (auto: bfloat16 on CUDA, float32 on CPU)",
    "device": "auto, cpu or cuda[:N]",
    "weights_seed": "seed of the weights of random:<shape> models",
    "block_size": "tokens per KV-cache block",
    "kv_cache_memory": "bytes for the KV cache, e.g. 2GiB (default: 1GiB on CPU, 80%% of free memory on GPU)",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "most tokens computed in one step (long prompts are prefilled in chunks)",
    "max_model_len": "context length (default: the model's, capped by what the KV cache holds)",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    for f in fields(EngineConfig):
        if f.name in _ENGINE_FLAGS:
            kind = int if f.type in ("int", "int | None") else str
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=getattr(defaults, f.name),
                                help=_ENGINE_FLAGS[f.name])
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="turn the prefix cache off")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="sampling seed")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def stream(engine: LLMEngine, prompt: Prompt, params: SamplingParams) -> str:
    """Run one request, printing its text as it comes; returns the whole text."""
    request = engine.add_request(prompt, params)
    text = ""
    while engine.has_unfinished():
        for out in engine.step():
            for delta in out.deltas:
                text += delta.text
                print(delta.text, end="", flush=True)
    print()
    print(f"[{request.sequences[0].finish_reason}: {len(request.sequences[0].output_token_ids)} tokens]",
          file=sys.stderr)
    return text


def as_prompt(engine: LLMEngine, text: str, raw: bool) -> Prompt:
    if raw or engine.tokenizer is None or not engine.tokenizer.hf.chat_template:
        return text
    return [{"role": "user", "content": text}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minillm", description="A compact LLM inference engine and server.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a reply to one prompt and print it as it streams")
    gen.add_argument("prompt")
    chat = sub.add_parser("chat", help="talk to the model in the terminal (empty line or Ctrl-D to quit)")
    for p in (gen, chat):
        add_engine_args(p)
        add_sampling_args(p)
        p.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        engine = LLMEngine(engine_config(args))
        params = sampling_params(args)
        if args.command == "generate":
            stream(engine, as_prompt(engine, args.prompt, args.raw), params)
            return 0
        messages: list[dict[str, str]] = []
        while True:
            try:
                line = input("> ").strip()
            except EOFError:
                return 0
            if not line:
                return 0
            if args.raw or engine.tokenizer is None or not engine.tokenizer.hf.chat_template:
                stream(engine, line, params)
                continue
            messages.append({"role": "user", "content": line})
            messages.append({"role": "assistant", "content": stream(engine, messages, params)})
    except MinillmError as e:
        print(f"minillm: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
