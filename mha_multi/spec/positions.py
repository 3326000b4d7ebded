"""Where queries and keys sit: which keys each query sees, positions, and position biases.

The masks (``valid_lens``, the causal rule, the sliding window), the positions
of a call's rows (with and without a cache) and the additive bias of the
scores (a call's ``bias`` and ALiBi), docs: "The spec" and "Positions and
biases".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mha_multi.spec.checks import check_valid_lens_dtype
from mha_multi.spec.ops import Array, ArrayOps
from mha_multi.spec.options import ScoreOptions


def visibility(
    ops: ArrayOps,
    num_queries: Any,
    num_keys: Any,
    valid_lens: Array | None,
    *,
    causal: bool = False,
    window: int | None = None,
    query_positions: Array | None = None,
    segments: Array | None = None,
) -> Array | None:
    """Which keys each query may see.

    Args:
        ops: the array-ops adapter.
        num_queries: ``Q``, as ``ops.size`` gives it (an int where known).
        num_keys: ``K``, likewise.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``, integer or floating.
            Key ``j`` is visible to query ``i`` of example ``b`` iff
            ``j < valid_lens[b]`` (or ``valid_lens[b, i]``), subnormal
            floating lengths included where the framework flushes them to
            zero (:meth:`ArrayOps.float_bits`).
        causal: additionally hide key ``j`` from query ``i`` when
            ``j > i_abs``, where ``i_abs = i + (K - Q)`` (bottom-right
            aligned) or ``query_positions[b, i]``.
        window: ``None``, or additionally hide key ``j`` from query ``i``
            unless ``i_abs - j < window`` (a sliding window; with
            ``causal`` each query sees at most ``window`` keys, itself
            included).
        query_positions: ``None``, or integer ``(B, Q)`` positions
            ``i_abs`` of the queries among the keys (a cached call's
            :func:`cache_positions`).
        segments: ``None``, or the boolean ``(B, 1, Q, K)`` visibility of
            packed sequences (:func:`mha_multi.spec.segments.segment_visibility`).

    Returns:
        ``None`` if every key is visible, else a boolean array broadcastable
        to ``(B, 1, Q, K)``: ``(B, 1, 1|Q, K)`` with lengths or query
        positions, ``(Q, K)`` with only ``causal`` and ``window``.
    """
    visible = None
    if valid_lens is not None:
        lens_dtype = ops.dtype(valid_lens)
        kind = ops.dtype_kind(lens_dtype)
        check_valid_lens_dtype(kind)
        # 16-bit floats cannot count past 256 (bf16) or 2048 (fp16) exactly.
        if kind == "f" and ops.itemsize(lens_dtype) < 4:
            valid_lens = ops.cast(valid_lens, ops.float32())
            lens_dtype = ops.dtype(valid_lens)
        key_positions = ops.arange(num_keys)  # (K,)
        positions_dtype = ops.dtype(key_positions)
        if kind in "iu" and ops.itemsize(lens_dtype) < ops.itemsize(positions_dtype):
            # Positions cast to int8 would wrap past 127: widen the lengths instead.
            valid_lens = ops.cast(valid_lens, positions_dtype)
        else:
            key_positions = ops.cast(key_positions, lens_dtype)
        lens = ops.expand_dims(valid_lens, -1)  # (B, 1) or (B, Q, 1)
        if ops.ndim(valid_lens) == 1:
            lens = ops.expand_dims(lens, -1)  # (B, 1, 1)
        bits = None if kind != "f" else ops.float_bits(lens)
        if bits is not None:
            # A positive length below the smallest normal number shows key 0 (0 < len),
            # which a framework that flushes it to zero compares as 0: its bits are
            # positive where it compares as at most 0 (NaN and inf compare as neither).
            # Such a length is 0.5 then, which shows key 0 alone. (No logical_not of a
            # comparison: TensorFlow's graph optimizer makes not(j < len) j >= len, false
            # for a NaN length, whose row then saw every key.)
            flushed = ops.logical_and(ops.less(bits * 0, bits), ops.greater_equal(lens * 0, lens))
            lens = ops.where(flushed, lens * 0 + 0.5, lens)
        visible = ops.less(key_positions, lens)
        visible = ops.expand_dims(visible, 1)  # (B, 1, 1|Q, K)
    rules = []
    if causal and query_positions is None:
        # j <= i + (K - Q)  <=>  K - 1 - j >= Q - 1 - i: distances from the end
        # need no concrete sizes.
        keys_from_end = ops.flip(ops.arange(num_keys))  # (K,)
        queries_from_end = ops.expand_dims(ops.flip(ops.arange(num_queries)), -1)
        rules.append(ops.greater_equal(keys_from_end, queries_from_end))  # (Q, K)
    elif causal:
        back = distance_back(ops, num_queries, num_keys, query_positions)
        rules.append(ops.greater_equal(back, back * 0))
    if window is not None:
        rules.append(ops.less(distance_back(ops, num_queries, num_keys, query_positions), window))
    if segments is not None:
        rules.append(segments)
    for rule in rules:
        visible = rule if visible is None else ops.logical_and(visible, rule)
    return visible


def distance_back(
    ops: ArrayOps, num_queries: Any, num_keys: Any, query_positions: Array | None = None
) -> Array:
    """``i_abs - j``: how far key ``j`` lies behind query ``i`` (negative: ahead).

    Key ``j`` sits at position ``j``; query ``i`` at ``i_abs = i + K - Q``
    (the causal rule's frame) or, given them, at ``query_positions[b, i]``.

    Returns:
        Integers ``(Q, K)``, or ``(B, 1, Q, K)`` with 2-D ``query_positions``.
    """
    if query_positions is None:
        # (K - 1 - j) - (Q - 1 - i), from the end as the causal rule: no concrete sizes.
        keys_from_end = ops.flip(ops.arange(num_keys))  # (K,)
        return keys_from_end - ops.expand_dims(ops.flip(ops.arange(num_queries)), -1)
    key_positions = ops.arange(num_keys)
    # One integer dtype: some frameworks do not mix int32 and int64.
    positions = ops.cast(query_positions, ops.dtype(key_positions))
    back = ops.expand_dims(positions, -1) - key_positions  # (B, Q, K) or (Q, K)
    return ops.expand_dims(back, 1) if ops.ndim(query_positions) == 2 else back


def cache_positions(ops: ArrayOps, lengths: Array, num_new: Any) -> Array:
    """``lengths[b] + i``: the absolute positions of a cached call's ``T`` new rows.

    Args:
        ops: the array-ops adapter.
        lengths: the cache's ``(B,)`` lengths *before* the call.
        num_new: ``T``, as ``ops.size`` gives it.

    Returns:
        ``(B, T)`` integers of ``lengths``' dtype.
    """
    steps = ops.cast(ops.arange(num_new), ops.dtype(lengths))
    return ops.expand_dims(lengths, 1) + ops.expand_dims(steps, 0)


def call_positions(
    ops: ArrayOps,
    positions: Array | None,
    *,
    num_queries: Any,
    num_keys: Any,
    lengths: Array | None = None,
) -> tuple[Array, Array]:
    """The rotary positions of a call's queries and keys.

    Given ``positions`` (checked by :func:`check_positions`) serve both:
    the keys of self-attention, or a cached call's new keys, are the
    queries' sequence. Otherwise a cached call's rows sit at
    :func:`cache_positions` (each example its own, so ragged and
    left-padded batches rotate correctly) and an uncached call's at
    ``arange(Q)`` and ``arange(K)``.

    Args:
        ops: the array-ops adapter.
        positions: the call's ``positions`` ``(B, Q)`` or ``(1, Q)``, or ``None``.
        num_queries: ``Q`` (``T`` with a cache), as ``ops.size`` gives it.
        num_keys: ``K`` of an uncached call (unused with a cache).
        lengths: the cache's lengths before the call, or ``None`` without a cache.

    Returns:
        ``(query_positions, key_positions)``, integer, ``(B|1, Q)`` or ``(Q,)``.
    """
    if positions is not None:
        return positions, positions
    if lengths is not None:
        cached = cache_positions(ops, lengths, num_queries)
        return cached, cached
    return ops.arange(num_queries), ops.arange(num_keys)


def score_bias(
    ops: ArrayOps, options: ScoreOptions, num_queries: Any, num_keys: Any, like: Array
) -> Array | None:
    """The additive bias of the scores: the call's ``bias`` plus the ALiBi term.

    ALiBi adds ``slope[h] * (j - i_abs)`` (:func:`distance_back` gives
    ``i_abs - j``), computed in float32 (float64 for float64 ``like``)
    from the host slopes. What :func:`adjust_scores` adds, and what a fused
    kernel that takes a bias is given.

    Args:
        ops: the array-ops adapter.
        options: the call's options.
        num_queries, num_keys: ``Q`` and ``K``, as ``ops.size`` gives them.
        like: an array of the dtype (and device) of the bias, such as the scores.

    Returns:
        ``None`` without bias or ALiBi, else an array of ``like``'s dtype
        broadcastable to ``(B, H, Q, K)``.
    """
    dtype = ops.dtype(like)
    bias = options.bias
    if options.alibi_slopes is not None:
        slopes = -np.asarray(options.alibi_slopes, dtype=np.float64)  # (j - i) = -(i - j)
        slopes = ops.constant(
            slopes if ops.itemsize(dtype) >= 8 else slopes.astype(np.float32), like
        )
        slopes = ops.expand_dims(ops.expand_dims(slopes, -1), -1)  # (H, 1, 1)
        back = distance_back(ops, num_queries, num_keys, options.query_positions)
        alibi = ops.cast(back, ops.dtype(slopes)) * slopes  # (H, Q, K) or (B, H, Q, K)
        bias = alibi if bias is None else alibi + ops.cast(bias, ops.dtype(alibi))
    if bias is None:
        return None
    return bias if ops.dtype(bias) == dtype else ops.cast(bias, dtype)


def adjust_scores(ops: ArrayOps, scores: Array, options: ScoreOptions) -> Array:
    """The scaled scores of every head after soft-capping and the additive bias.

    Order of docs "Positions and biases": ``softcap * tanh(s / softcap)``,
    then ``+ (bias + slope[h] * (j - i_abs))`` (:func:`score_bias`, summed
    first as a kernel given one bias sums them). The masks come after, and
    *replace* hidden scores (:func:`masked_softmax`), so a hidden key stays
    hidden whatever its bias.

    Args:
        ops: the array-ops adapter.
        scores: ``(B, H, Q, K)`` scaled scores (float32 for 16-bit inputs).
        options: the call's options.

    Returns:
        The adjusted scores, same shape and dtype.
    """
    if options.softcap is not None:
        scores = ops.tanh(scores / options.softcap) * options.softcap
    bias = score_bias(ops, options, ops.size(scores, 2), ops.size(scores, 3), scores)
    return scores if bias is None else scores + bias
