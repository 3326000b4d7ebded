"""Head importance for the NNX and Linen layers (docs: "Heads")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from mha_multi.heads import check_loss, importance_over
from mha_multi.jax import linen
from mha_multi.jax._facts import as_valid_lens, host_array
from mha_multi.jax.layer import MultiHeadAttention

__all__ = ["head_importance", "head_mask_gradient"]

#: A Linen module with its variables, as ``module.apply(variables, ...)`` takes them.
LinenPair = tuple[linen.MultiHeadAttention, Any]


def head_mask_gradient(
    layer: MultiHeadAttention | LinenPair, loss_fn: Callable[[jax.Array], Any]
) -> Callable[[jax.Array, jax.Array, jax.Array, Any], jax.Array]:
    """``dL/dξ`` at ``ξ = 1`` of a batch, the gradient a head's importance is made of.

    ``L = loss_fn(layer(queries, keys, values, valid_lens, head_mask=ξ))``
    with one gate per head (docs: "Heads"), in evaluation mode (no dropout),
    whatever the layer's mode, which is left as it is. The function returned
    is ``jax.jit``-ed once for the layer's parameters as they are now (an
    argument of it, not a constant): one compilation for each batch shape.

    Args:
        layer: an NNX layer, or a Linen module and its variables.
        loss_fn: ``loss_fn(output) -> scalar`` (a JAX scalar, or an array of
            one element), traced.

    Returns:
        ``gradient(queries, keys, values, valid_lens) -> (num_heads,)``, in
        float32 (float64 for a float64 layer); zeros where the loss does not
        depend on the output.

    Raises (when the returned function is called):
        ValueError: ``loss_fn`` returned other than one number.
        TypeError: ``loss_fn`` returned neither an array nor a number.
    """
    if isinstance(layer, MultiHeadAttention):
        graphdef, state = nnx.split(layer)
        num_heads = layer.num_heads
        param_dtype = layer.W_q.kernel.dtype if layer.dtype is None else layer.dtype

        def output(state: Any, gates: jax.Array, *args: Any) -> jax.Array:
            return nnx.merge(graphdef, state)(*args, head_mask=gates, deterministic=True)

    else:
        module, state = layer
        num_heads = module.num_heads
        param_dtype = module.param_dtype if module.dtype is None else module.dtype

        def output(state: Any, gates: jax.Array, *args: Any) -> jax.Array:
            return module.apply(state, *args, head_mask=gates)

    def loss(gates: jax.Array, state: Any, *args: Any) -> jax.Array:
        value = loss_fn(output(state, gates, *args))
        check_loss(value, lambda value: isinstance(value, jax.Array))
        # (In the gates' dtype: a number, or an integer array, has a zero gradient.)
        return jnp.reshape(jnp.asarray(value).astype(gates.dtype), ())

    gradient = jax.jit(jax.grad(loss))
    ones = jnp.ones(num_heads, jnp.promote_types(param_dtype, jnp.float32))

    def of_batch(
        queries: jax.Array, keys: jax.Array, values: jax.Array, valid_lens: Any
    ) -> jax.Array:
        return gradient(ones, state, queries, keys, values, as_valid_lens(valid_lens))

    return of_batch


def head_importance(
    layer: MultiHeadAttention | linen.MultiHeadAttention | LinenPair,
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
            variables, say), ``loss_fn`` returns neither an array nor a
            number (:func:`mha_multi.heads.check_loss`), or a batch is no
            tuple or list.
        ValueError: ``batches`` yields nothing or a batch of other than four
            items, or ``loss_fn`` returns other than one number.
    """
    gradient = head_mask_gradient(_as_layer(layer), loss_fn)
    return importance_over(lambda batch: host_array(gradient(*batch)), batches, normalize=normalize)


def _as_layer(layer: Any) -> MultiHeadAttention | LinenPair:
    """The NNX layer as it is; a Linen module with its variables as the pair."""
    if isinstance(layer, MultiHeadAttention):
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
    return module, dict(variables)
