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
from app.protocol import CompletionRequest, DetokenizeRequest, TokenizeRequest, cache_salt
from app.state import AppState
from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError, MinillmError
from engine.outputs import RequestOutput
from engine.sampler import TokenLogprobs
from engine.tokenizer import Chat


# ---- text completions ---------------------------------------------------------------------------


def completion_logprobs(engine: AsyncEngine, logprobs: list[TokenLogprobs | None], offset: int,
                        token_ids: list[int] | None = None) -> dict[str, Any]:
    """OpenAI's legacy logprobs, text_offset counting from offset: each position's top_logprobs holds its
    token too (at logprobs=0, only it), as OpenAI's and vLLM's do. A None position (the first prompt
    token: nothing predicts it) has null logprob and top_logprobs, and token_ids names its token."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    texts: dict[int, str] = {}  # a long prompt's alternatives repeat: decode each token once

    def text(token_id: int) -> str:
        if (t := texts.get(token_id)) is None:
            t = texts[token_id] = engine.token_text(token_id)
        return t

    for k, lp in enumerate(logprobs):
        token = text(lp.token_id if lp is not None else token_ids[k])  # type: ignore[index]
        out["tokens"].append(token)
        out["text_offset"].append(offset)
        offset += len(token)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top = {text(t): v for t, v in lp.top}
        top.setdefault(token, lp.logprob)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append(top)
    return out


def joined(first: dict[str, list[Any]] | None, then: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Two runs of legacy logprobs as one (the echoed prompt's, then the completion's)."""
    return then if first is None else {key: first[key] + then[key] for key in then}


def prompt_logprobs(engine: AsyncEngine, out: RequestOutput) -> dict[str, list[Any]] | None:
    """The echoed prompt's legacy logprobs, from a request's first output (None on the others)."""
    if out.prompt_logprobs is None:
        return None
    return completion_logprobs(engine, out.prompt_logprobs, 0, out.prompt_token_ids)


def scored(finish_reason: str | None) -> str | None:
    """A scoring-only choice stopped at its max_tokens of 0, whatever ended the hidden token."""
    return "length" if finish_reason in ("stop", "length") else finish_reason


def completion_usage(gen: Generation, scoring_only: bool) -> dict[str, Any]:
    usage = gen.usage()
    if scoring_only:  # the hidden token is no completion
        usage |= {"completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
    return usage


async def completions(request: Request) -> Response:
    state = state_of(request)
    body = CompletionRequest.model_validate(await read_json(request, state.settings.max_body_bytes))
    state.check_model(body.model)
    prompts, params = body.to_engine()
    params.cache_salt = cache_salt(body.cache_salt, request.headers.get("authorization"),
                                   state.settings.prefix_cache_isolation == "api-key")
    gen = Generation("completion", f"cmpl-{uuid.uuid4().hex}", state.settings.model_name, params.n)
    engine = state.live_engine()
    outputs = observed(request, gen, await start(request, gen, prompts, params))
    echo = {}
    if body.echo:
        echo = {i: p if isinstance(p, str) else (engine.decode(p) if engine.has_tokenizer else "")
                for i, p in enumerate(prompts)}
    want_logprobs = params.logprobs is not None
    scoring = body.scoring_only
    if body.stream:
        return event_stream(completion_stream(engine, gen, outputs, body.include_usage, want_logprobs, echo, scoring))
    items = await collect(request, outputs)
    if items is None:
        return Response(status_code=499)
    prompt_lps = {i: lps for i, out in items if (lps := prompt_logprobs(engine, out)) is not None}
    choices = []
    for k, c in join_choices(items, gen.n, echo):
        i = k // gen.n
        if scoring:
            c.text, c.logprobs, c.finish_reason = echo[i], [], scored(c.finish_reason)
        logprobs = None
        if want_logprobs:  # the completion's text_offset counts on from the echoed prompt's text
            logprobs = joined(prompt_lps.get(i), completion_logprobs(engine, c.logprobs, len(echo.get(i, ""))))
        choices.append({"index": k, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason})
    return JSONResponse(gen.head("text_completion") | {"choices": choices, "usage": completion_usage(gen, scoring)})


async def completion_stream(engine: AsyncEngine, gen: Generation, outputs: AsyncIterator[tuple[int, RequestOutput]],
                            include_usage: bool, want_logprobs: bool, echo: dict[int, str],
                            scoring: bool) -> AsyncIterator[bytes]:
    """Each choice's first chunk leads with its echoed prompt (text and logprobs); with scoring, it is all there is."""
    head = gen.head("text_completion")
    extra = {"usage": None} if include_usage else {}
    echoed: set[int] = set()
    offsets: dict[int, int] = {}
    pending_logprobs: dict[int, list[TokenLogprobs]] = {}
    prompt_lps: dict[int, dict[str, list[Any]]] = {}

    def chunk(index: int, prefix: str, prefix_logprobs: dict[str, list[Any]] | None, text: str,
              finish_reason: str | None) -> bytes:
        start = offsets.get(index, 0) + len(prefix)
        lps = pending_logprobs.pop(index, [])
        logprobs = joined(prefix_logprobs, completion_logprobs(engine, lps, start)) if want_logprobs else None
        offsets[index] = start + len(text)
        choice = {"index": index, "text": prefix + text, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse(head | {"choices": [choice]} | extra)

    try:
        async with aclosing(outputs):  # stopping early closes the source: aborts at once
            async for i, out in outputs:
                if (lps := prompt_logprobs(engine, out)) is not None:
                    prompt_lps[i] = lps
                for d in out.deltas:
                    index = i * gen.n + d.index
                    prefix, prefix_logprobs = "", None
                    if echo and index not in echoed:
                        echoed.add(index)
                        prefix, prefix_logprobs = echo[i], prompt_lps.get(i)
                    text, finish_reason = d.text, d.finish_reason
                    if scoring:
                        text, finish_reason = "", scored(finish_reason)
                    else:
                        pending_logprobs.setdefault(index, []).extend(d.logprobs or [])
                    if prefix or prefix_logprobs or text or finish_reason:
                        yield chunk(index, prefix, prefix_logprobs, text, finish_reason)
        if include_usage:
            yield sse(head | {"choices": [], "usage": completion_usage(gen, scoring)})
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
    # On the tokenizer's thread, as generation's prompts: a long text never holds up the event loop.
    if body.messages is not None:
        tools = [t.to_template() for t in body.tools] if body.tools else None
        chat = Chat([m.to_template() for m in body.messages], tools=tools,
                    add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message)
        tokens = await engine.on_tokenizer_thread(lambda gone: engine.render_chat(chat))
    else:
        prompt, special = body.prompt, body.add_special_tokens
        tokens = await engine.on_tokenizer_thread(lambda gone: engine.tokenize(prompt, special))
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len})


async def detokenize(request: Request) -> Response:
    state = state_of(request)
    body = DetokenizeRequest.model_validate(await read_json(request, state.settings.max_body_bytes))
    state.check_model(body.model)
    engine = state.live_engine()  # its tokenizer methods raise for a model without one
    if any(not 0 <= t < engine.vocab_size for t in body.tokens):
        raise InvalidRequestError("Token ids must be in [0, vocab size).", param="tokens")
    return JSONResponse({"prompt": engine.decode(body.tokens, skip_special_tokens=False)})
