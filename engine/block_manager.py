"""Paged KV cache bookkeeping: fixed-size blocks, block tables, and the prefix cache.

A block's KV is reusable by any sequence whose tokens up to the end of that block are the same, so
full blocks are keyed by a chained hash of their token ids (the chain starts from the request's
cache salt, if any). Blocks nobody references but that still hold cached KV wait in LRU order and
are evicted only when a fresh block is needed.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full of computed KV and registered


def block_hash(parent: bytes, token_ids: Seq[int] | bytes) -> bytes:
    """Chained hash: a block's key covers every token before it, not just its own. token_ids: the
    ids, or their int64 bytes."""
    data = token_ids if isinstance(token_ids, bytes) else array("q", token_ids).tobytes()
    return hashlib.blake2b(parent + data, digest_size=16).digest()


def salt_root(cache_salt: str | None) -> bytes:
    """The parent of a sequence's first block: empty, or a digest of its cache salt, so salted chains
    share no block with other salts or with none (a digest, so no salt can pose as a block's hash)."""
    if cache_salt is None:
        return b""
    return hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), digest_size=16, person=b"minillm-salt").digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))  # unreferenced, holding nothing cached
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, LRU first
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write, done before the next forward
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """seq's chained block hashes, the first num_blocks at least (computed once, kept on seq)."""
        bs, hashes = self.block_size, seq.block_hashes
        if len(hashes) >= num_blocks:
            return hashes
        # The new blocks' ids as int64 bytes in one conversion (a long prompt has hundreds of blocks).
        data = array("q", seq.token_ids[len(hashes) * bs : num_blocks * bs]).tobytes()
        width = 8 * bs
        for offset in range(0, len(data), width):
            parent = hashes[-1] if hashes else salt_root(seq.request.params.cache_salt)
            hashes.append(block_hash(parent, data[offset : offset + width]))
        return hashes

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's leading tokens. The last token is always left to compute,
        since its logits are needed to sample."""
        if not self.enable_prefix_caching or seq.request.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position's logits
        hits: list[int] = []
        # Hashed a block at a time up to the first miss: a fresh prompt's other blocks are hashed after
        # its first chunk has launched (cache_full_blocks), not before, where they would delay it.
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.cached.get(self._hashes(seq, i + 1)[i])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = ()) -> bool:
        """Make room for seq's next num_new_tokens tokens (after taking cached_blocks, for a sequence
        with no blocks yet). All or nothing: returns False and changes nothing if blocks run out."""
        assert not cached_blocks or not seq.block_table
        table = seq.block_table
        if (not cached_blocks and table and seq.num_computed_tokens + num_new_tokens <= len(table) * self.block_size
                and self.blocks[table[-1]].ref_count == 1):
            return True  # the common decode step: room left in its own last block
        num_computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        have = len(seq.block_table) + len(cached_blocks)
        need = max(self.blocks_for(num_computed + num_new_tokens) - have, 0)
        # Writing into a partly filled block that others share needs a private copy first.
        cow = bool(
            seq.block_table
            and num_computed % self.block_size
            and self.blocks[seq.block_table[-1]].ref_count > 1
        )
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if need + cow > self.num_free_blocks - revived:
            return False
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.evictable[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if self.enable_prefix_caching and have == len(cached_blocks):  # a first (re)admission: a lookup
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += len(cached_blocks) * self.block_size
        if cow:
            src = seq.block_table[-1]
            self.blocks[src].ref_count -= 1
            seq.block_table[-1] = self._take()
            self.pending_copies.append((src, seq.block_table[-1]))
        seq.block_table.extend(self._take() for _ in range(need))
        return True

    def cache_full_blocks(self, seq: Sequence, old_num_computed: int) -> None:
        """Register the blocks that seq's last step filled with computed KV of real tokens (the
        drafts of a step in flight are not, until it is read)."""
        if not self.enable_prefix_caching:
            return
        first = old_num_computed // self.block_size
        last = min(seq.num_computed_tokens, seq.num_real_tokens) // self.block_size
        if first >= last:
            return
        for i, h in enumerate(self._hashes(seq, last)[first:last], start=first):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.cached:
                block.hash = h
                self.cached[h] = block.block_id

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares all of parent's blocks (copy-on-write for the partial last one)."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; its tail blocks go first so they are evicted before its head."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []

    def trim(self, seq: Sequence) -> None:
        """Drop seq's blocks past its computed tokens': the ones only rejected draft tokens used (the
        next step allocates for its next token as any step does)."""
        keep = self.blocks_for(seq.num_computed_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            if block.hash is not None:
                self.evictable[block_id] = None
            else:
                self.free_ids.append(block_id)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _take(self) -> int:
        if self.free_ids:
            block = self.blocks[self.free_ids.popleft()]
        else:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached[block.hash]
            block.hash = None
        block.ref_count = 1
        return block.block_id
