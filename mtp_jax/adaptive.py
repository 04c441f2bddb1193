"""Adaptive speculation: how many drafts each dispatch verifies (the step kind, 0..K).

Speculation pays only when a verify of k+1 tokens plus k drafts costs less than the
tokens it commits would cost one by one: true for large models at small batch, false
for tiny models on a CPU or at large batch. So the engine compiles one multi-step program
per kind and, between dispatches, this controller picks the kind of the next one:

- cost: seconds per step of each kind, measured on the real job: a dispatch's time from
  launch to the moment its results are ready, over the loop iterations it ran, and a
  kind's cost is the least of its last few measurements (a shared machine only ever adds
  time, never takes it away). A kind not yet measured is interpolated between 0 and K
  (each draft adds about the same). Timing kinds on an idle slot at warmup does not work:
  an idle slot's step leaves out work that grows with the kind (a CPU verify of K+1
  tokens over every running request's context), so it misjudged real costs by 2-3x;
- acceptance: r_d, the share of verified depth-d drafts that were accepted (which
  includes the acceptance of every earlier depth), from decayed counts, so a kind k is
  expected to commit 1 + r_1 + ... + r_k tokens per step;
- choice: while requests wait for a slot, the kind with the most expected tokens per
  second (a slot that finishes early is refilled, so throughput is what counts). Once
  none waits (the job's last wave), the kind that finishes the last running request
  soonest: each request's remaining tokens over its own expected tokens per step (its
  acceptance counts, smoothed toward the job's), times the step cost; the requests that
  draft well would finish early to idle slots, and the poorly drafted ones set the end.
  K is measured first (for the
  acceptance of every depth), then 0; a kind in between is measured only when its
  interpolated cost makes it the best. After that the least recently measured kind runs as a check
  every `interval` dispatches, an interval that doubles (up to `max_interval`) each time
  the check leaves the choice as it was and falls back to `min_interval` when it changes
  it. Measurements and checks are short dispatches (`probe` is set while one is due: the
  engine runs a sixteenth of its usual steps), so a short job is not spent exploring.

Only timing and acceptance counts decide; nothing here touches the tokens. Greedy output
is identical to plain decoding whatever the schedule, and sampled rows verify by coupled
sampling under adaptive K (sampling.accept), so they too are the same for every schedule.
"""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np


class KController:
    def __init__(self, k_max: int, *, decay: float = 0.9,
                 min_interval: int = 8, max_interval: int = 256, prior: float = 0.5,
                 prior_weight: float = 2.0, window: int = 3, row_prior_weight: float = 4.0):
        if k_max < 1:
            raise ValueError("adaptive speculation needs K >= 1")
        self.k_max = k_max
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
        """Seconds per step of kind k: measured, else interpolated between 0 and K."""
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
        for k in (self.k_max, 0):  # K first: the acceptance of every depth
            if self.cost[k] is None:
                return k
        best = self.best()
        if self.cost[best] is None:
            return best  # an interpolated winner: measure it
        if self.dispatches >= self.next_check:
            others = [k for k in range(self.k_max + 1) if k != best]
            self._check = best
            return min(others, key=lambda k: self.measured[k])
        self.probe = False
        return best

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
