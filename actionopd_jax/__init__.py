"""actionopd_jax: JAX-native ActionOPD (distilling decisions, not tokens)."""

__version__ = "0.1.0"
