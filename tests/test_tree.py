"""Tree drafting's building blocks (mtp_jax/tree.py): specs, static and dynamic trees,
greedy and coupled acceptance, multi-candidate recursive rejection sampling (chi-square
against the target's distribution, duplicate siblings included), compaction.

The chi-square tests draw many independent rows in one batched call (a small vocabulary,
fixed seeds) and compare the committed tokens' counts with the target's distribution at
alpha = 0.001; each also shows that a sampler with a wrong proposal fails the same test.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax import tree as T
from mtp_jax import tree_spec as S
from mtp_jax.sampling import SALT_DRAFT, accept, process_logits, row_keys, sample

FP8 = jnp.float8_e4m3fn


# ------------------------------------------------------------------------------- specs
@pytest.mark.parametrize("text,branching,nodes", [
    ("2,2,1", (2, 2, 1), 11), (" 3, 1 ", (3, 1), 7), ("1,1,1", (1, 1, 1), 4), ("4", (4,), 5)])
def test_static_specs(text, branching, nodes):
    spec = S.parse_tree_spec(text)
    assert spec.branching == branching and not spec.dynamic
    assert spec.num_nodes == nodes and spec.max_depth == len(branching)
    assert S.parse_tree_spec(str(spec)) == spec
    assert spec.with_depth(7) == spec  # a static tree keeps its own depth


def test_dynamic_specs():
    spec = S.parse_tree_spec("budget:8")
    assert spec.dynamic and (spec.budget, spec.depth, spec.topk) == (8, None, S.DEFAULT_TOPK)
    assert spec.num_nodes == 9 and spec.max_depth is None and spec.num_candidates is None
    deep = spec.with_depth(3)
    assert deep.max_depth == 3 and deep.num_candidates == 4 + 2 * 16
    assert S.parse_tree_spec(str(deep)) == deep
    spec = S.parse_tree_spec("budget:10, depth:3, topk:2")
    assert (spec.budget, spec.depth, spec.topk, spec.num_candidates) == (10, 3, 2, 10)
    assert spec.with_depth(5) == spec  # the spec's own depth wins
    with pytest.raises(S.TreeSpecError, match="needs at least as many candidates"):
        S.parse_tree_spec("budget:40,topk:2").with_depth(3)


@pytest.mark.parametrize("text,match", [
    ("", "empty"), ("2,0,1", "at depth 2 must be at least 1"),
    ("2,x", "at depth 2 must be an integer"), ("2,,1", "must be an integer"),
    ("8,8,8", "584 draft nodes"), ("budget:0", "budget must be at least 1"),
    ("budget:8,foo:1", "optional ',depth:D'"), ("budget:8,depth:2,depth:3", "depth given twice"),
    ("budget:60,depth:2,topk:2", "makes 6"), ("budget", "expected 'budget:N'"),
    ("2,budget:3", "starts with 'budget:N'"), ("budget:129", "at most 128")])
def test_bad_specs_are_refused(text, match):
    with pytest.raises(S.TreeSpecError, match=match):
        S.parse_tree_spec(text)
    assert issubclass(S.TreeSpecError, ValueError)


def test_tree_methods():
    assert S.check_tree_method("chain") is None and S.check_tree_method("eagle") is None
    for method in ("window", "per_step", "none"):
        msg = S.check_tree_method(method)
        assert method in msg and "chain, eagle" in msg


# ------------------------------------------------------------------------ static trees
def test_static_tree_221():
    t = T.static_tree((2, 2, 1))
    assert t.parent.tolist() == [-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6]
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert t.rank.tolist() == [0, 0, 1, 0, 1, 0, 1, 0, 0, 0, 0]
    assert [t.level(d) for d in range(4)] == [slice(0, 1), slice(1, 3), slice(3, 7),
                                               slice(7, 11)]
    assert np.flatnonzero(t.ancestors[9]).tolist() == [0, 2, 5, 9]
    assert t.ancestors.sum(1).tolist() == (t.depth + 1).tolist()
    arrays = t.arrays(3)
    assert arrays.parent.shape == (3, 11) and arrays.ancestors.shape == (3, 11, 11)
    assert arrays.max_depth == 3 and arrays.num_nodes == 11


def test_static_tree_31_and_chain():
    t = T.static_tree((3, 1))
    assert t.parent.tolist() == [-1, 0, 0, 0, 1, 2, 3]
    assert t.rank.tolist() == [0, 0, 1, 2, 0, 0, 0]
    chain = T.static_tree((1, 1, 1))
    assert chain.parent.tolist() == [-1, 0, 1, 2] and chain.depth.tolist() == [0, 1, 2, 3]
    np.testing.assert_array_equal(chain.ancestors, np.tril(np.ones((4, 4), bool)))
    with pytest.raises(S.TreeSpecError):
        T.static_tree((2, 0))


# ---------------------------------------------------------------------- greedy accept
def test_greedy_accept_cases():
    """"2,2,1", four requests: the second depth-1 candidate and its first child accepted
    (n 2); the whole first path (n 3); nothing (n 0); duplicate depth-1 candidates that
    both match, the second's subtree going deeper."""
    t = T.static_tree((2, 2, 1))
    v = 50
    target = np.full((4, 11), 40)  # the target's argmax at each node
    tokens = np.arange(11)[None].repeat(4, 0) + 10  # 10 .. 20, none equal to 40
    # row 0: node 2 (depth 1) matches the root's argmax, node 5 its, node 9 does not
    target[0, 0], target[0, 2] = tokens[0, 2], tokens[0, 5]
    # row 1: 1 -> 3 -> 7 all match
    target[1, 0], target[1, 1], target[1, 3] = tokens[1, 1], tokens[1, 3], tokens[1, 7]
    # row 3: nodes 1 and 2 both carry 30 = the root's argmax; only node 2's child matches
    tokens[3, 1] = tokens[3, 2] = target[3, 0] = 30
    target[3, 2] = tokens[3, 6]
    fn = jax.jit(T.greedy_accept)
    n, path, bonus = fn(t.arrays(4), jnp.asarray(tokens), jnp.asarray(target))
    assert n.tolist() == [2, 3, 0, 2]
    assert path.tolist() == [[0, 2, 5, -1], [0, 1, 3, 7], [0, -1, -1, -1], [0, 2, 6, -1]]
    assert bonus.tolist() == [target[0, 5], target[1, 7], target[2, 0], target[3, 6]]
    # the committed tokens (drafts along the path, then the bonus), as accept gives them
    logits = np.full((4, 11, v), -1.0, np.float32)
    np.put_along_axis(logits, target[..., None], 1.0, axis=-1)
    zeros = jnp.zeros((4,), jnp.float32)
    n2, path2, committed = T.accept(
        t.arrays(4), jnp.asarray(logits), jnp.asarray(tokens), None,
        jnp.zeros((4, 4), jnp.int32), jnp.zeros((4, 2), jnp.uint32), zeros,
        jnp.zeros((4,), jnp.int32), zeros + 1, sampled=False)
    assert n2.tolist() == n.tolist() and path2.tolist() == path.tolist()
    assert committed.tolist() == [[tokens[0, 2], tokens[0, 5], target[0, 5], 0],
                                  [tokens[1, 1], tokens[1, 3], tokens[1, 7], target[1, 7]],
                                  [target[2, 0], 0, 0, 0],
                                  [30, tokens[3, 6], target[3, 6], 0]]


def test_greedy_ties_go_to_the_lower_node_and_negative_tokens_never_match():
    t = T.static_tree((3,))
    tokens = jnp.asarray([[0, 5, 5, 5], [0, -1, 7, 7]])
    target = jnp.asarray([[5, 1, 1, 1], [-1, 1, 1, 1]])
    n, path, _ = T.greedy_accept(t.arrays(2), tokens, target)
    assert n.tolist() == [1, 0] and path.tolist() == [[0, 1], [0, -1]]


def _chain_inputs(batch, k, v, seed):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(batch, k + 1, v)) * 2, jnp.float32)
    draft_logits = jnp.asarray(rng.normal(size=(batch, k, v)) * 2, jnp.float32) + logits[:, :k]
    temp = jnp.asarray(rng.choice([0.0, 0.7, 1.0], size=batch), jnp.float32)
    top_k = jnp.asarray(rng.choice([0, 5], size=batch), jnp.int32)
    top_p = jnp.asarray(rng.choice([1.0, 0.9], size=batch), jnp.float32)
    seeds = jnp.asarray(rng.integers(0, 2**32, size=(batch, 2)), jnp.uint32)
    positions = jnp.asarray(rng.integers(10, 100, size=(batch, 1)) + np.arange(k + 1),
                            jnp.int32)
    draft_logp = process_logits(draft_logits, temp, top_k, top_p)
    keys = row_keys(seeds, positions[:, :k], SALT_DRAFT)
    drafts, _ = sample(draft_logits, temp, top_k, top_p, keys)
    return logits, drafts, draft_logp, positions, seeds, temp, top_k, top_p


@pytest.mark.parametrize("coupled", [False, True])
def test_chain_tree_accepts_as_sampling_accept(coupled):
    """The chain as a tree ("1,1,1"): the same accepted count and committed tokens as
    sampling.accept, greedy, sampled (same keys, same residuals) and coupled rows alike."""
    batch, k, v = 64, 3, 12
    logits, drafts, draft_logp, positions, seeds, temp, top_k, top_p = _chain_inputs(
        batch, k, v, seed=5)
    n, tokens, _ = accept(logits, drafts, draft_logp, positions, seeds, temp, top_k, top_p,
                          coupled=coupled)
    tree = T.static_tree((1, 1, 1)).arrays(batch)
    node_tokens = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), drafts], axis=1)
    node_logp = jnp.pad(draft_logp, ((0, 0), (0, 1), (0, 0)))  # row i: node i's children
    n_t, path, tokens_t = jax.jit(T.accept, static_argnames=("coupled", "sampled"))(
        tree, logits, node_tokens, node_logp, positions, seeds, temp, top_k, top_p,
        coupled=coupled)
    np.testing.assert_array_equal(n_t, n)
    np.testing.assert_array_equal(tokens_t, tokens)
    assert 0 < int(jnp.sum(n)) < batch * k  # some drafts accepted, some rejected
    idx = np.arange(k + 1)[None]
    np.testing.assert_array_equal(path, np.where(idx <= np.asarray(n)[:, None], idx, -1))


# --------------------------------------------------------- rejection sampling, exactness
V = 5
ALPHA_Z = 3.09  # alpha = 0.001


def _chi2_crit(df: int) -> float:
    """The chi-square quantile at 1 - alpha (Wilson-Hilferty; within 1 % from df 3 on)."""
    return df * (1 - 2 / (9 * df) + ALPHA_Z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts, expected_p):
    """(statistic, df) of counts [..., V] against expected_p [..., V], summed over the
    leading groups (each its own conditional distribution); cells expected below 5 are
    pooled per group, groups with no count dropped."""
    counts, expected_p = np.atleast_2d(counts), np.atleast_2d(expected_p)
    stat, df = 0.0, 0
    for c, p in zip(counts, expected_p):
        total = c.sum()
        if total == 0:
            continue
        e = p * total
        big = e >= 5
        obs = np.append(c[big], c[~big].sum())
        exp = np.append(e[big], e[~big].sum())
        keep = exp > 0
        assert (obs[~keep] == 0).all(), "a count where the target has no mass"
        stat += float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        df += int(keep.sum()) - 1
    return stat, df


def _tables(rng, rows, temp=1.0):
    """[rows, V] distributions, some with zeros (top-k style)."""
    logits = rng.normal(size=(rows, V)) * 1.5
    logits[rng.random((rows, V)) < 0.2] = -np.inf
    logits[np.arange(rows), rng.integers(0, V, rows)] = 0.5  # never all -inf
    p = np.exp(logits / temp - np.max(logits / temp, -1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def _run_tree_sampler(branching, rows, seed, children, duplicate=False, wrong=None):
    """Recursive rejection sampling on a small-vocabulary tree of `branching`: the target's
    next-token distribution after token a is P[d][a] at depth d (after the root: P[0][0]),
    the draft's Q[d][a]. children: 'iid' (siblings drawn independently from the parent's
    Q, verified with it), 'wor' (drawn from it without replacement, verified with
    `distinct`; past Q's support a sibling is -1) or 'top' (siblings the best of Q,
    verified as point masses).
    duplicate: the last of 'top' siblings repeats the first (iid siblings repeat one
    another by chance; forcing it would make them not independent). wrong: a biased
    sampler for the power check, 'shifted' (iid siblings verified against another
    distribution than the one they were drawn from), 'as_iid' (top siblings verified as
    if drawn from Q) or 'wor_as_iid' (siblings drawn without replacement verified as if
    independent).
    Returns the committed tokens [rows, D + 1] (-1 past them), the accepted counts, the
    target tables and the node tokens."""
    rng = np.random.default_rng(seed)
    depth = len(branching)
    P = [_tables(rng, V) for _ in range(depth + 1)]
    Q = [_tables(rng, V, temp=1.6) for _ in range(depth)]
    t = T.static_tree(tuple(branching))
    n_nodes = t.num_nodes
    tokens = np.zeros((rows, n_nodes), np.int64)
    target = np.zeros((rows, n_nodes, V))
    draft = np.zeros((rows, n_nodes, V))
    target[:, 0] = P[0][0]
    for d in range(depth):
        for node in range(t.level(d).start, t.level(d).stop):
            q = Q[d][tokens[:, node]]
            draft[:, node] = q
            kids = np.flatnonzero(t.parent == node)
            if children == "iid":
                u = rng.random((rows, len(kids), 1))
                picks = (u > np.cumsum(q, -1)[:, None]).sum(-1)
            elif children == "wor":  # sequential draws, each from what is left of q
                picks = np.zeros((rows, len(kids)), np.int64)
                left = q.copy()
                for k in range(len(kids)):
                    mass = left.sum(-1, keepdims=True)
                    u = rng.random((rows, 1)) * mass
                    pick = np.minimum((u > np.cumsum(left, -1)).sum(-1), V - 1)
                    picks[:, k] = np.where(mass[:, 0] > 1e-12, pick, -1)
                    left[np.arange(rows), pick] = 0.0
            else:
                picks = np.argsort(-q, axis=-1, kind="stable")[:, :len(kids)]
            if duplicate and len(kids) > 1:
                picks[:, -1] = picks[:, 0]
            tokens[:, kids] = picks
            target[:, kids] = P[d + 1][np.maximum(picks, 0)]
    verify_q = None if children == "top" else draft
    if wrong == "shifted":
        verify_q = np.roll(draft, 1, axis=-1)
    elif wrong == "as_iid":
        verify_q = draft
    with np.errstate(divide="ignore"):
        target_logp = jnp.asarray(np.log(target), jnp.float32)
        draft_logp = None if verify_q is None else jnp.asarray(np.log(verify_q), jnp.float32)
    seeds = jnp.asarray(np.stack([np.full(rows, seed), np.arange(rows)], 1), jnp.uint32)
    positions = jnp.broadcast_to(jnp.arange(depth + 1, dtype=jnp.int32) + 20,
                                 (rows, depth + 1))
    distinct = children == "wor" and wrong != "wor_as_iid"
    n, path, bonus = jax.jit(functools.partial(T.rejection_accept, distinct=distinct))(
        t.arrays(rows), target_logp, jnp.asarray(tokens, jnp.int32), draft_logp, positions,
        seeds)
    n, path, bonus = (np.asarray(x) for x in (n, path, bonus))
    drafted = np.take_along_axis(tokens, np.roll(np.maximum(path, 0), -1, 1), 1)
    idx = np.arange(depth + 1)[None]
    committed = np.where(idx < n[:, None], drafted,
                         np.where(idx == n[:, None], bonus[:, None], -1))
    return committed, n, P, tokens


def _committed_chi2(committed, n, P):
    """Statistic and df over the committed tokens: the first against P[0], the d-th given
    the one before it (rows that committed it) against P[d][previous]."""
    stat, df = _chi2(np.bincount(committed[:, 0], minlength=V), P[0][0])
    for d in range(1, committed.shape[1]):
        have = n >= d
        counts = np.zeros((V, V))
        np.add.at(counts, (committed[have, d - 1], committed[have, d]), 1)
        s, f = _chi2(counts, P[d])
        stat, df = stat + s, df + f
    return stat, df


@pytest.mark.parametrize("branching,children,duplicate,seed", [
    ((3, 2), "iid", False, 11),    # independent draws: duplicate siblings happen by chance
    ((2, 2, 1), "iid", False, 11),
    ((3, 2), "top", False, 11),    # deterministic (top-k) siblings, point-mass proposals
    ((2, 2, 1), "top", True, 13),  # a duplicate among them: its second copy never accepted
    ((3, 2), "wor", False, 11),    # drawn without replacement: distinct siblings
    ((2, 2, 1), "wor", False, 13),
    ((1, 1, 1), "iid", False, 11),  # the chain
])
def test_rejection_sampling_matches_the_target(branching, children, duplicate, seed):
    rows = 20000
    committed, n, P, tokens = _run_tree_sampler(branching, rows, seed, children=children,
                                                duplicate=duplicate)
    if children == "iid" and branching[0] > 1:  # duplicate siblings drawn by chance
        assert (tokens[:, 1] == tokens[:, 2]).sum() > rows // 20
    if children == "wor":
        assert not ((tokens[:, 1] == tokens[:, 2]) & (tokens[:, 1] >= 0)).any()
    stat, df = _committed_chi2(committed, n, P)
    assert stat < _chi2_crit(df), f"chi2 {stat:.1f} >= {_chi2_crit(df):.1f} (df {df})"
    # the walk went both ways: drafts accepted (past depth 1 too) and rejected
    assert 0 < (n == 0).sum() < rows and (n >= 2).sum() > 0
    if branching[0] > 1 and not duplicate:  # a later sibling accepted after the first
        first = tokens[:, 1]
        assert ((n >= 1) & (committed[:, 0] != first)).sum() > 0


@pytest.mark.parametrize("wrong", ["shifted", "as_iid", "wor_as_iid"])
def test_a_wrong_proposal_fails_the_chi_square(wrong):
    """The test has the power to see a biased sampler: iid siblings verified against a
    distribution they were not drawn from, top-k siblings as if drawn from Q, siblings
    drawn without replacement as if independent."""
    children = {"shifted": "iid", "as_iid": "top", "wor_as_iid": "wor"}[wrong]
    committed, n, P, _ = _run_tree_sampler((3, 2), 20000, seed=11, children=children,
                                           wrong=wrong)
    stat, df = _committed_chi2(committed, n, P)
    assert stat > _chi2_crit(df), f"chi2 {stat:.1f} <= {_chi2_crit(df):.1f} (df {df})"


def test_accept_mixes_greedy_and_sampled_rows():
    """On "2,2,1", greedy rows of a mixed batch take greedy_accept's result and sampled
    rows rejection_accept's (with the processed target log-probs); jitted, batched."""
    rng = np.random.default_rng(2)
    batch, v = 16, 9
    t = T.static_tree((2, 2, 1)).arrays(batch)
    logits = jnp.asarray(rng.normal(size=(batch, 11, v)) * 2, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, size=(batch, 11)), jnp.int32)
    draft_logp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(batch, 11, v)), jnp.float32))
    temp = jnp.asarray(np.where(np.arange(batch) % 2, 0.8, 0.0), jnp.float32)
    top_k, top_p = jnp.zeros((batch,), jnp.int32), jnp.ones((batch,), jnp.float32)
    seeds = jnp.asarray(rng.integers(0, 2**32, size=(batch, 2)), jnp.uint32)
    positions = jnp.asarray(np.arange(4)[None] + 30, jnp.int32).repeat(batch, 0)
    n, path, committed = jax.jit(T.accept)(t, logits, tokens, draft_logp, positions, seeds,
                                           temp, top_k, top_p)
    n_g, path_g, bonus_g = T.greedy_accept(t, tokens, jnp.argmax(logits, -1))
    logp = process_logits(logits, temp, top_k, top_p)
    n_s, path_s, bonus_s = T.rejection_accept(t, logp, tokens, draft_logp, positions, seeds)
    hot = np.asarray(temp) > 0
    np.testing.assert_array_equal(n, np.where(hot, n_s, n_g))
    np.testing.assert_array_equal(path, np.where(hot[:, None], path_s, path_g))
    bonus = np.take_along_axis(np.asarray(committed), np.asarray(n)[:, None], 1)[:, 0]
    np.testing.assert_array_equal(bonus, np.where(hot, bonus_s, bonus_g))
    for b in range(batch):  # the drafts committed are the path's tokens
        nodes = np.asarray(path[b, 1:int(n[b]) + 1])
        assert committed[b, :int(n[b])].tolist() == np.asarray(tokens)[b, nodes].tolist()


# ---------------------------------------------------------------------------- drafting
def test_draw_children():
    """Greedy rows: the top `width`, best first. Sampled rows: the first child is what
    sampling.sample draws with the key, and the children are independent draws from the
    distribution (chi-square of the first two siblings' joint against q x q; the last
    ones' marginals: four siblings, whose keys' offsets pass 2^32)."""
    rows, m, v, width = 20000, 1, 4, 4
    q = np.array([0.1, 0.2, 0.3, 0.4])
    logp = jnp.broadcast_to(jnp.log(jnp.asarray(q, jnp.float32)), (rows, m, v))
    seeds = jnp.asarray(np.stack([np.full(rows, 3), np.arange(rows)], 1), jnp.uint32)
    keys = row_keys(seeds, jnp.full((rows, m), 17), SALT_DRAFT)
    temp = jnp.asarray(np.where(np.arange(rows) < 4, 0.0, 1.0), jnp.float32)
    kids = np.asarray(jax.jit(T.draw_children, static_argnums=1)(logp, width, keys, temp))
    assert kids.shape == (rows, m, width)
    assert (kids[:4, 0] == [3, 2, 1, 0]).all()
    ones = jnp.ones((rows,), jnp.float32)
    first, _ = sample(logp[:, 0], temp, jnp.zeros((rows,), jnp.int32), ones, keys[:, 0])
    np.testing.assert_array_equal(kids[:, 0, 0], first)
    hot = kids[4:, 0]
    joint = np.zeros((v, v))
    np.add.at(joint, (hot[:, 0], hot[:, 1]), 1)
    stat, df = _chi2(joint.reshape(-1), np.outer(q, q).reshape(-1))
    assert stat < _chi2_crit(df), (stat, df)
    for k in (2, 3):
        stat, df = _chi2(np.bincount(hot[:, k], minlength=v), q)
        assert stat < _chi2_crit(df), (k, stat, df)
    assert np.mean(hot[:, 3] == hot[:, 2]) < 0.5  # not one draw repeated
    greedy = T.draw_children(logp[:4], width, keys[:4], temp[:4], sampled=False)
    assert (np.asarray(greedy)[:, 0] == [3, 2, 1, 0]).all()


def test_draw_children_without_replacement():
    """`distinct`: sampled siblings differ, the first is what sampling.sample draws, the
    second follows q with the first taken out (chi-square against sum_i q_i q_j / (1 -
    q_i)), and past q's support a sibling is -1; greedy rows keep the top tokens."""
    rows, v, width = 20000, 4, 3
    q = np.array([0.1, 0.2, 0.3, 0.4])
    logp = jnp.broadcast_to(jnp.log(jnp.asarray(q, jnp.float32)), (rows, 1, v))
    seeds = jnp.asarray(np.stack([np.full(rows, 5), np.arange(rows)], 1), jnp.uint32)
    keys = row_keys(seeds, jnp.full((rows, 1), 17), SALT_DRAFT)
    temp = jnp.asarray(np.where(np.arange(rows) < 4, 0.0, 1.0), jnp.float32)
    draw = jax.jit(functools.partial(T.draw_children, distinct=True), static_argnums=1)
    kids = np.asarray(draw(logp, width, keys, temp))[:, 0]
    assert (kids[:4] == [3, 2, 1]).all()
    first, _ = sample(logp[:, 0], temp, jnp.zeros((rows,), jnp.int32), jnp.ones((rows,)),
                      keys[:, 0])
    np.testing.assert_array_equal(kids[:, 0], first)
    hot = kids[4:]
    assert (hot[:, 0] != hot[:, 1]).all() and (hot[:, 1] != hot[:, 2]).all()
    second = (q[:, None] * q[None, :] / (1 - q[:, None]) * (1 - np.eye(v))).sum(0)
    stat, df = _chi2(np.bincount(hot[:, 1], minlength=v), second)
    assert stat < _chi2_crit(df), (stat, df)
    two = jnp.log(jnp.asarray([0.5, 0.5, 0.0, 0.0], jnp.float32))  # two tokens to draw
    short = np.asarray(draw(jnp.broadcast_to(two, (8, 1, v)), width, keys[4:12],
                            temp[4:12]))[:, 0]
    assert (np.sort(short[:, :2], -1) == [0, 1]).all() and (short[:, 2] == -1).all()


def _grow(logp_fn, root, depth, topk):
    """A dynamic tree's candidates by expand / top_nodes, as a drafter makes them: logp_fn
    (depth, node tokens [B, k]) -> [B, k, V] draft log-probs after the expanded nodes."""
    batch = root.shape[0]
    scores = jnp.zeros((batch, 1), jnp.float32)
    ids = jnp.full((batch, 1), -1, jnp.int32)
    toks = root[:, None]
    all_t, all_s, all_p = [], [], []
    offset = 0
    for d in range(depth):
        t, s, p = T.expand(scores, ids, logp_fn(d, toks), topk)
        all_t.append(t)
        all_s.append(s)
        all_p.append(p)
        idx, scores = T.top_nodes(s, topk)
        ids = offset + idx
        toks = jnp.take_along_axis(t, idx, axis=1)
        offset += t.shape[1]
    return (jnp.concatenate(all_t, 1), jnp.concatenate(all_s, 1), jnp.concatenate(all_p, 1))


def test_dynamic_tree_keeps_the_budget_best():
    """expand / top_nodes / select_tree: the kept nodes are the `budget` best candidates
    (ties to the lower id), in level order, each with its parent, ancestors and depth
    consistent, and its score the sum of draft log-probs along its path. One row's draft
    puts probability 1 on a token, so a child ties its parent."""
    rng = np.random.default_rng(6)
    batch, v, depth, topk, budget = 3, 16, 3, 3, 10
    table = rng.normal(size=(depth, v, v)) * 1.5
    table[:, :, 5] = np.where(np.arange(v) == 7, 50.0, table[:, :, 5])  # after 7: 5 surely

    def logp_fn(d, parent_tokens):
        rows = jnp.asarray(table[d])[parent_tokens]  # [B, k, V]
        return jax.nn.log_softmax(rows + jnp.arange(batch)[:, None, None] * 0.3, axis=-1)

    root = jnp.asarray([7, 7, 2], jnp.int32)
    tokens, scores, parents = _grow(logp_fn, root, depth, topk)
    assert tokens.shape == (batch, topk + (depth - 1) * topk * topk)
    tree, node_tokens, source = jax.jit(T.select_tree, static_argnums=(4, 5))(
        root, tokens, scores, parents, budget, depth)
    tokens, scores, parents = (np.asarray(x) for x in (tokens, scores, parents))
    for b in range(batch):
        order = sorted(range(len(scores[b])), key=lambda i: (-scores[b, i], i))[:budget]
        assert np.asarray(source[b, 1:]).tolist() == sorted(order)
        assert source[b, 0] == -1 and node_tokens[b, 0] == root[b]
        par, dep, anc = (np.asarray(x[b]) for x in (tree.parent, tree.depth, tree.ancestors))
        assert par[0] == -1 and (par[1:] < np.arange(1, budget + 1)).all()
        assert (np.diff(dep) >= 0).all()  # level order
        for i in range(1, budget + 1):
            c = source[b, i]
            assert node_tokens[b, i] == tokens[b, c]
            want_parent = 0 if parents[b, c] < 0 else list(source[b]).index(parents[b, c])
            assert par[i] == want_parent and dep[i] == dep[par[i]] + 1
            assert anc[i].tolist() == (anc[par[i]] | (np.arange(budget + 1) == i)).tolist()
            # the score is the path's summed log-probs
            path_toks = [node_tokens[b, j] for j in np.flatnonzero(anc[i])]
            lp = sum(float(logp_fn(d, jnp.full((batch, 1), path_toks[d]))[b, 0, path_toks[d + 1]])
                     for d in range(dep[i]))
            np.testing.assert_allclose(scores[b, c], lp, rtol=1e-5, atol=1e-5)
    # the sure token: the root 7's child 5 scores 0, as the root does, and is kept
    assert 5 in np.asarray(node_tokens[0, 1:]).tolist()
    # a target that agrees with each node's first child: the accepted path follows first
    # children down to a leaf
    par = np.asarray(tree.parent)
    target = np.zeros((batch, budget + 1), np.int32)
    want = []
    for b in range(batch):
        first = {i: np.flatnonzero(par[b] == i) for i in range(budget + 1)}
        for i, kids in first.items():
            target[b, i] = node_tokens[b, kids[0]] if len(kids) else -1
        node, walk = 0, [0]
        while len(first[node]):
            node = first[node][0]
            walk.append(node)
        want.append(walk)
    n, path, _ = T.greedy_accept(tree, node_tokens, jnp.asarray(target))
    assert n.tolist() == [len(w) - 1 for w in want] and min(n.tolist()) >= 2
    for b in range(batch):
        assert path[b, :int(n[b]) + 1].tolist() == want[b]


# --------------------------------------------------------------------------- compaction
def test_compaction_indices_and_rows():
    path = jnp.asarray([[0, 2, 5, -1], [0, 1, 3, 7], [0, -1, -1, -1]], jnp.int32)
    n = jnp.asarray([2, 3, 0], jnp.int32)
    idx = T.compaction_indices(path, n, 11)
    assert idx.tolist() == [[0, 2, 5] + list(range(3, 11)), [0, 1, 3, 7] + list(range(4, 11)),
                            list(range(11))]
    hid = jnp.arange(3 * 11 * 2).reshape(3, 11, 2)
    rows = T.compact_rows(hid, idx)
    np.testing.assert_array_equal(rows[0, :3], hid[0, [0, 2, 5]])
    np.testing.assert_array_equal(rows[1, :4], hid[1, [0, 1, 3, 7]])
    np.testing.assert_array_equal(rows[2], hid[2])


@pytest.mark.parametrize("dtype", [jnp.float32, FP8])
def test_compact_pages_moves_the_path_into_place(dtype):
    """Node path[d]'s cached row moves from base + path[d] to base + d (d = 1..n) in every
    page array, across page boundaries, copied bit for bit; nothing else changes, and a
    move whose source or target is past the limit is dropped."""
    rng = np.random.default_rng(8)
    heads, ps, width, dims = 2, 4, 6, 3
    batch = 3
    num_pages = batch * width + 1
    table = jnp.asarray(1 + rng.permutation(batch * width).reshape(batch, width), jnp.int32)
    k = jnp.asarray(rng.normal(size=(heads, num_pages, ps, dims)), jnp.float32).astype(dtype)
    v = jnp.asarray(rng.normal(size=(heads, num_pages, ps, dims + 2)), jnp.float32).astype(dtype)
    base = jnp.asarray([2, 9, 5], jnp.int32)  # node i at base + i: pages split the tree
    path = jnp.asarray([[0, 2, 5, 9], [0, 1, 4, -1], [0, 2, 6, 10]], jnp.int32)
    n = jnp.asarray([3, 2, 3], jnp.int32)
    limit = jnp.asarray([100, 100, 14], jnp.int32)  # row 2: node 10 (position 15) is past it
    idx = T.compaction_indices(path, n, 11)
    k2, v2 = jax.jit(T.compact_pages, static_argnums=5)((k, v), table, base, idx, n, ps, limit)
    assert k2.dtype == dtype

    def at(pages, b, p):  # the cached row of position p of request b
        page = table[b, p // ps]
        return np.asarray(pages[:, page, p % ps].astype(jnp.float32))

    moved = set()
    for b in range(batch):
        for d in range(1, int(n[b]) + 1):
            src, dst = int(base[b] + path[b, d]), int(base[b] + d)
            if src >= int(limit[b]) or dst >= int(limit[b]):
                continue
            for old, new in ((k, k2), (v, v2)):
                np.testing.assert_array_equal(at(new, b, dst), at(old, b, src))
            moved.add((b, dst))
    assert (2, 8) not in moved  # the past-the-limit source was not copied
    for b in range(batch):  # every other row is as it was
        for p in range(width * ps):
            if (b, p) not in moved:
                for old, new in ((k, k2), (v, v2)):
                    np.testing.assert_array_equal(at(new, b, p), at(old, b, p))
