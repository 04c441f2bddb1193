"""The drafting methods as data: one frozen `Strategy` per `SpecConfig.method`.

Everything that differs between the methods and is decided by the method alone lives
here, once: which MTP modules a K uses (and so which KV layers the engine allocates),
how the modules are run over the draft window, where each module's input hiddens come
from, what the prompt's prefill fills, which caches need zeroing. The config resolves the
method string to its strategy once (`SpecConfig.strategy`); step, engine, drafting and
evaluate read the strategy's fields and never compare method names.

Plain Python (no jax), so the config and the scheduler can hold it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

# how module m + 1's hiddens over the window are made from module m's pass
SHIFTED = "shifted"  # the window's target hiddens, one slot on; the newest is module m's
CHAINED = "chained"  # module m's output hiddens over the whole window
FED_BACK = "fed_back"  # single-token passes: the previous pass's output hidden


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One drafting method (DESIGN.md, Draft strategies; drafting.py for the passes)."""

    name: str
    speculative: bool  # drafts at all (`none`: plain decoding)
    # every module runs over the whole window (window, chain); else module 1 runs over the
    # window, then the other depths are single-token passes at draft positions
    over_window: bool = False
    module_per_depth: bool = False  # depth s drafts with module s (else module 1 throughout)
    hidden_from: Optional[str] = None  # SHIFTED, CHAINED or FED_BACK (None: no drafting)
    default_k: Optional[int] = None  # K of "auto" (None: the model's module count)

    def modules(self, k: int) -> int:
        """MTP modules (and MTP KV layers) a K of `k` uses."""
        return k if self.module_per_depth else min(k, 1)

    def module_at(self, depth: int) -> int:
        """The module (0-based) that drafts at depth `depth` (0-based)."""
        return depth if self.module_per_depth else 0

    def history_modules(self, k: int) -> int:
        """Modules whose caches the prefill fills over the prompt: those that see committed
        positions. Single-token passes only ever see draft positions past the first."""
        return self.modules(k) if self.over_window else min(k, 1)

    def draft_only_modules(self, k: int) -> range:
        """Modules (0-based) that only ever write draft positions: the rest of their pages
        must read as zeros, not as an earlier request's keys (`per_step`)."""
        return range(self.history_modules(k), self.modules(k))

    @property
    def history_reads_ahead(self) -> bool:
        """The prompt's MTP history at a position reads the K target hiddens after it
        (`window`), so it runs a chunk behind the target's prefill, as programs of its own."""
        return self.hidden_from == SHIFTED

    def auto_k(self, num_mtp_modules: int) -> int:
        """K for num_speculative_tokens="auto"."""
        if not self.speculative:
            return 0
        return self.default_k if self.default_k is not None else max(1, num_mtp_modules)

    def check_k(self, k: int, num_mtp_modules: int) -> Optional[str]:
        """Why `k` drafts cannot run on a model of `num_mtp_modules` modules, or None."""
        if not self.speculative:
            return None
        if self.module_per_depth and not 1 <= k <= num_mtp_modules:
            return (f"method {self.name} needs 1 <= num_speculative_tokens <= "
                    f"{num_mtp_modules} (the number of MTP modules), got {k}")
        if num_mtp_modules < 1:
            return f"method {self.name} needs at least one MTP module"
        return None


NONE = Strategy("none", speculative=False)
EAGLE = Strategy("eagle", True, hidden_from=FED_BACK, default_k=3)
PER_STEP = Strategy("per_step", True, module_per_depth=True, hidden_from=FED_BACK)
WINDOW = Strategy("window", True, over_window=True, module_per_depth=True, hidden_from=SHIFTED)
CHAIN = Strategy("chain", True, over_window=True, module_per_depth=True, hidden_from=CHAINED)

STRATEGIES = {s.name: s for s in (NONE, EAGLE, PER_STEP, WINDOW, CHAIN)}
METHODS = tuple(STRATEGIES)  # the user-facing names (`--method`)


def strategy_for(method: str) -> Strategy:
    """The strategy of a method name; KeyError naming the choices for an unknown one."""
    try:
        return STRATEGIES[method]
    except KeyError:
        raise KeyError(f"method {method!r} not in {METHODS}") from None


__all__ = ["Strategy", "STRATEGIES", "METHODS", "strategy_for", "NONE", "EAGLE",
           "PER_STEP", "WINDOW", "CHAIN", "SHIFTED", "CHAINED", "FED_BACK"]
