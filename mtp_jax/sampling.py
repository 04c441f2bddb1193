"""Sampling: logit processing, seeded keys, speculative acceptance.

Every random draw is keyed by (request seed, position of the token it decides, salt), never
by a step counter or a slot, so a request's output does not depend on which requests share
its batch or which slot it sits in. Draws: the draft sample (SALT_DRAFT), the accept test
of a draft (SALT_ACCEPT) and the target sample, a bonus or residual token (SALT_TARGET).
Plain decoding uses SALT_TARGET too, so the engine's `none` method and the reference
generator produce the same tokens for the same seed.

Temperature 0 is greedy and ignores the seed. Top-k and top-p are applied alike to target
and draft distributions (vLLM / HF order: top-k, then top-p on what is left); the sort they
need runs under `lax.cond` only when some row asks for it.

Acceptance of K drafts from the target's K+1 verify rows:
- greedy: n = sum(cumprod(draft == argmax)); the bonus is the argmax of row n;
- sampled: draft j accepted when u < p_j(d) / q_j(d); on the first rejection the token is
  drawn from the residual max(p - q, 0) (renormalized), else from row K;
- coupled (adaptive speculation): every row draws the target's own sample with the key of
  its position (SALT_TARGET, as plain decoding does) and a draft is accepted when it equals
  that sample; drafts are drawn with the same key, so a good draft usually matches. The
  output is then token for token what plain decoding gives for the seed, whatever K and
  drafts were used (a few points less acceptance than rejection sampling);
- relaxed (TensorRT-LLM, greedy rows in a thinking phase): a draft is also accepted when
  it is among the target's top `relaxed_topk` and within `relaxed_delta` of the top-1
  probability; the phase is switched by the think begin / end token ids as tokens commit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from .sharding import P, active_mesh, axis_size, batch_axis

SALT_DRAFT, SALT_ACCEPT, SALT_TARGET = 1, 2, 3


def _mix(x):
    """A 32-bit integer hash with good avalanche (lowbias32)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds, positions, salt: int):
    """Keys [*positions.shape] (uint32) for seeds [b, 2] uint32 (hi, lo), positions [b, ...].

    A counter-based hash of (seed, position, salt): cheap to compile and to run, and the
    same key whatever batch or slot the request is in.
    """
    pos = positions.astype(jnp.uint32)
    extra = (1,) * (positions.ndim - 1)
    hi = seeds[:, 0].reshape((-1,) + extra)
    lo = seeds[:, 1].reshape((-1,) + extra)
    x = _mix(pos * jnp.uint32(0x9E3779B9) + jnp.uint32(salt) * jnp.uint32(0x85EBCA6B))
    return _mix(_mix(x ^ lo) ^ (hi * jnp.uint32(0xC2B2AE35) + jnp.uint32(0x27D4EB2F)))


def _unit(bits):
    """uint32 -> float32 uniform in (0, 1) from the top 24 bits."""
    return ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))


def split_seed(seed: int) -> tuple[int, int]:
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


def uniform(keys):
    """One uniform in (0, 1) per key."""
    return _unit(_mix(keys ^ jnp.uint32(0x5BD1E995)))


def gumbel_noise(keys, v: int):
    """[..., v] standard Gumbel noise, one stream per key of keys [...]."""
    idx = jnp.arange(v, dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
    u = _unit(_mix(_mix(keys[..., None] + idx) ^ keys[..., None]))
    return -jnp.log(-jnp.log(u))


def gumbel_argmax(logp, keys):
    """Sample from log-probs [..., v] with one key per row [...] (Gumbel-max)."""
    return jnp.argmax(logp + gumbel_noise(keys, logp.shape[-1]), axis=-1).astype(jnp.int32)


def _filter_sorted(logits, top_k, top_p):
    """Mask logits [r, v] outside top-k then top-p (per-row k, p); needs a sort."""
    v = logits.shape[-1]
    srt = -jnp.sort(-logits, axis=-1)
    kk = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(srt, (kk - 1)[:, None], axis=-1)
    srt = jnp.where(jnp.arange(v)[None] < kk[:, None], srt, -jnp.inf)
    ps = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(ps, axis=-1) - ps  # mass strictly before each sorted token
    # the top token always; top_p >= 1 keeps all (a rounded cumsum may pass 1 before the end)
    keep = (before < top_p[:, None]) | (jnp.arange(v)[None] == 0) | (top_p[:, None] >= 1.0)
    pth = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
    thr = jnp.maximum(kth, pth)
    return jnp.where(logits >= thr, logits, -jnp.inf)


def process_logits(logits, temperature, top_k, top_p):
    """Log-probs [..., v] (f32) after temperature, top-k and top-p; rows [...] broadcast.

    Greedy rows (temperature 0) get temperature 1 here; callers use argmax for them.
    """
    shape = logits.shape
    x = logits.reshape(-1, shape[-1]).astype(jnp.float32)
    rows = x.shape[0] // temperature.shape[0]
    rep = lambda a: jnp.repeat(a, rows)  # noqa: E731  (per-request params over its rows)
    t, k, p = rep(temperature), rep(top_k), rep(top_p)
    x = x / jnp.where(t > 0, t, 1.0)[:, None]
    need = ((k > 0) & (k < x.shape[-1])) | (p < 1.0)
    x = jax.lax.cond(jnp.any(need), lambda y: _filter(y, k, p, need), lambda y: y, x)
    return jax.nn.log_softmax(x, axis=-1).reshape(shape)


def _filter(logits, top_k, top_p, need, sort=None):
    """`_filter_sorted`'s masking for the rows that `need` it, other rows unchanged. On a
    CPU by bisection (`_filter_bisect`): a full-vocabulary sort is the costliest op of a
    sampled step on a CPU, so a speculative step, which samples K+1 target rows and K
    draft rows per request, paid several plain steps for it (docs/DECISIONS.md, "Top-k /
    top-p by bisection on a CPU"). Elsewhere one batched sort, as before: a bisection's
    64 dependent passes are launches there, not yet measured against the sort. `sort`:
    True or False picks the path whatever the backend."""
    logits = _whole_rows(logits)
    if sort is None:
        sort = jax.default_backend() != "cpu"
    if not sort:
        return _filter_bisect(logits, top_k, top_p, need)
    return jnp.where(need[:, None], _filter_sorted(logits, top_k, top_p), logits)


def _whole_rows(x):
    """x [r, v] with every row whole on a device (rows split over `dp` where they divide)
    under a mesh with `tp`; unchanged otherwise. Logits come split over `tp` by vocabulary,
    and the partitioner turns the sort's cumulative sum along that split axis into a
    windowed reduction over the whole row for every output, quadratic in v and no longer a
    prefix sum the GPU compiler rewrites as a scan (a sampled decode step of the shipped
    model took 230x its one-GPU time under tp=2); the bisection's 64 row sums would be as
    many all-reduces. Gathering the rows once is a few KiB to MiB a step."""
    mesh = active_mesh()
    if mesh is None or axis_size(mesh, "tp") == 1:
        return x
    spec = P(batch_axis(mesh, x.shape[0]), None)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _filter_bisect(logits, top_k, top_p, need):
    """`_filter_sorted`'s masking without a sort: the top-k and top-p thresholds found by
    bisection over the logits' ordered bit patterns (32 halvings of a uint32 range, each
    one masked count or sum over the row), so O(32 v) per row instead of a sort.

    Top-k: the largest t with #(x >= t) >= k, the k-th largest value; its distribution
    is normalised over exactly k tokens, as the sort's first k entries are. Top-p: the
    smallest t whose mass strictly above stays under p; a token is kept when it lies at
    or above both, the sort's rule (a tie with a kept token is kept). Sums run in another
    order than the sort's cumsum, so a token whose preceding mass is p to the last bit may
    fall the other way."""
    v = logits.shape[-1]
    bits = jax.lax.bitcast_convert_type(logits, jnp.int32)
    u = jax.lax.bitcast_convert_type(jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits), jnp.uint32)
    u = u ^ jnp.uint32(0x80000000)  # float order as unsigned order
    kk = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)[:, None]
    zero = jnp.zeros((logits.shape[0], 1), jnp.uint32)
    top = jnp.full_like(zero, 0xFFFFFFFF)

    def kth_step(_, lohi):
        lo, hi = lohi
        d = hi - lo
        mid = lo + (d >> 1) + (d & 1)
        ok = jnp.sum(u >= mid, -1, keepdims=True) >= kk
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    kth_u = jax.lax.cond(jnp.any(need & (kk[:, 0] < v)),
                         lambda: jax.lax.fori_loop(0, 32, kth_step, (zero, top))[0],
                         lambda: zero)
    mx = jnp.max(logits, -1, keepdims=True)
    e = jnp.exp(logits - mx)
    above = u > kth_u
    kthv = jnp.min(jnp.where(u >= kth_u, logits, jnp.inf), -1, keepdims=True)
    n_above = jnp.sum(above, -1, keepdims=True)
    den = jnp.where(kk < v, jnp.sum(jnp.where(above, e, 0.0), -1, keepdims=True)
                    + (kk - n_above) * jnp.exp(kthv - mx), jnp.sum(e, -1, keepdims=True))
    q = e / den
    p = top_p[:, None]

    def p_step(_, lohi):
        lo, hi = lohi
        mid = lo + ((hi - lo) >> 1)
        ok = jnp.sum(jnp.where(u > mid, q, 0.0), -1, keepdims=True) < p
        # lo == hi (no t qualifies: top_p 0) must not wrap mid + 1 past the top
        return jnp.where(ok, lo, jnp.minimum(mid, hi - 1) + 1), jnp.where(ok, mid, hi)

    t0 = jax.lax.cond(jnp.any(need & (top_p < 1.0)),
                      lambda: jax.lax.fori_loop(0, 32, p_step, (kth_u, top))[0],
                      lambda: kth_u)
    t0 = jnp.where(p >= 1.0, kth_u, t0)
    t0 = jnp.minimum(t0, jnp.max(u, -1, keepdims=True))  # the top token always (top_p 0)
    keep = (u >= kth_u) & (u >= t0)
    return jnp.where(need[:, None] & ~keep, -jnp.inf, logits)


def sample(logits, temperature, top_k, top_p, keys, *, sampled=True):
    """Tokens [...] and their log-probs [..., v] for logits [b, ..., v], keys [b, ...].
    `sampled` False: every row is greedy (the caller knows), so the argmax alone and no
    log-probs (None): no conditional, no [..., v] log-softmax."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sampled:
        return greedy, None
    logp = process_logits(logits, temperature, top_k, top_p)
    hot = temperature.reshape((-1,) + (1,) * (logits.ndim - 2)) > 0
    drawn = jax.lax.cond(jnp.any(temperature > 0), lambda: gumbel_argmax(logp, keys),
                         lambda: greedy)
    return jnp.where(hot, drawn, greedy), logp


def think_phase(tokens, start, begin_id, end_id):
    """Thinking flag before each of tokens [b, t] (and after the last), from `start` [b]."""
    def step(state, tok):
        nxt = jnp.where(tok == begin_id, True, jnp.where(tok == end_id, False, state))
        return nxt, state

    last, before = jax.lax.scan(step, start, tokens.T)
    return before.T, last


def accept(target_logits, drafts, draft_logp, positions, seeds, temperature, top_k, top_p,
           *, relaxed=None, coupled=False, sampled=True):
    """Verify K drafts against K+1 target rows.

    target_logits [b, K+1, v] (row j predicts the token at positions[:, j]),
    drafts [b, K], draft_logp [b, K, v] (processed draft log-probs, used by sampled rows),
    positions [b, K+1], seeds [b, 2]. `relaxed`: None or (enabled [b], think [b],
    topk, delta, begin_id, end_id) for greedy rows. `coupled`: sampled rows verify by
    coupled sampling (draft_logp unused; a draft of -1 never matches). `sampled` False:
    every row is greedy (the caller knows), so no sampled branch (draft_logp unused).
    Returns (n [b] accepted drafts, tokens [b, K+1] = d_1..d_n, bonus, then padding,
    think state after the committed tokens or None).
    """
    b, k1, v = target_logits.shape
    k = k1 - 1
    hot = temperature > 0
    greedy_tok = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [b, K+1]
    match = drafts == greedy_tok[:, :k]
    think_out = None
    if relaxed is not None:
        enabled, think, rk, delta, begin_id, end_id = relaxed
        probs = jax.nn.softmax(target_logits[:, :k].astype(jnp.float32), axis=-1)
        topv, topi = jax.lax.top_k(probs, rk)
        in_top = jnp.any(topi == drafts[..., None], axis=-1)
        p_d = jnp.take_along_axis(probs, drafts[..., None], axis=-1)[..., 0]
        close = p_d >= topv[..., 0] - delta
        phase, _ = think_phase(drafts, think, begin_id, end_id)
        match = match | (enabled[:, None] & phase & in_top & close)

    def sampled_rows():
        logp = process_logits(target_logits, temperature, top_k, top_p)  # [b, K+1, v]
        if coupled:
            own = gumbel_argmax(logp, row_keys(seeds, positions, SALT_TARGET))  # [b, K+1]
            n = jnp.sum(jnp.cumprod((drafts == own[:, :k]).astype(jnp.int32), axis=-1),
                        axis=-1) if k else jnp.zeros((b,), jnp.int32)
            return n, jnp.take_along_axis(own, n[:, None], axis=1)[:, 0]
        if k == 0:
            n = jnp.zeros((b,), jnp.int32)
        else:
            lp_d = jnp.take_along_axis(logp[:, :k], drafts[..., None], -1)[..., 0]
            lq_d = jnp.take_along_axis(draft_logp, drafts[..., None], -1)[..., 0]
            u = uniform(row_keys(seeds, positions[:, :k], SALT_ACCEPT))
            ok = jnp.log(jnp.maximum(u, 1e-38)) < lp_d - lq_d
            n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)
        p_n = jnp.take_along_axis(logp, n[:, None, None], axis=1)[:, 0]
        if k:
            q_n = jnp.take_along_axis(draft_logp, jnp.minimum(n, k - 1)[:, None, None], 1)[:, 0]
            resid = jnp.maximum(jnp.exp(p_n) - jnp.exp(q_n), 0.0)
            use_resid = (n < k) & (jnp.sum(resid, -1) > 0)
            p_n = jnp.where(use_resid[:, None], jnp.log(resid), p_n)
        pos_n = jnp.take_along_axis(positions, n[:, None], axis=1)
        tok = gumbel_argmax(p_n, row_keys(seeds, pos_n, SALT_TARGET)[:, 0])
        return n, tok

    n_greedy = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=-1), axis=-1) if k else \
        jnp.zeros((b,), jnp.int32)
    bonus_greedy = jnp.take_along_axis(greedy_tok, n_greedy[:, None], axis=1)[:, 0]
    if sampled:
        n_s, tok_s = jax.lax.cond(jnp.any(hot), sampled_rows,
                                  lambda: (n_greedy, bonus_greedy))
        n = jnp.where(hot, n_s, n_greedy)
        bonus = jnp.where(hot, tok_s, bonus_greedy)
    else:
        n, bonus = n_greedy, bonus_greedy
    idx = jnp.arange(k1)[None]
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    tokens = jnp.where(idx < n[:, None], padded, jnp.where(idx == n[:, None], bonus[:, None], 0))
    if relaxed is not None:
        enabled, think, rk, delta, begin_id, end_id = relaxed
        committed = jnp.where(idx <= n[:, None], tokens, -1)
        _, think_out = think_phase(committed, think, begin_id, end_id)
    return n, tokens, think_out
