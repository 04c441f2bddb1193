"""Pallas kernels for mtp_jax: one op per module, each with its pure-jnp reference; the
helpers they share are in common.py."""
