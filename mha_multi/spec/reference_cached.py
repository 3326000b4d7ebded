"""The float64 reference of a cached call, one example, head and query at a time.

Written from the rules of the docs ("Generating with a cache", "Positions and
biases") rather than from :func:`~mha_multi.spec.cache.update_cache` and
:func:`~mha_multi.spec.positions.visibility`, so that it checks them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from mha_multi.spec.attention import MASK_VALUE
from mha_multi.spec.cache import KVCache
from mha_multi.spec.cache_checks import check_cache_values
from mha_multi.spec.checks import heads_of_weights
from mha_multi.spec.ops import NumpyOps
from mha_multi.spec.options import LayerOptions, alibi_slopes
from mha_multi.spec.reference import (
    as_float64,
    checked_bias,
    checked_head_mask,
    checked_positions,
    linear,
)
from mha_multi.spec.rotary import rotate


def reference_cached_forward(
    weights: Mapping[str, Any],
    queries: Any,
    keys: Any,
    values: Any,
    cache: KVCache,
    valid_lens: Any = None,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
    head_mask: Any = None,
    positions: Any = None,
    bias: Any = None,
    **options: Any,
) -> tuple[np.ndarray, np.ndarray, KVCache]:
    """A cached call evaluated in float64 numpy, one example, head and query at a time.

    Written without :func:`update_cache`, :func:`visibility` or
    :func:`adjust_scores`, from the rules of the docs ("Generating with a
    cache", "Positions and biases"), so that it checks them.

    Args:
        weights: canonical weights.
        queries: ``(B, T, query_size)``.
        keys: ``(B, T, key_size)``, or ``None`` to append nothing.
        values: ``(B, T, value_size)``, or ``None``.
        cache: numpy ``keys``/``values`` ``(B, num_kv_heads, M, head_dim)``
            and ``lengths`` ``(B,)``.
        valid_lens: ``None`` or ``(B,)``: new positions per example.
        num_heads, num_kv_heads: as in :func:`reference_forward`.
        causal: query ``i`` of example ``b`` sees key ``j`` only when ``j <=
            lengths[b] + i``.
        head_mask: ``None``, ``(H,)`` or ``(B, H)`` gates of the heads' context.
        positions: ``None`` or integer ``(B, T)``: the rotary positions of
            the queries and the new keys; ``None`` for ``lengths[b] + i``.
        bias: ``None``, or floating, broadcastable to ``(B, H, T, M)``.
        **options: ``rotary``, ``alibi``, ``window``, ``softcap``
            (:class:`LayerOptions`). ALiBi and the window place query ``i``
            of example ``b`` at ``lengths[b] + i`` and key ``j`` at ``j``;
            keys older than the window stay in the cache, hidden.

    Returns:
        ``(output, attention_weights, cache)``: ``(B, T, num_hiddens)``,
        ``(B, H, T, M)`` and the cache after the call (float64, lengths int32).
    """
    layer = LayerOptions.of(options)
    w = {name: as_float64(value) for name, value in weights.items()}
    heads = heads_of_weights(w, num_heads, num_kv_heads=num_kv_heads)
    queries = as_float64(queries)
    cache_keys, cache_values = (as_float64(x).copy() for x in (cache.keys, cache.values))
    lengths = np.asarray(cache.lengths).astype(np.int64)
    batch, num_new = queries.shape[:2]
    max_length = cache_keys.shape[2]
    if keys is None:
        new = np.zeros(batch, np.int64)
    else:
        new = np.full(batch, num_new) if valid_lens is None else np.asarray(valid_lens)
    check_cache_values(lengths, new, num_new, max_length)
    gates = checked_head_mask(head_mask, heads, batch)
    if gates is not None and gates.ndim == 1:
        gates = np.broadcast_to(gates, (batch, heads.num_heads))
    positions = checked_positions(positions, batch, num_new, None)
    bias = checked_bias(bias, heads, batch, num_new, max_length)
    if bias is not None:
        bias = np.broadcast_to(bias, (batch, heads.num_heads, num_new, max_length))
    slopes = alibi_slopes(heads.num_heads) if layer.alibi else None
    if positions is None:
        positions = lengths[:, None] + np.arange(num_new)  # each example's own positions
    ops = NumpyOps()
    dh, group = heads.head_dim, heads.group_size
    with np.errstate(invalid="ignore", over="ignore"):
        q = linear(queries, w, "q")
        if layer.rotary is not None:
            q = rotate(ops, q, positions, layer.rotary, heads.num_heads, dh)
        if keys is not None:
            projected_k = linear(as_float64(keys), w, "k")
            if layer.rotary is not None:  # keys enter the cache rotated
                projected_k = rotate(
                    ops, projected_k, positions, layer.rotary, heads.num_kv_heads, dh
                )
            projected_k = projected_k.reshape(
                batch, num_new, -1 if num_new else heads.num_kv_heads, dh
            )
            projected_v = linear(as_float64(values), w, "v").reshape(
                batch, num_new, -1 if num_new else heads.num_kv_heads, dh
            )
            for b in range(batch):
                start, stop = lengths[b], lengths[b] + new[b]
                cache_keys[b, :, start:stop] = projected_k[b, : new[b]].transpose(1, 0, 2)
                cache_values[b, :, start:stop] = projected_v[b, : new[b]].transpose(1, 0, 2)
        q = q.reshape(batch, num_new, heads.num_heads, dh)
        attention_weights = np.zeros((batch, heads.num_heads, num_new, max_length))
        context = np.zeros((batch, num_new, heads.num_heads, dh))
        key_positions = np.arange(max_length)
        # An empty cache (max_length 0) has no key: the context is 0, as with K = 0.
        for b in range(batch if max_length else 0):
            for i in range(num_new):
                at = lengths[b] + i  # the query's position among the keys
                seen = lengths[b] + (min(new[b], i + 1) if causal else new[b])
                visible = key_positions < seen
                if layer.window is not None:
                    visible &= at - key_positions < layer.window
                for h in range(heads.num_heads):
                    scores = cache_keys[b, h // group] @ q[b, i, h] / math.sqrt(dh)
                    if layer.softcap is not None:
                        scores = layer.softcap * np.tanh(scores / layer.softcap)
                    if bias is not None:
                        scores = scores + bias[b, h, i]
                    if slopes is not None:
                        scores = scores + slopes[h] * (key_positions - at)
                    scores = np.where(visible, scores, MASK_VALUE)
                    row = np.exp(scores - scores.max())
                    row = row / row.sum()
                    attention_weights[b, h, i] = row
                    context[b, i, h] = row @ cache_values[b, h // group]
                    if gates is not None:
                        context[b, i, h] *= gates[b, h]
        output = linear(context.reshape(batch, num_new, heads.query_features), w, "o")
    updated = KVCache(cache_keys, cache_values, (lengths + new).astype(np.int32))
    return output, attention_weights, updated
