"""Canonical weights to and from d2l's Keras/TensorFlow ``MultiHeadAttention`` (and ours).

Part of :mod:`mha_multi.interop.keras`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from mha_multi.keras import _facts
from mha_multi.weights import check_only_projections, check_weights

__all__ = ["from_keras_d2l", "to_keras_d2l"]


def from_keras_d2l(layer: Any) -> dict[str, np.ndarray]:
    """Canonical weights of d2l's Keras/TensorFlow ``MultiHeadAttention`` (or ours).

    d2l's layer holds ``keras.layers.Dense`` projections ``W_q``, ``W_k``,
    ``W_v``, ``W_o``; their kernels are canonical as they are.

    Args:
        layer: any object whose ``W_q``... attributes have a ``kernel`` and,
            with biases, a ``bias`` (Dense layers), or are variables (ours).

    Raises:
        ValueError: a missing projection, invalid weights, or weights beyond the
            projections (ours with ``qk_norm`` or ``sinks``).
    """
    check_only_projections(layer, "from_keras_d2l")
    weights = {}
    for name in ("W_q", "W_k", "W_v", "W_o"):
        projection = getattr(layer, name, None)
        if projection is None:
            raise ValueError(f"the layer has no {name} projection (not built yet?)")
        if isinstance(projection, keras.Variable):  # ours: the kernel itself, b_* beside it
            kernel, bias = projection, getattr(layer, f"b_{name[-1]}", None)
        else:  # a Dense layer
            _check_linear(projection, name)
            kernel, bias = projection.kernel, projection.bias
        weights[name] = _facts.host_array(kernel)
        if bias is not None:
            weights[f"b_{name[-1]}"] = _facts.host_array(bias)
    return check_weights(weights)[0]


def to_keras_d2l(weights: Mapping[str, Any], layer: Any) -> Any:
    """Loads canonical weights into d2l's Keras/TensorFlow ``MultiHeadAttention``.

    Args:
        weights: canonical weights.
        layer: d2l's layer, built (called once), whose ``Dense`` projections
            have biases iff the weights do.

    Returns:
        ``layer``.

    Raises:
        ValueError: invalid weights, an unbuilt layer, or bias/shape mismatches.
    """
    arrays, config = check_weights(weights)
    for name in ("W_q", "W_k", "W_v", "W_o"):
        dense = getattr(layer, name)
        _check_linear(dense, name)
        if not dense.built:
            raise ValueError(f"{name} is not built yet: call the layer once")
        if (dense.bias is not None) != config.bias:
            raise ValueError(
                f"{name} has {'a' if dense.bias is not None else 'no'} bias; the weights "
                f"have {'biases' if config.bias else 'none'}"
            )
        if tuple(dense.kernel.shape) != arrays[name].shape:
            raise ValueError(
                f"{name} kernel has shape {tuple(dense.kernel.shape)}; the weights' {name} "
                f"has {arrays[name].shape}"
            )
        dense.kernel.assign(arrays[name])
        if config.bias:
            dense.bias.assign(arrays[f"b_{name[-1]}"])
    return layer


def _check_linear(dense: Any, name: str) -> None:
    """Refuses a ``Dense`` projection with an activation: d2l's are linear, and the
    canonical layer's, so its weights would convert to another computation."""
    activation = getattr(dense, "activation", None)
    if activation is not None and activation is not keras.activations.linear:
        raise ValueError(
            f"{name} has the activation {getattr(activation, '__name__', activation)!r}; "
            "the canonical layer's projections are linear"
        )
