"""Attention sinks: each head's learned logit joins every query's softmax (gpt-oss).

With ``sinks=True`` head ``h`` has a learned logit ``sinks[h]``. The softmax
of every query row runs over the row's scores (options applied, hidden ones
replaced by :data:`~mha_multi.spec.MASK_VALUE`) plus one extra column holding
``sinks[h]``, which is never masked, soft-capped or biased. The real keys get
the weights that softmax gives them, which sum to less than 1; the sink takes
its share and contributes no value. A row whose keys are all hidden therefore
puts (within ``exp(-1e6)``) all its weight on the sink, and its context is 0
(docs: "Positions and biases"). This is transformers' gpt-oss
``eager_attention_forward``: the logits concatenated, the row's maximum
subtracted, the softmax, the sink's column dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mha_multi.spec.checks import check_flag
from mha_multi.spec.ops import Array, ArrayOps


def sink_column(ops: ArrayOps, scores: Array, sinks: Array) -> Array:
    """Each head's sink logit as one column beside ``(B, H, Q, K)`` scores: ``(B, H, Q, 1)``.

    Zeros of the rows' shape plus the ``(1, H, 1, 1)`` logits, in the scores'
    dtype. The zeros are an ``any`` over an empty slice of the scores, so
    they cost nothing, read no value (a NaN score stays in its own row) and
    need no known ``K`` (``K = 0`` included).
    """
    empty = ops.slice_last(scores, 0, 0)
    zeros = ops.cast(ops.any_last(ops.less(empty, empty)), ops.dtype(scores))
    logits = ops.expand_dims(ops.cast(sinks, ops.dtype(scores)), 0)  # (1, H)
    return zeros + ops.expand_dims(ops.expand_dims(logits, -1), -1)  # + (1, H, 1, 1)


def sink_weights(scores: np.ndarray, sinks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy ``(keys' weights, sink's weight)`` of masked ``(B, H, Q, K)`` scores.

    The softmax over the row and the sink, written out (``exp(x - max) /
    sum``) for the reference's backward pass; the sink's weight is
    ``(B, H, Q, 1)``.
    """
    column = np.broadcast_to(sinks[None, :, None, None], (*scores.shape[:3], 1))
    joined = np.concatenate([scores, column], axis=-1)
    exponentials = np.exp(joined - joined.max(axis=-1, keepdims=True))
    weights = exponentials / exponentials.sum(axis=-1, keepdims=True)
    return weights[..., :-1], weights[..., -1:]


def sink_softmax_backward(
    weights: np.ndarray, sink_weight: np.ndarray, grad_weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The gradients of the scores and the logits, from the keys' weights' gradient.

    The sink contributes no value, so its weight's gradient is 0 and the
    softmax's backward ``p * (g - sum(p g))`` keeps the form it has without
    a sink (the sum runs over the keys only); the logit of head ``h`` gets
    ``-p_sink * sum(p g)`` summed over its rows.

    Args:
        weights: the keys' weights ``(B, H, Q, K)`` (:func:`sink_weights`).
        sink_weight: the sink's ``(B, H, Q, 1)``.
        grad_weights: the gradient of ``weights``, ``(B, H, Q, K)``.

    Returns:
        ``(grad_scores (B, H, Q, K), grad_sinks (H,))``.
    """
    row = (grad_weights * weights).sum(axis=-1, keepdims=True)
    grad_scores = weights * (grad_weights - row)
    grad_sinks = -(sink_weight * row).sum(axis=(0, 2, 3))
    return grad_scores, grad_sinks


def check_sinks(sinks: Any) -> bool:
    """Raises ``TypeError`` unless ``sinks`` is a bool (:func:`check_flag`)."""
    return check_flag("sinks", sinks)


def sink_logits_of(weights: Mapping[str, Any], sinks: bool, num_heads: int) -> Array | None:
    """The ``sinks`` entry of canonical weights, checked against the layer's ``sinks`` flag.

    Returns:
        The ``(num_heads,)`` logits with ``sinks=True``; ``None`` otherwise.

    Raises:
        ValueError: the entry is missing with ``sinks=True``, present without,
            or not of shape ``(num_heads,)``.
    """
    if not sinks:
        if "sinks" in weights:
            raise ValueError("weights has an entry 'sinks' but the layer has sinks=False")
        return None
    if "sinks" not in weights:
        raise ValueError("weights is missing 'sinks' (sinks=True)")
    logits = weights["sinks"]
    if tuple(np.shape(logits)) != (num_heads,):
        raise ValueError(
            f"weights['sinks'] must have shape ({num_heads},); got {tuple(np.shape(logits))}"
        )
    return logits


def sinks_shape(entry: Any, num_heads: int | None, query_features: int) -> tuple[int]:
    """The shape the canonical ``sinks`` entry must have: ``(num_heads,)``.

    Where the heads are not known (a file), the entry's own length, if it is
    1-D and divides ``W_q``'s width ``query_features``.

    Raises:
        ValueError: such an entry is not 1-D or its length does not divide.
    """
    if num_heads is not None:
        return (int(num_heads),)
    shape = tuple(np.shape(() if entry is None else entry))
    if len(shape) != 1 or shape[0] == 0 or query_features % shape[0]:
        raise ValueError(
            "weights['sinks'] must be (num_heads,) for a num_heads that divides W_q's width "
            f"{query_features}; got shape {shape}"
        )
    return (int(shape[0]),)
