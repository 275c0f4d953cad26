"""passrate-jax: a JAX-native RLVR trainer built around rollout efficiency."""

__version__ = "0.1.0"
