"""DecodeState and the jitted programs over it: admit, prefill, the speculative step, the loop.

The speculative step (fixed shapes, no host sync, no Python branch on data):
  1. verify: target forward over [last token, d_1..d_K] at positions L-1..L+K-1, paged
     attention with the bottom-right causal mask, KV written by slot mapping;
  2. accept: greedy / rejection sampling / relaxed (sampling.accept) -> n drafts + 1 token;
  3. emit the committed tokens into the output buffer, evaluate stop conditions on device
     (stop ids, max tokens, max_model_len, NaN / Inf in a used logits row);
  4. carry: `shift_draft_inputs` turns the history carry + verify outputs into the draft
     window of the K+1 newest committed positions and the next carry;
  5. draft K tokens for the next step with the chosen strategy (drafting.draft).
With a draft tree (`SpecConfig.draft_tree`, tree.py) step 1 verifies the tree's N nodes in
one pass under its ancestor mask, step 2 walks the tree (`tree.accept`), the accepted
path's KV rows and hiddens are compacted into place before step 4, and step 5 drafts the
next tree a depth per module call (`drafting.draft_tree`).
Rollback is free: writes are position-indexed and attention is masked by length, so only
the committed length moves. Linear-attention layers (Gated DeltaNet) carry a state per
slot instead: the verify keeps the state after each of its K+1 tokens and the accepted
count picks the one carried on (`PagedKV.commit_states`); nothing is recomputed. `run_steps` runs up to N steps in one `lax.while_loop`.

Prefill (a batch of up to `EngineConfig.prefill_batch` requests in one forward, a row
each, rows and chunk lengths bucketed to powers of two): `prefill_target` per chunk
(writes target KV, keeps the chunk's MTP hiddens in the row's scratch, and fills the MTP
caches of the history region, positions < a - K with a = prompt_len - 1, over the same
chunk), then `prefill_finish` samples each row's first token and runs its regular draft
window. `window` drafting reads K hiddens past each position, so its history runs a
program of its own (`prefill_mtp`) after the target's chunks.
All programs take the state donated and are built by `programs(...)` for one static
configuration, so nothing recompiles once each prefill bucket has been seen.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import os
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import Mesh

from pallas_kernels.invariant import compiler_options as invariant_compiler_options
from pallas_kernels.invariant import row_invariant
from pallas_kernels.shift_draft_inputs import shift_draft_inputs

from . import compile_cache
from .config import EngineConfig, ModelConfig, SpecConfig
from .drafting import draft, draft_tree, mtp_prefill
from .kv_cache import KVLayout, PagedKV, init_caches
from .sampling import SALT_TARGET, accept, row_keys, sample
from . import tree as trees
from .sharding import P, axis_size, batch_axis, shard_kernel, use_mesh

FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_ERROR = 0, 1, 2, 3


@flax.struct.dataclass
class SamplingState:
    temperature: jax.Array  # [B] f32, 0 = greedy
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] f32
    seed: jax.Array  # [B, 2] uint32 (hi, lo)


@flax.struct.dataclass
class DecodeState:
    # request bookkeeping, per slot
    active: jax.Array  # [B] bool   slot holds an admitted request not yet collected
    finish: jax.Array  # [B] int32  FINISH_* (0 while running)
    bad_from: jax.Array  # [B] int32  first prompt position whose hidden was non-finite
    #                      (max_model_len if none): the prompt's KV from there on is unusable
    length: jax.Array  # [B] int32  committed tokens L (prompt + generated)
    last_token: jax.Array  # [B] int32  t_{L-1}: first input of the next verify
    num_generated: jax.Array  # [B] int32
    max_tokens: jax.Array  # [B] int32  generation budget
    limit: jax.Array  # [B] int32  KV writes at positions >= limit are dropped
    stop_ids: jax.Array  # [B, S] int32  stop token ids, -1 padded
    sampling: SamplingState  # per-slot sampling params
    relaxed: jax.Array  # [B] bool   request allows relaxed acceptance
    think: jax.Array  # [B] bool   inside a thinking phase
    # speculation
    drafts: jax.Array  # [B, K] int32  drafts for the next verify (-1: none at that depth);
    #                    with a draft tree [B, N - 1]: its nodes' tokens but the root's
    draft_logp: jax.Array  # [B, K, V] f32  their processed draft log-probs ([B, K, 0] when
    #                        sampled rows verify by coupling, which does not read them); a
    #                        static tree's [B, N, V]: row i, what node i's children were
    #                        drawn from (a dynamic tree's [B, N, 0]: point masses)
    tree_parent: jax.Array  # [B, N] int32  the drafted tree's parents ([B, 0]: no tree)
    tree_slot: jax.Array  # [B, N] int32  each node's index among the nodes the drafting
    #                       ran the modules over (-1: a leaf), where its MTP rows are stored
    hist_tokens: jax.Array  # [B, K] int32  carry: MTP input tokens t_{p+1}, p = a-K+1..a
    hist_hidden: jax.Array  # [B, K, D]  carry: target hiddens H_p, same positions
    # paged KV
    caches: tuple  # per layer (target, then MTP) (k, v) [KVH, pages, page_size, hd], or
    #                (kv,) [1, pages, page_size, latent + rope] for latent attention (MLA)
    block_tables: tuple  # per KV group [B, width] int32
    # statistics and output
    steps: jax.Array  # [B] int32  target verify forwards
    accepted: jax.Array  # [B, K] int32  steps whose draft at depth d was accepted
    drafted: jax.Array  # [B, K] int32  steps that verified a draft at depth d
    out_tokens: jax.Array  # [B, T] int32  generated tokens
    # prefill scratch, a row per request of the prefill batch being admitted
    prefill_tokens: jax.Array  # [R, S] int32  prompt tokens t_i at O + i (O = K+1; entries
    #                            below O are never written)
    prefill_hidden: jax.Array  # [R, S or L, D]  target MTP hiddens H_p at
    #                            Static.hidden_slot(p): O + p, or a ring of the last L
    #                            positions (Static.hidden_ring); positions < 0 read as zeros


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything the compiled programs specialise on."""

    cfg: ModelConfig
    spec: SpecConfig
    eng: EngineConfig
    layout: KVLayout
    mesh: Optional[Mesh] = None
    weights_quantized: bool = False  # int8 / fp8 matmul weights (quant.mode_of)
    # the decode steps and the prefill's first tokens carry the sampled rows' paths;
    # False: programs for batches whose rows are all greedy (`Programs.steps(kind,
    # sampled=False)`, `Programs.prefill_finish(sampled=False)`)
    sampled: bool = True

    @property
    def k(self) -> int:
        return self.spec.k

    @property
    def strategy(self):
        """The drafting method's `strategies.Strategy`."""
        return self.spec.strategy

    @property
    def tree(self):
        """The draft tree (tree_spec.TreeSpec; its depth is K), or None for a chain."""
        return self.spec.tree

    @property
    def tree_nodes(self) -> int:
        """Rows of a verify: N for a tree, K + 1 for a chain."""
        return self.k + 1 if self.tree is None else self.tree.num_nodes

    @property
    def coupled(self) -> bool:
        """Sampled rows verify by coupled sampling (adaptive K: output independent of K)."""
        return self.spec.adaptive

    @property
    def kinds(self) -> tuple:
        """The step kinds (drafts verified per step) this engine compiles."""
        return tuple(range(self.k + 1)) if self.spec.adaptive else (self.k,)

    @property
    def offset(self) -> int:
        """Scratch index of position 0 (room for the window's rows before the prompt)."""
        return self.spec.k + 1

    @property
    def history_in_target(self) -> bool:
        """The MTP history prefill of a chunk runs in its target-prefill program: it needs
        only that chunk's hiddens (and prompt tokens). `window` reads the K hiddens after
        each position too, so it runs a chunk behind, as a program of its own."""
        return self.k > 0 and not self.strategy.history_reads_ahead

    @property
    def history_apart(self) -> bool:
        """The MTP history prefill runs as programs of its own (`prefill_mtp`)."""
        return self.k > 0 and not self.history_in_target

    @property
    def prefill_rows(self) -> int:
        """Requests one prefill forward carries (the scratch's rows)."""
        return self.eng.prefill_batch or 1

    @property
    def scratch_len(self) -> int:
        return self.offset + self.eng.max_model_len + self.eng.prefill_chunk + self.spec.k + 1

    @property
    def hidden_ring(self) -> Optional[int]:
        """Positions the hidden scratch keeps (a ring), or None for the whole prompt.
        With the history in the target's programs, a chunk's hiddens are read only by that
        chunk's program and the first draft window (the prompt's last K+1 positions): the
        latest chunk + K + 1 positions are enough, instead of max_model_len. `window`
        reads the whole prompt's after its target chunks."""
        return self.eng.prefill_chunk + self.spec.k + 1 if self.history_in_target else None

    @property
    def hidden_len(self) -> int:
        return self.hidden_ring or self.scratch_len

    def hidden_slot(self, pos):
        """Scratch index of prompt position(s) pos >= 0 in the hidden scratch."""
        return pos % self.hidden_ring if self.hidden_ring else self.offset + pos


def init_state(st: Static, hidden_dtype) -> DecodeState:
    cfg, eng, k = st.cfg, st.eng, st.k
    b, v, d = eng.max_batch, cfg.vocab_size, cfg.hidden_size
    zi = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
    state = DecodeState(
        active=jnp.zeros((b,), bool), finish=zi(b),
        bad_from=jnp.full((b,), eng.max_model_len, jnp.int32), length=zi(b), last_token=zi(b),
        num_generated=zi(b), max_tokens=zi(b), limit=zi(b),
        stop_ids=jnp.full((b, eng.max_stop_ids), -1, jnp.int32),
        sampling=SamplingState(jnp.zeros((b,), jnp.float32), zi(b),
                               jnp.ones((b,), jnp.float32), jnp.zeros((b, 2), jnp.uint32)),
        relaxed=jnp.zeros((b,), bool), think=jnp.zeros((b,), bool),
        drafts=zi(b, k), draft_logp=jnp.zeros((b, k, 0 if st.coupled else v), jnp.float32),
        tree_parent=zi(b, 0), tree_slot=zi(b, 0),
        hist_tokens=zi(b, k), hist_hidden=jnp.zeros((b, k, d), hidden_dtype),
        caches=init_caches(st.layout),
        block_tables=tuple(zi(b, st.layout.width) for _ in st.layout.groups),
        steps=zi(b), accepted=zi(b, k), drafted=zi(b, k), out_tokens=zi(b, eng.max_model_len),
        prefill_tokens=zi(st.prefill_rows, st.scratch_len),
        prefill_hidden=jnp.zeros((st.prefill_rows, st.hidden_len, d), hidden_dtype))
    tree = st.tree
    if tree is None:
        return state
    n = tree.num_nodes
    return state.replace(drafts=zi(b, n - 1), draft_logp=jnp.zeros(
        (b, n, 0 if tree.dynamic else v), jnp.float32),
        tree_parent=_placeholder_tree(b, n, k), tree_slot=zi(b, n))


def _placeholder_tree(b: int, n: int, depth: int):
    """[b, n] parents of a tree of n nodes no deeper than `depth` (a chain to `depth`, the
    rest the root's children): a valid tree for the rows no draft has run for yet."""
    i = jnp.arange(n, dtype=jnp.int32)
    return jnp.broadcast_to(jnp.where(i <= depth, i - 1, 0)[None], (b, n))


def _where(mask, new, old):
    """Per-slot select over matching pytrees (mask [B] broadcast over trailing dims)."""
    def sel(n, o):
        return jnp.where(mask.reshape(mask.shape + (1,) * (n.ndim - 1)), n, o)
    return jax.tree_util.tree_map(sel, new, old)


def _mtp_table(st: Static, block_tables):
    g = st.layout.layer_group[st.cfg.num_layers] if st.k else 0
    return block_tables[g]


# ---------------------------------------------------------------------------- the step
def decode_step(model, s: Static, st: DecodeState, kr: Optional[int] = None) -> DecodeState:
    """One verify + accept + draft step of kind kr (drafts verified and drafted next,
    0..K; default K). The carry and the state stay K wide whatever the kind."""
    k, eng = (s.k if kr is None else kr), s.eng
    b = st.length.shape[0]
    run = st.active & (st.finish == FINISH_NONE)
    length = st.length
    idx = jnp.arange(k + 1)
    drafts_in = st.drafts[:, :k]
    limit = jnp.where(run, st.limit, 0)
    # linear-attention layers keep their states after each verified token until the
    # accepted count is known (`commit_states` below)
    kv = PagedKV(s.layout, st.caches, st.block_tables, limit, backend=eng.attention_backend,
                 mesh=s.mesh, keep_states=bool(s.layout.linear))
    sp = st.sampling
    think = None
    if s.tree is not None:
        finite, hid, n, new_toks = _verify_tree(model, s, st, kv, run)
    else:
        # depths without a draft hold -1: never accepted, fed to the target as token 0
        toks = jnp.concatenate([st.last_token[:, None], jnp.maximum(drafts_in, 0)], axis=1)
        pos = length[:, None] - 1 + idx  # [B, K+1]
        with jax.named_scope("verify"):
            normed, pre = model.target(toks, pos, kv.attend(pos, jnp.where(run, length + k, 0)))
            logits = model.target.head(normed)  # [B, K+1, V] f32
            hid = model.target.mtp_hidden(normed, pre)
        with jax.named_scope("accept"):
            relaxed = None
            if s.spec.relaxed_acceptance:
                relaxed = (st.relaxed, st.think, s.spec.relaxed_topk, s.spec.relaxed_delta,
                           s.spec.think_begin_id, s.spec.think_end_id)
            n, new_toks, think = accept(logits, drafts_in, st.draft_logp[:, :k], pos + 1,
                                        sp.seed, sp.temperature, sp.top_k, sp.top_p,
                                        relaxed=relaxed, coupled=s.coupled, sampled=s.sampled)
        finite = jnp.all(jnp.isfinite(logits), axis=-1)  # [B, K+1]
    kv.commit_states(n)  # the states after the last accepted token: t_{L-1}, d_1..d_n
    with jax.named_scope("emit"):
        m = n + 1
        used = idx[None] <= n[:, None]
        bad = jnp.any(used & ~finite, axis=-1)
        is_stop = jnp.any(new_toks[..., None] == st.stop_ids[:, None, :], -1) & used
        first_stop = jnp.where(jnp.any(is_stop, -1), jnp.argmax(is_stop, -1), k + 1)
        cap = jnp.minimum(jnp.minimum(m, st.max_tokens - st.num_generated),
                          eng.max_model_len - length)
        stopped = first_stop + 1 <= cap
        emit = jnp.where(bad, 0, jnp.where(stopped, first_stop + 1, cap))
        gen = st.num_generated + emit
        at_len = (gen >= st.max_tokens) | (length + emit >= eng.max_model_len)
        finish = jnp.where(bad, FINISH_ERROR, jnp.where(stopped, FINISH_STOP, jnp.where(
            at_len, FINISH_LENGTH, FINISH_NONE)))
        t_out = st.out_tokens.shape[1]
        out_idx = jnp.where(run[:, None] & (idx[None] < emit[:, None]),
                            st.num_generated[:, None] + idx[None], t_out)
        out_tokens = st.out_tokens.at[jnp.arange(b)[:, None], out_idx].set(new_toks, mode="drop")
    new_len = length + m
    last = jnp.take_along_axis(new_toks, n[:, None], axis=1)[:, 0]
    pad = s.k - k  # depths this kind does not verify
    depth = jnp.arange(s.k)[None]
    # a tree has nodes at every depth; a chain's depths without a draft hold -1
    has_draft = True if s.tree is not None else st.drafts[:, :s.k] >= 0
    upd = dict(finish=finish, length=new_len, last_token=last, num_generated=gen,
               steps=st.steps + 1, accepted=st.accepted + (depth < n[:, None]),
               drafted=st.drafted + ((depth < k) & has_draft))
    if think is not None:
        upd["think"] = think
    if s.k:
        with jax.named_scope("shift"):
            hid = hid.astype(st.hist_hidden.dtype)
            if pad:  # the carry is K wide: rows past n are never read
                new_toks = jnp.pad(new_toks, ((0, 0), (0, pad)))
                hid = jnp.pad(hid, ((0, 0), (0, pad), (0, 0)))
            win_t, win_h, win_pos, hist_t, hist_h = _shift(
                s, st.hist_tokens, st.hist_hidden, new_toks, hid, n, length + n - 1,
                _mtp_table(s, st.block_tables), limit)
        upd.update(hist_tokens=hist_t, hist_hidden=hist_h)
        drafts = jnp.full((b, s.k), -1, jnp.int32)
        if s.tree is not None:
            with jax.named_scope("draft"):
                upd.update(_draft_tree(model, s, kv, win_t, win_h, win_pos, sp))
            drafts = upd.pop("drafts")
        elif k:
            # a kind that verifies k drafts commits at most k + 1 new positions: the
            # modules rewrite those (as an engine of K = k does), not the K + 1 of the
            # carry; on a CPU the draft's cost grows with the window
            w = k + 1
            with jax.named_scope("draft"):
                d, logp = draft(model, s.strategy, k, kv, win_t[:, -w:], win_h[:, -w:],
                                win_pos[:, -w:], sp, coupled=s.coupled, sampled=s.sampled)
            drafts = drafts.at[:, :k].set(d)
            if logp is not None and not s.coupled:  # greedy rows never read theirs
                upd["draft_logp"] = logp
        upd["drafts"] = drafts
    fields = {f: getattr(st, f) for f in upd}
    merged = _where(run, upd, fields)
    return st.replace(caches=tuple(kv.caches), out_tokens=out_tokens, **merged)


def _verify_tree(model, s: Static, st: DecodeState, kv: PagedKV, run):
    """The target over the drafted tree's N nodes in one pass, acceptance, and the
    accepted path moved into place (tree.py): the root t_{L-1} and node i's token at
    position L - 1 + depth_i, its KV stored at L - 1 + i, attending to the committed
    positions and its ancestors. Then the path's target KV rows and verify hiddens are
    compacted to L - 1 + d, and (`chain`) each module's rows of the path to its own
    positions, so nothing of the rejected branches is read again. Returns (finite [B, D +
    1]: the path's logits rows are finite, hiddens [B, D + 1, d] of the root and the path,
    n [B], committed tokens [B, D + 1] as sampling.accept's)."""
    sp, length = st.sampling, st.length
    tree = trees.tree_of(st.tree_parent, s.k)
    n_nodes = s.tree_nodes
    toks = jnp.concatenate([st.last_token[:, None], jnp.maximum(st.drafts, 0)], axis=1)
    base = length - 1
    rope = base[:, None] + tree.depth
    store = base[:, None] + jnp.arange(n_nodes)
    with jax.named_scope("verify"):
        normed, pre = model.target(toks, rope, kv.attend(
            store, jnp.where(run, base + n_nodes, 0), tree_mask=tree.ancestors))
        logits = model.target.head(normed)  # [B, N, V] f32
        hid = model.target.mtp_hidden(normed, pre)
    with jax.named_scope("accept"):
        logp = None if s.tree.dynamic else st.draft_logp
        n, path, new_toks = trees.accept(
            tree, logits, toks, logp, length[:, None] + jnp.arange(s.k + 1), sp.seed,
            sp.temperature, sp.top_k, sp.top_p, sampled=s.sampled, distinct=logp is not None)
    with jax.named_scope("compact"):
        order = trees.compaction_indices(path, n, n_nodes)
        finite = trees.compact_rows(jnp.all(jnp.isfinite(logits), axis=-1), order)
        hid = trees.compact_rows(hid, order)[:, :s.k + 1]
        kv.compact([i for i in range(s.cfg.num_layers) if not s.cfg.is_linear(i)], base,
                   order, n)
        if s.strategy.over_window:
            # module m's rows of node x sit at a - m + slot(x) (a = L - 2, the drafting's
            # anchor); a path node at depth d belongs at a - m + d
            slot = jnp.take_along_axis(st.tree_slot, jnp.maximum(path, 0), axis=1)
            d = jnp.arange(path.shape[1])[None]
            moved = jnp.where((d <= n[:, None]) & (slot >= 0), slot, d)
            for m in range(s.strategy.modules(s.k)):
                kv.compact([s.cfg.num_layers + m], length - 2 - m, moved, n)
    return finite[:, :s.k + 1], hid, n, new_toks


def _draft_tree(model, s: Static, kv: PagedKV, win_t, win_h, win_pos, sp) -> dict:
    """The next tree's state fields drafted from a window (drafting.draft_tree)."""
    parent, tokens, logp, slot = draft_tree(model, s.strategy, s.tree, kv, win_t, win_h,
                                            win_pos, sp, sampled=s.sampled)
    upd = dict(drafts=tokens[:, 1:], tree_parent=parent, tree_slot=slot)
    if logp is not None:  # greedy programs draw top-k children and never read it
        upd["draft_logp"] = logp
    return upd


def _shift(s: Static, hist_t, hist_h, new_t, new_h, n, anchor, table, limit):
    """shift_draft_inputs, per slot shard under a mesh (the kernel is per request)."""
    dp = batch_axis(s.mesh, hist_t.shape[0])

    def shift(hist_t, hist_h, new_t, new_h, n, anchor, table, limit):
        win_t, win_h, win_pos, _, nt, nh = shift_draft_inputs(
            hist_t, hist_h, new_t, new_h, n, anchor, table, page_size=s.layout.page_size,
            limit=limit)
        return win_t, win_h, win_pos, nt, nh

    two, three = P(dp, None), P(dp, None, None)
    fn = shard_kernel(shift, s.mesh, (two, three, two, three, P(dp), P(dp), two, P(dp)),
                      (two, three, two, two, three))
    return fn(hist_t, hist_h, new_t, new_h, n, anchor, table, limit)


def run_steps(model, s: Static, st: DecodeState, num_steps, kr: Optional[int] = None
              ) -> DecodeState:
    """Up to num_steps steps of kind kr (default K) while any slot runs."""
    def cond(c):
        i, st = c
        return (i < num_steps) & jnp.any(st.active & (st.finish == FINISH_NONE))

    def body(c):
        i, st = c
        return i + 1, decode_step(model, s, st, kr)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), st))[1]


# ------------------------------------------------------------------------------- admit
def admit(s: Static, st: DecodeState, slots, prompts, limit, max_tokens, stop_ids,
          temperature, top_k, top_p, seed, relaxed, think, table_rows, zero_pages
          ) -> DecodeState:
    """Put a prefill batch's requests into `slots` [R] (R = the scratch's rows; their
    block-table rows table_rows [R, groups, width] already reserved), one call a batch.

    Row i's prompt [S] (prompts [R, S] int32) is placed at scratch offset O in scratch
    row i, its place in the prefill batch; a slot of max_batch marks a padding row, whose
    updates are dropped. The per-row arrays are [R] (stop_ids [R, n], seed [R, 2]).
    think: the prompt leaves the request inside a thinking phase (relaxed acceptance).
    zero_pages [n] int32: pages whose per_step MTP-module KV (modules after the first)
    must read as zeros, padded with the null page 0.
    """
    def put(arr, val):
        return arr.at[slots].set(val, mode="drop")

    sp = st.sampling
    return st.replace(
        active=put(st.active, True), finish=put(st.finish, FINISH_NONE), length=put(st.length, 0),
        bad_from=put(st.bad_from, s.eng.max_model_len),
        num_generated=put(st.num_generated, 0), max_tokens=put(st.max_tokens, max_tokens),
        limit=put(st.limit, limit), stop_ids=put(st.stop_ids, stop_ids),
        sampling=SamplingState(put(sp.temperature, temperature), put(sp.top_k, top_k),
                               put(sp.top_p, top_p), put(sp.seed, seed)),
        relaxed=put(st.relaxed, relaxed), think=put(st.think, think),
        steps=put(st.steps, 0), accepted=put(st.accepted, 0), drafted=put(st.drafted, 0),
        block_tables=tuple(put(bt, table_rows[:, g]) for g, bt in enumerate(st.block_tables)),
        caches=_zero_per_step_pages(s, st.caches, zero_pages),
        prefill_tokens=prompts)


def _zero_per_step_pages(s: Static, caches, pages) -> tuple:
    """per_step's modules after the first only ever write draft positions: the rest of
    their pages must read as zeros, not as an earlier request's keys."""
    caches = list(caches)
    for m in s.strategy.draft_only_modules(s.k):
        layer = s.cfg.num_layers + m
        caches[layer] = tuple(c.at[:, pages].set(0) for c in caches[layer])
    return tuple(caches)


def grow(s: Static, st: DecodeState, mask, rows, limit, new_pages) -> DecodeState:
    """Slots `mask` [B] got more full-attention pages: their table rows [B, width] and
    KV write limits [B] replace the old ones; new_pages [n] (null-page padded) are the
    pages just handed out (zeroed where per_step needs it)."""
    tables = list(st.block_tables)
    tables[0] = jnp.where(mask[:, None], rows, tables[0])
    return st.replace(block_tables=tuple(tables), limit=jnp.where(mask, limit, st.limit),
                      caches=_zero_per_step_pages(s, st.caches, new_pages))


def release(st: DecodeState, mask) -> DecodeState:
    """Mark slots [B] bool as free (their pages are released on the host)."""
    return st.replace(active=st.active & ~mask)


# ----------------------------------------------------------------------------- prefill
def _rows_kv(s: Static, st: DecodeState, slots, limit, fresh=None):
    """PagedKV over the slots [r] of a prefill batch, writes below `limit` [r] (and the
    slot's own limit). A slot index of max_batch marks a padding row: every write dropped.
    fresh [r]: rows whose linear-attention states start from zeros (a prompt's first
    chunk; a resumed request's too, so its states are rebuilt from its tokens)."""
    real = slots < s.eng.max_batch
    tables = tuple(bt.at[slots].get(mode="clip") for bt in st.block_tables)
    limit = jnp.where(real, jnp.minimum(st.limit.at[slots].get(mode="clip"), limit), 0)
    return PagedKV(s.layout, st.caches, tables, limit, backend=s.eng.attention_backend,
                   mesh=s.mesh, batch_sharded=False, state_rows=slots, fresh=fresh)


def _scratch_rows(scratch, start, size: int):
    """Per row r of a prefill batch, scratch[r, start[r]: start[r] + size]."""
    rows = scratch[: start.shape[0]]
    return jax.vmap(lambda x, a: jax.lax.dynamic_slice_in_dim(x, a, size, 0))(rows, start)


def _hidden_rows(s: Static, scratch, start, size: int):
    """Per row r of a prefill batch, the hiddens of positions start[r] .. + size - 1
    (zeros for positions < 0)."""
    if not s.hidden_ring:
        return _scratch_rows(scratch, s.offset + start, size)
    pos = start[:, None] + jnp.arange(size)
    rows = jnp.take_along_axis(scratch[: start.shape[0]], s.hidden_slot(
        jnp.maximum(pos, 0))[..., None], axis=1)
    return jnp.where((pos >= 0)[..., None], rows, jnp.zeros_like(rows))


def prefill_target(model, s: Static, st: DecodeState, slots, start, valid, logits, chunk: int,
                   history_end):
    """Target over prompt positions start[r]..start[r]+chunk-1 of each row r of a prefill
    batch (slots [r], scratch rows 0..r-1; the first valid[r] positions are real, a row
    with valid 0 writes nothing).

    Writes the target KV and the MTP hiddens into the scratch; returns (state, logits
    [r, V]: a row's last valid position, or `logits`' row where valid is 0). When
    `s.history_in_target`, also the MTP history over the same positions (`prefill_mtp`,
    writes at >= history_end[r] dropped), in the same program."""
    o = s.offset
    r = slots.shape[0]
    tokens = _scratch_rows(st.prefill_tokens, o + start, chunk)
    pos = start[:, None] + jnp.arange(chunk)
    kv = _rows_kv(s, st, slots, start + valid, fresh=(start == 0) & (valid > 0))
    normed, pre = model.target(tokens, pos, kv.attend(pos, start + chunk))
    last = jnp.take_along_axis(normed, jnp.maximum(valid - 1, 0)[:, None, None], axis=1)
    logits = jnp.where((valid > 0)[:, None], model.target.head(last[:, 0]), logits)
    hid = model.target.mtp_hidden(normed, pre).astype(st.prefill_hidden.dtype)
    real = jnp.arange(chunk)[None] < valid[:, None]  # [r, chunk]
    at = jnp.where(real, s.hidden_slot(pos), st.prefill_hidden.shape[1])  # past it: dropped
    scratch = st.prefill_hidden.at[jnp.arange(r)[:, None], at].set(hid, mode="drop")
    # A non-finite hidden anywhere in the prompt ends the request (its K/V are written
    # as zeros, so the last row's logits alone would not show it).
    nonfinite = real & ~jnp.all(jnp.isfinite(pre.astype(jnp.float32)), axis=-1)  # [r, chunk]
    bad = jnp.any(nonfinite, axis=1)
    was = st.finish.at[slots].get(mode="clip")
    finish = st.finish.at[slots].set(jnp.where(bad, FINISH_ERROR, was), mode="drop")
    # where it started (the prefix cache must not share the blocks from there on)
    first = jnp.min(jnp.where(nonfinite, pos, s.eng.max_model_len), axis=1)
    bad_from = st.bad_from.at[slots].min(first, mode="drop")
    st = st.replace(caches=tuple(kv.caches), prefill_hidden=scratch, finish=finish,
                    bad_from=bad_from)
    if s.history_in_target:
        st = prefill_mtp(model, s, st, slots, start, history_end, chunk)
    return st, logits


def prefill_mtp(model, s: Static, st: DecodeState, slots, start, history_end, chunk: int):
    """MTP caches over prompt positions start[r]..start[r]+chunk-1 of each row; writes at
    >= history_end[r] (the first position of the row's final draft window) are dropped."""
    o, k = s.offset, s.k
    tokens_ext = _scratch_rows(st.prefill_tokens, o + start + 1, chunk + k)
    hidden_ext = _hidden_rows(s, st.prefill_hidden, start, chunk + k)
    pos = start[:, None] + jnp.arange(chunk)
    kv = _rows_kv(s, st, slots, history_end)
    mtp_prefill(model, s.strategy, k, kv, tokens_ext, hidden_ext, pos, start + chunk)
    return st.replace(caches=tuple(kv.caches))


def prefill_finish(model, s: Static, st: DecodeState, slots, logits, prompt_len, allowed):
    """Per row of a prefill batch: sample the first token among the row's `allowed` ones
    ([r, V] bool; all true but for a healed prompt, healing.py: the other logits are -inf
    for this one draw, greedy and sampled alike, with the usual key); draft from the window
    of positions a-K..a (a = P - 1). Padding rows (slot max_batch) change nothing.
    `s.sampled` False: every row is greedy, so argmax tokens and no draft log-probs, as in
    the greedy step programs."""
    k, o = s.k, s.offset
    at = lambda x: x.at[slots].get(mode="clip")  # noqa: E731
    put = lambda x, v: x.at[slots].set(v, mode="drop")  # noqa: E731
    sp = jax.tree_util.tree_map(at, st.sampling)
    keys = row_keys(sp.seed, prompt_len[:, None], SALT_TARGET)[:, 0]
    first, _ = sample(jnp.where(allowed, logits, -jnp.inf), sp.temperature, sp.top_k,
                      sp.top_p, keys, sampled=s.sampled)
    bad = ~jnp.all(jnp.isfinite(logits), axis=-1) | (at(st.finish) == FINISH_ERROR)
    length = prompt_len + 1
    stop = jnp.any(at(st.stop_ids) == first[:, None], axis=-1)
    at_len = (at(st.max_tokens) <= 1) | (length >= s.eng.max_model_len)
    finish = jnp.where(bad, FINISH_ERROR, jnp.where(stop, FINISH_STOP, jnp.where(
        at_len, FINISH_LENGTH, FINISH_NONE)))
    upd = dict(length=put(st.length, length), last_token=put(st.last_token, first),
               num_generated=put(st.num_generated, jnp.where(bad, 0, 1)),
               finish=put(st.finish, finish),
               out_tokens=st.out_tokens.at[slots, 0].set(first, mode="drop"))
    if k:
        a = prompt_len - 1
        win_t = _scratch_rows(st.prefill_tokens, o + a - k + 1, k + 1).at[:, k].set(first)
        win_h = _hidden_rows(s, st.prefill_hidden, a - k, k + 1)
        win_pos = a[:, None] - k + jnp.arange(k + 1)
        kv = _rows_kv(s, st, slots, at(st.limit))
        if s.tree is not None:
            upd.update({f: put(getattr(st, f), x) for f, x in _draft_tree(
                model, s, kv, win_t, win_h, win_pos, sp).items()})
        else:
            drafts, logp = draft(model, s.strategy, k, kv, win_t, win_h, win_pos, sp,
                                 coupled=s.coupled, sampled=s.sampled)
            if logp is not None and not s.coupled:  # greedy rows never read theirs
                upd["draft_logp"] = put(st.draft_logp, logp)
            upd["drafts"] = put(st.drafts, drafts)
        upd.update(hist_tokens=put(st.hist_tokens, win_t[:, 1:]),
                   hist_hidden=put(st.hist_hidden, win_h[:, 1:]), caches=tuple(kv.caches))
    return st.replace(**upd)


# ---------------------------------------------------------------------------- programs
class Program:
    """One engine program with the compile cache on: its executables, loaded from or saved
    to the cache folder (`compile_cache.ExecutableStore`), so a warm start calls them
    without tracing (otherwise programs are plain jitted functions). One executable per
    signature of the leaf arguments (the prefill row counts); a call whose params or state
    differ from the executable's (the executable refuses it before running) finds or
    compiles its own. A loaded executable whose first call fails is compiled afresh and
    called again (the store replaces its file), unless that call consumed its donated
    arguments: then, as for any error of the fresh one, the error is the caller's."""

    def __init__(self, jitted, name: str, store, context: str):
        self.jitted, self.name, self.store, self.context = jitted, name, store, context
        self._by_args: dict = {}
        self._unproven: set = set()  # signatures whose loaded executable has not run yet

    @staticmethod
    def _sig(args) -> tuple:
        return tuple((type(x), getattr(x, "shape", None), getattr(x, "dtype", None),
                      getattr(x, "weak_type", None))
                     for a in args if not isinstance(a, (dict, nnx.State, DecodeState))
                     for x in jax.tree_util.tree_leaves(a))

    def _fetch(self, sig, args):
        fn, loaded = self.store.get(self.jitted, self.name, self.context, args)
        self._keep(sig, fn, loaded)
        return fn

    def _keep(self, sig, fn, loaded: bool) -> None:
        self._by_args[sig] = fn
        if loaded:
            self._unproven.add(sig)
        else:
            self._unproven.discard(sig)

    def preload(self, *args) -> None:
        """Load the saved executable for these arguments if the store holds one; compiling
        what it lacks is left to `prepare` (tracing reads this thread's mesh and numerics
        switches, so it must not run on a worker thread; loading does not)."""
        sig = self._sig(args)
        if sig not in self._by_args:
            fn = self.store.load(self.name, self.context, args)
            if fn is not None:
                self._keep(sig, fn, True)

    def __call__(self, *args):
        sig, fn = self.prepare(*args)
        try:
            out = fn(*args)
        except TypeError:  # other params or state than this executable's: nothing ran
            return self._fetch(sig, args)(*args)
        except Exception:
            if sig not in self._unproven or _any_deleted(args):
                raise
            fn = self._by_args[sig] = self.store.replace(self.jitted, self.name,
                                                         self.context, args)
            out = fn(*args)
        self._unproven.discard(sig)
        return out

    def prepare(self, *args) -> tuple:
        """(signature, executable) for these arguments, loaded (or compiled and saved)
        without running it."""
        sig = self._sig(args)
        fn = self._by_args.get(sig)
        if fn is None:
            fn = self._fetch(sig, args)
        return sig, fn

    def _cache_size(self) -> int:
        return self.jitted._cache_size() + len(self._by_args)


def _any_deleted(args) -> bool:
    """Whether a failed call consumed (donated) any of its array arguments."""
    return any(getattr(x, "is_deleted", lambda: False)()
               for x in jax.tree_util.tree_leaves(args))


def preload(calls) -> None:
    """Make the executables of `calls` [(program, args)] ready several at a time, before
    `prepare` walks them in order: the saved ones are loaded on worker threads
    (deserializing is most of a warm start's warmup, about 0.2 s a step program on a CPU),
    then the missing ones are traced here and compiled side by side (a cold start's
    programs are independent of each other)."""
    todo = {}
    for f, a in calls:
        if isinstance(f, Program):
            todo.setdefault((id(f), f._sig(a)), (f, a))
    if len(todo) < 2:
        return
    with concurrent.futures.ThreadPoolExecutor(min(len(todo), PRELOAD_THREADS)) as pool:
        for done in [pool.submit(f.preload, *a) for f, a in todo.values()]:
            done.result()
    missing = {}  # per store: the programs it holds no executable of
    for (_, sig), (f, a) in todo.items():
        if sig not in f._by_args:
            missing.setdefault(id(f.store), []).append((f, a))
    for group in missing.values():
        threads = min(len(group), PRELOAD_THREADS, os.cpu_count() or 1)
        if threads < 2:
            continue
        got = group[0][0].store.compile_many(
            [(f.jitted, f.name, f.context, a) for f, a in group], threads)
        for (f, a), fn in zip(group, got):
            if fn is not None:
                f._keep(f._sig(a), fn, False)


PRELOAD_THREADS = 8  # executables loaded or compiled at once (each compile holds its program)


def prepare(program, *args):
    """Make `program` ready for these arguments: an executable-store program is loaded (or
    compiled into the store) without running, which spares a warm start the first
    execution (on CPU it costs several later ones); a plain jitted program runs once, its
    compile happening on that call. The outputs, or None when nothing ran."""
    if isinstance(program, Program):
        program.prepare(*args)
        return None
    return program(*args)


# Rows per matmul (slots per device x tokens per slot) from which a decode step's dense
# matmuls run on cuBLAS instead of XLA's Triton GEMMs on a GPU. H100, MiMo-7B shape, ctx
# 1024, step ms Triton / cuBLAS: `none` B=8 6.33 / 6.61, B=16 7.00 / 7.20, B=32 7.93 / 7.94,
# B=64 10.27 / 9.73; `chain` K=3 (4 rows a slot) B=8 8.92 / 9.19, B=16 9.93 / 9.61, B=32
# 11.44 / 10.92, B=64 14.64 / 14.54; at one row Triton's split-K GEMMs win by far (5.82 /
# 8.01). docs/BENCHMARKS.md, "The decode steps' GEMMs: Triton or cuBLAS by rows".
CUBLAS_FROM_ROWS = 64


def step_gemms(s: Static, kind: int) -> str:
    """'triton' or 'cublas': the backend of the dense matmuls of a decode step of `kind`
    (drafts verified) on a GPU: EngineConfig.step_gemms, else Triton for quantized weights
    (the products past the quantized-matmul kernel's rows are XLA's, which fuses the
    weights' conversion into its Triton GEMM; cuBLAS would read them converted to bf16 in
    memory: an int8 model's `chain` step at B=16 took twice as long on an H100), else by the
    verify's rows per device."""
    if s.eng.step_gemms is not None:
        return s.eng.step_gemms
    if s.weights_quantized:
        return "triton"
    dp = batch_axis(s.mesh, s.eng.max_batch)
    slots = s.eng.max_batch // (1 if dp is None else axis_size(s.mesh, dp))
    return "cublas" if slots * (kind + 1) >= CUBLAS_FROM_ROWS else "triton"


def greedy_steps(eng: EngineConfig) -> bool:
    """Whether all-greedy dispatches take the step programs without the sampled paths
    (`Static.sampled` False; EngineConfig.greedy_steps, on unless False). They are smaller
    (a CPU compiles them in about three quarters of the time) and, on a GPU, free of the
    sampled paths' conditionals, each of which reads a predicate back to the host."""
    return eng.greedy_steps is not False


def greedy_dispatches() -> bool:
    """Whether a job that mixes greedy and sampled requests compiles both step-program
    variants and runs its all-greedy dispatches on the greedy one: on a GPU, where each of
    the full program's conditionals costs a round trip to the host. Elsewhere such a job
    runs the full program throughout, one compile fewer (its conditionals cost little)."""
    return jax.default_backend() == "gpu"


def step_compiler_options(s: Static, kind: int) -> dict:
    """XLA options of the decode step program of `kind` (its GEMM backend on a GPU; in
    deterministic mode every program's, `program_compiler_options`)."""
    if s.eng.deterministic:
        return program_compiler_options(s)
    if jax.default_backend() == "gpu" and step_gemms(s, kind) == "cublas":
        return {"xla_gpu_enable_triton_gemm": False}
    return {}


def program_compiler_options(s: Static) -> dict:
    """XLA options of every engine program: in deterministic mode, the row-invariant
    ones (`pallas_kernels.invariant.compiler_options`), the same for every program so
    that a token's GEMMs are configured alike in a decode, a verify and a prefill."""
    return invariant_compiler_options() if s.eng.deterministic else {}


@dataclasses.dataclass(frozen=True, eq=False)
class Programs:
    """The jitted programs for one static configuration (state donated everywhere).

    With a mesh, `state_sharding` / `params_sharding` pin the shardings of inputs and
    outputs so a program's output feeds the next call without a reshard or recompile.
    Each program keeps its executables in the compile cache's store when the cache is on
    (`Program`); the store keys them by the devices they run on.
    """

    static: Static
    graphdef: object
    state_sharding: object = None
    params_sharding: object = None

    def _merge(self, params):
        return nnx.merge(self.graphdef, params)

    @functools.cached_property
    def _store(self):
        return compile_cache.executable_store()

    @functools.cached_property
    def _context(self) -> str:
        """What the programs are traced from besides their arguments, for the store's keys
        (a mesh's repr names its axes, not its devices: those are added in mesh order)."""
        mesh = self.static.mesh
        devices = None if mesh is None else [(d.id, d.device_kind) for d in mesh.devices.flat]
        return hashlib.sha256(repr((self.static, self.graphdef, devices)).encode()).hexdigest()

    def _jit(self, fn, n_extra: int, *, name: str, with_params=True, logits=False,
             compiler_options=None):
        """fn([params,] st, *extra) -> state (or (state, logits)), state donated.

        Under a mesh every input's sharding is pinned, the extra (host-side) arguments
        replicated: left unspecified, the compiler chooses the sharding of an uncommitted
        argument (the first prefill chunk's zero logits came out split over `tp`), which a
        later call's committed one (the previous chunk's replicated logits) does not
        match: `jax.jit` compiles again, a stored executable refuses the call."""
        if compiler_options is None:
            compiler_options = program_compiler_options(self.static)
        kw = {"compiler_options": compiler_options} if compiler_options else {}
        if self.state_sharding is not None:
            ins = (self.params_sharding,) if with_params else ()
            rep = jax.sharding.NamedSharding(self.static.mesh, P())
            kw["in_shardings"] = ins + (self.state_sharding,) + (rep,) * n_extra
            kw["out_shardings"] = (self.state_sharding, rep) if logits else self.state_sharding
        mesh = self.static.mesh

        invariant = self.static.eng.deterministic

        @functools.wraps(fn)
        def traced(*args):  # model code (MoE) shards over the mesh it finds while tracing
            with use_mesh(mesh), row_invariant(invariant):
                return fn(*args)

        return self._stored(jax.jit(traced, donate_argnums=(1 if with_params else 0,), **kw),
                            name)

    def _stored(self, jitted, name: str):
        """`jitted`, or its `Program` over the executable store when there is one."""
        store = self._store
        return jitted if store is None else Program(jitted, name, store, self._context)

    def _variant(self, sampled: bool) -> Static:
        """The static config of a program variant: `sampled` False for all-greedy rows."""
        return self.static if sampled else dataclasses.replace(self.static, sampled=False)

    @functools.cache
    def init(self, dtype):
        """The program that makes a fresh state: one compile, where building the state op by
        op would compile each of its small operations."""
        kw = {} if self.state_sharding is None else {"out_shardings": self.state_sharding}
        return self._stored(jax.jit(lambda: init_state(self.static, dtype), **kw),
                            f"init_state_{jnp.dtype(dtype).name}")

    @functools.cache
    def steps(self, kind: int, sampled: bool = True):
        """The multi-step program of one step kind (drafts verified per step); `sampled`
        False: the variant for batches whose rows are all greedy (`Static.sampled`)."""
        static = self._variant(sampled)

        def f(params, st, num_steps):
            return run_steps(self._merge(params), static, st, num_steps, kind)
        # the options follow from the static config and the platform, which key the store
        return self._jit(f, 1, name=f"steps{kind}" + ("" if sampled else "_greedy"),
                         compiler_options=step_compiler_options(static, kind))

    @property
    def run_steps(self):
        """The multi-step program at the full K."""
        return self.steps(self.static.k)

    @functools.cached_property
    def admit(self):
        return self._jit(functools.partial(admit, self.static), 13, name="admit",
                         with_params=False)

    @functools.cached_property
    def release(self):
        return self._jit(release, 1, name="release", with_params=False)

    @functools.cached_property
    def grow(self):
        return self._jit(functools.partial(grow, self.static), 4, name="grow",
                         with_params=False)

    @functools.cache
    def no_logits(self, rows: int):
        """The logits a prefill batch of `rows` starts from (zeros [rows, V]), placed as
        the prefill programs return theirs (replicated over the mesh, committed): jax
        traces a committed argument apart from an uncommitted one, so a first chunk
        passing fresh zeros and a later one passing the previous chunk's logits would
        compile the program twice."""
        rep = None if self.static.mesh is None else jax.sharding.NamedSharding(
            self.static.mesh, P())
        return jnp.zeros((rows, self.static.cfg.vocab_size), jnp.float32, device=rep)

    # The prefill programs take a batch of r requests (slots [r], per-row int32 arrays):
    # one compile per chunk length and row count.
    @functools.cache
    def prefill_target(self, chunk: int):
        """The target-prefill program for one chunk length (with the MTP history when
        `history_in_target`)."""
        def f(params, st, slots, start, valid, logits, history_end):
            return prefill_target(self._merge(params), self.static, st, slots, start, valid,
                                  logits, chunk, history_end)
        return self._jit(f, 5, name=f"prefill_target{chunk}", logits=True)

    @functools.cache
    def prefill_mtp(self, chunk: int):
        def f(params, st, slots, start, history_end):
            return prefill_mtp(self._merge(params), self.static, st, slots, start, history_end,
                               chunk)
        return self._jit(f, 3, name=f"prefill_mtp{chunk}")

    @functools.cache
    def prefill_finish(self, sampled: bool = True):
        """First tokens and drafts of a prefill batch; `sampled` False: the variant for
        batches whose rows are all greedy, as for `steps`."""
        static = self._variant(sampled)

        def f(params, st, slots, logits, prompt_len, allowed):
            return prefill_finish(self._merge(params), static, st, slots, logits, prompt_len,
                                  allowed)
        return self._jit(f, 4, name="prefill_finish" + ("" if sampled else "_greedy"))


def programs(static: Static, graphdef, state_sharding=None, params_sharding=None) -> Programs:
    return Programs(static, graphdef, state_sharding, params_sharding)


__all__ = ["DecodeState", "SamplingState", "Static", "Program", "Programs", "programs",
           "init_state", "decode_step", "run_steps", "FINISH_NONE", "FINISH_STOP",
           "FINISH_LENGTH", "FINISH_ERROR"]
