"""The fork server that grammar worker processes start from. This module imports neither torch nor
xgrammar: `minillm serve`'s worker starts the fork server before it imports them itself, so that
the fork server's imports of both run beside its own."""
from __future__ import annotations

import multiprocessing as mp
from multiprocessing import forkserver

PRELOAD = ["engine.grammar_worker"]  # what the fork server imports once, for every worker it forks


def fork_server_context() -> mp.context.ForkServerContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_fork_server() -> None:
    """Start the fork server now, without waiting for its imports."""
    fork_server_context()
    forkserver.ensure_running()
