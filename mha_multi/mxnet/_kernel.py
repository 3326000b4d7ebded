"""MXNet's fused route: ``npx.sequence_mask``, its plan's facts and its call.

When the attention weights are not asked for, a call takes a faster route
to the spec's numbers (:func:`sequence_mask_attention`): the scale applied
to the queries rather than to the scores, ``batch_dot`` with the transposed
keys instead of an explicit transpose, and the mask applied by
``SequenceMask`` (which replaces hidden scores by ``MASK_VALUE``, exactly
the spec's rule) instead of a broadcast ``where``, so the softmax is MXNet's
plain (oneDNN) one. Every mask of the spec hides a suffix of the keys
(lengths and the causal rule both do), so the number of visible keys,
counted from :func:`mha_multi.spec.visibility`, is that mask's length.
Grouped key/value heads take the spec's grouped layout
(:func:`mha_multi.spec.transpose_grouped_queries`): one ``batch_dot`` per
key/value head scores its whole group, and no key or value is repeated.

The route is written on :class:`~mha_multi.mxnet._ops.MXNetOps`, so it runs
on arrays (an imperative call) and on symbols (a hybridized graph) alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from mha_multi import spec
from mha_multi.mxnet._ops import MXNetOps

__all__ = ["SEQUENCE_MASK", "sequence_mask_attention", "weights_dropout"]

Array = Any

#: The fast route's kernel: SequenceMask *replaces* hidden scores by the
#: spec's MASK_VALUE, so fully hidden rows get uniform weights, non-finite
#: hidden scores do not reach the weights, and dropout on the weights is the
#: generic path's; it has no causal flag (the rule goes into the mask).
SEQUENCE_MASK = spec.FusedKernel(
    "npx.sequence_mask",
    takes_dropout=True,
    causal_flag=False,
    replaces_hidden_scores=True,
    hidden_rows_uniform=True,
    takes_grouped_heads=True,
    # Visible keys must be a prefix of each row: packed sequences' are not.
    takes_any_mask=False,
)


def weights_dropout(ops: MXNetOps, rate: float) -> Callable[[Array], Array] | None:
    """Dropout of the attention weights at ``rate`` (``None`` at 0), by ``npx.dropout``.

    MXNet's dropout acts only while ``autograd`` records in training mode,
    so a layer with dropout passes it to every call.
    """
    if rate <= 0:
        return None

    def dropout(weights: Array) -> Array:
        return ops.npx.dropout(weights, p=rate)

    return dropout


def _batch_dot(ops: MXNetOps, a: Array, b: Array, dtype: np.dtype) -> Array:
    """``a @ b`` in ``dtype``; 16-bit accumulated in float32, as in MXNetOps.matmul."""
    if dtype.itemsize < 4:
        product = ops.npx.batch_dot(a.astype(np.float32), b.astype(np.float32))
        return product.astype(dtype)
    return ops.npx.batch_dot(a, b)


def sequence_mask_attention(
    ops: MXNetOps,
    q: Array,
    k: Array,
    v: Array,
    valid_lens: Array | None,
    plan: spec.KernelPlan,
    *,
    heads: spec.Heads,
    kv_split: bool,
    dropout_rate: float,
) -> Array:
    """Attention through MXNet's fastest CPU kernels, to the spec's numbers.

    Heads are in the spec's grouped layout (docs: "The spec", grouped
    heads): the ``G`` query heads that read key/value head ``j`` are rows
    of one ``(G*Q, dh)`` block, which meets that head's ``(K, dh)`` keys
    and values in one ``batch_dot``; with ``G = 1`` it is d2l's layout.

    Args:
        ops: the adapter of these arrays or symbols.
        q: projected queries ``(B, Q, num_heads * head_dim)``.
        k, v: projected keys and values ``(B, K, num_kv_heads * head_dim)``,
            or with ``kv_split`` ``(B, num_kv_heads, K, head_dim)`` (a cache's).
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``.
        plan: what :func:`mha_multi.call.plan` decided (the mask it needs).
        heads: the layer's head layout.
        kv_split: the layout of ``k`` and ``v``.
        dropout_rate: dropout on the weights (``npx.dropout``: in training only).

    Returns:
        The concatenated heads ``(B, Q, num_heads * head_dim)``.
    """
    dtype = ops.dtype(q)
    kv_heads, group_size = heads.num_kv_heads, heads.group_size
    low_precision = dtype.itemsize < 4
    if low_precision:
        # As spec.scaled_scores: 16-bit heads give float32 scores, which
        # stay float32 into the float32 softmax (inputs of magnitude 300
        # give scores beyond float16's range).
        q, k = q.astype(np.float32), k.astype(np.float32)
    # Scaling the queries instead of the (B*H, Q, K) scores is K / head_dim
    # times less work; it is exact when sqrt(head_dim) is a power of two
    # (head_dim 4, 16, 64, 256), and otherwise differs by rounding only.
    q = q / math.sqrt(heads.head_dim)
    q = spec.transpose_grouped_queries(ops, q, kv_heads, group_size)  # (B*H_kv, G*Q, dh)
    if kv_split:
        k, v = (ops.merge_axes(x, 0) for x in (k, v))  # (B*H_kv, K, dh)
    else:
        k, v = (spec.transpose_qkv(ops, x, kv_heads) for x in (k, v))
    scores = ops.npx.batch_dot(q, k, transpose_b=True)  # (B*H_kv, G*Q, K)
    # Row ((b*H_kv + j)*G + g)*Q + i is query i of head h = j*G + g: as
    # (B, H, Q, K), a view, the rows line up with the spec's masks.
    head_scores = spec.grouped_to_heads(ops, scores, kv_heads, group_size)  # (B, H, Q, K)
    mask = plan.mask(ops, ops.size(head_scores, 2), ops.size(head_scores, 3), valid_lens)
    if mask is not None:
        # Visible keys form a prefix of each row (lengths and the causal
        # rule hide suffixes, and so does their AND), so the number of
        # visible keys is a SequenceMask length, and SequenceMask
        # *replaces* the rest by the spec's MASK_VALUE: fully hidden rows
        # get uniform weights and hidden scores no gradient, as in the spec.
        counts = ops.np.sum(mask.astype(np.int32), axis=-1)  # (B, 1, 1|Q) or (Q,)
        rows = ops.np.zeros_like(head_scores[:, :, :, 0], dtype=np.int32)  # (B, H, Q)
        lengths = ops.npx.reshape(rows + counts, (-1,))  # (B*H*Q,), the order of scores' rows
        masked = ops.npx.sequence_mask(
            ops.npx.reshape(scores, (-5, -2)),  # (B*H*Q, K)
            lengths,
            use_sequence_length=True,
            value=spec.MASK_VALUE,
            axis=1,
        )
        scores = ops.npx.reshape_like(masked, scores)
    weights = ops.npx.softmax(scores, axis=-1)
    if low_precision:
        weights = weights.astype(dtype)
    if dropout_rate > 0:
        weights = ops.npx.dropout(weights, p=dropout_rate)
    context = _batch_dot(ops, weights, v, dtype)  # (B*H_kv, G*Q, dh)
    return spec.transpose_grouped_output(ops, context, kv_heads, group_size)
