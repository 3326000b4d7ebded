"""The key/value cache: its arrays, and a call's new keys and values written into it.

Docs: "Generating with a cache". The cache is a named tuple of a backend's
arrays, so it passes through ``jax.jit``, ``torch.compile`` and
``tf.function`` as it is; :func:`update_cache` is the functional write that
compiled code takes (eager backends write in place where they can).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from mha_multi.spec.checks import Heads
from mha_multi.spec.ops import Array, ArrayOps


class KVCache(NamedTuple):
    """The projected keys and values a layer has seen, per example.

    A named tuple of the backend's arrays, so it passes through ``jax.jit``
    (a pytree), ``torch.compile`` and ``tf.function`` as it is: ``keys`` and
    ``values`` are the projected keys and values ``(B, num_kv_heads,
    max_length, head_dim)``, ``lengths`` ``(B,)`` int32 the positions each
    example holds (positions from ``lengths[b]`` on are free and hold nothing
    meaningful).
    """

    keys: Any
    values: Any
    lengths: Any


def cache_shape(batch_size: Any, max_length: Any, heads: Heads) -> tuple[int, int, int, int]:
    """The shape of a cache's keys and values, ``(B, num_kv_heads, max_length, head_dim)``.

    Raises:
        TypeError: ``batch_size`` or ``max_length`` is not an int.
        ValueError: either is negative.
    """
    for name, value in (("batch_size", batch_size), ("max_length", max_length)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be a non-negative int; got {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be a non-negative int; got {value}")
    return (int(batch_size), heads.num_kv_heads, int(max_length), heads.head_dim)


def check_new_cache_dtype(dtype: Any, kind_of: Callable[[Any], str]) -> None:
    """Raises unless a new cache's keys and values are of a floating dtype (every
    backend's ``init_cache``).

    Args:
        dtype: the dtype as the caller gave it.
        kind_of: the framework's kind of a dtype, numpy's letter (``"f"`` for
            floating); it may raise for what is no dtype of the framework.

    Raises:
        TypeError: naming ``dtype``.
    """
    try:
        kind = kind_of(dtype)
    except (TypeError, ValueError, AttributeError):  # (no dtype of the framework)
        kind = None
    if kind != "f":
        raise TypeError(
            "init_cache's dtype must be a floating dtype of the layer's framework or None; "
            f"got {dtype!r}"
        )


#: ``scatter(held, rows, positions, kept)``: ``held`` ``(B, H_kv, M, dh)`` with row ``t``
#: of example ``b`` of ``rows`` ``(B, T, H_kv, dh)`` at position ``positions[b, t]`` where
#: ``kept[b, t]`` (:func:`row_positions`), every other position as it was.
Scatter = Callable[[Array, Array, Array, Array], Array]


def update_cache(
    ops: ArrayOps,
    cache: KVCache,
    k: Array | None,
    v: Array | None,
    valid_lens: Array | None,
    *,
    head_dim: int,
    causal: bool,
    scatter: Scatter | None = None,
) -> tuple[KVCache, Array]:
    """Writes a call's new keys and values into the cache, and says what each query sees.

    Example ``b`` holds ``lengths[b]`` positions and appends ``n_b =
    valid_lens[b]`` (all ``T`` by default) at positions ``lengths[b] ..
    lengths[b] + n_b - 1``; padding past ``n_b`` is not kept. Query ``i``
    (absolute position ``lengths[b] + i``) sees key ``j`` iff ``j <
    lengths[b] + n_b`` and, when causal, ``j <= lengths[b] + i``: the causal
    rule aligned bottom-right for each example on its own.

    Positions at or past ``max_length`` are never written, and no position
    below ``lengths[b]`` is overwritten, whatever the lengths: where an
    eager caller would have raised (:func:`check_cache_values`), compiled
    code drops the positions that do not fit, and ``lengths`` still counts
    them, so ``lengths > max_length`` tells that it happened.

    Args:
        ops: the array-ops adapter.
        cache: the cache before the call.
        k: projected new keys ``(B, T, num_kv_heads * head_dim)``, or
            ``None`` to append nothing.
        v: projected new values, likewise.
        valid_lens: ``(B,)`` integer new positions per example, or ``None``.
            Backends whose sizes are not ints (MXNet symbols) pass them.
        head_dim: the size of each head.
        causal: the call's causal flag.
        scatter: ``None``: each of the ``max_length`` positions is built from
            the new rows by a gather. Else the framework's scatter of the
            ``T`` rows (``T`` an int), the same numbers: a compiler that fuses
            the rows' producer into the gather recomputes it at every
            position (with rotary positions, the rotation: docs: "Generating
            with a cache"); a scatter runs it once per row.

    Returns:
        ``(cache, lens)``: the cache after the call, and the lengths for
        :func:`visibility` over its ``max_length`` keys: ``(B, T)`` when
        causal, else ``(B,)``.
    """
    lengths = cache.lengths
    if k is None:
        return cache, lengths
    num_new = ops.size(k, 1)
    if isinstance(num_new, int) and num_new == 0:
        return cache, lengths  # no position to write, and no query
    check_cache_dtype(ops, cache, ops.dtype(k), ops.dtype(v))
    new = appended(ops, lengths, valid_lens, num_new)
    if scatter is not None:
        at, kept = row_positions(ops, lengths, new, num_new, ops.size(cache.keys, 2))
        keys, values = (
            scatter(held, ops.split_axis(x, 2, (-1, head_dim)), at, kept)
            for held, x in ((cache.keys, k), (cache.values, v))
        )
        updated = KVCache(keys, values, lengths + new)
        return updated, cached_visibility(ops, lengths, new, num_new, causal=causal)
    positions = ops.arange(ops.size(cache.keys, 2))  # (M,)
    start = ops.expand_dims(lengths, 1)  # (B, 1)
    offsets = ops.expand_dims(positions, 0) - start  # (B, M): p - lengths[b]
    written = ops.logical_and(
        ops.greater_equal(offsets, offsets * 0), ops.less(offsets, ops.expand_dims(new, 1))
    )
    source = ops.where(written, offsets, offsets * 0)  # any position in range where unwritten
    written = ops.expand_dims(ops.expand_dims(written, 1), -1)  # (B, 1, M, 1)

    def write(x: Array, held: Array) -> Array:
        rows = ops.gather_positions(x, source)  # (B, M, H_kv*dh)
        rows = ops.permute(ops.split_axis(rows, 2, (-1, head_dim)), (0, 2, 1, 3))
        return ops.where(written, rows, held)

    updated = KVCache(write(k, cache.keys), write(v, cache.values), lengths + new)
    return updated, cached_visibility(ops, lengths, new, num_new, causal=causal)


def check_cache_dtype(ops: ArrayOps, cache: KVCache, keys_dtype: Any, values_dtype: Any) -> None:
    """The cache holds the projections' dtypes (a ``TypeError`` naming the cache's array if not)."""
    for name, dtype in (("keys", keys_dtype), ("values", values_dtype)):
        held = ops.dtype(getattr(cache, name))
        if held != dtype:
            raise TypeError(
                f"cache.{name} dtype {held} differs from the layer's projected {name} "
                f"dtype {dtype}; make the cache with layer.init_cache"
            )


def appended(ops: ArrayOps, lengths: Array, valid_lens: Array | None, num_new: Any) -> Array:
    """``(B,)`` the positions each example appends: ``valid_lens`` (all ``T`` when ``None``).

    Unchecked (compiled) lengths are clipped into ``[0, T]``, the call's positions.
    """
    if valid_lens is None:
        return lengths * 0 + num_new
    new = ops.cast(valid_lens, ops.dtype(lengths))
    if isinstance(num_new, int):
        new = ops.where(ops.less(new, num_new), new, num_new)
        new = ops.where(ops.less(new, 0), new * 0, new)
    return new


def row_positions(
    ops: ArrayOps, lengths: Array, new: Array, num_new: int, max_length: int
) -> tuple[Array, Array]:
    """Where each new row of a cached call goes, and whether it is kept there.

    Row ``t`` of example ``b`` belongs at position ``lengths[b] + t``; it is
    kept where ``t < new[b]`` (:func:`appended`) and that position is in
    ``[0, max_length)``: the rows :func:`update_cache` writes, for frameworks
    that scatter them rather than gather every position.

    Returns:
        ``(positions, kept)``, both ``(B, T)``.
    """
    rows = ops.expand_dims(ops.arange(num_new), 0)  # (1, T)
    positions = ops.expand_dims(lengths, -1) + rows  # (B, T)
    inside = ops.logical_and(ops.less(positions, max_length), ops.greater_equal(positions, 0))
    return positions, ops.logical_and(ops.less(rows, ops.expand_dims(new, -1)), inside)


def cached_visibility(
    ops: ArrayOps, lengths: Array, new: Array, num_new: Any, *, causal: bool
) -> Array:
    """What each query of a cached call sees: lengths for :func:`visibility`.

    Args:
        lengths: ``(B,)`` the cache's lengths before the call.
        new: ``(B,)`` the positions each example appends (:func:`appended`).
        num_new: ``T``.
        causal: the call's causal flag.

    Returns:
        ``lengths + new`` ``(B,)``, or when causal ``(B, T)``: query ``i``
        sees ``lengths[b] + min(new[b], i + 1)`` keys.
    """
    if not causal:
        return lengths + new
    seen = ops.expand_dims(ops.arange(num_new), 0) + 1  # (1, T)
    new_column = ops.expand_dims(new, 1)  # (B, 1)
    own = ops.where(ops.less(seen, new_column), seen, new_column)  # (B, T)
    return ops.expand_dims(lengths, 1) + own
