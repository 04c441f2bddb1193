"""Draft tree specs (`--draft-tree SHAPE`): parsing and checking, plain Python.

`2,2,1`: static, children per node at each depth; `budget:N[,depth:D][,topk:W]`: dynamic,
the N best nodes of the candidates. What the trees are and how they are verified:
tree.py. The config checks a spec here without importing the jitted tree code.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

MAX_TREE_NODES = 128  # draft nodes a tree may hold (the root not counted)
DEFAULT_TOPK = 4  # a dynamic tree's candidates per expanded node and nodes expanded a depth
# methods whose modules draft from the target's hidden state, so one module call can run a
# whole level of nodes, each from its parent's module hidden
TREE_METHODS = ("chain", "eagle")


class TreeSpecError(ValueError):
    """A `--draft-tree` spec that cannot be parsed or built."""


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """A parsed `--draft-tree`: static `branching`, or a dynamic tree of `budget` drafts."""

    branching: tuple = ()  # static: children per node at each depth
    budget: Optional[int] = None  # dynamic: draft nodes kept (the root not counted)
    depth: Optional[int] = None  # dynamic: depths drafted (None: the engine's K)
    topk: int = DEFAULT_TOPK  # dynamic: candidates per expanded node, nodes expanded a depth

    @property
    def dynamic(self) -> bool:
        return self.budget is not None

    @property
    def max_depth(self) -> Optional[int]:
        """The deepest node's depth (the drafts a path can commit); None for a dynamic spec
        whose depth is the engine's (`with_depth`)."""
        return self.depth if self.dynamic else len(self.branching)

    @property
    def num_nodes(self) -> int:
        """Rows of the verify: the drafts and the root."""
        if self.dynamic:
            return self.budget + 1
        return 1 + sum(math.prod(self.branching[:d + 1]) for d in range(len(self.branching)))

    @property
    def num_candidates(self) -> Optional[int]:
        """A dynamic tree's candidates, the nodes it keeps `budget` of: `topk` at depth 1,
        then `topk` children of each of the `topk` expanded nodes per depth."""
        if not self.dynamic or self.depth is None:
            return None
        return self.topk + (self.depth - 1) * self.topk ** 2

    def with_depth(self, k: int) -> "TreeSpec":
        """A dynamic spec with its depth set to `k` where the spec names none (the engine's
        num_speculative_tokens); checked again. A static spec is returned as is."""
        if not self.dynamic or self.depth is not None:
            return self
        spec = dataclasses.replace(self, depth=k)
        _check(spec, str(spec))
        return spec

    def __str__(self) -> str:
        if not self.dynamic:
            return ",".join(map(str, self.branching))
        extra = "" if self.depth is None else f",depth:{self.depth}"
        return f"budget:{self.budget}{extra},topk:{self.topk}"


def _positive(text: str, what: str, spec: str) -> int:
    try:
        n = int(text.strip())
    except ValueError:
        raise TreeSpecError(f"draft tree {spec!r}: {what} must be an integer, got "
                            f"{text.strip()!r}") from None
    if n < 1:
        raise TreeSpecError(f"draft tree {spec!r}: {what} must be at least 1, got {n}")
    return n


def _check(spec: TreeSpec, text: str) -> None:
    drafts = spec.num_nodes - 1
    if drafts > MAX_TREE_NODES:
        raise TreeSpecError(f"draft tree {text!r} has {drafts} draft nodes; at most "
                            f"{MAX_TREE_NODES} are supported")
    cands = spec.num_candidates
    if cands is not None and cands < spec.budget:
        raise TreeSpecError(
            f"draft tree {text!r}: a budget of {spec.budget} needs at least as many "
            f"candidates, but depth {spec.depth} with topk {spec.topk} makes {cands} "
            f"(topk + (depth - 1) * topk^2)")


def parse_tree_spec(text: str) -> TreeSpec:
    """`2,2,1` (children per node at each depth) or `budget:N[,depth:D][,topk:W]` (the N
    best of the candidates W best children of the W best nodes of each depth make, D
    depths: the engine's K when not given; W defaults to DEFAULT_TOPK). TreeSpecError
    (a ValueError) naming what is wrong."""
    spec_text = text.strip()
    if not spec_text:
        raise TreeSpecError("draft tree spec is empty: give per-depth branching such as "
                            "'2,2,1' or a budget such as 'budget:8'")
    parts = [p.strip() for p in spec_text.split(",")]
    if parts[0].startswith("budget"):
        fields: dict = {}
        for part in parts:
            key, sep, value = part.partition(":")
            key = key.strip()
            if not sep or key not in ("budget", "depth", "topk"):
                raise TreeSpecError(f"draft tree {spec_text!r}: expected 'budget:N' with "
                                    f"optional ',depth:D' and ',topk:W', got {part!r}")
            if key in fields:
                raise TreeSpecError(f"draft tree {spec_text!r}: {key} given twice")
            fields[key] = _positive(value, key, spec_text)
        spec = TreeSpec(budget=fields["budget"], depth=fields.get("depth"),
                        topk=fields.get("topk", DEFAULT_TOPK))
    else:
        if any(":" in p for p in parts):
            raise TreeSpecError(f"draft tree {spec_text!r}: a dynamic tree starts with "
                                "'budget:N'")
        spec = TreeSpec(branching=tuple(
            _positive(p, f"the branching at depth {d + 1}", spec_text)
            for d, p in enumerate(parts)))
    _check(spec, spec_text)
    return spec


def check_tree_method(method: str) -> Optional[str]:
    """Why drafting method `method` cannot draft a tree, or None."""
    if method in TREE_METHODS:
        return None
    return (f"--draft-tree needs a method whose MTP modules draft from the target's hidden "
            f"state ({', '.join(TREE_METHODS)}); method {method!r} cannot draft a tree")


__all__ = ["TreeSpec", "TreeSpecError", "parse_tree_spec", "check_tree_method",
           "TREE_METHODS", "MAX_TREE_NODES", "DEFAULT_TOPK"]
