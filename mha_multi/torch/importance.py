"""Head importance for the PyTorch layer (docs: "Heads")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from mha_multi.heads import check_loss, importance_over
from mha_multi.torch._facts import host_array
from mha_multi.torch.layer import MultiHeadAttention

__all__ = ["head_importance", "head_mask_gradient"]


def head_mask_gradient(
    layer: MultiHeadAttention,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid_lens: Any,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``dL/dξ`` at ``ξ = 1`` of one batch: the gradient a head's importance is made of.

    ``L = loss_fn(layer(queries, keys, values, valid_lens, head_mask=ξ))``
    with one gate per head (docs: "Heads"), in the layer's current mode
    (:func:`head_importance` puts it in ``eval()``). The gradient is taken
    with ``torch.autograd.grad``: the parameters' ``.grad`` are left as they
    are.

    Returns:
        ``(num_heads,)``, float32 for a 16-bit layer (else the layer's
        dtype), on the layer's device; zeros where the loss does not depend
        on the output.

    Raises:
        TypeError: ``loss_fn`` returned neither a tensor nor a number.
        ValueError: it returned other than one number.
    """
    parameter = layer.W_o.weight
    dtype = torch.promote_types(parameter.dtype, torch.float32)
    # The whole layer's heads, also when they are sharded (docs: "Sharding heads").
    num_heads = layer._canonical_heads().num_heads
    # Under torch.inference_mode nothing records a gradient (the gates' would be zeros),
    # and its tensors cannot be saved for a backward pass: the gradient is taken outside
    # it, of copies of such inputs.
    with torch.inference_mode(False), torch.enable_grad():
        copies: dict[int, torch.Tensor] = {}
        queries, keys, values = (
            copies.setdefault(id(x), x.clone())
            if isinstance(x, torch.Tensor) and x.is_inference()
            else x
            for x in (queries, keys, values)
        )
        gates = torch.ones(num_heads, dtype=dtype, device=parameter.device, requires_grad=True)
        loss = loss_fn(layer(queries, keys, values, valid_lens, head_mask=gates))
        if not check_loss(loss, torch.is_tensor) or not loss.requires_grad:
            return torch.zeros_like(gates, requires_grad=False)
        (grad,) = torch.autograd.grad(loss.reshape(()), gates, allow_unused=True)
    return torch.zeros_like(gates, requires_grad=False) if grad is None else grad


def head_importance(
    layer: MultiHeadAttention,
    batches: Iterable[tuple[Any, Any, Any, Any]],
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    normalize: bool = True,
) -> np.ndarray:
    """How much the loss depends on each head (docs: "Heads").

    Michel, Levy & Neubig (2019): ``I_h = mean over batches of |dL/dξ_h|``
    at ``ξ = 1``, where ``ξ`` is the ``head_mask`` (one gate per head), then
    divided by its L2 norm over the heads when ``normalize`` (gradients all
    zero stay zero). Computed in ``eval()`` mode (no dropout); the layer's
    mode is restored afterwards, and its parameters' ``.grad`` are left as
    they are. Heads of low importance are the ones to prune
    (:func:`mha_multi.heads.prune_heads`).

    Args:
        layer: the layer.
        batches: an iterable of ``(queries, keys, values, valid_lens)``
            tensors (``valid_lens`` may be ``None``), as the layer takes them.
        loss_fn: ``loss_fn(output) -> scalar tensor``, differentiable.
        normalize: divide by the L2 norm over the heads.

    Returns:
        float64 numpy ``(num_heads,)``.

    Raises:
        ValueError: ``batches`` yields nothing or a batch of other than four
            items, or ``loss_fn`` returns other than one number.
        TypeError: ``loss_fn`` returns neither a tensor nor a number
            (:func:`mha_multi.heads.check_loss`), or a batch is no tuple or list.
    """
    training = layer.training
    layer.eval()
    try:
        return importance_over(
            lambda batch: host_array(head_mask_gradient(layer, *batch, loss_fn)),
            batches,
            normalize=normalize,
        )
    finally:
        layer.train(training)
