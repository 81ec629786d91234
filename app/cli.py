"""`minillm`: the command line. `serve` runs the OpenAI-compatible server; `generate` and `chat` try a
model in the terminal; `quantize` writes an int4 (AWQ-layout) or FP8 copy of a float checkpoint.

Parsing needs only light imports (no torch): each subcommand imports the engine when it runs, so
`minillm --help` answers at once."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from app.settings import add_arguments, engine_config, server_settings
from engine.errors import MinillmError
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine, Prompt

# engine.quantization's METHODS, CALIBRATION_TOKENS and TUNE_STEPS, as plain values: that package
# imports torch, which --help must not wait for (tests/app/test_cli.py checks that they agree).
QUANTIZE_METHODS = ("awq", "rtn", "fp8-gptq")
CALIBRATION_TOKENS = 8192
TUNE_STEPS = 40


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="sampling temperature; 0: greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample from the likeliest tokens holding this much probability (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample from the k likeliest tokens; 0: all (default: %(default)s)")
    parser.add_argument("--seed", dest="sampling_seed", type=int, default=None,
                        help="sampling seed (default: a random one)")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template (default: off)")


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
    if raw or not engine.has_chat_template:
        return text
    return [{"role": "user", "content": text}]


def add_quantize_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="a float Hugging Face model directory, or 'default' (the embedded SmolLM2-135M-Instruct) "
                             "(default: %(default)s)")
    parser.add_argument("--method", choices=QUANTIZE_METHODS, default="awq",
                        help="int4: awq (activation-aware scales and clipping from a calibration text) or rtn (round "
                             "to nearest); fp8-gptq: FP8 with per-channel scales, rounded by GPTQ on the calibration "
                             "text (default: %(default)s)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="int4: input features per scale and zero point (default: the blocks of the quantized file the "
                             "weights came from, e.g. 32 for the embedded Q4_1 model; else 128, or 64 or 32 where "
                             "128 does not fit the model)")
    parser.add_argument("--lm-head", action="store_true",
                        help="int4: quantize lm_head too (quantization_config lm_head: true; AutoAWQ keeps it float, "
                             "so other servers may not load the result; at batch 1 on a 1B model it is half the "
                             "bytes a step reads) (default: off)")
    parser.add_argument("--calibration-tokens", type=int, default=CALIBRATION_TOKENS,
                        help="tokens of the calibration text awq and fp8-gptq run through the model (default: all of "
                             "the shipped one, ~5,900)")
    parser.add_argument("--calibration-text", default=None,
                        help="awq, fp8-gptq: a UTF-8 text file to calibrate on instead of the shipped one (the "
                             "Declaration of Independence and the Articles of Confederation); text like what the "
                             "model will serve (default: the shipped one)")
    parser.add_argument("--tune-steps", type=int, default=TUNE_STEPS,
                        help="awq: most steps of the end-to-end tuning of the scales and norm weights against the "
                             "float model, stopped early by a held-out part of the text (default: %(default)s; "
                             "0: none)")
    parser.add_argument("--device", default="auto",
                        help="auto (cuda if available), cpu or cuda[:N] (default: %(default)s)")
    parser.add_argument("--out", required=True, help="the directory to write (must not exist, or be empty)")
    parser.add_argument("--log-level", default="INFO", help="debug, info, warning or error (default: %(default)s)")


def quantize(args: argparse.Namespace) -> int:
    from engine.quantization import quantize_checkpoint  # imports torch: only when it runs

    out = quantize_checkpoint(args.model, args.out, args.method, args.group_size, args.calibration_tokens,
                              args.device, lm_head=args.lm_head, tune_steps=args.tune_steps,
                              calibration_text=args.calibration_text)
    print(f"minillm: wrote {out}; serve it with `minillm serve --model {out}`", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minillm", description="A compact LLM inference engine and server.")
    sub = parser.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API (Granian, one worker)",
                         description="Every flag also reads a MINILLM_* environment variable, e.g. MINILLM_MODEL.")
    add_arguments(srv, server=True)
    gen = sub.add_parser("generate", help="generate a reply to one prompt and print it as it streams")
    gen.add_argument("prompt", help="the user's message (sent through the chat template unless --raw)")
    chat = sub.add_parser("chat", help="talk to the model in the terminal (empty line or Ctrl-D to quit)")
    for p in (gen, chat):
        add_arguments(p, server=False)
        add_sampling_args(p)
        p.add_argument("--log-level", default="WARNING", help="debug, info, warning or error (default: %(default)s)")
    quant = sub.add_parser("quantize", help="write an int4 (AutoAWQ's GEMM layout) or FP8 copy of a float checkpoint",
                           description="Quantize a float checkpoint's decoder linear layers to 4 bits (AWQ or "
                                       "round-to-nearest, AutoAWQ's layout) or to FP8 (GPTQ, compressed-tensors' "
                                       "layout) into a new model directory that minillm loads.")
    add_quantize_args(quant)
    args = parser.parse_args(argv)
    if args.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        print(f"minillm: --log-level must be one of debug, info, warning, error, critical; got {args.log_level!r}",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "serve":
            from app.serve import serve  # imports Granian: only the server needs it

            serve(server_settings(args))  # exits non-zero (SystemExit) when the worker fails
            return 0
        if args.command == "quantize":
            return quantize(args)
        from engine.llm_engine import LLMEngine  # imports torch: only once a model is needed

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
            if args.raw or not engine.has_chat_template:
                stream(engine, line, params)
                continue
            messages.append({"role": "user", "content": line})
            messages.append({"role": "assistant", "content": stream(engine, messages, params)})
    except MinillmError as e:
        print(f"minillm: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
