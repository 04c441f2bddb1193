"""Pallas kernels for mtp_jax: one op per module, each with its pure-jnp reference."""

from __future__ import annotations

import os

BACKENDS = ("gpu", "tpu", "reference")


def resolve_backend(backend, env_var: str, op: str, extra: tuple[str, ...] = ()) -> str:
    """Explicit argument, else $env_var, else by `jax.default_backend()` (cpu: reference).

    `extra` names further backends that this one op accepts on top of BACKENDS.
    """
    import jax

    choice = backend or os.environ.get(env_var) or jax.default_backend()
    choice = {"cuda": "gpu", "rocm": "gpu", "cpu": "reference"}.get(choice, choice)
    allowed = BACKENDS + tuple(extra)
    if choice not in allowed:
        raise ValueError(f"unknown {op} backend {choice!r}; expected one of {allowed} "
                         "(or None for jax.default_backend())")
    return choice


def next_pow2(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(0, (n - 1).bit_length())


def first_divisor(n: int, candidates):
  """The first of `candidates` that divides n, or None."""
  return next((c for c in candidates if n % c == 0), None)


def check_positive_ints(config, skip: tuple[str, ...] = ()) -> None:
  """ValueError naming the field of a block-config dataclass that is not a positive int
  (fields named in `skip` are the caller's to check)."""
  import dataclasses

  for f in dataclasses.fields(config):
    if f.name in skip:
      continue
    v = getattr(config, f.name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise ValueError(f"{type(config).__name__}.{f.name} must be a positive int, got {v!r}.")
