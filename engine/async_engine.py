"""The engine's step loop in its own thread, so the HTTP layer never waits on the model.

Requests come in through one command queue; each request's outputs go back through its own
asyncio queue on the caller's event loop.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from engine.errors import EngineDeadError, EngineFailedError, InvalidRequestError, MinillmError
from engine.llm_engine import EngineStats, LLMEngine, Prompt
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Request
from engine.tokenizer import Chat, Tokenizer

log = logging.getLogger("minillm.engine")
T = TypeVar("T")


@dataclass
class _Channel:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        _send(self.loop, [(self.queue, item)])


def _send(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    """Hand items to their queues on loop's thread: one wake-up of that loop for all of them."""
    def put_all() -> None:
        for q, item in items:
            q.put_nowait(item)

    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the caller's loop is closed: nobody is listening any more
        pass


class AsyncEngine:
    """The app's one door to the engine: requests in, outputs out, and what the server needs to know
    about the model and its tokenizer."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._channels: dict[str, _Channel] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
        # One thread: the tokenizer is never used by two requests at once.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="minillm-tokenizer")
        self._stats = engine.stats()
        # Sequences admitted (reserve) or handed to the engine thread that its last stats do not
        # count yet; with the stats' waiting ones, what admission control bounds.
        self._unstarted = 0
        self._lock = threading.Lock()  # _unstarted and _stats change together
        self.error: BaseException | None = None

    def start(self) -> "AsyncEngine":
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._tokenizer_thread.shutdown(wait=False)
        self._stopping.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout)
        self._engine.close()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stats(self) -> EngineStats:
        """The numbers as of the last step (read without stopping the loop); waiting counts what
        admission does (num_waiting)."""
        with self._lock:
            return replace(self._stats, waiting=self._unstarted + self._stats.waiting)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for the engine: admitted but not running yet (tokenizing, queued, or
        preempted). Running or finished ones are not, even if their client has not read them."""
        with self._lock:
            return self._unstarted + self._stats.waiting

    def reserve(self, num_seqs: int, max_waiting: int) -> bool:
        """Admission: count num_seqs more sequences as waiting if at most max_waiting would then
        wait; False if not. Checked and counted at once, so arrivals at the same moment cannot all
        pass. The caller release()s them once stream() has queued its requests (or they failed)."""
        with self._lock:
            if self._unstarted + self._stats.waiting + num_seqs > max_waiting:
                return False
            self._unstarted += num_seqs
            return True

    def release(self, num_seqs: int) -> None:
        with self._lock:
            self._unstarted -= num_seqs

    # ---- the model and its tokenizer ------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: valid token ids are [0, vocab_size)."""
        return self._engine.model_config.vocab_size

    @property
    def has_tokenizer(self) -> bool:
        return self._engine.tokenizer is not None

    def _tokenizer(self) -> Tokenizer:
        if self._engine.tokenizer is None:
            raise InvalidRequestError("This model has no tokenizer.", param="model")
        return self._engine.tokenizer

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text to token ids (add_special_tokens: the tokenizer's own, e.g. BOS, as a prompt gets them)."""
        return self._tokenizer().encode(text, add_special_tokens)

    def render_chat(self, chat: Chat | list[dict[str, Any]]) -> list[int]:
        """Chat messages to a prompt's token ids, through the model's chat template."""
        return self._tokenizer().apply_chat_template(chat)

    @property
    def chat_template(self) -> str:
        """The chat template's text; '' without a tokenizer or template."""
        return self._engine.tokenizer.chat_template if self._engine.tokenizer else ""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer().decode(token_ids, skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included; without a tokenizer, its id."""
        return self.decode([token_id], skip_special_tokens=False) if self.has_tokenizer else str(token_id)

    def prepare(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        """Tokenize and validate now (raises typed errors), without queueing: callers check every
        prompt of an API call before they send a byte."""
        if not self.is_alive:
            raise EngineDeadError("The engine is not running.")
        if request_id is not None and request_id in self._channels:
            raise InvalidRequestError(f"Request id {request_id!r} is already in use.", param="request_id")
        return self._engine.make_request(prompt, params, request_id)

    async def prepare_all(self, items: list[tuple[Prompt, SamplingParams, str | None]]) -> list[Request]:
        """prepare() for each item, on the tokenizer's own thread: a long prompt's tokenization and
        chat template never hold up the event loop (its other streams)."""
        return await self.on_tokenizer_thread(lambda gone: [self.prepare(*item) for item in items if not gone()])

    async def on_tokenizer_thread(self, work: Callable[[Callable[[], bool]], T]) -> T:
        """work(gone) on the tokenizer's thread, after what was queued there before. Cancelling the
        caller (client gone) drops work not started yet; started work can poll gone() to stop early."""
        cancelled = threading.Event()
        future = asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, work, cancelled.is_set)
        try:
            return await future
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def stream(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Queue a prepared request now and return its outputs, step by step. Closing the iterator
        early (client gone), or dropping it unread, aborts the request and frees its blocks."""
        channel = _Channel(asyncio.get_running_loop(), asyncio.Queue())
        self._channels[request.request_id] = channel
        with self._lock:
            self._unstarted += request.params.n
        self._commands.put(("add", request))
        if self.error is not None:  # the loop died before it could take this request
            channel.put(EngineDeadError("The engine is not running."))
        outputs = self._outputs(request.request_id, channel)
        weakref.finalize(outputs, self._forget, request.request_id, channel)
        return outputs

    def _forget(self, request_id: str, channel: _Channel) -> None:
        """A stream dropped before it was read: nobody will read its outputs."""
        if self._channels.get(request_id) is channel:
            self._channels.pop(request_id, None)
            self.abort(request_id)

    async def _outputs(self, request_id: str, channel: _Channel) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await channel.queue.get()
                # A reader that fell behind (a slow client, a busy event loop) gets what queued up
                # as one output: one message for several steps' tokens.
                while isinstance(item, RequestOutput) and not item.finished and not channel.queue.empty():
                    later = channel.queue.get_nowait()
                    item = later if isinstance(later, BaseException) else item.merge(later)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if self._channels.get(request_id) is channel:
                self._channels.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """prepare() then stream(): bad input raises before the first yield."""
        async for out in self.stream(self.prepare(prompt, params, request_id)):
            yield out

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every request a caller is still waiting on (end of a shutdown's grace period)."""
        for request_id in list(self._channels):
            self.abort(request_id)

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                added = self._take_commands(block=not self._engine.has_unfinished())
                if self._engine.has_unfinished():
                    self._deliver(self._engine.step())
                stats = self._engine.stats()
                with self._lock:  # the added sequences are in the stats now, running or waiting
                    self._stats = stats
                    self._unstarted -= added
        except BaseException as e:  # noqa: BLE001 - whatever killed the loop must reach every waiter
            # Every request in flight fails (500, its id named); new ones get 503 (is_alive).
            self.error = e
            failed = list(self._channels.items())
            log.exception("engine loop died; failing %d requests in flight: %s", len(failed),
                          " ".join(request_id for request_id, _ in failed))
            for request_id, channel in failed:
                channel.put(EngineFailedError(f"Internal server error: the engine failed while running request "
                                              f"{request_id} and stopped."))

    def _take_commands(self, block: bool) -> int:
        """Carry out the queued commands (waiting up to 0.5 s for one if block); the number of
        sequences added."""
        added = 0
        while True:
            try:
                kind, arg = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                return added
            block = False
            if kind == "add":
                assert isinstance(arg, Request)
                added += arg.params.n
                if arg.request_id not in self._channels:
                    continue  # its reader left before the engine saw it: nothing to abort
                try:
                    self._engine.add(arg)
                except MinillmError as e:
                    if channel := self._channels.get(arg.request_id):
                        channel.put(e)
            elif kind == "abort":
                out = self._engine.abort(str(arg))
                if out is not None:
                    self._deliver([out])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
        for out in outputs:
            if channel := self._channels.get(out.request_id):
                by_loop.setdefault(channel.loop, []).append((channel.queue, out))
        for loop, items in by_loop.items():
            _send(loop, items)
