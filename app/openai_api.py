"""The OpenAI-compatible routes besides chat: text completions (streamed or not), models, tokenizer."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.errors import typed_error_body
from app.generation import Generation, collect, event_stream, join_choices, observed, read_json, start, state_of
from app.json import SSE_DONE, JSONResponse, sse
from app.protocol import CompletionRequest, DetokenizeRequest, TokenizeRequest
from app.state import AppState
from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError, MinillmError
from engine.outputs import RequestOutput, SampleDelta
from engine.sampler import TokenLogprobs
from engine.tokenizer import Chat


# ---- text completions ---------------------------------------------------------------------------


def completion_logprobs(engine: AsyncEngine, logprobs: list[TokenLogprobs], offset: int) -> dict[str, Any]:
    tokens = [engine.token_text(lp.token_id) for lp in logprobs]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{engine.token_text(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets}


async def completions(request: Request) -> Response:
    state = state_of(request)
    body = CompletionRequest.model_validate(await read_json(request, state.settings.max_body_bytes))
    state.check_model(body.model)
    prompts, params = body.to_engine()
    gen = Generation("completion", f"cmpl-{uuid.uuid4().hex}", state.settings.model_name, params.n)
    engine = state.live_engine()
    outputs = observed(request, gen, await start(request, gen, prompts, params))
    echo = {}
    if body.echo:
        echo = {i: p if isinstance(p, str) else (engine.decode(p) if engine.has_tokenizer else "")
                for i, p in enumerate(prompts)}
    want_logprobs = params.logprobs is not None
    if body.stream:
        return event_stream(completion_stream(engine, gen, outputs, body.include_usage, want_logprobs, echo))
    items = await collect(request, outputs)
    if items is None:
        return Response(status_code=499)
    return JSONResponse(gen.head("text_completion") | {
        "choices": [{"index": k, "text": c.text,
                     "logprobs": completion_logprobs(engine, c.logprobs, 0) if want_logprobs else None,
                     "finish_reason": c.finish_reason} for k, c in join_choices(items, gen.n, echo)],
        "usage": gen.usage(),
    })


async def completion_stream(engine: AsyncEngine, gen: Generation, outputs: AsyncIterator[tuple[int, RequestOutput]],
                            include_usage: bool, want_logprobs: bool, echo: dict[int, str]) -> AsyncIterator[bytes]:
    head = gen.head("text_completion")
    extra = {"usage": None} if include_usage else {}
    echoed: set[int] = set()
    offsets: dict[int, int] = {}
    pending_logprobs: dict[int, list[TokenLogprobs]] = {}

    def chunk(index: int, text: str, d: SampleDelta | None) -> bytes:
        lps = pending_logprobs.pop(index, [])
        logprobs = completion_logprobs(engine, lps, offsets.get(index, 0)) if want_logprobs else None
        offsets[index] = offsets.get(index, 0) + len(text)
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": d.finish_reason if d else None}
        return sse(head | {"choices": [choice]} | extra)

    try:
        async with aclosing(outputs):  # stopping early closes the source: aborts at once
            async for i, out in outputs:
                for d in out.deltas:
                    index = i * gen.n + d.index
                    text = d.text
                    if echo and index not in echoed:
                        echoed.add(index)
                        text = echo[i] + text
                    pending_logprobs.setdefault(index, []).extend(d.logprobs or [])
                    if text or d.finish_reason:
                        yield chunk(index, text, d)
        if include_usage:
            yield sse(head | {"choices": [], "usage": gen.usage()})
    except MinillmError as e:
        yield sse(typed_error_body(e))
    yield SSE_DONE


# ---- models and tokenizer -----------------------------------------------------------------------


def model_card(state: AppState) -> dict[str, Any]:
    card = {"id": state.settings.model_name, "object": "model", "created": state.created, "owned_by": "minillm"}
    if state.engine is not None:
        card["max_model_len"] = state.engine.max_model_len
    return card


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [model_card(state_of(request))]})


async def get_model(request: Request) -> Response:
    state = state_of(request)
    state.check_model(request.path_params["model_id"])
    return JSONResponse(model_card(state))


async def tokenize(request: Request) -> Response:
    state = state_of(request)
    body = TokenizeRequest.model_validate(await read_json(request, state.settings.max_body_bytes))
    state.check_model(body.model)
    engine = state.live_engine()  # its tokenizer methods raise for a model without one
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("Give exactly one of prompt or messages.", param="prompt")
    if body.messages is not None:
        tools = [t.to_template() for t in body.tools] if body.tools else None
        tokens = engine.render_chat(Chat([m.to_template() for m in body.messages], tools=tools,
                                         add_generation_prompt=body.add_generation_prompt,
                                         continue_final_message=body.continue_final_message))
    else:
        tokens = engine.tokenize(body.prompt, body.add_special_tokens)
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len})


async def detokenize(request: Request) -> Response:
    state = state_of(request)
    body = DetokenizeRequest.model_validate(await read_json(request, state.settings.max_body_bytes))
    state.check_model(body.model)
    engine = state.live_engine()  # its tokenizer methods raise for a model without one
    if any(not 0 <= t < engine.vocab_size for t in body.tokens):
        raise InvalidRequestError("Token ids must be in [0, vocab size).", param="tokens")
    return JSONResponse({"prompt": engine.decode(body.tokens, skip_special_tokens=False)})
