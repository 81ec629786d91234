"""ModelRunner's host-side helpers (the forward itself is covered through the engine's tests)."""
from __future__ import annotations

import random

import pytest

from engine.model_runner import cache_slots


@pytest.mark.parametrize("start,end", [(0, 300), (5, 300), (16, 17), (15, 17), (31, 32), (40, 40)])
def test_cache_slots_are_each_positions_block_and_offset(start: int, end: int) -> None:
    block_size = 16
    table = random.Random(start).sample(range(1000), 20)  # scattered blocks
    assert cache_slots(table, start, end, block_size) == [
        table[p // block_size] * block_size + p % block_size for p in range(start, end)]
