"""Tree drafting's building blocks: trees as arrays, acceptance, compaction (the specs:
tree_spec.py).

A draft tree proposes several candidates per depth and the target verifies all of them in
one forward (`--draft-tree SHAPE`):
- static, by per-depth branching (`2,2,1`: two candidates at depth 1, each extended by
  its top 2, each of those by its top 1: 2 + 4 + 4 = 10 drafts); `1,1,1` is the chain;
- dynamic under a node budget (`budget:N`, EAGLE-2 / SGLang): each depth expands the
  `topk` best nodes by cumulative draft log-probability into their `topk` best children,
  and the tree keeps the N best of all candidates.

Layout. A tree of N nodes is in level order: node 0 is the root (the last committed
token, t_{L-1}), then the nodes of depth 1, depth 2, ...; every parent before its
children, siblings together in their parent's order of preference. Per node: `parent`
(-1 at the root), `depth`, and `ancestors`, [N, N] bool, row i holding i's ancestors and
i itself (the attention's `tree_mask`). `StaticTree` holds these for a branching as numpy
arrays; `Tree` holds them per request, [B, N] and [B, N, N], for the jitted step (a static
tree broadcast, or `select_tree`'s dynamic one).

Verify. Node i's token enters the target at logical position L - 1 + depth_i (RoPE),
its KV is stored at position L - 1 + i (one slot per node), and it attends to the
committed positions < L - 1 and to its ancestors' slots (paged attention with
`tree_mask=ancestors`). Its output row predicts the token after it, at position
L + depth_i.

Acceptance (the accepted path is root, then one node per depth, `path` [B, D + 1] with -1
past its length n; the step commits the path's n tokens and a bonus):
- greedy (`greedy_accept`): the deepest node whose every token on the path equals the
  target's argmax at its parent (ties: the lower node index); the bonus is the argmax at
  that node. With the target's seeded samples in place of the argmax it is coupled
  sampling: output then equals plain decoding's for the seed;
- sampled (`rejection_accept`, multi-candidate recursive rejection sampling, SpecInfer /
  EAGLE): at the current node p is the target's distribution; its children are tried in
  order, child c accepted with probability min(1, p(c) / q(c)); a rejection sets
  p <- norm(max(p - q, 0)) and the next sibling is tried; when all are rejected the bonus
  is drawn from p (the residual), and when one is accepted the walk moves to it with the
  target's distribution there. q is the distribution the child was drawn from: the
  parent's draft distribution when siblings are independent draws from it (`draft_logp`),
  or a point mass on the child itself when the siblings were chosen by the draft
  deterministically (top-k, a dynamic tree; `draft_logp=None`): then a child is accepted
  with probability p(c) and a rejection takes c out of p. Either way the committed tokens
  are distributed as the target's (duplicate siblings included). Keys follow sampling.py:
  (request seed, position, salt); the k-th sibling's accept draw takes the position's key
  plus k times a constant, so a chain draws exactly what `sampling.accept` draws.

Compaction. After acceptance the path's rows move to consecutive positions: the KV of
node path[d] from L - 1 + path[d] to L - 1 + d (`compact_pages`), and verify outputs
(hiddens for the MTP carry) from row path[d] to row d (`compact_rows`), both through
`compaction_indices`.

Plain numpy and jax; nothing here knows the engine.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_write import DROP_SLOT, slot_mapping

from .sampling import (SALT_ACCEPT, SALT_TARGET, gumbel_argmax, gumbel_noise, process_logits,
                       row_keys, uniform)
from .tree_spec import MAX_TREE_NODES, TreeSpecError

_SIBLING = 0x632BE5AB  # the k-th sibling's accept key: the position's key + k * this


# ----------------------------------------------------------------------- static trees
@dataclasses.dataclass(frozen=True, eq=False)
class StaticTree:
    """The tree of a per-depth branching, as numpy arrays (module docstring, Layout)."""

    branching: tuple
    parent: np.ndarray  # [N] int32, -1 at the root
    depth: np.ndarray  # [N] int32
    rank: np.ndarray  # [N] int32: node i is its parent's rank[i]-th candidate (0: the best)
    ancestors: np.ndarray  # [N, N] bool: row i holds i's ancestors and i

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    @property
    def max_depth(self) -> int:
        return len(self.branching)

    def level(self, depth: int) -> slice:
        """The nodes of one depth (contiguous: level order)."""
        return slice(int(np.searchsorted(self.depth, depth)),
                     int(np.searchsorted(self.depth, depth, side="right")))

    def arrays(self, batch: int) -> "Tree":
        """The tree for every request of a batch of `batch`, as jnp arrays."""
        n = self.num_nodes
        return Tree(jnp.broadcast_to(jnp.asarray(self.parent), (batch, n)),
                    jnp.broadcast_to(jnp.asarray(self.depth), (batch, n)),
                    jnp.broadcast_to(jnp.asarray(self.ancestors), (batch, n, n)),
                    self.max_depth)


@functools.lru_cache(maxsize=None)
def static_tree(branching: tuple) -> StaticTree:
    """The static tree of `branching` (children per node at each depth), level order,
    siblings together in their parent's order of preference."""
    branching = tuple(int(b) for b in branching)
    if not branching or min(branching) < 1:
        raise TreeSpecError(f"a static tree needs at least one depth and a branching of at "
                            f"least 1 at each, got {branching}")
    parent, depth, rank = [-1], [0], [0]
    level = [0]
    for d, b in enumerate(branching):
        nxt = []
        for p in level:
            for r in range(b):
                parent.append(p)
                depth.append(d + 1)
                rank.append(r)
                nxt.append(len(parent) - 1)
        level = nxt
    n = len(parent)
    if n - 1 > MAX_TREE_NODES:
        raise TreeSpecError(f"static tree {branching} has {n - 1} draft nodes; at most "
                            f"{MAX_TREE_NODES} are supported")
    anc = np.eye(n, dtype=bool)
    for i in range(1, n):  # parents come first: their rows are complete
        anc[i] |= anc[parent[i]]
    as_i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return StaticTree(branching, as_i32(parent), as_i32(depth), as_i32(rank), anc)


# --------------------------------------------------------------- trees in the program
@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["parent", "depth", "ancestors"], meta_fields=["max_depth"])
@dataclasses.dataclass(frozen=True)
class Tree:
    """Per-request trees of N nodes in level order (module docstring, Layout): parent
    [B, N] int32 (-1 at the root), depth [B, N] int32, ancestors [B, N, N] bool (the
    attention's tree_mask); max_depth, static, bounds every depth."""

    parent: jax.Array
    depth: jax.Array
    ancestors: jax.Array
    max_depth: int

    @property
    def num_nodes(self) -> int:
        return self.parent.shape[-1]


def sibling_rank(parent):
    """[B, N] int32: how many earlier nodes share each node's parent (0: the first child)."""
    n = parent.shape[-1]
    same = parent[:, :, None] == parent[:, None, :]
    earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]
    return jnp.sum(same & earlier, axis=-1, dtype=jnp.int32)


def path_to(tree: Tree, node):
    """[B, D + 1] int32: the nodes from the root to `node` [B], one per depth, -1 past
    node's depth."""
    anc = jnp.take_along_axis(tree.ancestors, node[:, None, None], axis=1)[:, 0]  # [B, N]
    at = anc[:, None, :] & (tree.depth[:, None, :] ==
                            jnp.arange(tree.max_depth + 1)[None, :, None])  # [B, D + 1, N]
    return jnp.where(jnp.any(at, -1), jnp.argmax(at, -1), -1).astype(jnp.int32)


def _committed(tokens, path, n, bonus):
    """[B, D + 1] int32: what a path commits, its drafts d_1..d_n (the tokens of path[1..n]),
    the bonus at n, zeros after (sampling.accept's layout)."""
    idx = jnp.arange(path.shape[1])[None]
    drafted = jnp.take_along_axis(tokens, jnp.roll(jnp.maximum(path, 0), -1, axis=1), axis=1)
    return jnp.where(idx < n[:, None], drafted,
                     jnp.where(idx == n[:, None], bonus[:, None], 0)).astype(jnp.int32)


def greedy_accept(tree: Tree, tokens, target_tokens):
    """The longest root-to-node path whose tokens equal the target's choice at their
    parents. tokens [B, N] (the root's entry is not read; a negative token never
    matches), target_tokens [B, N]: the target's argmax at each node (or its seeded sample,
    for coupled sampling). Returns (n [B] accepted drafts, path [B, D + 1] node indices, -1
    past n, bonus [B] = target_tokens at the path's last node). Among paths of one length
    the one ending at the lower node index wins."""
    parent = jnp.maximum(tree.parent, 0)
    root = tree.parent < 0
    match = (tokens == jnp.take_along_axis(target_tokens, parent, axis=1)) & (tokens >= 0)
    ok = root
    for _ in range(tree.max_depth):  # a node's path is settled one depth at a time
        ok = root | (match & jnp.take_along_axis(ok, parent, axis=1))
    best = jnp.argmax(jnp.where(ok, tree.depth, -1), axis=1).astype(jnp.int32)
    n = jnp.take_along_axis(tree.depth, best[:, None], axis=1)[:, 0]
    bonus = jnp.take_along_axis(target_tokens, best[:, None], axis=1)[:, 0]
    return n, path_to(tree, best), bonus


def rejection_accept(tree: Tree, target_logp, tokens, draft_logp, positions, seeds, *,
                     distinct=False):
    """Multi-candidate recursive rejection sampling over a tree (module docstring).

    target_logp [B, N, V]: the target's processed log-probs at each node (row i: the token
    after node i); tokens [B, N] (root's entry not read; a negative token is never
    accepted); draft_logp [B, N, V] or None: row i is the distribution node i's children
    were drawn from, independently (None: they were chosen deterministically, each child's
    proposal a point mass on itself); positions [B, D + 1]: the position a node of each
    depth decides (L + depth); seeds [B, 2]. `distinct`: a node's children were drawn
    from draft_logp's row without replacement, in sibling order (`draw_children(distinct=
    True)`): the k-th child's proposal is the row with the earlier siblings' tokens taken
    out and renormalised (each step is the same rejection step with the distribution the
    child was drawn from, so the result stays exact; no duplicates are verified).
    Returns (n [B], path [B, D + 1] with -1 past n, bonus [B]). Nodes are visited once in
    order, so a tree's children must follow their parents (level order does).
    """
    b, n_nodes, v = target_logp.shape
    depth = tree.depth
    pos = jnp.take_along_axis(positions, jnp.maximum(depth - 1, 0), axis=1)  # [B, N]
    keys = row_keys(seeds, pos, SALT_ACCEPT) + sibling_rank(tree.parent).astype(
        jnp.uint32) * jnp.uint32(_SIBLING)
    log_u = jnp.log(jnp.maximum(uniform(keys), 1e-38))
    vocab = jnp.arange(v)[None]
    rows = jnp.arange(b)

    def visit(j, carry):
        # cur: the last accepted node; lr: log of p there (unnormalised once a child was
        # rejected), ls: log of its sum (0 while p is the target's own); lw (distinct):
        # the proposal of cur's next child, its draft row less the siblings tried
        cur, lr, ls, lw = carry
        tok = tokens[:, j]
        child = (tree.parent[:, j] == cur) & (tok >= 0)
        c = jnp.maximum(tok, 0)
        lp_c = jnp.take_along_axis(lr, c[:, None], axis=1)[:, 0] - ls
        if draft_logp is None:  # the child's proposal: a point mass on itself
            lq = jnp.where(vocab == c[:, None], 0.0, -jnp.inf)
            lq_c = jnp.zeros((b,), jnp.float32)
        else:
            lq = lw if distinct else draft_logp[rows, jnp.maximum(tree.parent[:, j], 0)]
            lq_c = jnp.take_along_axis(lq, c[:, None], axis=1)[:, 0]
        # a child its proposal could not draw (no mass left) is never accepted
        ok = child & (log_u[:, j] < lp_c - lq_c) & (lq_c > -jnp.inf)
        resid = jnp.maximum(jnp.exp(lr - ls[:, None]) - jnp.exp(lq), 0.0)
        total = jnp.sum(resid, axis=-1)
        # rejected: p <- max(p - q, 0), normalised through ls; a residual of nothing
        # (p = q) cannot have been rejected but by rounding, and keeps p
        shrink = child & ~ok & (total > 0)
        lr = jnp.where(ok[:, None], target_logp[:, j],
                       jnp.where(shrink[:, None], jnp.log(resid), lr))
        ls = jnp.where(ok, 0.0, jnp.where(shrink, jnp.log(total), ls))
        if distinct:  # accepted: its children's row; rejected: this token taken out
            rest = jnp.log(jnp.maximum(-jnp.expm1(lq_c), 1e-30))
            out = jnp.where(vocab == c[:, None], -jnp.inf, lw - rest[:, None])
            lw = jnp.where(ok[:, None], draft_logp[:, j],
                           jnp.where((child & ~ok)[:, None], out, lw))
        return jnp.where(ok, j, cur), lr, ls, lw

    lw = draft_logp[:, 0] if distinct else jnp.zeros((b, 0), jnp.float32)
    init = (jnp.zeros((b,), jnp.int32), target_logp[:, 0], jnp.zeros((b,), jnp.float32), lw)
    cur, lr, _, _ = jax.lax.fori_loop(1, n_nodes, visit, init)
    n = jnp.take_along_axis(depth, cur[:, None], axis=1)[:, 0]
    pos_n = jnp.take_along_axis(positions, n[:, None], axis=1)
    bonus = gumbel_argmax(lr, row_keys(seeds, pos_n, SALT_TARGET)[:, 0])
    return n, path_to(tree, cur), bonus


def accept(tree: Tree, target_logits, tokens, draft_logp, positions, seeds, temperature,
           top_k, top_p, *, coupled=False, sampled=True, distinct=False):
    """Verify a tree: `sampling.accept` for trees. target_logits [B, N, V] (row i
    predicts the token after node i), tokens [B, N], draft_logp as `rejection_accept`'s
    (processed; unused by greedy and coupled rows), positions [B, D + 1] (L + depth),
    seeds [B, 2], per-row temperature, top_k, top_p [B]. Greedy rows (temperature 0)
    take `greedy_accept` of the argmax; sampled rows `rejection_accept`, or with `coupled`
    `greedy_accept` of the target's own seeded samples (output equal to plain decoding's).
    `sampled` False: every row is greedy (no sampled branch). `distinct`: siblings drawn
    without replacement (`rejection_accept`). Returns (n [B] accepted
    drafts, path [B, D + 1] (-1 past n), tokens [B, D + 1] = the path's drafts d_1..d_n,
    the bonus, then zeros)."""
    hot = temperature > 0
    argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    n_g, path_g, bonus_g = greedy_accept(tree, tokens, argmax)
    if not sampled:
        return n_g, path_g, _committed(tokens, path_g, n_g, bonus_g)

    def sampled_rows():
        logp = process_logits(target_logits, temperature, top_k, top_p)
        if coupled:
            at = jnp.take_along_axis(positions, tree.depth, axis=1)  # the token after node i
            own = gumbel_argmax(logp, row_keys(seeds, at, SALT_TARGET))
            return greedy_accept(tree, tokens, own)
        return rejection_accept(tree, logp, tokens, draft_logp, positions, seeds,
                                distinct=distinct)

    n_s, path_s, bonus_s = jax.lax.cond(jnp.any(hot), sampled_rows,
                                        lambda: (n_g, path_g, bonus_g))
    n = jnp.where(hot, n_s, n_g)
    path = jnp.where(hot[:, None], path_s, path_g)
    bonus = jnp.where(hot, bonus_s, bonus_g)
    return n, path, _committed(tokens, path, n, bonus)


# ----------------------------------------------------------------------------- drafting
def draw_children(logp, width: int, keys, temperature, *, sampled=True, distinct=False):
    """[B, M, width] int32: `width` children for each of M nodes from their draft
    log-probs logp [B, M, V]. Greedy rows (temperature 0) take the top `width` tokens
    (distinct, best first); sampled rows `width` independent draws (duplicates possible:
    verify them with their distribution as `draft_logp`), the k-th drawn with keys [B, M]
    plus k (k = 0: the key itself, so one child is what `sampling.sample` draws).
    `distinct`: sampled rows draw without replacement instead (Gumbel-top-k over the
    key's noise, so the first child is again `sampling.sample`'s; verify with
    `distinct=True`); a child past the tokens of nonzero probability is -1.
    `sampled` False: every row is greedy."""
    top = jax.lax.top_k(logp, width)[1].astype(jnp.int32)
    if not sampled:
        return top
    if distinct:
        val, idx = jax.lax.top_k(logp + gumbel_noise(keys, logp.shape[-1]), width)
        draws = jnp.where(val > -jnp.inf, idx, -1).astype(jnp.int32)
    else:
        draws = jnp.stack([gumbel_argmax(logp, keys + jnp.uint32(k * _SIBLING % 2**32))
                           for k in range(width)], axis=-1)
    hot = (temperature > 0)[:, None, None]
    return jax.lax.cond(jnp.any(temperature > 0), lambda: jnp.where(hot, draws, top),
                        lambda: top)


def expand(scores, ids, logp, width: int):
    """One depth of a dynamic tree: the `width` best children of each of k expanded
    nodes. scores [B, k]: the nodes' cumulative draft log-probs (0 at the root), ids
    [B, k]: their candidate ids (-1: the root), logp [B, k, V]: their draft log-probs.
    Returns (tokens, scores, parents) [B, k * width]: the children, their cumulative
    log-probs (a child's is never above its parent's) and their parents' candidate ids,
    node by node, best child first."""
    b, k, _ = logp.shape
    lp, tok = jax.lax.top_k(logp, width)
    cum = scores[:, :, None] + lp
    parents = jnp.broadcast_to(ids[:, :, None], (b, k, width))
    return (tok.reshape(b, k * width).astype(jnp.int32), cum.reshape(b, k * width),
            parents.reshape(b, k * width).astype(jnp.int32))


def top_nodes(scores, k: int):
    """(indices, scores) [B, k]: the k best of a depth's candidates, the nodes the next
    depth expands (ties: the lower index)."""
    best, idx = jax.lax.top_k(scores, k)
    return idx.astype(jnp.int32), best


def select_tree(root_token, tokens, scores, parents, budget: int, max_depth: int):
    """The dynamic tree: the `budget` best candidates by cumulative draft log-prob.

    tokens, scores, parents [B, M]: every candidate drafted (`expand`'s outputs of each
    depth concatenated in depth order, so a candidate's id is its index here and its
    parent's id is lower; -1: the root); root_token [B]; max_depth: the deepest candidate's
    depth. A child's score is at most its parent's and ties go to the lower index, so the
    kept set holds every kept node's ancestors. Returns (tree of budget + 1 nodes in level
    order, tokens [B, budget + 1] with the root's first, source [B, budget + 1]: each
    node's candidate id, -1 at the root, to gather per-candidate data such as the draft's
    hiddens).
    """
    b, m = scores.shape
    _, chosen = jax.lax.top_k(scores, budget)
    chosen = jnp.sort(chosen, axis=1).astype(jnp.int32)  # candidate order: level order
    rows = jnp.arange(b)[:, None]
    node_of = jnp.full((b, m), -1, jnp.int32).at[rows, chosen].set(
        jnp.arange(1, budget + 1, dtype=jnp.int32))
    up = jnp.take_along_axis(parents, chosen, axis=1)
    parent = jnp.where(up < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(up, 0), axis=1))
    parent = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parent], axis=1)
    node_tokens = jnp.concatenate([root_token[:, None].astype(jnp.int32),
                                   jnp.take_along_axis(tokens, chosen, axis=1)], axis=1)
    source = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), chosen], axis=1)
    return tree_of(parent, max_depth), node_tokens, source


def tree_of(parent, max_depth: int) -> Tree:
    """The Tree of per-request parents [B, N] int32 (level order, -1 at the root; no node
    deeper than max_depth): ancestors and depths follow."""
    b, n = parent.shape
    eye = jnp.eye(n, dtype=bool)[None]
    up_idx = jnp.maximum(parent, 0)
    is_root = (parent < 0)[:, :, None]
    anc = jnp.broadcast_to(eye, (b, n, n))
    for _ in range(max_depth):  # each round completes one more depth's rows
        anc = eye | (~is_root & jnp.take_along_axis(anc, up_idx[:, :, None], axis=1))
    depth = jnp.sum(anc, axis=-1, dtype=jnp.int32) - 1
    return Tree(parent, depth, anc, max_depth)


# --------------------------------------------------------------------------- compaction
def compaction_indices(path, n, num_nodes: int):
    """[B, num_nodes] int32 gather indices that move the accepted path's rows to
    consecutive places: index d holds path[d] for d <= n (the node at depth d) and d
    after (rows past the path stay)."""
    d = jnp.arange(num_nodes)[None]
    padded = jnp.pad(path, ((0, 0), (0, max(0, num_nodes - path.shape[1]))),
                     constant_values=-1)[:, :num_nodes]
    return jnp.where(d <= n[:, None], padded, d).astype(jnp.int32)


def compact_rows(x, idx):
    """Per-node rows x [B, N, ...] (verify outputs: hiddens, logits) with the path's rows
    first: row d = x[idx[d]]."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def compact_pages(pages, block_table, base, idx, n, page_size: int, limit):
    """Move the accepted path's cached rows into place in each page array of `pages`
    ([H, num_pages, page_size, X] each, any dtype: the stored values are copied, fp8
    included). The tree's node i sits at position base + i (base [B] = L - 1); node
    idx[d] moves to base + d for 1 <= d <= n (idx from `compaction_indices`). Positions
    outside [0, limit) are neither read nor written. Returns the updated pages."""
    d = jnp.arange(idx.shape[1])[None]
    move = (d >= 1) & (d <= n[:, None]) & (idx != d)
    src = slot_mapping(block_table, base[:, None] + idx, page_size, limit)
    dst = slot_mapping(block_table, base[:, None] + d, page_size, limit)
    dst = jnp.where(move & (src != DROP_SLOT), dst, DROP_SLOT).reshape(-1)
    src = jnp.where(dst.reshape(src.shape) != DROP_SLOT, src, 0).reshape(-1)
    out = []
    for p in pages:
        h, num_pages, size, x = p.shape
        flat = p.reshape(h, num_pages * size, x)
        flat = flat.at[:, dst].set(flat[:, src], mode="drop")  # all reads before writes
        out.append(flat.reshape(p.shape))
    return tuple(out)


__all__ = ["StaticTree", "static_tree", "Tree",
           "sibling_rank", "path_to", "greedy_accept", "rejection_accept", "accept",
           "draw_children", "expand", "top_nodes", "select_tree", "tree_of", "compaction_indices",
           "compact_rows", "compact_pages"]
