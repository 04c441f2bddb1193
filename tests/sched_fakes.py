"""Stand-ins for what the scheduler, the page allocator and the prefix cache read of the
KV layout (kv_cache.KVLayout) and of a request (engine.Request): no jax, no model."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Group:
    window: object
    num_pages: int
    ring_pages: int = 0


@dataclasses.dataclass(frozen=True)
class Layout:
    page_size: int = 8
    width: int = 8
    groups: tuple = (Group(None, 9),)  # 8 pages + the null page
    linear: tuple = ()
    num_layers: int = 2

    def pages_for(self, group: int, tokens: int) -> int:
        g = self.groups[group]
        return g.ring_pages if g.window is not None else -(-tokens // self.page_size)

    def is_linear(self, layer: int) -> bool:
        return bool(self.linear) and self.linear[layer] is not None


@dataclasses.dataclass(frozen=True)
class Sampling:
    max_tokens: int = 16
    temperature: float = 0.0
    stop: tuple = ()
    stop_token_ids: tuple = ()


@dataclasses.dataclass
class Req:
    id: object
    prompt_ids: list
    sampling: Sampling = Sampling()
