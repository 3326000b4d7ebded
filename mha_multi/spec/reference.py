"""The float64 reference: the spec evaluated in numpy, and the checked inputs it shares.

:func:`reference_forward` runs the same spec functions as every backend, with
:class:`~mha_multi.spec.ops.NumpyOps` in float64. The hand-derived gradients
and the cached form, written apart from the layer's code so that they check
it, are in :mod:`mha_multi.spec.reference_gradients` and
:mod:`mha_multi.spec.reference_cached`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mha_multi.spec.attention import apply_head_mask, attention, check_head_mask
from mha_multi.spec.checks import Heads, check_inputs, heads_of_weights
from mha_multi.spec.ops import NumpyOps
from mha_multi.spec.options import LayerOptions, check_bias, check_positions
from mha_multi.spec.positions import call_positions
from mha_multi.spec.rotary import Rotary, rotate


def linear(x: np.ndarray, weights: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    y = x @ weights[f"W_{name}"]
    bias = weights.get(f"b_{name}")
    return y if bias is None else y + bias


def as_float64(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def checked_inputs(
    weights: Mapping[str, Any],
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any,
    num_heads: int,
    num_kv_heads: int | None,
    causal: Any,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, Heads]:
    """Float64 copies of the reference's arguments, checked; and the head layout."""
    w = {name: as_float64(value) for name, value in weights.items()}
    queries, keys, values = (as_float64(x) for x in (queries, keys, values))
    lens = None if valid_lens is None else np.asarray(valid_lens)
    check_inputs(
        queries.shape,
        keys.shape,
        values.shape,
        None if lens is None else lens.shape,
        query_size=w["W_q"].shape[0],
        key_size=w["W_k"].shape[0],
        value_size=w["W_v"].shape[0],
        causal=causal,
    )
    heads = heads_of_weights(w, num_heads, num_kv_heads=num_kv_heads)
    return w, queries, keys, values, lens, heads


def checked_positions(
    positions: Any, batch: int, num_queries: int, num_keys: int | None
) -> np.ndarray | None:
    """A call's ``positions`` as int64 numpy, checked (:func:`check_positions`)."""
    if positions is None:
        return None
    array = np.asarray(positions)
    check_positions(
        array.shape, array.dtype.kind, batch=batch, num_queries=num_queries, num_keys=num_keys
    )
    return array.astype(np.int64)


def checked_bias(
    bias: Any, heads: Heads, batch: int, num_queries: int, num_keys: int
) -> np.ndarray | None:
    """A call's ``bias`` as float64 numpy, checked (:func:`check_bias`)."""
    if bias is None:
        return None
    array = np.asarray(bias)
    check_bias(
        array.shape,
        array.dtype.kind,
        batch=batch,
        num_heads=heads.num_heads,
        num_queries=num_queries,
        num_keys=num_keys,
    )
    return array.astype(np.float64)


def projections(
    w: Mapping[str, np.ndarray],
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    heads: Heads,
    rotary: Rotary | None,
    positions: np.ndarray | None,
) -> dict[str, np.ndarray]:
    """The projected ``q``, ``k``, ``v`` of an uncached call, ``q`` and ``k`` rotated."""
    projected = {"q": linear(queries, w, "q"), "k": linear(keys, w, "k")}
    projected["v"] = linear(values, w, "v")
    if rotary is not None:
        ops = NumpyOps()
        query_positions, key_positions = call_positions(
            ops, positions, num_queries=queries.shape[1], num_keys=keys.shape[1]
        )
        projected["q"] = rotate(
            ops, projected["q"], query_positions, rotary, heads.num_heads, heads.head_dim
        )
        projected["k"] = rotate(
            ops, projected["k"], key_positions, rotary, heads.num_kv_heads, heads.head_dim
        )
    return projected


def reference_forward(
    weights: Mapping[str, Any],
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
    head_mask: Any = None,
    positions: Any = None,
    bias: Any = None,
    **options: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """The spec evaluated in float64 numpy.

    Args:
        weights: canonical weights (``W_q``... in ``x @ W + b`` orientation).
        queries: ``(B, Q, query_size)``.
        keys: ``(B, K, key_size)``.
        values: ``(B, K, value_size)``.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``.
        num_heads: number of (query) heads; ``head_dim`` is ``W_q``'s width
            over it.
        num_kv_heads: number of key/value heads; ``None`` infers it from
            ``W_k``'s width (``num_heads`` for multi-head attention).
        causal: bottom-right aligned causal mask.
        head_mask: ``None``, ``(H,)`` or ``(B, H)`` gates of the heads'
            context (:func:`apply_head_mask`).
        positions: ``None`` or integer ``(B, Q)``: the rotary positions of
            the queries and (``K == Q``) the keys; ``None`` for ``arange``.
        bias: ``None``, or floating, broadcastable to ``(B, H, Q, K)``.
        **options: the layer's options, ``rotary``, ``alibi``, ``window``
            and ``softcap`` (:class:`LayerOptions`).

    Returns:
        ``(output, attention_weights)``: ``(B, Q, num_hiddens)`` and
        ``(B, H, Q, K)``, float64.

    Raises:
        TypeError, ValueError: a bad argument, named.
    """
    layer = LayerOptions.of(options)
    w, queries, keys, values, lens, heads = checked_inputs(
        weights, queries, keys, values, valid_lens, num_heads, num_kv_heads, causal
    )
    batch, num_queries = queries.shape[:2]
    num_keys = keys.shape[1]
    gates = checked_head_mask(head_mask, heads, batch)
    positions = checked_positions(positions, batch, num_queries, num_keys)
    bias = checked_bias(bias, heads, batch, num_queries, num_keys)
    # Non-finite inputs propagate by design (docs: "Edge cases"); numpy's warnings
    # about them would only be noise.
    with np.errstate(invalid="ignore", over="ignore"):
        projected = projections(w, queries, keys, values, heads, layer.rotary, positions)
        context, attention_weights = attention(
            NumpyOps(),
            projected["q"],
            projected["k"],
            projected["v"],
            lens,
            num_heads=heads.num_heads,
            head_dim=heads.head_dim,
            num_kv_heads=heads.num_kv_heads,
            causal=causal,
            options=layer.score_options(num_heads=heads.num_heads, bias=bias),
        )
        context = apply_head_mask(NumpyOps(), context, gates, heads.num_heads)
        return linear(context, w, "o"), attention_weights


def checked_head_mask(head_mask: Any, heads: Heads, batch: int) -> np.ndarray | None:
    if head_mask is None:
        return None
    gates = np.asarray(head_mask)
    check_head_mask(gates.shape, gates.dtype.kind, num_heads=heads.num_heads, batch=batch)
    return gates.astype(np.float64)
