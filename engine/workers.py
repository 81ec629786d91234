"""The other tensor-parallel ranks: one process per device, started by rank 0.

Rank 0 is the engine's own process: it schedules, samples and streams. Each other rank loops on
the steps rank 0 sends (engine.model_runner.StepInputs, pickled through a pipe) and runs the same
forward on its shard; the collectives inside the forward keep them in lockstep.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback

import torch

from engine.builder import build_runner, check_tensor_parallel, kv_cache_blocks, load_shard
from engine.config import EngineConfig
from engine.distributed import SINGLE, TensorParallel, close_tensor_parallel, init_tensor_parallel, rank_device
from engine.model_runner import StepInputs

log = logging.getLogger("minillm.engine")


class Workers:
    """Rank 0's handle on ranks 1..N-1: starts them, sends them each step, stops them.

    A rank that dies leaves the others waiting in a collective forever, so a watchdog ends this
    process too (its supervisor restarts the server)."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        """Start ranks 1..N-1, then join their group as rank 0 on `device`."""
        self.size = config.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix="minillm-tp-")
        self.init_file = os.path.join(self._dir, "rendezvous")
        ctx = torch.multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        for rank in range(1, self.size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, config, self.init_file, theirs, os.getpid()),
                               name=f"minillm-tp{rank}", daemon=True)
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        self._closing = False
        self.tp = SINGLE  # rank 0's group, once joined
        threading.Thread(target=self._watch, name="minillm-tp-watchdog", daemon=True).start()
        atexit.register(self.close)  # before multiprocessing's own exit handler kills them
        try:
            self.tp = init_tensor_parallel(0, self.size, device, self.init_file)
        except BaseException:
            self.close()
            raise

    def send(self, step: StepInputs | None) -> None:
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._conns:
            conn.send_bytes(data)

    def close(self) -> None:
        """Stop the other ranks (they leave their loop at the next message), leave the group with
        them (at the same time: NCCL's teardown is collective) and wait for them."""
        if self._closing:
            return
        self._closing = True
        try:
            self.send(None)
        except OSError:  # a rank already gone
            pass
        close_tensor_parallel(self.tp)
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: p for p in self._procs}
        ended = multiprocessing.connection.wait(list(by_sentinel))
        if self._closing:
            return
        proc = by_sentinel[ended[0]]
        proc.join(1.0)  # for its exit code
        log.critical("tensor-parallel worker %s exited with code %s; the other ranks cannot go on without it: "
                     "exiting", proc.name, proc.exitcode)
        logging.shutdown()
        os._exit(1)


def _exit_with_parent(parent: int) -> None:
    """A worker whose rank 0 was killed would wait forever: leave when it is gone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _worker_main(rank: int, config: EngineConfig, init_file: str, conn: multiprocessing.connection.Connection,
                 parent: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(name)s[rank {rank}] %(levelname)s %(message)s")
    # Rank 0 stops this rank when it is done (after its drain); a Ctrl-C or SIGTERM sent to the whole
    # process group must not end it first, which would end rank 0 mid-drain.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    size = config.tensor_parallel_size
    device = rank_device(config.torch_device(), rank)
    if device.type == "cpu":  # share the cores with the other ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    tp = SINGLE
    try:
        tp = init_tensor_parallel(rank, size, device, init_file)
        model = load_shard(config, tp, device)
        runner = build_runner(config, model, kv_cache_blocks(config, model, tp))
        log.info("rank %d of %d ready on %s", rank, size, device)
        while (step := pickle.loads(conn.recv_bytes())) is not None:
            runner.follow(step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except EOFError:  # rank 0 is gone
        os._exit(1)
    except BaseException:  # noqa: BLE001 - say why before the watchdog on rank 0 ends the server
        log.critical("rank %d failed:\n%s", rank, traceback.format_exc())
        logging.shutdown()
        os._exit(1)
    close_tensor_parallel(tp)
    # Nothing is left to clean up, and the interpreter's teardown beside the group's native threads
    # can abort (a spawned child exits through sys.exit): leave at once, with a clean exit code.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start_tensor_parallel(config: EngineConfig) -> tuple[TensorParallel, Workers | None, torch.device]:
    """Rank 0's group, the other ranks (None without tensor parallelism), and rank 0's device."""
    check_tensor_parallel(config)
    device = config.torch_device()
    if config.tensor_parallel_size == 1:
        return SINGLE, None, device
    device = rank_device(device, 0)
    workers = Workers(config, device)
    return workers.tp, workers, device
