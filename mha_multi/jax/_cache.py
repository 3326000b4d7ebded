"""JAX's cache write: a call's new rows scattered to their positions, the spec's update exactly.

:func:`mha_multi.spec.update_cache` builds each cache position from the new
rows by a gather over all ``max_length`` positions. Under ``jit``, XLA fuses
whatever produced the rows into that gather, so each cache position
recomputes its row's producer: with rotary positions, the rotation and its
sines and cosines, ``max_length`` times per new row (docs: "Generating with a
cache"). :func:`scatter_update` writes the same numbers by one scatter of the
``T`` new rows (:func:`mha_multi.spec.update_cache` with a scatter), as a hand-written
static cache's ``dynamic_update_slice`` does, so their producer runs once per
row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mha_multi import spec
from mha_multi.jax._ops import JaxOps

__all__ = ["scatter_rows", "scatter_update"]

Array = jax.Array

#: The spec's helpers taken here multiply no matrices: no precision plays a part.
_OPS = JaxOps(None)


def scatter_rows(held: Array, rows: Array, positions: Array, kept: Array) -> Array:
    """``held`` ``(B, H_kv, M, dh)`` with the kept ``rows`` ``(B, T, H_kv, dh)`` at their
    ``positions`` (:data:`mha_multi.spec.cache.Scatter`)."""
    # Rows not kept aim past the end, where the scatter drops them.
    positions = jnp.where(kept, positions, held.shape[2])
    examples = jnp.arange(held.shape[0])[:, None]  # (B, 1)
    # Two index arrays around a slice: the indexed axes come first, (B, T, H_kv, dh).
    return held.at[examples, :, positions].set(rows, mode="drop")


def scatter_update(
    cache: spec.KVCache, k: Array | None, v: Array | None, lens: Array | None, *, causal: bool
) -> tuple[spec.KVCache, Array]:
    """:func:`mha_multi.spec.update_cache`'s cache and lengths, its rows written by a scatter.

    Row ``t`` of example ``b`` goes to position ``lengths[b] + t`` where ``t
    < new[b]`` (:func:`mha_multi.spec.cache.appended`) and that position is in
    ``[0, max_length)``; every other row is dropped, so no kept position is
    overwritten and none at or past ``max_length`` is written, whatever the
    (traced) lengths: the spec's update, value for value.

    Args:
        cache: the checked cache before the call.
        k, v: projected new keys and values ``(B, T, num_kv_heads *
            head_dim)``, or ``None`` to append nothing.
        lens: ``(B,)`` integer new positions per example (``valid_lens``), or ``None``.
        causal: the call's causal flag.

    Returns:
        ``(cache, lens)`` as :func:`mha_multi.spec.update_cache` returns them.
    """
    head_dim = cache.keys.shape[3]
    return spec.update_cache(
        _OPS, cache, k, v, lens, head_dim=head_dim, causal=causal, scatter=scatter_rows
    )
