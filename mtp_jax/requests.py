"""Requests and their results: what callers hand the engine and get back.

`finished` turns a slot's counters and tokens after a dispatch into its request's
`Result` once it is done (a finish reason from the device, or a stop string the host
finds in the decoded text), joining the parts of a preempted request. A healed request's
text (healing.py) is the continuation of its original prompt, and so is the text its stop
strings are looked for in.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from .config import SamplingParams
from .healing import Healing, strip_healed


@dataclasses.dataclass
class Request:
    id: Any
    prompt_ids: list
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    # token healing (healing.Healer.heal): the prompt's last token was dropped and the
    # first generated token is one of `healing.allowed`
    healing: Optional[Healing] = None


@dataclasses.dataclass
class Result:
    id: Any
    token_ids: list
    finish_reason: str  # stop | length | error
    num_prompt_tokens: int  # of the prompt as given (a healed one's dropped token included)
    text: Optional[str] = None
    error: Optional[str] = None
    num_steps: int = 0  # target forwards after prefill
    accepted_per_depth: list = dataclasses.field(default_factory=list)  # counts
    drafted_per_depth: list = dataclasses.field(default_factory=list)  # steps verifying one
    healed: Optional[str] = None  # the text of the prompt's last token, when healing re-chose it
    num_cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_accepted_length(self) -> float:
        """Generated tokens per target forward (the prefill forward counts as one)."""
        return len(self.token_ids) / (self.num_steps + 1) if self.token_ids else 0.0

    @property
    def verified_per_depth(self) -> list:
        """Steps that verified a draft at each depth (every step, at a fixed K)."""
        return self.drafted_per_depth or [self.num_steps] * len(self.accepted_per_depth)

    @property
    def acceptance_per_depth(self) -> list:
        """Per depth: accepted drafts over the steps that verified a draft there."""
        return [a / t if t else 0.0 for a, t in zip(self.accepted_per_depth,
                                                     self.verified_per_depth)]


NONFINITE = "non-finite (NaN or Inf) logits: the request was stopped"


def error_result(req, msg: str) -> Result:
    """The Result of a request that could not run."""
    n = len(req.prompt_ids) + (getattr(req, "healing", None) is not None) if isinstance(
        req.prompt_ids, (list, tuple, np.ndarray)) else 0
    return Result(req.id, [], "error", n, error=msg)


def finished(live, k: int, tokens: list, reason: Optional[str], steps, accepted, drafted,
             tokenizer) -> Optional[Result]:
    """The Result of the request running as `live` (scheduler.Live) with `tokens` generated
    since its admission, or None while it runs. `reason`: the device's finish reason
    (None while running), overridden by a stop string found in the text."""
    before = live.before(k)
    toks = before.tokens + tokens
    text = err = None
    heal = before.req.healing
    found = match_stop_string(tokenizer, toks, live.stop_strings, heal) \
        if live.stop_strings else None
    if found is not None:
        toks, text, reason = found[0], found[1], "stop"
    elif reason is None:
        return None  # still running, no stop string yet
    if reason == "error":
        err = NONFINITE
    res = Result(before.req.id, toks, reason, len(before.req.prompt_ids) + (heal is not None),
                 text=text, error=err, num_steps=before.steps + int(steps),
                 healed=None if heal is None else heal.text,
                 num_cached_prompt_tokens=before.cached,
                 accepted_per_depth=[a + int(x) for a, x in zip(before.accepted, accepted)],
                 drafted_per_depth=[a + int(x) for a, x in zip(before.drafted, drafted)])
    if res.text is None and tokenizer is not None:
        res.text = strip_healed(tokenizer.decode(toks), heal)
    return res


def match_stop_string(tokenizer, toks, stops, healing: Optional[Healing] = None):
    """(tokens up to and including the one completing the stop string, text before it).
    `healing`: the text searched starts after the healed prompt token's text."""
    if tokenizer is None:
        return None
    text = strip_healed(tokenizer.decode(toks), healing)
    hits = [text.find(s) for s in stops if s in text]
    if not hits:
        return None
    pos = min(hits)
    for j in range(1, len(toks) + 1):  # shortest prefix whose text holds a stop string
        prefix = strip_healed(tokenizer.decode(toks[:j]), healing)
        if any(s in prefix for s in stops):
            return toks[:j], text[:pos]
    return toks, text[:pos]


def unrun_result(before, k: int) -> Result:
    """The Result of a request continuing after a preemption that is dropped before it
    runs again, because the cached prompt blocks it had read met non-finite values: the
    error its prefill would have met without the cache, with no tokens."""
    n = len(before.req.prompt_ids) + (before.req.healing is not None)
    return Result(before.req.id, [], "error", n, error=NONFINITE,
                  accepted_per_depth=[0] * k, drafted_per_depth=[0] * k,
                  num_cached_prompt_tokens=before.cached)


__all__ = ["Request", "Result", "error_result", "finished", "match_stop_string",
           "unrun_result", "NONFINITE"]
