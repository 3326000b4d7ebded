"""Head importance for the NNX and Linen layers (docs: "Heads")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from flax import linen as nn

from mha_multi.heads import importance
from mha_multi.jax import _backend, linen
from mha_multi.jax.layer import MultiHeadAttention

__all__ = ["head_importance"]


def head_importance(
    layer: MultiHeadAttention | linen.MultiHeadAttention | tuple[linen.MultiHeadAttention, Any],
    batches: Iterable[tuple[Any, Any, Any, Any]],
    loss_fn: Callable[[jax.Array], Any],
    *,
    normalize: bool = True,
) -> np.ndarray:
    """How much the loss depends on each head (docs: "Heads").

    Michel, Levy & Neubig (2019): ``I_h = mean over batches of |dL/dξ_h|``
    at ``ξ = 1``, where ``ξ`` is the ``head_mask`` (one gate per head), then
    divided by its L2 norm over the heads when ``normalize`` (gradients all
    zero stay zero). Computed in evaluation mode (no dropout) whatever the
    layer's mode, which is left as it is; nothing of the layer changes.
    The gradient is taken by one ``jax.jit``-ed function for every batch,
    compiled once for each batch shape. Heads of low importance are the
    ones to prune (:func:`mha_multi.heads.prune_heads`).

    Args:
        layer: the NNX :class:`mha_multi.jax.MultiHeadAttention`; or a Linen
            :class:`mha_multi.jax.linen.MultiHeadAttention` with its
            variables, as the pair ``(module, variables)`` that
            ``module.apply(variables, ...)`` takes, or bound to them
            (``module.bind(variables)``).
        batches: an iterable of ``(queries, keys, values, valid_lens)`` JAX
            arrays (``valid_lens`` may be ``None``), as the layer takes them.
        loss_fn: ``loss_fn(output) -> scalar``, differentiable, traced by
            ``jax.jit``.
        normalize: divide by the L2 norm over the heads.

    Returns:
        float64 numpy ``(num_heads,)``.

    Raises:
        TypeError: ``layer`` is none of the above (a Linen module without
            variables, say), or ``loss_fn`` returns no number.
        ValueError: ``batches`` yields nothing, or ``loss_fn`` returns more
            than one number.
    """
    gradient = _backend.head_mask_gradient(_as_layer(layer), loss_fn)
    gradients = [_backend.host_array(gradient(*batch)) for batch in batches]
    if not gradients:
        raise ValueError("batches yielded no batch: head importance needs at least one")
    return importance(gradients, normalize=normalize)


def _as_layer(layer: Any) -> MultiHeadAttention | _backend.LinenLayer:
    """The NNX layer as it is; a Linen module and its variables as a ``LinenLayer``."""
    if isinstance(layer, (MultiHeadAttention, _backend.LinenLayer)):
        return layer
    if isinstance(layer, tuple) and len(layer) == 2 and isinstance(layer[0], nn.Module):
        module, variables = layer
    elif isinstance(layer, nn.Module) and layer.scope is not None:
        module, variables = layer.unbind()
    else:
        module, variables = layer, None
    if not isinstance(module, linen.MultiHeadAttention) or variables is None:
        raise TypeError(
            "layer must be an NNX mha_multi.jax.MultiHeadAttention, or a Linen "
            "mha_multi.jax.linen.MultiHeadAttention as (module, variables) or bound to its "
            f"variables; got {type(layer).__name__}"
        )
    return _backend.LinenLayer(module, dict(variables), jax.devices()[0], jax.random.key(0))
