"""Grammar matching in a process of its own, beside the engine's thread.

xgrammar holds the GIL while it fills masks, so on the engine's thread that time would add to
every constrained step: the engine's host loop is what bounds decode speed at small and medium
batches. In a worker process it runs while the engine thread collects the last step, schedules and
prepares the next (the cost, measured: bench/README.md).

The engine thread talks to it by message, one per constrained step: the ids sampled in the step
it filled last (fed to the matchers of the rows it filled), matchers to open (a new sample's
grammar) or close (its sequence is gone), and which matcher each row of the next step has, sent
only when that changed. So a steady decode's message is a few hundred bytes, built without a loop
over the rows. The worker fills the rows into a bitmask in shared memory and replies with the
sequences whose matcher refused its token and the seconds it spent.

A sequence with k draft tokens has k + 1 rows keyed by its matcher, and the step sends its drafts
(`feeds`): the worker fills the first row, then for each further row has the matcher take the draft
before it and fills that row, and rolls the matcher back after. Rows after a draft the grammar
refuses allow every token: the target's masked sample before it differs from that draft, so none of
them is kept. When the ids come, the matcher takes the first row's, then each next row's while the
row before it sampled that row's draft: the tokens the engine keeps (speculative.accepted).
The tokenizer thread also sends each new request's spec, so the worker compiles it while the
engine compiles it to validate it.

A large batch's fills take longer than the engine thread's work around them, so there it is split
between processes: each owns the matchers whose key it is given (key % processes), takes every
message and does its own part of it, and fills its own rows of the one bitmask (the first process
also the rows without a grammar).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
from array import array
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from multiprocessing.shared_memory import SharedMemory

import torch
import xgrammar as xgr

from engine.errors import InvalidRequestError
from engine.fork_server import fork_server_context
from engine.sampling_params import StructuredOutput
from engine.structured_output import GrammarCompiler

log = logging.getLogger("minillm.engine")

READY_TIMEOUT_S = 120.0  # a spawned worker imports torch and xgrammar: seconds on a busy machine
SPLIT_BATCH = 32  # an engine that batches this many sequences splits its fills, cores allowing


def worker_processes(max_num_seqs: int) -> int:
    """How many processes fill masks: where a step may hold SPLIT_BATCH rows, four on a machine of 8
    cores or more, two on one of 4 to 7 (the engine thread keeps a core); else one, as on a two-core
    CI runner. Each process's share of a step is what the engine thread waits for."""
    cores = os.cpu_count() or 1
    if max_num_seqs < SPLIT_BATCH or cores < 4:
        return 1
    return 4 if cores >= 8 else 2


class GrammarWorkerError(RuntimeError):
    """The grammar worker process died or did not start."""


class Grammar:
    """One sequence's matcher, as the engine thread sees it: a key into the worker's matchers."""

    def __init__(self, key: int, spec: StructuredOutput) -> None:
        self.key = key
        self.spec = spec
        self.ended = False  # it took a stop token, or refused one: the sample is over (engine thread)


@dataclass
class _Step:
    """One message to the worker (pickled)."""

    fill: int  # this step's number
    accepts: list[tuple[int, bytes]]  # (a filled step's number, its sampled ids as int32 by row)
    closes: list[int]
    opens: list[tuple[int, StructuredOutput]]
    keys: bytes | None  # int32 by row: the matcher to fill the row from, -1 for none (None: as last step)
    shm_name: str | None  # a new bitmask buffer to attach (None: the last one)
    feeds: bytes | None = None  # int32 by row: the draft token the row follows, -1 for none (None: no drafts)


class GrammarWorker:
    """The engine thread's end: hands out Grammars, sends each step's grammar work, takes its masks.
    The process starts at the first use (or `start`); `submit` returns at once and `masks` waits."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, cache_size: int = 256, processes: int = 1) -> None:
        self._words = (tokenizer_info.vocab_size + 31) // 32  # the masks cover the info's ids
        self._info_json = tokenizer_info.serialize_json()
        self._cache_size = cache_size
        self.processes = processes
        self._processes: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._shm: SharedMemory | None = None
        self._bitmask: torch.Tensor | None = None  # [capacity rows, words] int32 over the shared memory
        self._new_shm = False
        self._pinned = False
        self._next_key = 0
        self._opens: list[tuple[int, StructuredOutput]] = []
        self._closes: list[int] = []  # appended by Grammar finalizers: a sequence's grammar is gone
        self._accepts: list[tuple[int, bytes]] = []
        self._fill = 0  # the number of the last submitted step
        self._keys: list[int] | None = None  # its rows' matchers, as last sent
        self._grammars: weakref.WeakValueDictionary[int, Grammar] = weakref.WeakValueDictionary()
        self._send_lock = threading.Lock()
        self._pending = 0  # the rows of a submitted step whose masks are not taken yet (0: none)
        self.mask_seconds = 0.0  # the worker's time feeding tokens and filling masks

    def start(self) -> None:
        """Start the workers and wait until they have loaded the tokenizer's vocabulary. They are forks
        of a fork server: a process that CUDA never touched (CUDA forbids forking the engine's own),
        which imports xgrammar and torch once, so that only a process's first worker pays for that."""
        if self._processes:
            return
        ctx = fork_server_context()
        for index in range(self.processes):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(theirs, self._info_json, self._cache_size, index, self.processes),
                                  name=f"minillm-grammar-{index}", daemon=True)
            process.start()
            theirs.close()
            self._processes.append(process)
            self._conns.append(ours)
        for conn in self._conns:
            if not conn.poll(READY_TIMEOUT_S):
                raise GrammarWorkerError("the grammar worker did not start")
            self._receive(conn)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
            conn.close()
        self._conns = []
        for process in self._processes:
            process.join(5)
            if process.is_alive():
                process.kill()
        self._processes = []
        if self._shm is not None:
            self._release_shm()

    def prepare(self, spec: StructuredOutput) -> None:
        """Have the workers compile `spec` now, while the engine compiles it to validate it (any
        thread; no reply: a spec that fails is left out of the workers' caches)."""
        if self._conns:
            self._send(("compile", spec))

    def grammar(self, spec: StructuredOutput) -> Grammar:
        """A new sample's grammar, at its beginning (its matcher opens with the next step)."""
        key, self._next_key = self._next_key, self._next_key + 1
        grammar = Grammar(key, spec)
        self._opens.append((key, spec))
        self._grammars[key] = grammar
        weakref.finalize(grammar, self._closes.append, key)  # the sequence is gone: drop its matcher
        return grammar

    def accept(self, token_ids: list[int]) -> None:
        """The ids sampled by row in the last submitted step: each filled row's matcher takes its
        own (sent with the next step; a matcher that took a stop token takes no more)."""
        self._accepts.append((self._fill, array("i", token_ids).tobytes()))

    def submit(self, keys: list[int], feeds: list[int] | None = None) -> bool:
        """Send the ids taken since the last step and have the worker fill the masks of a step whose
        row r is constrained by the grammar keyed keys[r] (-1: none), after the draft feeds[r] (-1:
        none) where sequences carry drafts (None: none does); returns at once. False if no row has
        a grammar (nothing is sent)."""
        assert not self._pending, "the last step's masks were not taken"
        if max(keys, default=-1) < 0:
            return False
        self.start()
        batch = len(keys)
        if self._bitmask is None or len(self._bitmask) < batch:
            self._allocate(max(batch, 256))
        self._fill += 1
        changed = keys != self._keys
        message = _Step(self._fill, self._accepts, self._closes[:], self._opens,
                        array("i", keys).tobytes() if changed else None, self._shm.name if self._new_shm else None,
                        None if feeds is None else array("i", feeds).tobytes())
        del self._closes[: len(message.closes)]
        self._accepts, self._opens, self._new_shm, self._keys = [], [], False, keys
        self._send(message)
        self._pending = batch
        return True

    def masks(self) -> torch.Tensor:
        """Wait for the submitted step's masks: the batch's bitmask (apply_token_mask reads it).
        Grammars that refused a token are marked ended."""
        batch, self._pending = self._pending, 0
        refused = []
        for conn in self._conns:
            theirs, seconds = self._receive(conn)
            refused += theirs
            self.mask_seconds += seconds
        for key in refused:
            if (grammar := self._grammars.get(key)) is not None:
                grammar.ended = True
                log.error("grammar of %s refused its sampled token", grammar.spec.param)
        bitmask = self._bitmask[:batch]
        # Unpinned memory on a GPU machine: a pinned copy (else the copy to the device would wait for it).
        return bitmask.pin_memory() if torch.cuda.is_available() and not self._pinned else bitmask

    def _send(self, message: _Step | tuple[str, StructuredOutput]) -> None:
        data = ForkingPickler.dumps(message)  # once, for every worker
        try:
            with self._send_lock:  # the tokenizer thread sends compiles, the engine thread steps
                for conn in self._conns:
                    conn.send_bytes(data)
        except OSError as e:
            raise GrammarWorkerError(f"the grammar worker is gone: {e}") from None

    @staticmethod
    def _receive(conn: Connection) -> object:
        try:
            reply = conn.recv()
        except (EOFError, OSError) as e:
            raise GrammarWorkerError(f"the grammar worker is gone: {e!r}") from None
        if isinstance(reply, BaseException):
            raise GrammarWorkerError(f"the grammar worker failed: {reply!r}")
        return reply

    def _allocate(self, capacity: int) -> None:
        """A shared bitmask of `capacity` rows; pinned for the device's copies where there is one."""
        if self._shm is not None:
            self._release_shm()
        self._shm = SharedMemory(create=True, size=capacity * self._words * 4)
        self._unlink = weakref.finalize(self, self._shm.unlink)  # at close, or at exit at the latest
        self._bitmask = torch.frombuffer(self._shm.buf, dtype=torch.int32).view(capacity, self._words)
        # Pinned, so the sampler's copy to the device is queued behind the forward, not waited for.
        self._pinned = torch.cuda.is_available() and _register(self._bitmask)
        self._new_shm = True

    def _release_shm(self) -> None:
        if self._pinned:
            torch.cuda.synchronize()  # no copy may still read it
            torch.cuda.cudart().cudaHostUnregister(self._bitmask.data_ptr())
        self._bitmask = None
        self._unlink()
        try:
            self._shm.close()
        except BufferError:  # a mask view is still alive: the mapping goes with it
            pass
        self._shm = None


def _register(bitmask: torch.Tensor) -> bool:
    """Page-lock host memory that torch did not allocate; False (logged) where CUDA refuses."""
    err = torch.cuda.cudart().cudaHostRegister(bitmask.data_ptr(), bitmask.numel() * 4, 0)
    if int(getattr(err, "value", err)) != 0 or not bitmask.is_pinned():
        log.warning("could not pin the grammar masks' shared memory (%s): each step copies them", err)
        return False
    return True


def _serve(conn: Connection, info_json: str, cache_size: int, index: int = 0, processes: int = 1) -> None:
    """A worker process: one matcher per open sequence whose key is its own (key % processes ==
    index), a compiled grammar per spec (cached); it fills its own rows, and process 0 those with no grammar."""
    # One thread: torch's pool would wake every core for a fill of a few rows, then spin on them
    # beside the engine's thread.
    torch.set_num_threads(1)
    try:
        info = xgr.TokenizerInfo.deserialize_json(info_json)
        compiler = GrammarCompiler(info, cache_size)
        batch = xgr.BatchGrammarMatcher(1)
        matchers: dict[int, xgr.GrammarMatcher] = {}
        shm: SharedMemory | None = None
        bitmask: torch.Tensor | None = None
        filled = 0  # the last step's number
        # The last step's rows: (row, matcher) of this process's keys (None: its grammar failed to
        # open) but for rows after a draft, those (matcher, its draft rows), and the rows with no grammar.
        mine: list[tuple[int, xgr.GrammarMatcher | None]] = []
        drafted: list[tuple[xgr.GrammarMatcher | None, list[int]]] = []
        free: list[int] = []
        keys = array("i")
        feeds: array | None = None  # the last step's drafts by row (None: it had none)
    except BaseException as e:  # noqa: BLE001 - reported to the engine, which raises it
        conn.send(e)
        return
    conn.send(None)  # ready
    while True:
        try:
            step = conn.recv()
        except (EOFError, OSError):  # the engine's process is gone
            break
        if step is None:  # the engine closed
            break
        if isinstance(step, tuple):  # ("compile", spec): ahead of the sequences that will use it
            try:
                compiler.compile(step[1])
            except InvalidRequestError:  # the engine refuses it too
                pass
            continue
        try:
            start = time.perf_counter()
            refused = []
            for fill, token_bytes in step.accepts:
                if fill != filled:
                    raise RuntimeError(f"the ids of step {fill} came after step {filled} was filled")
                token_ids = array("i", token_bytes)
                # A matcher that took a stop token is done: it takes no more.
                live = [(r, m) for r, m in mine if m is not None and not m.is_terminated()]
                if live:
                    accepted = batch.batch_accept_token([m for _, m in live], [token_ids[r] for r, _ in live])
                    refused += [keys[r] for (r, _), ok in zip(live, accepted) if not ok]
                for m, rows in drafted:  # each draft row's id, while the row before it sampled its draft
                    for r in rows:
                        if m is None or token_ids[r - 1] != feeds[r] or m.is_terminated():
                            break
                        if not m.accept_token(token_ids[r]):
                            refused.append(keys[r])
                            break
            for key in step.closes:
                matchers.pop(key, None)
            for key, spec in step.opens:
                if key % processes != index:
                    continue
                try:
                    matchers[key] = xgr.GrammarMatcher(compiler.compile(spec))
                except InvalidRequestError:  # the engine compiled it first, so never expected: the sample ends
                    refused.append(key)
            if step.keys is not None or step.opens or step.closes or step.feeds is not None or feeds is not None:
                if step.keys is not None:
                    keys = array("i", step.keys)
                feeds = None if step.feeds is None else array("i", step.feeds)
                mine = [(r, matchers.get(k)) for r, k in enumerate(keys) if k >= 0 and k % processes == index
                        and (feeds is None or feeds[r] < 0)]
                free = [r for r, k in enumerate(keys) if k < 0] if index == 0 else []
                drafted = _draft_rows(keys, feeds, matchers, index, processes)
            filled = step.fill
            if step.shm_name is not None:
                if shm is not None:
                    shm.close()
                shm = SharedMemory(name=step.shm_name)
                bitmask = torch.frombuffer(shm.buf, dtype=torch.int32).view(-1, (info.vocab_size + 31) // 32)
            rows = bitmask[: len(keys)]
            # A row without a grammar, or whose matcher is done (took a stop token: its sequence ends)
            # or missing, allows every token.
            fills, done = [], []
            for r, m in mine:
                if m is not None and not m.is_terminated():
                    fills.append((r, m))
                else:
                    done.append(r)
            if free or done:
                rows[free + done] = -1
            if fills:
                batch.batch_fill_next_token_bitmask([m for _, m in fills], rows, [r for r, _ in fills])
            for m, draft_rows in drafted:
                _fill_after_drafts(m, draft_rows, feeds, rows)
            conn.send((refused, time.perf_counter() - start))
        except BaseException as e:  # noqa: BLE001 - reported to the engine, which raises it
            conn.send(e)
    if shm is not None:
        shm.close()


def _draft_rows(keys: array, feeds: array | None, matchers: dict[int, xgr.GrammarMatcher], index: int,
                processes: int) -> list[tuple[xgr.GrammarMatcher | None, list[int]]]:
    """This process's drafted sequences: (matcher, the rows after its first, each following a draft)."""
    if feeds is None:
        return []
    drafted: dict[int, list[int]] = {}
    for r, (k, feed) in enumerate(zip(keys, feeds)):
        if feed >= 0 and k >= 0 and k % processes == index:
            drafted.setdefault(k, []).append(r)
    return [(matchers.get(k), rows) for k, rows in drafted.items()]


def _fill_after_drafts(m: xgr.GrammarMatcher | None, draft_rows: list[int], feeds: array, rows: torch.Tensor) -> None:
    """Fill each draft row of a sequence after its matcher takes the drafts up to it, then roll the
    matcher back. From a draft it refuses (or once it is done) the rows allow every token."""
    taken, ok = 0, m is not None
    for r in draft_rows:
        ok = ok and not m.is_terminated() and m.accept_token(feeds[r])
        taken += ok
        if ok and not m.is_terminated():
            m.fill_next_token_bitmask(rows, r)
        else:
            rows[r] = -1
    if taken:
        m.rollback(taken)
