"""Head importance for the MXNet layer (docs: "Heads")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import autograd

from mha_multi.heads import check_loss, importance_over
from mha_multi.mxnet._facts import gates_dtype, to_numpy
from mha_multi.mxnet.layer import MultiHeadAttention

__all__ = ["head_importance", "head_mask_gradient"]


def head_mask_gradient(
    layer: MultiHeadAttention,
    queries: mx.np.ndarray,
    keys: mx.np.ndarray,
    values: mx.np.ndarray,
    valid_lens: Any,
    loss_fn: Callable[[mx.np.ndarray], mx.np.ndarray],
) -> np.ndarray:
    """``dL/dξ`` at gates ``ξ`` of ones ``(num_heads,)``, ``L = loss_fn(output)`` (eval mode).

    One batch of :func:`mha_multi.mxnet.head_importance` (docs: "Heads").
    Only the gates' gradient is taken (``autograd.grad``): the layer's
    parameters and the inputs keep the gradients they hold.

    Returns:
        The gradient as float64 numpy ``(num_heads,)``.

    Raises:
        TypeError: ``loss_fn`` returned neither an ``mxnet.numpy`` array nor a number.
        ValueError: it returned other than one number.
    """
    # (The gates' own dtype: float32 for a 16-bit layer, whose gradient float16 may not hold.)
    gates = mx.np.ones((layer.num_heads,), dtype=gates_dtype(layer.dtype), ctx=queries.ctx)
    gates.attach_grad()
    with autograd.record(train_mode=False):
        loss = loss_fn(layer(queries, keys, values, valid_lens, head_mask=gates))
        if not check_loss(loss, lambda value: isinstance(value, mx.np.ndarray)):
            return np.zeros(layer.num_heads)  # (a number: no gradient)
        # Zero times the gates: a loss the graph did not record (made apart from the
        # output) has a zero gradient, where autograd.grad would refuse it.
        loss = loss.reshape(()) + (gates * 0).sum().astype(loss.dtype)
    (gradient,) = autograd.grad(loss, [gates], train_mode=False)
    return to_numpy(gradient)


def head_importance(
    layer: MultiHeadAttention,
    batches: Iterable[tuple[Any, Any, Any, Any]],
    loss_fn: Callable[[Any], Any],
    *,
    normalize: bool = True,
) -> np.ndarray:
    """How much each head matters to ``loss_fn`` (docs: "Heads"; Michel, Levy & Neubig 2019).

    ``I_h`` is the mean over the batches of ``|dL/dξ_h|``, the gradient of
    the loss with respect to head ``h``'s gate (``head_mask``) at gates of
    ones, out of training mode (no dropout); with ``normalize`` it is divided
    by its L2 norm over the heads (gradients all zero give zeros). Only the
    gates' gradients are taken: the parameters' ``grad`` are left as they are.

    Args:
        layer: the layer, initialized (or with deferred sizes the first
            batch fixes), imperative or hybridized.
        batches: yields ``(queries, keys, values, valid_lens)``, as the
            layer's call takes them.
        loss_fn: ``output -> loss``, a scalar ``mxnet.numpy`` array built
            from the output with MXNet operations (a number, or an array
            made apart from the output, has a zero gradient).
        normalize: divide by the L2 norm over the heads.

    Returns:
        float64 numpy ``(num_heads,)``.

    Raises:
        ValueError: ``batches`` yields nothing or a batch of other than four
            items, or ``loss_fn`` returns other than one number; and the
            layer's errors for the batches.
        TypeError: ``loss_fn`` returns neither an ``mxnet.numpy`` array nor a
            number (:func:`mha_multi.heads.check_loss`), or a batch is no tuple
            or list.
    """
    return importance_over(
        lambda batch: head_mask_gradient(layer, *batch, loss_fn), batches, normalize=normalize
    )
