"""Prefix caching: KV pages of full prompt blocks, shared read-only between requests.

Plain Python (no jax), as the allocator and the scheduler that use it.

A block is `page_size` consecutive prompt positions; its pages (one per KV group) hold
every layer's KV there: the target's and each MTP module's (a DeepSeek Sparse Attention
layer's index keys too). A block is keyed by the hash of every token its KV depends on:
the target's KV at position p reads tokens <= p, but MTP module m (0-based) at p reads
token p + 1 + m and the target hiddens up to p + m + 1, so the block's key covers the
tokens up to its end plus K more (`lookahead`). Keys chain: block b's key is a function of
all tokens before its end (+ K), so equal keys mean equal KV.

Only blocks the prompt's prefill writes and nothing writes later are shared: those wholly
below the prompt's history end P - 1 - K (from there on the first draft window and the
decode steps write the MTP caches, and the target writes from P on). So the last partial
block, and the full blocks the draft window covers, are never shared.

A block is reference-counted by the running requests that read it (its first owner
included, from the admission that prefills it). At zero it stays cached and idle, least
recently used first in line for eviction: the allocator reclaims idle blocks' pages when
its free lists run short (`PageAllocator.reclaim`). A block registered by an admission is
`ready` only once that admission's prefill ran: a request admitted after it in the same
round waits for that prefill instead of computing the prefix again (engine.py).

Not used for layouts with a sliding-window group (a request's ring pages alias positions,
so they cannot be shared) or linear-attention layers (a prefix's recurrent state is not
kept per block; the prompt is recomputed): `PrefixCache.supports`.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Optional

import numpy as np


@dataclasses.dataclass
class Block:
    key: bytes
    pages: tuple  # one page id per KV group
    refs: int = 0  # running requests that read it
    ready: bool = False  # its KV is written (the registering admission's prefill ran)
    dead: bool = False  # its prefill met non-finite values: out of the index, freed unread


class PrefixCache:
    """Cached prompt blocks of one engine's page pools (`layout`: its KVLayout), keyed
    with `lookahead` (K) tokens past their end."""

    def __init__(self, layout, lookahead: int):
        self.layout, self.lookahead = layout, lookahead
        self.page_size = layout.page_size
        self.blocks: dict[bytes, Block] = {}
        self.idle: collections.OrderedDict = collections.OrderedDict()  # key -> Block, LRU first
        self.stats = collections.Counter()

    @staticmethod
    def supports(layout) -> Optional[str]:
        """Why prefix caching cannot run on this layout, or None."""
        if any(g.window is not None for g in layout.groups):
            return "a sliding-window layer's ring pages cannot be shared"
        if any(layout.is_linear(i) for i in range(layout.num_layers)):
            return ("a linear-attention layer's recurrent state is not kept per block, so "
                    "a prefix cannot be resumed from cached pages")
        return None

    # ------------------------------------------------------------------ keys
    def keys(self, prompt) -> list:
        """Keys of the prompt's shareable blocks: the full blocks below its history end
        P - 1 - K, each hashed over the tokens up to its end + K."""
        ids = np.asarray(prompt, np.int64)
        n = max(0, len(ids) - 1 - self.lookahead) // self.page_size
        ps, h, out = self.page_size, hashlib.blake2b(digest_size=16), []
        for b in range(n):
            h.update(ids[b * ps: (b + 1) * ps].tobytes())
            key = h.copy()
            key.update(ids[(b + 1) * ps: (b + 1) * ps + self.lookahead].tobytes())
            out.append(key.digest())
        return out

    def hits(self, keys: list) -> list:
        """The cached blocks of the longest prefix of `keys` held (ready or not)."""
        out = []
        for key in keys:
            block = self.blocks.get(key)
            if block is None:
                break
            out.append(block)
        return out

    # ------------------------------------------------------------- references
    def acquire(self, blocks: list) -> None:
        for block in blocks:
            block.refs += 1
            self.idle.pop(block.key, None)

    def register(self, key: bytes, pages: tuple) -> Optional[Block]:
        """A new block of one reference (its owner's), not ready; None when the key is
        held already (the owner keeps its page private)."""
        if key in self.blocks:
            return None
        block = self.blocks[key] = Block(key, tuple(pages), refs=1)
        return block

    def release(self, blocks: list) -> list:
        """Drop one reference from each of a prompt's blocks; those left unread become the
        most recently used idle ones, the prompt's first block last of all (its deeper
        blocks go first: a prefix outlives its continuations). The pages of dead blocks
        left unread, to be freed."""
        freed = []
        for block in reversed(blocks):
            block.refs -= 1
            if block.refs == 0:
                if block.dead:
                    freed.append(block.pages)
                else:
                    self.idle[block.key] = block
        return freed

    def kill(self, blocks: list) -> None:
        """Take blocks whose KV is unusable out of the index (their readers still hold
        them; their pages are freed with the last reference)."""
        for block in blocks:
            if not block.dead and self.blocks.get(block.key) is block:
                del self.blocks[block.key]
            block.dead = True

    def forget(self, blocks: list) -> list:
        """Remove never-ready blocks (their admission failed); the pages freed."""
        pages = []
        for block in blocks:
            if not block.ready and self.blocks.get(block.key) is block:
                del self.blocks[block.key]
                self.idle.pop(block.key, None)
                pages.append(block.pages)
        return pages

    # ---------------------------------------------------------------- eviction
    def idle_pages(self) -> int:
        """Pages per group the idle blocks hold (one each)."""
        return len(self.idle)

    def evict(self, n: int) -> list:
        """Evict up to n idle blocks, least recently used first; their pages."""
        out = []
        while self.idle and len(out) < n:
            _, block = self.idle.popitem(last=False)
            del self.blocks[block.key]
            out.append(block.pages)
        self.stats["evicted_blocks"] += len(out)
        return out

    def clear(self) -> list:
        """Forget every block (no request may read one); the idle blocks' pages."""
        pages = [b.pages for b in self.idle.values()]
        self.idle.clear()
        self.blocks.clear()
        return pages

    def held_pages(self) -> int:
        """Pages per group the cache holds (shared, owned or idle), each counted once."""
        return len(self.blocks)

    def shared_refs(self) -> int:
        """Block references beyond the first: pages that sharing saved."""
        return sum(max(0, b.refs - 1) for b in self.blocks.values())


__all__ = ["PrefixCache", "Block"]
