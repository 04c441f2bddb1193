"""Warm starts: JAX's persistent compilation cache, on by default.

Every `generate` / `evaluate` run and every `Engine` compiles the same programs for the
same model and engine shapes; with the cache the second run loads them from disk instead
of compiling again. The folder is `--compile-cache` (`enable(path)`), else
`$MTP_JAX_COMPILE_CACHE`, else `<user cache dir>/mtp_jax/jax-<jax version>`
(`$XDG_CACHE_HOME` or `~/.cache`); the value `off` disables it for the process. A cache folder the user already gave JAX (`jax_compilation_cache_dir`)
is left as it is. Programs whose executables JAX cannot serialize (host callbacks, e.g.
Pallas interpret mode) are simply compiled each time.

`CacheStats` counts hits and misses from JAX's own monitoring events, for run summaries.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import jax

ENV_VAR = "MTP_JAX_COMPILE_CACHE"
OFF = ("off", "0", "false", "none", "no")

_lock = threading.Lock()
_counts = {"hits": 0, "misses": 0}
_listening = False
_disabled = False


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mtp_jax", f"jax-{jax.__version__}")


def _listen(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _counts["hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        _counts["misses"] += 1


def enable(path: Optional[str] = None) -> Optional[str]:
    """Turn the persistent cache on (see the module doc); returns its folder or None.

    path: a folder, `off`, or None for $MTP_JAX_COMPILE_CACHE / the default folder. Once
    turned off in a process (by either), later calls with path None leave it off.
    """
    global _listening, _disabled
    choice = path if path is not None else os.environ.get(ENV_VAR)
    if choice is not None and str(choice).strip().lower() in OFF:
        _disabled = True
        return None
    if path is None and _disabled:
        return None
    with _lock:
        if not _listening:
            jax.monitoring.register_event_listener(_listen)
            _listening = True
        current = jax.config.jax_compilation_cache_dir
        if current:
            return current
        folder = os.path.abspath(os.path.expanduser(choice or default_dir()))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            return None  # a read-only home: run without the cache rather than fail
        jax.config.update("jax_compilation_cache_dir", folder)
        # CPU programs are many and each compiles in well under JAX's 1 s default floor.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        try:  # a process that compiled before this call has already decided "no cache"
            from jax._src import compilation_cache
            compilation_cache.reset_cache()
        except Exception:  # noqa: BLE001 (private API: best effort on other versions)
            pass
        return folder


def add_compile_cache_option(parser) -> None:
    parser.add_argument("--compile-cache", metavar="DIR|off",
                        help=f"persistent compilation cache folder, or off (default: "
                             f"${ENV_VAR}, else {default_dir()})")


class CacheStats:
    """Persistent-cache hits and misses since this object was made."""

    def __init__(self):
        self._start = dict(_counts)

    @property
    def hits(self) -> int:
        return _counts["hits"] - self._start["hits"]

    @property
    def misses(self) -> int:
        return _counts["misses"] - self._start["misses"]

    def __str__(self) -> str:
        folder = jax.config.jax_compilation_cache_dir
        if not folder:
            return "compile cache off"
        return f"compile cache {self.hits} hits / {self.misses} misses ({folder})"


__all__ = ["ENV_VAR", "CacheStats", "add_compile_cache_option", "default_dir", "enable"]
