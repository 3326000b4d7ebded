"""The float64 reference: the spec evaluated in numpy, and its gradients derived by hand.

:func:`reference_forward` runs the same spec functions as every backend, with
:class:`~mha_multi.spec.ops.NumpyOps` in float64; :func:`reference_gradients`
is its backward pass written out, with no autodiff framework, so it checks
every backend's gradients. :func:`reference_cached_forward` is a cached call
computed one example, head and query at a time from the rules of the docs
("Generating with a cache", "Positions and biases") rather than from
:func:`~mha_multi.spec.update_cache` or :func:`~mha_multi.spec.visibility`,
so that it checks them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from mha_multi.spec import layout
from mha_multi.spec.attention import (
    MASK_VALUE,
    apply_head_mask,
    attention,
    check_head_mask,
    masked_softmax,
    scaled_scores,
)
from mha_multi.spec.cache import KVCache
from mha_multi.spec.cache_checks import check_cache_values, check_cached_call
from mha_multi.spec.checks import Heads, check_inputs, heads_of_weights
from mha_multi.spec.norms import QKNorm, rms_norm, rms_norm_backward
from mha_multi.spec.ops import NumpyOps
from mha_multi.spec.options import (
    LayerOptions,
    alibi_slopes,
    check_bias,
    check_positions,
    positions_on_host,
)
from mha_multi.spec.positions import adjust_scores, call_positions, visibility
from mha_multi.spec.rotary import Rotary, rotate
from mha_multi.spec.segments import checked_segment_ids, reference_segments
from mha_multi.spec.sinks import sink_logits_of, sink_softmax_backward, sink_weights


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
    array = positions_on_host(positions)
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


def call_length(positions: Any, num_queries: int, num_keys: int) -> int:
    """A call's rotary length (docs: "Positions and biases"): its largest position + 1.

    Over the whole batch, the queries' and the keys' positions
    (``arange(Q)`` and ``arange(K)`` without ``positions``; a pair: each
    side's own); 0 for none.
    """
    if positions is None:
        return max(num_queries, num_keys)
    every = np.concatenate(
        [np.ravel(p) for p in (positions if isinstance(positions, tuple) else [positions])]
    )
    return int(every.max()) + 1 if every.size else 0


def rotary_positions(
    ops: NumpyOps, positions: Any, num_queries: int, num_keys: int
) -> tuple[Any, Any]:
    """The queries' and the keys' rotary positions: a pair as it is (packed sequences'), else
    :func:`call_positions`."""
    if isinstance(positions, tuple):
        return positions
    return call_positions(ops, positions, num_queries=num_queries, num_keys=num_keys)


def projections(
    w: Mapping[str, np.ndarray],
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    heads: Heads,
    rotary: Rotary | None,
    positions: Any,
    qk_norm: QKNorm | None = None,
) -> dict[str, np.ndarray]:
    """The projected ``q``, ``k``, ``v`` of an uncached call, ``q`` and ``k`` normalised
    (``qk_norm``) and rotated."""
    projected = {"q": linear(queries, w, "q"), "k": linear(keys, w, "k")}
    projected["v"] = linear(values, w, "v")
    if qk_norm is not None:
        projected["q"] = normed(w, projected["q"], "q", qk_norm, heads)
        projected["k"] = normed(w, projected["k"], "k", qk_norm, heads)
    if rotary is not None:
        ops = NumpyOps()
        query_positions, key_positions = rotary_positions(
            ops, positions, queries.shape[1], keys.shape[1]
        )
        length = call_length(positions, queries.shape[1], keys.shape[1])
        for name, at, count in (
            ("q", query_positions, heads.num_heads),
            ("k", key_positions, heads.num_kv_heads),
        ):
            projected[name] = rotate(
                ops, projected[name], at, rotary, count, heads.head_dim, length=length
            )
    return projected


def normed(
    w: Mapping[str, np.ndarray], x: np.ndarray, name: str, qk_norm: QKNorm, heads: Heads
) -> np.ndarray:
    """The projection ``name`` (``"q"`` or ``"k"``) through its norm (:func:`rms_norm`)."""
    count = heads.num_heads if name == "q" else heads.num_kv_heads
    return rms_norm(NumpyOps(), x, w[f"{name}_norm"], qk_norm, count, heads.head_dim)


def reference_forward(
    weights: Mapping[str, Any],
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    segment_ids: Any = None,
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
        weights: canonical weights (``W_q``... in ``x @ W + b`` orientation;
            ``sinks`` with ``sinks=True``).
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
        segment_ids: ``None``, or integer ``(B, Q)`` ids of packed sequences
            (a tuple ``(query_ids, key_ids)`` where the keys have their own):
            query ``i`` sees key ``j`` only when their ids are equal and not
            negative; rotary positions restart at each sequence unless
            ``positions`` are given (:mod:`mha_multi.spec.segments`).
        **options: the layer's options, ``rotary``, ``alibi``, ``window``,
            ``softcap``, ``sinks`` and ``qk_norm`` (:class:`LayerOptions`); with
            ``qk_norm``, ``weights`` hold ``q_norm`` and ``k_norm``.

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
    ids = checked_segment_ids(segment_ids, batch=batch, num_queries=num_queries, num_keys=num_keys)
    positions, segments = reference_segments(ids, positions, layer.rotary is not None)
    # Non-finite inputs propagate by design (docs: "Edge cases"); numpy's warnings
    # about them would only be noise.
    with np.errstate(invalid="ignore", over="ignore"):
        projected = projections(
            w, queries, keys, values, heads, layer.rotary, positions, layer.qk_norm
        )
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
            options=layer.score_options(num_heads=heads.num_heads, bias=bias)
            .with_sinks(sink_logits_of(w, layer.sinks, heads.num_heads))
            .with_segments(segments),
        )
        context = apply_head_mask(NumpyOps(), context, gates, heads.num_heads)
        return linear(context, w, "o"), attention_weights


def checked_head_mask(head_mask: Any, heads: Heads, batch: int) -> np.ndarray | None:
    if head_mask is None:
        return None
    gates = np.asarray(head_mask)
    check_head_mask(gates.shape, gates.dtype.kind, num_heads=heads.num_heads, batch=batch)
    return gates.astype(np.float64)


def _sum_to_shape(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The gradient of a broadcast: ``x`` summed over the axes ``shape`` was broadcast along."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    axes = tuple(axis for axis, size in enumerate(shape) if size == 1 and x.shape[axis] != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


def reference_gradients(
    weights: Mapping[str, Any],
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
    output_gradient: Any,
    head_mask: Any = None,
    positions: Any = None,
    bias: Any = None,
    segment_ids: Any = None,
    **options: Any,
) -> dict[str, np.ndarray]:
    """Float64 vector-Jacobian product of :func:`reference_forward`.

    The backward pass is derived by hand (no autodiff framework), so it is an
    independent check of every backend's gradients. Hidden scores are
    replaced by a constant, so they receive no gradient (nor does the bias
    there). A rotation's transpose is the rotation by the opposite angles;
    soft-capping's derivative is ``1 - tanh(s / c) ** 2``; the query/key
    norms' is :func:`rms_norm_backward`; the sinks' is
    :func:`~mha_multi.spec.sinks.sink_softmax_backward`'s.

    Args:
        weights, queries, keys, values, valid_lens, num_heads, num_kv_heads, causal: as in
            :func:`reference_forward`.
        output_gradient: the cotangent of the output, ``(B, Q, num_hiddens)``.
        head_mask: as in :func:`reference_forward`; its gradient is returned
            too.
        positions, bias, segment_ids: as in :func:`reference_forward`; the
            gradient of ``bias`` is returned too, in its shape.
        **options: as in :func:`reference_forward`.

    Returns:
        Gradients keyed ``queries``, ``keys``, ``values``, every weight name
        and, with a ``head_mask``, ``head_mask``, with a ``bias``, ``bias``.
    """
    ops = NumpyOps()
    layer = LayerOptions.of(options)
    w, queries, keys, values, lens, heads = checked_inputs(
        weights, queries, keys, values, valid_lens, num_heads, num_kv_heads, causal
    )
    batch, num_queries = queries.shape[:2]
    num_keys = keys.shape[1]
    positions = checked_positions(positions, batch, num_queries, num_keys)
    bias = checked_bias(bias, heads, batch, num_queries, num_keys)
    ids = checked_segment_ids(segment_ids, batch=batch, num_queries=num_queries, num_keys=num_keys)
    positions, segments = reference_segments(ids, positions, layer.rotary is not None)
    head_dim = heads.head_dim
    grad_out = as_float64(output_gradient)
    scale = 1.0 / math.sqrt(head_dim)

    projected = projections(w, queries, keys, values, heads, layer.rotary, positions, layer.qk_norm)
    # The grouped layout (docs: "The spec"): (B*H_kv, G*Q, dh) queries against
    # (B*H_kv, K, dh) keys and values; with G = 1 it is d2l's (B*H, Q, dh).
    kv_heads, group = heads.num_kv_heads, heads.group_size
    q = layout.transpose_grouped_queries(ops, projected["q"], kv_heads, group)
    k, v = (layout.transpose_qkv(ops, projected[n], kv_heads) for n in "kv")
    raw_scores = layout.grouped_to_heads(ops, scaled_scores(ops, q, k, head_dim), kv_heads, group)
    sinks = sink_logits_of(w, layer.sinks, heads.num_heads)
    score_options = layer.score_options(num_heads=heads.num_heads, bias=bias).with_sinks(sinks)
    scores = adjust_scores(ops, raw_scores, score_options)  # (B, H, Q, K)
    visible = visibility(
        ops,
        num_queries,
        num_keys,
        lens,
        causal=causal,
        window=score_options.window,
        segments=segments,
    )
    if sinks is None:
        attn = layout.heads_to_grouped(ops, masked_softmax(ops, scores, visible), kv_heads, group)
    else:  # the sink's weight too, for the logits' gradient
        masked = scores if visible is None else np.where(visible, scores, MASK_VALUE)
        head_attn, sink_weight = sink_weights(masked, sinks)
        attn = layout.heads_to_grouped(ops, head_attn, kv_heads, group)
    context = layout.transpose_grouped_output(ops, attn @ v, kv_heads, group)
    gates = checked_head_mask(head_mask, heads, batch)

    grads: dict[str, np.ndarray] = {}
    grads["W_o"] = np.einsum(
        "bqi,bqj->ij", apply_head_mask(ops, context, gates, heads.num_heads), grad_out
    )
    if "b_o" in w:
        grads["b_o"] = grad_out.sum(axis=(0, 1))
    grad_context = grad_out @ w["W_o"].T  # (B, Q, H*dh), of the gated context
    if gates is not None:
        # d(context_h * gate_h): the gate's gradient sums its head's products,
        # over the batch too for one gate per head.
        per_head = (grad_context * context).reshape(
            *context.shape[:2], heads.num_heads, heads.head_dim
        )
        grad_gates = per_head.sum(axis=(1, 3))  # (B, H)
        grads["head_mask"] = grad_gates if gates.ndim == 2 else grad_gates.sum(axis=0)
        grad_context = apply_head_mask(ops, grad_context, gates, heads.num_heads)
    grad_heads = layout.transpose_grouped_queries(ops, grad_context, kv_heads, group)
    grad_attn = grad_heads @ np.swapaxes(v, -1, -2)  # d(attn @ v) / d attn
    # A key/value head's gradient sums over its whole group (the G*Q rows).
    grad_v = np.swapaxes(attn, -1, -2) @ grad_heads
    if sinks is None:
        grad_scores = attn * (grad_attn - (grad_attn * attn).sum(axis=-1, keepdims=True))
        grad_scores = layout.grouped_to_heads(ops, grad_scores, kv_heads, group)  # (B, H, Q, K)
    else:
        grad_scores, grads["sinks"] = sink_softmax_backward(
            head_attn, sink_weight, layout.grouped_to_heads(ops, grad_attn, kv_heads, group)
        )
    if visible is not None:
        grad_scores = np.where(visible, grad_scores, 0.0)
    if bias is not None:
        grads["bias"] = _sum_to_shape(grad_scores, bias.shape)  # the bias is added
    if layer.softcap is not None:
        grad_scores = grad_scores * (1.0 - np.tanh(raw_scores / layer.softcap) ** 2)
    grad_scores = layout.heads_to_grouped(ops, grad_scores, kv_heads, group)
    grad_q = grad_scores @ k * scale
    grad_k = np.swapaxes(grad_scores, -1, -2) @ q * scale

    inputs = {"q": ("queries", queries), "k": ("keys", keys), "v": ("values", values)}
    projected_grads = {
        "q": layout.transpose_grouped_output(ops, grad_q, kv_heads, group),
        "k": layout.transpose_output(ops, grad_k, kv_heads),
        "v": layout.transpose_output(ops, grad_v, kv_heads),
    }
    if layer.rotary is not None:
        query_positions, key_positions = rotary_positions(ops, positions, num_queries, num_keys)
        for name, at, count in (
            ("q", query_positions, heads.num_heads),
            ("k", key_positions, kv_heads),
        ):
            projected_grads[name] = rotate(
                ops,
                projected_grads[name],
                at,
                layer.rotary,
                count,
                head_dim,
                inverse=True,
                length=call_length(positions, num_queries, num_keys),
            )
    if layer.qk_norm is not None:
        for name in "qk":
            before = linear(inputs[name][1], w, name)
            projected_grads[name], grads[f"{name}_norm"] = rms_norm_backward(
                before, w[f"{name}_norm"], layer.qk_norm, head_dim, projected_grads[name]
            )
    for name, grad_projected in projected_grads.items():
        input_name, x = inputs[name]
        grads[f"W_{name}"] = np.einsum("bti,btj->ij", x, grad_projected)
        if f"b_{name}" in w:
            grads[f"b_{name}"] = grad_projected.sum(axis=(0, 1))
        grads[input_name] = grad_projected @ w[f"W_{name}"].T
    return grads


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
        **options: ``rotary``, ``alibi``, ``window``, ``softcap``, ``sinks``,
            ``qk_norm`` (:class:`LayerOptions`). ALiBi and the window place query ``i``
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
    lens = None if valid_lens is None else np.asarray(valid_lens)
    lengths = np.asarray(cache.lengths).astype(np.int64)  # (as a harness hands them: any)
    # (The layers' checks of a cached call, on the same shapes and dtypes.)
    check_cached_call(
        queries,
        None if keys is None else np.asarray(keys),
        None if values is None else np.asarray(values),
        lens,
        KVCache(cache_keys, cache_values, lengths),
        heads=heads,
        dtype_kind=lambda dtype: np.dtype(dtype).kind,
        itemsize=lambda dtype: np.dtype(dtype).itemsize,
        causal=causal,
    )
    batch, num_new = queries.shape[:2]
    max_length = cache_keys.shape[2]
    if keys is None:
        new = np.zeros(batch, np.int64)
    else:
        new = np.full(batch, num_new) if lens is None else lens
    check_cache_values(lengths, new, num_new, max_length)
    gates = checked_head_mask(head_mask, heads, batch)
    if gates is not None and gates.ndim == 1:
        gates = np.broadcast_to(gates, (batch, heads.num_heads))
    positions = checked_positions(positions, batch, num_new, None)
    bias = checked_bias(bias, heads, batch, num_new, max_length)
    if bias is not None:
        bias = np.broadcast_to(bias, (batch, heads.num_heads, num_new, max_length))
    slopes = alibi_slopes(heads.num_heads) if layer.alibi else None
    sinks = sink_logits_of(w, layer.sinks, heads.num_heads)
    if positions is None:
        positions = lengths[:, None] + np.arange(num_new)  # each example's own positions
    ops = NumpyOps()
    dh, group = heads.head_dim, heads.group_size
    with np.errstate(invalid="ignore", over="ignore"):
        q = linear(queries, w, "q")
        if layer.qk_norm is not None:
            q = normed(w, q, "q", layer.qk_norm, heads)
        # Keys already in the cache keep the angles they were written with.
        length = call_length(positions, num_new, num_new)
        if layer.rotary is not None:
            q = rotate(ops, q, positions, layer.rotary, heads.num_heads, dh, length=length)
        if keys is not None:
            projected_k = linear(as_float64(keys), w, "k")
            if layer.qk_norm is not None:  # before the rotation, as every key
                projected_k = normed(w, projected_k, "k", layer.qk_norm, heads)
            if layer.rotary is not None:  # keys enter the cache rotated
                projected_k = rotate(
                    ops, projected_k, positions, layer.rotary, heads.num_kv_heads, dh, length=length
                )
            # (Sizes spelled out: no -1 is inferred for an empty batch or call.)
            projected_k = projected_k.reshape(batch, num_new, heads.num_kv_heads, dh)
            projected_v = linear(as_float64(values), w, "v").reshape(
                batch, num_new, heads.num_kv_heads, dh
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
                    if sinks is not None:  # one more column, dropped (docs: "Positions ...")
                        scores = np.append(scores, sinks[h])
                    row = np.exp(scores - scores.max())
                    row = (row / row.sum())[:max_length]
                    attention_weights[b, h, i] = row
                    context[b, i, h] = row @ cache_values[b, h // group]
                    if gates is not None:
                        context[b, i, h] *= gates[b, h]
        output = linear(context.reshape(batch, num_new, heads.query_features), w, "o")
    updated = KVCache(cache_keys, cache_values, (lengths + new).astype(np.int32))
    return output, attention_weights, updated
