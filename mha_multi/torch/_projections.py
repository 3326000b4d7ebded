"""The PyTorch layer's projections: lazy sizes, 16-bit products, stacked weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mha_multi.torch._ops import linear, needs_float32_copies

__all__ = [
    "StackedWeights",
    "finish_lazy",
    "in_features",
    "infer_size",
    "project_with",
    "projection",
    "split_stacked",
]


def projection(in_features: int | None, out_features: int, bias: bool) -> nn.Module:
    if in_features is None:
        return nn.LazyLinear(out_features, bias=bias)
    return nn.Linear(in_features, out_features, bias=bias)


def in_features(linear: nn.Module) -> int | None:
    """The projection's input size, ``None`` while lazy.

    Read from the parameter table rather than through ``nn.Module``'s
    attribute lookup: every call asks, and a small call's cost is such work.
    """
    weight = linear._parameters["weight"]
    if type(weight) is nn.parameter.UninitializedParameter:
        return None
    return int(weight.shape[1])


def finish_lazy(linear: nn.Module) -> None:
    """Turns a lazy projection whose weight was loaded into a plain ``nn.Linear``.

    Loading materialises the parameters but leaves the lazy class and its
    hooks until the first call; a call on an empty batch finishes the job
    now, so later calls (and ``torch.compile``) see an ordinary module.
    """
    if isinstance(linear, nn.modules.lazy.LazyModuleMixin):
        linear.in_features = int(linear.weight.shape[1])
        weight = linear.weight
        linear(torch.zeros(0, linear.in_features, device=weight.device, dtype=weight.dtype))


def infer_size(module: nn.Module, x: torch.Tensor) -> None:
    """A lazy projection learns its input size from ``x`` (nothing is computed).

    Its parameters are made ordinary tensors even under
    ``torch.inference_mode``, where they would otherwise be inference
    tensors: those cannot be trained later, and have no version counter for
    :class:`StackedWeights` to key on.
    """
    if in_features(module) is None:
        with torch.inference_mode(False), torch.no_grad():
            module(x[:0])


def project_with(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, with a 16-bit product accumulated in float32 and rounded once.

    Products that are not 16-bit, or whose device kernels accumulate in
    float32 by construction, call the module itself (its hooks run); the
    others run on float32 copies.
    """
    if not needs_float32_copies(x, module.weight):
        return module(x)
    infer_size(module, x)
    return linear(x, module.weight, module.bias)


class StackedWeights:
    """The stacked weights (and biases) of projections that share their input.

    Stacking copies every weight (a 512-wide layer: 3 MB, longer than the
    projection of one token), so a call that needs no gradient reuses the
    stack of the last such call while no parameter has been replaced or
    changed in place (their version counters tell). A call that records
    gradients stacks anew: the stack is part of its graph. (A stack made
    under ``torch.inference_mode`` is an inference tensor, which a graph
    may not save: the mode is part of the key.)
    """

    def __init__(self) -> None:
        self._key: list[Any] | None = None
        self._stack: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def __call__(self, modules: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight, bias)`` of ``modules`` stacked along the output features."""
        # Compiled graphs hold their own stack.
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return _stack(modules)
        # The parameter tables, not nn.Module's attribute lookup: every call asks.
        key: list[Any] = [torch.is_inference_mode_enabled()]
        try:
            for module in modules:
                for p in module._parameters.values():
                    if p is not None:
                        key += (id(p), p.data_ptr(), p._version)
        except RuntimeError:  # an inference tensor: no version to key on
            return _stack(modules)
        if self._stack is None or self._key != key:
            self._key, self._stack = key, _stack(modules)
        return self._stack


def split_stacked(
    product: torch.Tensor, heads: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)``: the column blocks of self-attention's stacked projection
    ``(..., query_features + 2 * kv_features)`` of ``heads`` (a :class:`mha_multi.spec.Heads`)."""
    widths = [heads.query_features, heads.kv_features, heads.kv_features]
    q, k, v = product.split_with_sizes(widths, dim=-1)
    return q, k, v


def _stack(modules: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([m.weight for m in modules])
    biases = [m.bias for m in modules]
    return weight, None if biases[0] is None else torch.cat(biases)
