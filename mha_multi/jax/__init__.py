"""JAX/Flax backend: ``MultiHeadAttention`` as a Flax NNX module.

The Flax Linen module is in :mod:`mha_multi.jax.linen`; both are thin
shells over the call flow of :mod:`mha_multi.call` with JAX's facts and
their parameters, as the pure function
:func:`mha_multi.jax.functional.multi_head_attention` is. Heads are split
across devices with :func:`shard_heads` (:mod:`mha_multi.jax.sharding`).
"""

from mha_multi.jax.functional import multi_head_attention
from mha_multi.jax.importance import head_importance
from mha_multi.jax.layer import MultiHeadAttention, get_weights, set_weights
from mha_multi.jax.sharding import shard_cache, shard_heads
from mha_multi.spec import KVCache

__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "get_weights",
    "head_importance",
    "multi_head_attention",
    "set_weights",
    "shard_cache",
    "shard_heads",
]
