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

import jax.numpy as jnp

from .sampling import SALT_DRAFT, SALT_TARGET, row_keys, sample
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
