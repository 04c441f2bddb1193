"""Draft strategies: which positions, tokens and hiddens each MTP module sees.

Every strategy starts from the same window of the K+1 most recent committed positions
p = a-K .. a (a = L-2, the newest position whose target hidden exists), built by
`shift_draft_inputs` from the hidden-history carry and the verify outputs: module-1
inputs pair the token t_{p+1} with the target hidden H_p. Module k (0-based) predicts the
token at position a + k + 2 from its output at the window's last slot.

- `window` (TensorRT-LLM MTPWorker): every module runs over the whole window; module k+1
  takes the tokens rolled left by one (the newest slot gets module k's draft) and the
  hiddens shifted left by one, the newest slot getting module k's output hidden. So its
  earlier slots pair tokens with target hiddens (H_{p+k}), only the newest is chained.
- `chain` (vLLM MTP3, training style): as `window`, but module k+1 consumes module k's
  output hiddens over the whole window, exactly the DeepSeek training recurrence.
- `eagle` (vLLM EagleProposer / TensorRT-LLM MTPEagleWorker): module 1 over the window,
  then K-1 single-token passes of module 1 at positions a+1, a+2, ... feeding back its
  own hidden.
- `per_step` (vLLM Step3p5MTPProposer): as `eagle`, but pass s uses module s and its head.
  Modules after the first only ever see draft positions (their KV is zeroed at admission
  so unwritten positions read as zeros, the same for every batch): a known approximation.

A window of K+1 (not K) positions rewrites every module's KV for all newly committed
positions even when all K drafts were accepted. The architecture's `mtp_hidden_source`
is orthogonal: with `target`, every module consumes the target hidden of its anchor (the
window's H, or H_a for single-token passes) and only the tokens rotate.
The same module passes fill the MTP caches over the prompt at prefill (`mtp_prefill`).
Each method is a `strategies.Strategy`; the passes below read its fields.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import tree as T
from .sampling import SALT_DRAFT, SALT_TARGET, process_logits, row_keys, sample
from .strategies import CHAINED, Strategy


def draft(model, strategy: Strategy, k: int, kv, win_tokens, win_hidden, win_pos, sp, *,
          coupled=False, sampled=True):
    """k drafts [b, k] and their processed log-probs [b, k, v] from a window [b, W].

    Only the first k modules run, over the whole window (the decode step passes the k + 1
    positions a kind of k drafts can commit). `kv` is the PagedKV of the traced program; `sp`
    holds per-row temperature, top_k, top_p [b] and seeds [b, 2]. `coupled`: sampled
    drafts use the target's key of their position (see sampling.accept). `sampled` False:
    every row is greedy, the drafts are argmaxes and the log-probs None.
    """
    cfg = model.cfg
    a = win_pos[:, -1]
    previous = cfg.mtp_hidden_source == "previous"
    drafts, logps = [], []

    def pick(m, normed, depth):
        logits = model.draft_logits(m, normed)
        keys = row_keys(sp.seed, (a + 2 + depth)[:, None],
                        SALT_TARGET if coupled else SALT_DRAFT)[:, 0]
        tok, logp = sample(logits, sp.temperature, sp.top_k, sp.top_p, keys, sampled=sampled)
        drafts.append(tok)
        logps.append(logp)
        return tok

    if not strategy.speculative:
        raise ValueError(f"no drafting for method {strategy.name!r}")
    if strategy.over_window:
        tok, hin = win_tokens, win_hidden
        for m in range(k):
            hout, normed = model.draft(m, tok, hin, win_pos, kv.attend(win_pos, a + 1))
            d = pick(m, normed[:, -1], m)
            tok = jnp.concatenate([tok[:, 1:], d[:, None]], axis=1)
            if not previous:
                hin = win_hidden
            elif strategy.hidden_from == CHAINED:
                hin = hout
            else:
                hin = jnp.concatenate([hin[:, 1:], hout[:, -1:].astype(hin.dtype)], axis=1)
    else:
        hout, normed = model.draft(0, win_tokens, win_hidden, win_pos, kv.attend(win_pos, a + 1))
        d = pick(0, normed[:, -1], 0)
        h = hout[:, -1:]
        for s in range(1, k):
            m = strategy.module_at(s)
            pos = (a + s)[:, None]
            hin = h if previous else win_hidden[:, -1:]
            h, normed = model.draft(m, d[:, None], hin, pos, kv.attend(pos, a + s + 1))
            d = pick(m, normed[:, 0], s)
    return jnp.stack(drafts, axis=1), jnp.stack(logps, axis=1) if sampled else None


def mtp_prefill(model, strategy: Strategy, k: int, kv, tokens_ext, hidden_ext, pos, kv_lens):
    """Fill MTP caches for prompt positions pos [b, C] (consecutive, no drafting).

    tokens_ext [b, C + K]: t_{p+1} for p from pos[:, 0] on; hidden_ext [b, C + K, d]:
    the target hiddens H_p for the same positions (the tail lets `window` read H_{p+m}).
    Writes past the history region must be dropped by the caller's limit.
    """
    cfg = model.cfg
    c = pos.shape[1]
    previous = cfg.mtp_hidden_source == "previous"
    hin = hidden_ext[:, :c]
    for m in range(strategy.history_modules(k)):
        hout, _ = model.draft(m, tokens_ext[:, m: m + c], hin, pos, kv.attend(pos, kv_lens))
        if not previous:
            hin = hidden_ext[:, :c]
        elif strategy.hidden_from == CHAINED:
            hin = hout
        else:
            hin = hidden_ext[:, m + 1: m + 1 + c]


def draft_tree(model, strategy: Strategy, spec, kv, win_tokens, win_hidden, win_pos, sp, *,
               sampled=True):
    """Draft a tree (tree.py) from a window [b, K + 1] (K = the tree's depth D).

    Depth by depth, the nodes the tree expands (a static tree: all of a depth; a dynamic
    one: the root, then the `topk` best of each depth's candidates) run through one module
    call, each node's input its own token and its parent's module hidden, and their
    logits give the next depth's children. `eagle`: module 1 over the window (the root
    is its last slot), then one call a depth over that depth's nodes at positions a + e,
    attending to the window and their ancestors. `chain`: module e + 1 over the window's
    committed slots it reads (as the chain does, tokens e on) and every expanded node of
    depths 0..e, node x at position a - e + depth(x), over the module's own rows of x's
    ancestors: along any path, exactly the chain's recurrence (a tree of branching 1 is
    the chain). A module's tree rows are stored from its first draft position on, at
    that position plus the node's index among the expanded nodes (`slot`).

    A static tree's sampled rows draw each node's children without replacement (no
    duplicate siblings; the first is the chain's draft).

    Returns (parent [b, N] int32 (level order, -1 at the root), tokens [b, N] int32 (the
    root's first: the last committed token), draft_logp [b, N, v] or None (row i: what
    node i's children were drawn from, for a static tree's sampled rows; None for a
    dynamic tree, whose children are the draft's top-k, and when `sampled` is False),
    slot [b, N] int32 (the node's index among the expanded nodes, -1 for the others)).
    """
    cfg = model.cfg
    b, w = win_tokens.shape
    k = w - 1
    depth_total = spec.max_depth
    a = win_pos[:, -1]
    previous = cfg.mtp_hidden_source == "previous"
    static = None if spec.dynamic else T.static_tree(spec.branching)
    width = spec.topk if spec.dynamic else None

    # the expanded nodes so far: parents (index among them), tokens, depths, output hiddens
    par = jnp.full((b, 1), -1, jnp.int32)
    toks = win_tokens[:, -1:]
    dep = [0]
    node_h = None  # [b, T, d] the last module's output hiddens of the expanded nodes
    committed_h = win_hidden  # chain: the last module's hiddens of the committed slots
    logps, levels = [], []  # static: per depth, the level's processed log-probs, children
    cands = []  # dynamic: (tokens, scores, parent candidate ids) per depth
    cand_slot = []  # dynamic: per depth, each candidate's index among the expanded nodes
    scores = jnp.zeros((b, 1), jnp.float32)
    ids = jnp.full((b, 1), -1, jnp.int32)
    for e in range(depth_total):
        n_exp = toks.shape[1]
        m_e = sum(1 for d in dep if d == e)  # this depth's nodes: the last m_e
        anc = T.tree_of(par, max(e, 1)).ancestors
        deps = jnp.asarray(dep, jnp.int32)[None]
        if strategy.over_window:
            mod = strategy.module_at(e)
            c = k - e  # committed slots before the root
            # a sibling drawn past the draft's support is -1: fed as 0, never accepted
            q_toks = jnp.concatenate([win_tokens[:, e:k], jnp.maximum(toks, 0)], axis=1)
            if previous:
                parent_h = jnp.take_along_axis(node_h, jnp.maximum(par, 0)[..., None], axis=1) \
                    if e else None
                tree_h = committed_h[:, c:c + 1] if not e else jnp.concatenate(
                    [committed_h[:, c:c + 1], parent_h[:, 1:].astype(committed_h.dtype)], 1)
                q_h = jnp.concatenate([committed_h[:, :c], tree_h], axis=1)
            else:
                q_h = jnp.concatenate([win_hidden[:, :c], jnp.take_along_axis(
                    win_hidden, jnp.broadcast_to(c + deps, (b, n_exp))[..., None], 1)], 1)
            rope = jnp.concatenate([win_pos[:, :c], (a - e)[:, None] + deps], axis=1)
            store = (a - k)[:, None] + jnp.arange(c + n_exp)
            if e == 0:  # the window itself: causal
                attend = kv.attend(store, a + 1)
            else:
                q = c + n_exp
                mask = jnp.tril(jnp.ones((q, q), bool))[None].repeat(b, 0)
                mask = mask.at[:, c:, c:].set(anc)
                attend = kv.attend(store, a - e + n_exp, tree_mask=mask)
            hout, normed = model.draft(mod, q_toks, q_h, rope, attend)
            committed_h = hout[:, :c]
            node_h = hout[:, c:]
        else:
            mod = 0
            if e == 0:
                hout, normed = model.draft(0, win_tokens, win_hidden, win_pos,
                                           kv.attend(win_pos, a + 1))
                node_h = hout[:, -1:]
            else:
                lvl = slice(n_exp - m_e, n_exp)
                lp = par[:, lvl]
                q_h = jnp.take_along_axis(node_h, lp[..., None], axis=1) if previous else \
                    jnp.broadcast_to(win_hidden[:, -1:], (b, m_e, win_hidden.shape[-1]))
                rope = jnp.broadcast_to((a + e)[:, None], (b, m_e))
                store = a[:, None] + jnp.arange(n_exp - m_e, n_exp)
                hout, normed = model.draft(0, jnp.maximum(toks[:, lvl], 0), q_h, rope, kv.attend(
                    store, a + n_exp, tree_mask=anc[:, lvl, :n_exp]))
                node_h = jnp.concatenate([node_h, hout.astype(node_h.dtype)], axis=1)
        logits = model.draft_logits(mod, normed[:, -m_e:])  # [b, m_e, V]
        lvl_idx = jnp.arange(n_exp - m_e, n_exp, dtype=jnp.int32)
        if not spec.dynamic:
            bw = spec.branching[e]
            logp = process_logits(logits, sp.temperature, sp.top_k, sp.top_p) if sampled \
                else logits
            keys = jnp.broadcast_to(row_keys(sp.seed, (a + 2 + e)[:, None], SALT_DRAFT),
                                    (b, m_e))
            kids = T.draw_children(logp, bw, keys, sp.temperature, sampled=sampled,
                                   distinct=True)
            logps.append(logp)
            levels.append(kids.reshape(b, m_e * bw))
            if e + 1 < depth_total:  # the children are expanded next
                par = jnp.concatenate([par, jnp.broadcast_to(
                    jnp.repeat(lvl_idx, bw)[None], (b, m_e * bw))], axis=1)
                toks = jnp.concatenate([toks, levels[-1]], axis=1)
                dep += [e + 1] * (m_e * bw)
        else:
            logp = process_logits(logits, sp.temperature, sp.top_k, sp.top_p) if sampled \
                else jax.nn.log_softmax(logits, axis=-1)
            c_tok, c_score, c_par = T.expand(scores, ids, logp, width)
            offset = sum(x[0].shape[1] for x in cands)
            cands.append((c_tok, c_score, c_par))
            slot_e = jnp.full(c_tok.shape, -1, jnp.int32)
            if e + 1 < depth_total:
                pick, scores = T.top_nodes(c_score, width)
                ids = offset + pick
                par = jnp.concatenate([par, lvl_idx[pick // width]], axis=1)
                toks = jnp.concatenate([toks, jnp.take_along_axis(c_tok, pick, 1)], axis=1)
                slot_e = slot_e.at[jnp.arange(b)[:, None], pick].set(
                    n_exp + jnp.arange(width, dtype=jnp.int32)[None])
                dep += [e + 1] * width
            cand_slot.append(slot_e)

    if not spec.dynamic:
        n_nodes = static.num_nodes
        tokens = jnp.concatenate([win_tokens[:, -1:]] + levels, axis=1)
        parent = jnp.broadcast_to(jnp.asarray(static.parent)[None], (b, n_nodes))
        slot = jnp.where(jnp.arange(n_nodes) < len(dep), jnp.arange(n_nodes), -1)
        slot = jnp.broadcast_to(slot.astype(jnp.int32)[None], (b, n_nodes))
        draft_logp = None
        if sampled:
            lp = jnp.concatenate(logps, axis=1)
            draft_logp = jnp.pad(lp, ((0, 0), (0, n_nodes - lp.shape[1]), (0, 0)))
        return parent, tokens, draft_logp, slot
    c_tok, c_score, c_par = (jnp.concatenate(x, axis=1) for x in zip(*cands))
    tree, tokens, source = T.select_tree(win_tokens[:, -1], c_tok, c_score, c_par,
                                         spec.budget, depth_total)
    all_slot = jnp.concatenate(cand_slot, axis=1)
    slot = jnp.where(source < 0, 0, jnp.take_along_axis(all_slot, jnp.maximum(source, 0), 1))
    return tree.parent, tokens, None, slot
