"""Head importance for the Keras layer (docs: "Heads")."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import keras
import numpy as np

from mha_multi.heads import check_loss, importance_over
from mha_multi.keras._facts import (
    device_of,
    device_scope,
    host_array,
    is_tensor,
    scalar_gradient,
)
from mha_multi.keras.layer import MultiHeadAttention

__all__ = ["head_importance", "head_mask_gradient"]

Tensor = Any


def head_mask_gradient(
    layer: MultiHeadAttention,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Any,
    loss_fn: Callable[[Tensor], Tensor],
) -> np.ndarray:
    """``dL/dξ`` at gates of ones, ``L = loss_fn(layer(..., head_mask=ξ))`` in evaluation mode.

    The block :func:`head_importance` is made of: one batch, the layer
    called eagerly as a user calls it (fused path included), its
    ``(num_heads,)`` gates differentiated the backend's way
    (``tf.GradientTape``, ``jax.grad``, ``torch.autograd.grad``). The gates
    are float32 (float64 for a float64 layer), so 16-bit layers sum their
    gradient in float32.

    Returns:
        ``(num_heads,)`` numpy, in the gates' dtype; zeros where the loss does
        not depend on the output.

    Raises:
        TypeError: ``loss_fn`` returned neither a tensor nor a number.
        ValueError: it returned other than one number.
    """
    dtype = "float64" if layer.compute_dtype == "float64" else "float32"
    # (Numpy batches, which the layer takes, live nowhere: the gates go where it puts them.)
    placed = device_scope(device_of(queries)) if is_tensor(queries) else contextlib.nullcontext()
    with placed:
        gates = keras.ops.ones((layer.num_heads,), dtype)

        def loss(gates: Tensor) -> Tensor:
            output = layer(queries, keys, values, valid_lens, head_mask=gates, training=False)
            value = loss_fn(output)
            if not check_loss(value, keras.ops.is_tensor):
                value = np.asarray(value)  # (a number: no gradient)
            # (In the gates' dtype: a number, or an integer tensor, has a zero gradient.)
            return keras.ops.reshape(keras.ops.cast(value, dtype), ())

        return host_array(scalar_gradient(loss, gates))


def head_importance(
    layer: MultiHeadAttention,
    batches: Iterable[tuple[Any, Any, Any, Any]],
    loss_fn: Callable[[Any], Any],
    *,
    normalize: bool = True,
) -> np.ndarray:
    """The importance of each head: the mean ``|dL/dξ_h|`` at gates of ones (docs: "Heads").

    Michel, Levy & Neubig (2019): each batch's loss ``loss_fn(layer(queries,
    keys, values, valid_lens, head_mask=ξ))`` is differentiated with respect
    to the gates ``ξ`` at ``ξ = 1``, in evaluation mode (no dropout), and
    :func:`mha_multi.heads.importance` averages the absolute gradients over
    the batches and normalizes them.

    Args:
        layer: the layer whose ``num_heads`` heads are measured.
        batches: yields ``(queries, keys, values, valid_lens)`` of tensors
            (``valid_lens`` may be ``None``).
        loss_fn: ``output -> scalar`` tensor of the active Keras backend
            (``keras.ops`` works on every one); a number, or a tensor made
            apart from the output, has a zero gradient.
        normalize: divide by the L2 norm over the heads (all-zero gradients
            stay zero).

    Returns:
        ``(num_heads,)`` float64 numpy.

    Raises:
        ValueError: ``batches`` yields nothing or a batch of other than four
            items, or ``loss_fn`` returns other than one number.
        TypeError: ``loss_fn`` returns neither a tensor nor a number
            (:func:`mha_multi.heads.check_loss`), or a batch is no tuple or list.
    """
    return importance_over(
        lambda batch: head_mask_gradient(layer, *batch, loss_fn), batches, normalize=normalize
    )
