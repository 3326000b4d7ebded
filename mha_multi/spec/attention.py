"""The attention itself: scores, the masked softmax, heads' weights and context, head gates.

Hidden scores are *replaced* by :data:`MASK_VALUE` (d2l's rule), so a row
whose keys are all hidden gets uniform weights ``1/K`` (a layer with sinks puts
it on the sink); fused kernels get that value back with
:func:`fix_fully_hidden_rows`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from mha_multi.spec import layout
from mha_multi.spec.checks import one_of
from mha_multi.spec.ops import Array, ArrayOps
from mha_multi.spec.options import NO_OPTIONS, ScoreOptions
from mha_multi.spec.positions import adjust_scores, visibility
from mha_multi.spec.sinks import sink_column

#: Hidden scores are *replaced* by this value before the softmax (d2l's rule).
#: A row whose keys are all hidden therefore gets uniform weights ``1/K`` (with
#: attention sinks: puts its weight on the sink, :mod:`mha_multi.spec.sinks`).
MASK_VALUE = -1e6


def is_low_precision(ops: ArrayOps, dtype: Any) -> bool:
    """Whether ``dtype`` is a 16-bit float (float16, bfloat16)."""
    return ops.dtype_kind(dtype) == "f" and ops.itemsize(dtype) < 4


def masked_softmax(
    ops: ArrayOps,
    scores: Array,
    visible: Array | None,
    dtype: Any = None,
    sinks: Array | None = None,
) -> Array:
    """Softmax over the last axis with hidden scores replaced by ``MASK_VALUE``.

    Hidden scores are *replaced*, so a NaN or inf score of a hidden key does
    not reach the weights.

    Args:
        scores: ``(B, H, Q, K)``.
        visible: ``None`` or a boolean array broadcastable to ``scores``.
        dtype: the dtype of the weights; ``None`` keeps that of ``scores``.
        sinks: ``None``, or the ``(H,)`` sink logits of these heads: each
            row's softmax then runs over its scores and one more column
            holding its head's logit, never masked, and that column is
            dropped from the weights (:mod:`mha_multi.spec.sinks`).

    Returns:
        Weights of ``dtype``. 16-bit scores are softmaxed in float32
        (``-1e6`` overflows float16) and the weights rounded once.
    """
    dtype = ops.dtype(scores) if dtype is None else dtype
    if is_low_precision(ops, ops.dtype(scores)):
        scores = ops.cast(scores, ops.float32())
    if visible is not None:
        scores = ops.where(visible, scores, MASK_VALUE)
    if sinks is None:
        weights = ops.softmax(scores)
    else:
        joined = ops.concat_last([scores, sink_column(ops, scores, sinks)])
        weights = ops.slice_last(ops.softmax(joined), 0, -1)
    return weights if ops.dtype(weights) == dtype else ops.cast(weights, dtype)


def fix_fully_hidden_rows(
    ops: ArrayOps,
    output: Array,
    values: Array,
    visible: Array | None,
    *,
    heads_axis: int,
    group_size: int = 1,
) -> Array:
    """Gives a fused kernel's fully hidden rows the spec's value.

    Fused kernels mask with ``-inf`` and return 0 (or NaN) for a query that
    sees no key. The spec replaces hidden scores by ``MASK_VALUE``, so such a
    row has uniform weights ``1/K`` and its output is the mean of all value
    rows; its gradient flows to every value row and to no query or key, which
    selecting the mean reproduces. Rows with a visible key are untouched.

    Args:
        ops: the array-ops adapter.
        output: per-head output, ``(B, H, Q, dh)`` when ``heads_axis == 1`` or
            ``(B, Q, H, dh)`` when ``heads_axis == 2``.
        values: per-head values in the same layout, ``K`` in place of ``Q``.
        visible: what :func:`visibility` returned for these shapes.
        heads_axis: where the heads axis is, 1 or 2.
        group_size: query heads per key/value head (grouped-query
            attention): ``values`` then has ``H / group_size`` heads, and a
            fully hidden row of query head ``h`` is the mean of key/value
            head ``h // group_size``, broadcast over its group (no value is
            repeated).

    Returns:
        ``output`` with fully hidden rows replaced.
    """
    if visible is None:
        return output
    hidden = ops.logical_not(ops.any_last(visible))  # (B, 1, Q|1, 1) or (Q, 1)
    if heads_axis == 2:
        if ops.ndim(hidden) == 4:
            hidden = ops.permute(hidden, (0, 2, 1, 3))  # (B, Q|1, 1, 1)
        else:
            hidden = ops.expand_dims(hidden, -1)  # (Q, 1, 1)
        keys_axis = 1
    elif heads_axis == 1:
        keys_axis = 2
    else:
        raise ValueError(f"heads_axis must be 1 or 2; got {heads_axis}")
    means = ops.mean(values, keys_axis)
    if group_size == 1:
        return ops.where(hidden, means, output)
    # Heads axis h -> (h // G, h % G): a group axis of size G for the means
    # and the hidden rows to broadcast over.
    grouped = ops.split_axis(output, heads_axis, (-1, group_size))
    means = ops.expand_dims(means, heads_axis + 1)
    if ops.ndim(hidden) == 4 or heads_axis == 2:
        hidden = ops.expand_dims(hidden, heads_axis + 1)
    return ops.merge_axes(ops.where(hidden, means, grouped), heads_axis)


def scaled_scores(ops: ArrayOps, q: Array, k: Array, head_dim: int) -> Array:
    """``(q @ k^T) / sqrt(head_dim)`` for ``(B*H, T, dh)`` heads (d2l's order).

    16-bit heads give float32 scores: the products of two 16-bit numbers are
    exact in float32 and the sum is accumulated there, so the scores of
    inputs of magnitude 300 (about 1e5) cannot overflow float16 on their way
    into the float32 softmax.
    """
    if is_low_precision(ops, ops.dtype(q)):
        q, k = ops.cast(q, ops.float32()), ops.cast(k, ops.float32())
    return ops.matmul_swapped(q, k) / math.sqrt(head_dim)


def attention(
    ops: ArrayOps,
    q: Array,
    k: Array,
    v: Array,
    valid_lens: Array | None,
    *,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
    dropout: Callable[[Array], Array] | None = None,
    kv_split: bool = False,
    options: ScoreOptions = NO_OPTIONS,
) -> tuple[Array, Array]:
    """Multi-head scaled dot-product attention on projected inputs.

    Args:
        ops: the array-ops adapter.
        q: projected queries ``(B, Q, num_heads * head_dim)``.
        k: projected keys ``(B, K, num_kv_heads * head_dim)``.
        v: projected values ``(B, K, num_kv_heads * head_dim)``.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``.
        num_heads: ``H``, the query heads.
        head_dim: the size of each head (static, so that symbolic graphs
            need no shapes); scores are scaled by ``1/sqrt(head_dim)``.
        num_kv_heads: the key/value heads (``None``: ``num_heads``); query
            head ``h`` reads key/value head ``h // (num_heads // num_kv_heads)``.
        causal: bottom-right aligned causal mask, combined with ``valid_lens``.
        dropout: applied to the attention weights (training), or ``None``.
        kv_split: ``k`` and ``v`` are already split into heads,
            ``(B, num_kv_heads, K, head_dim)``, as a :class:`KVCache` holds
            them.
        options: soft-capping, bias, ALiBi, the sliding window
            (:func:`adjust_scores`, :func:`visibility`) and the heads' sink
            logits (:func:`masked_softmax`); rotary embeddings are applied to
            ``q`` and ``k`` before (:func:`rotate`).

    Returns:
        ``(context, weights)``: the concatenated heads ``(B, Q, num_heads *
        head_dim)`` before the output projection, and the pre-dropout
        attention weights ``(B, H, Q, K)``.
    """
    if num_kv_heads is not None and num_kv_heads != num_heads:
        return _grouped_attention(
            ops,
            q,
            k,
            v,
            valid_lens,
            num_heads,
            num_kv_heads,
            head_dim,
            causal,
            dropout,
            kv_split,
            options,
        )
    q = layout.transpose_qkv(ops, q, num_heads)
    k, v = (_kv_heads(ops, x, num_heads, kv_split) for x in (k, v))
    head_scores = scaled_scores(ops, q, k, head_dim)  # (B*H, Q, K)
    # Rows are b*H + h, so splitting axis 0 as (B, H) lines heads up with a
    # (B, 1, ...) mask: valid_lens repeated interleaved, never tiled.
    scores = ops.split_axis(head_scores, 0, (-1, num_heads))  # (B, H, Q, K)
    weights = _option_weights(ops, scores, valid_lens, causal, options, ops.dtype(v))
    flat_weights = ops.merge_axes(weights, 0)
    if dropout is not None:
        flat_weights = dropout(flat_weights)
    context = layout.transpose_output(ops, ops.matmul(flat_weights, v), num_heads)
    return context, weights


def attention_by_kv_heads(
    ops: ArrayOps,
    q: Array,
    k: Array,
    v: Array,
    valid_lens: Array | None,
    *,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int,
    causal: bool = False,
    kv_split: bool = False,
    vmap: Callable[..., Callable[..., Any]],
) -> tuple[Array, Array]:
    """:func:`attention` mapped over the examples and the key/value heads.

    d2l's layout merges examples and heads into one axis ``(B*H, T, dh)``,
    which a partitioner cannot split by heads: with the heads sharded over
    devices, XLA gathers the projections and every device computes every
    head. Here each example's key/value head ``j`` meets its group of query
    heads ``[j G, (j + 1) G)`` (columns ``[j G dh, (j + 1) G dh)`` of ``q``)
    in one mapped call of :func:`attention`, so the heads stay an axis of
    their own and each device attends with its own (docs: "Sharding heads").
    Every score is the same dot product: the numbers are :func:`attention`'s.
    No dropout: a mapped dropout would draw the same mask for every head.

    Args:
        ops: the array-ops adapter.
        q: projected queries ``(B, Q, num_heads * head_dim)``.
        k: projected keys ``(B, K, num_kv_heads * head_dim)``, or with
            ``kv_split`` a cache's ``(B, num_kv_heads, M, head_dim)``;
            ``v`` likewise.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``.
        num_heads, head_dim, num_kv_heads, causal: as in :func:`attention`.
        kv_split: as in :func:`attention`.
        vmap: ``jax.vmap``, or a function of its signature for the
            adapter's arrays (``in_axes``, ``out_axes``).

    Returns:
        ``(context, weights)``: ``(B, Q, num_heads * head_dim)`` and
        ``(B, H, Q, K)``, as :func:`attention` returns them.
    """
    group_size = num_heads // num_kv_heads
    q = ops.split_axis(q, 2, (num_kv_heads, group_size * head_dim))  # (B, Q, H_kv, G*dh)
    if kv_split:
        kv_axis = 0  # an example's (H_kv, M, dh)
    else:
        k, v = (ops.split_axis(x, 2, (num_kv_heads, head_dim)) for x in (k, v))
        kv_axis = 1  # an example's (K, H_kv, dh)

    def one_group(q: Array, k: Array, v: Array, lens: Array | None) -> tuple[Array, Array]:
        # One example (a batch of 1) and one key/value head: multi-head attention.
        context, weights = attention(
            ops,
            ops.expand_dims(q, 0),
            ops.expand_dims(k, 0),
            ops.expand_dims(v, 0),
            None if lens is None else ops.expand_dims(lens, 0),
            num_heads=group_size,
            head_dim=head_dim,
            num_kv_heads=1,
            causal=causal,
        )
        return ops.merge_axes(context, 0), ops.merge_axes(weights, 0)

    per_group = vmap(one_group, in_axes=(1, kv_axis, kv_axis, None), out_axes=(1, 0))
    lens_axis = None if valid_lens is None else 0
    per_example = vmap(per_group, in_axes=(0, 0, 0, lens_axis), out_axes=(0, 0))
    context, weights = per_example(q, k, v, valid_lens)  # (B, Q, H_kv, G*dh), (B, H_kv, G, Q, K)
    return ops.merge_axes(context, 2), ops.merge_axes(weights, 1)


def _grouped_attention(
    ops: ArrayOps,
    q: Array,
    k: Array,
    v: Array,
    valid_lens: Array | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    causal: bool,
    dropout: Callable[[Array], Array] | None,
    kv_split: bool,
    options: ScoreOptions,
) -> tuple[Array, Array]:
    """:func:`attention` with ``num_kv_heads < num_heads``, no key or value repeated.

    Each key/value head meets its group of query heads in one product
    (:func:`transpose_grouped_queries`); every score is the same dot product
    as with the key/value heads repeated, so the numbers are those of
    multi-head attention on repeated heads.
    """
    group_size = num_heads // num_kv_heads
    q = layout.transpose_grouped_queries(ops, q, num_kv_heads, group_size)  # (B*H_kv, G*Q, dh)
    k, v = (_kv_heads(ops, x, num_kv_heads, kv_split) for x in (k, v))  # (B*H_kv, K, dh)
    scores = layout.grouped_to_heads(
        ops, scaled_scores(ops, q, k, head_dim), num_kv_heads, group_size
    )  # (B, H, Q, K)
    weights = _option_weights(ops, scores, valid_lens, causal, options, ops.dtype(v))
    flat_weights = layout.heads_to_grouped(ops, weights, num_kv_heads, group_size)
    if dropout is not None:
        flat_weights = dropout(flat_weights)
    context = ops.matmul(flat_weights, v)  # (B*H_kv, G*Q, dh)
    return layout.transpose_grouped_output(ops, context, num_kv_heads, group_size), weights


def _option_weights(
    ops: ArrayOps,
    scores: Array,
    valid_lens: Array | None,
    causal: bool,
    options: ScoreOptions,
    dtype: Any,
) -> Array:
    """The weights of ``(B, H, Q, K)`` scaled scores: options, masks, softmax.

    Both layouts of :func:`attention` reach the heads' scores as ``(B, H,
    Q, K)``, so each option is applied here once.
    """
    if options.adjusts_scores:
        scores = adjust_scores(ops, scores, options)
    visible = visibility(
        ops,
        ops.size(scores, 2),
        ops.size(scores, 3),
        valid_lens,
        causal=causal,
        window=options.window,
        query_positions=options.query_positions,
        segments=options.segments,
    )
    return masked_softmax(ops, scores, visible, dtype, sinks=options.sinks)


def _kv_heads(ops: ArrayOps, x: Array, num_kv_heads: int, split: bool) -> Array:
    """Keys or values as ``(B*H_kv, K, dh)``; ``split``: from ``(B, H_kv, K, dh)``."""
    return ops.merge_axes(x, 0) if split else layout.transpose_qkv(ops, x, num_kv_heads)


def check_head_mask(
    head_mask_shape: Sequence[int], head_mask_kind: str, *, num_heads: int, batch: int
) -> None:
    """Validates a ``head_mask``: ``(num_heads,)`` or ``(batch, num_heads)``, floating.

    Raises:
        TypeError: ``head_mask`` is not floating-point (numpy dtype kind ``head_mask_kind``).
        ValueError: another shape.
    """
    if head_mask_kind != "f":
        raise TypeError(
            f"head_mask must be a floating-point array; got dtype kind {head_mask_kind!r}"
        )
    shape = tuple(head_mask_shape)
    if not one_of(shape, (num_heads,), (batch, num_heads)):
        raise ValueError(
            f"head_mask must have shape (num_heads,) = ({num_heads},) or (batch, num_heads) = "
            f"({batch}, {num_heads}); got {shape}"
        )


def apply_head_mask(
    ops: ArrayOps, context: Array, head_mask: Array | None, num_heads: int
) -> Array:
    """Multiplies head ``h``'s context by ``head_mask[..., h]`` (docs: "Heads").

    The gate of Michel, Levy & Neubig (2019): the heads' concatenated context
    ``(B, Q, num_heads * head_dim)``, before ``W_o``, times ``(num_heads,)``
    or ``(B, num_heads)`` gates; a gate of 0 removes the head, and the
    gradient with respect to the gates measures each head's importance.
    A 16-bit context is gated in float32 and rounded once, so that the
    gates' gradient (a sum over examples, queries and head entries, which
    in float16 overflows where a head matters most) is taken in float32.
    """
    if head_mask is None:
        return context
    dtype = ops.dtype(context)
    low = is_low_precision(ops, dtype)
    if low:
        context = ops.cast(context, ops.float32())
    heads = ops.split_axis(context, 2, (num_heads, -1))  # (B, Q, H, dh)
    gates = ops.expand_dims(ops.cast(head_mask, ops.dtype(context)), -1)  # (1|B, H, 1)
    if ops.ndim(head_mask) == 2:
        gates = ops.expand_dims(gates, 1)  # (B, 1, H, 1)
    gated = ops.merge_axes(heads * gates, 2)
    return ops.cast(gated, dtype) if low else gated
