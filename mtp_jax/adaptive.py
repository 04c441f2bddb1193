"""Adaptive speculation: how many drafts each dispatch verifies (the step kind, 0..K).

Speculation pays only when a verify of k+1 tokens plus k drafts costs less than the
tokens it commits would cost one by one: true for large models at small batch, false
for tiny models on a CPU or at large batch. So the engine compiles one multi-step program
per kind and, between dispatches, this controller picks the kind of the next one:

- cost: seconds per step of each kind, measured on the real job: a dispatch's time from
  launch to the moment its results are ready, over the loop iterations it ran, and a
  kind's cost is the least of its last few measurements (a shared machine only ever adds
  time, never takes it away). A dispatch that also waited for prompts admitted just
  before it is not timed. A kind not yet measured is estimated from `prior_cost`, one
  step of each kind timed at warmup on a dummy slot, scaled by the job's own timing of
  the nearest measured kind: the step programs have fixed shapes, so the dummy slot does
  all of a real step's work but the attention over long contexts, and the ratios between
  kinds hold (on the shipped model on a CPU: warmup 18 / 29 / 40 / 51 ms for K = 0..3,
  the job 21 / 34 / - / 60). The same ratios also bound a kind timed earlier from below:
  steps slow down as contexts grow, so a kind's old timing is raised to what a kind
  timed since implies for it. Without a prior, kinds between measured ones are
  interpolated (each draft adds about the same);
- acceptance: r_d, the share of verified depth-d drafts that were accepted (which
  includes the acceptance of every earlier depth), from decayed counts, so a kind k is
  expected to commit 1 + r_1 + ... + r_k tokens per step;
- choice: while requests wait for a slot, the kind with the most expected tokens per
  second (a slot that finishes early is refilled, so throughput is what counts). Once
  none waits (the job's last wave), the kind that finishes the last running request
  soonest: each request's remaining tokens over its own expected tokens per step (its
  acceptance counts, smoothed toward the job's), times the step cost; the requests that
  draft well would finish early to idle slots, and the poorly drafted ones set the end.
- exploration: K is measured first (the acceptance of every depth), over enough steps
  for `samples` verified drafts per depth (a job's first steps after the prompts draft
  worse than its later ones, so two steps of one request say little). With a prior,
  another kind is measured only when its estimate makes it the best, in a dispatch of
  the usual length; without one, 0 is measured next and an interpolated winner in a short
  dispatch. After that the least recently measured kind runs as a check every
  `interval` dispatches, an interval that doubles (up to `max_interval`) each time the
  check leaves the choice as it was and falls back to `min_interval` when it changes it.
  Measurements and checks are short dispatches (`probe` is set while one is due, and
  `steps()` gives its length: a sixteenth of the usual steps), so a short job is not spent
  exploring.

Only timing and acceptance counts decide; nothing here touches the tokens. Greedy output
is identical to plain decoding whatever the schedule, and sampled rows verify by coupled
sampling under adaptive K (sampling.accept), so they too are the same for every schedule.
"""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np


class KController:
    def __init__(self, k_max: int, *, prior_cost=None, decay: float = 0.9,
                 min_interval: int = 8, max_interval: int = 256, prior: float = 0.5,
                 prior_weight: float = 2.0, window: int = 3, row_prior_weight: float = 4.0,
                 samples: int = 32):
        if k_max < 1:
            raise ValueError("adaptive speculation needs K >= 1")
        if prior_cost is not None and (len(prior_cost) != k_max + 1
                                       or not all(c > 0 for c in prior_cost)):
            raise ValueError(f"prior_cost needs {k_max + 1} positive seconds per step")
        self.k_max = k_max
        self.prior_cost = None if prior_cost is None else [float(c) for c in prior_cost]
        self.samples = samples
        self.decay = decay
        self.min_interval, self.max_interval = min_interval, max_interval
        self.prior, self.prior_weight = prior, prior_weight
        self.row_prior_weight = row_prior_weight
        self.drain = None  # (remaining, accepted, verified) of the last wave, see choose()
        self.cost: list = [None] * (k_max + 1)  # seconds per step, measured on the job
        self._recent = [collections.deque(maxlen=window) for _ in range(k_max + 1)]
        self.measured = [-1] * (k_max + 1)  # dispatch index of the last measurement
        self.acc = np.zeros(k_max)  # decayed accepted counts per depth
        self.tried = np.zeros(k_max)  # decayed verified-draft counts per depth
        self.dispatches = 0
        self.interval = min_interval
        self.next_check = 0
        self._check: Optional[int] = None  # the choice a running check is measured against
        self.probe = False  # the kind chosen last is a measurement or a check
        self.schedule: list = []  # run-length [kind, dispatches]

    # ------------------------------------------------------------------ model
    def rates(self) -> np.ndarray:
        """r_d: accepted / verified drafts at depth d (prior-smoothed)."""
        w = self.prior_weight
        return (self.acc + w * self.prior) / (self.tried + w)

    def expected_tokens(self, k: int) -> float:
        """Tokens one step of kind k commits on average."""
        return 1.0 + float(np.sum(self.rates()[:k]))

    def estimated_cost(self, k: int) -> Optional[float]:
        """Seconds per step of kind k: measured (and with a prior, at least what the kind
        measured since implies for it); else the warmup prior scaled by the nearest
        measured kind's timing; else interpolated between 0 and K."""
        if self.prior_cost is not None:
            known = [j for j in range(self.k_max + 1) if self.cost[j] is not None]
            if not known:
                return None
            if self.cost[k] is None:
                j = min(known, key=lambda j: (abs(j - k), -j))
                return self.prior_cost[k] * self.estimated_cost(j) / self.prior_cost[j]
            # Steps grow slower as the contexts grow, so a kind timed early (the short
            # first measurement of K, on the prompts alone) looks cheaper than it is now.
            latest = max(known, key=lambda j: self.measured[j])
            if self.measured[latest] > self.measured[k]:
                return max(self.cost[k],
                           self.prior_cost[k] * self.cost[latest] / self.prior_cost[latest])
            return self.cost[k]
        if self.cost[k] is not None:
            return self.cost[k]
        lo, hi = self.cost[0], self.cost[self.k_max]
        return None if lo is None or hi is None else lo + (hi - lo) * k / self.k_max

    def tokens_per_second(self, k: int) -> Optional[float]:
        c = self.estimated_cost(k)
        return None if c is None else self.expected_tokens(k) / c

    def finish_time(self, k: int) -> Optional[float]:
        """Seconds until the last running request is done at kind k (the last wave)."""
        c = self.estimated_cost(k)
        if c is None:
            return None
        remaining, acc, tried = self.drain
        w = self.row_prior_weight
        r = (acc[:, :k] + w * self.rates()[:k]) / (tried[:, :k] + w)  # [n, k]
        return c * float(np.max(remaining / (1.0 + r.sum(axis=1))))

    def best(self) -> int:
        if all(self.estimated_cost(k) is None for k in range(self.k_max + 1)):
            return self.k_max  # nothing timed yet: K is measured first
        if self.drain is not None:
            times = {k: self.finish_time(k) for k in range(self.k_max + 1)}
            return min((k for k, t in times.items() if t is not None), key=lambda k: times[k])
        rates = {k: self.tokens_per_second(k) for k in range(self.k_max + 1)}
        return max((k for k, r in rates.items() if r is not None), key=lambda k: rates[k])

    # --------------------------------------------------------------- decisions
    def choose(self, drain=None) -> int:
        """The kind of the next dispatch. drain: None while requests wait for a slot, else
        (remaining tokens [n], accepted [n, K], verified [n, K] draft counts) of the n
        running requests."""
        if drain is not None:
            n, k = len(drain[0]), self.k_max
            drain = None if n == 0 else (
                np.maximum(np.asarray(drain[0], float), 1.0),
                np.asarray(drain[1], float).reshape(n, -1)[:, :k],
                np.asarray(drain[2], float).reshape(n, -1)[:, :k])
        self.drain = drain
        self.probe = True
        first = (self.k_max,) if self.prior_cost is not None else (self.k_max, 0)
        for k in first:  # K first: the acceptance of every depth
            if self.cost[k] is None:
                return k
        best = self.best()
        if self.cost[best] is None:  # an estimated winner: measure it, in a short
            self.probe = self.prior_cost is None  # dispatch unless a prior backs it
            return best
        if self.dispatches >= self.next_check:
            others = [k for k in range(self.k_max + 1) if k != best]
            self._check = best
            return min(others, key=lambda k: self.measured[k])
        self.probe = False
        return best

    def steps(self, n: int, running: int) -> int:
        """Loop iterations for the dispatch just chosen: n, a probe's sixteenth of it, or,
        while K's acceptance is still unmeasured, enough for `samples` drafts per depth
        (up to a quarter of n)."""
        if not self.probe:
            return n
        short = max(1, n // 16)
        if self.tried[self.k_max - 1] == 0:
            return min(max(short, -(-self.samples // max(running, 1))), max(short, n // 4))
        return short

    def update(self, kind: int, seconds: float, steps: int, accepted, verified) -> None:
        """Record a dispatch of `kind`: its wall seconds, loop iterations, and the accepted
        / verified draft counts per depth [K] summed over its slots."""
        if self.schedule and self.schedule[-1][0] == kind:
            self.schedule[-1][1] += 1
        else:
            self.schedule.append([kind, 1])
        self.dispatches += 1
        if steps > 0 and seconds > 0:
            self._recent[kind].append(seconds / steps)
            self.cost[kind] = min(self._recent[kind])
            self.measured[kind] = self.dispatches
        seen = np.asarray(verified, float)[: self.k_max] > 0
        self.acc = np.where(seen, self.decay * self.acc + np.asarray(accepted, float), self.acc)
        self.tried = np.where(seen, self.decay * self.tried + np.asarray(verified, float),
                              self.tried)
        if self._check is not None:
            same = self.best() == self._check
            self.interval = min(2 * self.interval, self.max_interval) if same \
                else self.min_interval
            self._check = None
            self.next_check = self.dispatches + self.interval
        elif self.next_check == 0 and self.cost[self.best()] is not None:
            self.next_check = self.dispatches + self.interval  # measuring is done

    def summary(self) -> str:
        """The schedule as `k=3 x2, k=0 x40, ...` (run-length, in dispatch order)."""
        return ", ".join(f"k={k} x{n}" for k, n in self.schedule) or "no dispatches"

    def counts(self) -> dict:
        """Dispatches per kind."""
        out: dict = {}
        for k, n in self.schedule:
            out[k] = out.get(k, 0) + n
        return dict(sorted(out.items()))


__all__ = ["KController"]
