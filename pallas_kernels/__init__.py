"""Pallas kernels for mtp_jax: one op per module, each with its pure-jnp reference."""
