"""MTP draft modules and the combined model (target + K modules).

MTP module k (1-based) at anchor position i:

    x   = proj(concat(norm_e(embed(t_{i+k})), norm_h(g_i^k)))   # order from the config
    y   = Block_k(x) at RoPE position i                          # its own KV cache
    out = final_norm(y);  logits = head_k(out)                   # predicts t_{i+k+1}
    h_i^k = out or y (config `mtp_output_hidden`)                # handed to the next module

where g_i^k, the hidden the module consumes, is the target's hidden h_i^0 (before or after
its final norm, config `mtp_hidden_from`) for k = 1 and, for k > 1, h_i^{k-1}
(`mtp_hidden_source = previous`, DeepSeek-style training) or h_i^0 (`target`). The
embedding is zeroed at position 0 where the architecture does so. The head is the target
lm_head or a per-module `shared_head.head`; the embedding is the target's or per module.
Qwen3-Next shares one fc / pre-norms / final norm across modules (`mtp_shared_input`).
Which positions and hiddens a draft strategy feeds in is drafting.py's business.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .layers import Attend, RMSNorm, _param, causal_attend
from .model import Block, Decoder
from .qarray import take_rows, value
from .quant import DRAFT_HEAD_MAX_ROWS, qeinsum, reads_head_copy


class MTPInput(nnx.Module):
    """The input side of a module (norms, projection) and its output norm."""

    QUANT_AXES = {"proj": (0,)}

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        norm = dict(eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)
        self.enorm = RMSNorm(d, **norm)
        self.hnorm = RMSNorm(d, **norm)
        self.proj = _param(rngs, (2 * d, d), dtype, (2 * d) ** -0.5)
        self.final_norm = RMSNorm(d, **norm)


class MTPModule(nnx.Module):
    QUANT_AXES = {"head": (0,)}  # its own embedding, if any, is only gathered from

    def __init__(self, cfg: ModelConfig, k: int, *, dtype, rngs: nnx.Rngs):
        d, v = cfg.hidden_size, cfg.vocab_size
        self.input = None if cfg.mtp_shared_input else MTPInput(cfg, dtype=dtype, rngs=rngs)
        self.block = Block(cfg.layer_spec(cfg.num_layers + k), d, dtype=dtype, rngs=rngs)
        self.embed = _param(rngs, (v, d), dtype, 1.0) if cfg.mtp_own_embed else None
        self.head = _param(rngs, (d, v), dtype, d ** -0.5) if cfg.mtp_own_head else None


class DraftHead(nnx.Module):
    def __init__(self, d: int, n: int, *, dtype, rngs: nnx.Rngs):
        self.head = _param(rngs, (d, n), dtype, d ** -0.5)


class DraftVocab(nnx.Module):
    """A reduced draft vocabulary (FR-Spec, EAGLE-3): the MTP heads score only the
    `draft_vocab_size` tokens `ids`, with their columns of the head copied into `heads`
    (one for the shared target lm_head, else one per module), and every other token gets
    logit -inf. The draft reads d x n head bytes instead of d x V; verification scores the
    full vocabulary, so output is unchanged (greedy: a draft outside the set is simply
    never proposed; sampling: the draft's real distribution, zero outside the set, goes
    into the acceptance test). Set by `draft_vocab.with_draft_vocab`."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        n, d = cfg.draft_vocab_size, cfg.hidden_size
        self.ids = nnx.Param(jnp.arange(n, dtype=jnp.int32))
        count = cfg.num_mtp_modules if cfg.mtp_own_head else 1
        self.heads = nnx.List([DraftHead(d, n, dtype=dtype, rngs=rngs) for _ in range(count)])

    def logits(self, head, normed, vocab_size: int, kernel_rows=None):
        """Full-vocabulary logits (f32) from `head` [d, n] (one of `heads`, or its
        quantized copy, read by the kernel up to `kernel_rows`): the set's scores, -inf
        elsewhere."""
        small = qeinsum("...d,dn->...n", normed, head, preferred_element_type=jnp.float32,
                        kernel_rows=kernel_rows)
        full = jnp.full(small.shape[:-1] + (vocab_size,), -jnp.inf, jnp.float32)
        return full.at[..., self.ids[...]].set(small)


class MTPModel(nnx.Module):
    """Target decoder plus its MTP modules; the unit that is loaded, saved and split."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.target = Decoder(cfg, dtype=dtype, rngs=rngs)
        self.mtp = nnx.List([MTPModule(cfg, k, dtype=dtype, rngs=rngs)
                             for k in range(cfg.num_mtp_modules)])
        self.mtp_shared = (MTPInput(cfg, dtype=dtype, rngs=rngs)
                           if cfg.mtp_shared_input and cfg.num_mtp_modules else None)
        self.draft_vocab = (DraftVocab(cfg, dtype=dtype, rngs=rngs)
                            if cfg.draft_vocab_size and cfg.num_mtp_modules else None)
        # Quantized copies of the heads the draft reads (checkpoint.with_draft_head): one
        # per weight of `draft_head_weights`, [d, draft vocabulary or V].
        n = cfg.draft_vocab_size or cfg.vocab_size
        count = cfg.num_mtp_modules if cfg.mtp_own_head else 1
        self.draft_heads = (nnx.List([DraftHead(cfg.hidden_size, n, dtype=dtype, rngs=rngs)
                                      for _ in range(count)])
                            if cfg.draft_head and cfg.num_mtp_modules else None)

    def draft(self, k: int, tokens, hidden, positions, attend: Attend):
        """Run module k (0-based) on tokens [b, t] paired with consumed hiddens [b, t, d].

        Returns (hidden handed on [b, t, d], final-normed output [b, t, d]). The module's
        attention is `attend(num_layers + k, ...)`.
        """
        cfg = self.cfg
        mod = self.mtp[k]
        inp = mod.input if mod.input is not None else self.mtp_shared
        table = mod.embed if mod.embed is not None else self.target.embed
        e = take_rows(table, tokens, inp.enorm.weight[...].dtype)
        if cfg.mtp_zero_embed_at_pos0:
            e = jnp.where((positions == 0)[..., None], jnp.zeros_like(e), e)
        e = inp.enorm(e)
        h = inp.hnorm(hidden.astype(e.dtype))
        x = jnp.concatenate([h, e] if cfg.mtp_concat_order == "hidden_first" else [e, h], -1)
        x = qeinsum("btc,cd->btd", x, inp.proj)
        with jax.named_scope(f"mtp{k}"):
            y = mod.block(x, positions, attend, cfg.num_layers + k)
        out = inp.final_norm(y)
        return (out if cfg.mtp_output_hidden == "post_norm" else y), out

    def draft_head_weights(self) -> list:
        """The head weights [d, n] the draft reads (without `draft_heads`): the draft
        vocabulary's, each module's own, or the target's lm_head (the embedding's
        transpose when tied); one shared head is one entry."""
        if self.draft_vocab is not None:
            return [h.head for h in self.draft_vocab.heads]
        if self.cfg.mtp_own_head:
            return [m.head for m in self.mtp]
        if self.target.lm_head is None:
            return [value(self.target.embed).T]
        return [self.target.lm_head]

    def draft_logits(self, k: int, normed):
        """Logits (f32) of module k for its final-normed output [..., d].

        With `draft_heads`, products of up to 64 rows on one device (`quant.
        reads_head_copy`) read the quantized copy of the head through the quantized-matmul
        kernel; larger ones read the head itself, which streams faster there.
        """
        rows = None  # the kernel's own limit, unless the copy is read
        if self.draft_heads is not None and reads_head_copy(math.prod(normed.shape[:-1])):
            heads, rows = self.draft_heads, DRAFT_HEAD_MAX_ROWS
        else:
            heads = None if self.draft_vocab is None else self.draft_vocab.heads
        if heads is not None:
            head = heads[min(k, len(heads) - 1)].head
            if self.draft_vocab is not None:
                return self.draft_vocab.logits(head, normed, self.cfg.vocab_size, rows)
            return qeinsum("...d,dv->...v", normed, head, preferred_element_type=jnp.float32,
                           kernel_rows=rows)
        head = self.mtp[k].head
        if head is None:
            return self.target.head(normed)
        return qeinsum("...d,dv->...v", normed, head, preferred_element_type=jnp.float32)


def init_model(cfg: ModelConfig, *, seed: int = 0, dtype=jnp.float32) -> MTPModel:
    return MTPModel(cfg, dtype=dtype, rngs=nnx.Rngs(params=seed))


def forward_train(model: MTPModel, tokens, num_modules=None, attend_for=None):
    """Full-sequence forward for training and tests (dense causal attention).

    tokens [b, T]. Returns (target logits [b, T, v], list of module logits): module k
    (0-based) at anchor i consumes t_{i+k+1} and predicts t_{i+k+2}, over anchors
    0..T-k-2, DeepSeek style (module k-1's hidden over the same anchors for `previous`).
    attend_for(positions) -> attend backend (default `layers.causal_attend`).
    """
    attend_for = attend_for or causal_attend
    cfg = model.cfg
    b, T = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(T), (b, T))
    attend = attend_for(pos)
    normed, pre = model.target(tokens, pos, attend)
    logits = model.target.head(normed)
    h0 = model.target.mtp_hidden(normed, pre)
    h = h0
    outs = []
    n = cfg.num_mtp_modules if num_modules is None else num_modules
    for k in range(n):
        span = T - k - 1
        p = pos[:, :span]
        src = h[:, :span] if cfg.mtp_hidden_source == "previous" else h0[:, :span]
        h, out = model.draft(k, tokens[:, k + 1: k + 1 + span], src, p, attend_for(p))
        outs.append(model.draft_logits(k, out))
    return logits, outs
