"""Canonical weights to and from ``keras.layers.GroupQueryAttention``, as a layer or its arrays.

Part of :mod:`mha_multi.interop.keras`, whose notes say how the layer maps
onto the spec's grouped-query attention and what it cannot express.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from mha_multi import spec
from mha_multi.interop.keras._projections import _kernels_of_state, _projection_state
from mha_multi.keras import _native
from mha_multi.weights import check_state_mapping, check_weights

__all__ = [
    "KERAS_GQA_NAMES",
    "from_keras_gqa",
    "from_keras_gqa_state",
    "to_keras_gqa",
    "to_keras_gqa_state",
]

#: ``keras.layers.GroupQueryAttention``'s sublayer name -> canonical projection letter.
KERAS_GQA_NAMES = _native.NATIVE_GQA_PROJECTIONS


def from_keras_gqa_state(
    state: Mapping[str, Any],
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Canonical weights and head layout from the arrays of a ``keras.layers.GroupQueryAttention``.

    Args:
        state: ``query/kernel`` ``(query_size, num_heads, head_dim)``,
            ``key/kernel`` ``(key_size, num_kv_heads, head_dim)``,
            ``value/kernel`` ``(value_size, num_kv_heads, head_dim)``,
            ``attention_output/kernel`` ``(num_heads, head_dim, out)``, and
            with biases ``query/bias`` ``(num_heads, head_dim)`` ...
            ``attention_output/bias`` ``(out,)``.

    Returns:
        ``(weights, heads)``: the canonical mapping, and ``num_heads``,
        ``num_kv_heads``, ``head_dim`` as the layer's keywords
        (``MultiHeadAttention(out, **heads)``).

    Raises:
        ValueError: a missing or unexpected entry (a gate's, named so),
            biases on some projections only, or shapes no head layout
            explains (named).
    """
    check_state_mapping(state, "state")
    if any(name.startswith("gate/") for name in state):
        raise ValueError(
            "unsupported keras.layers.GroupQueryAttention option: use_gate=True "
            "(the canonical layer has no gate)"
        )
    kernels, with_bias = _kernels_of_state(state, KERAS_GQA_NAMES, "GroupQueryAttention")
    for name, kernel in kernels.items():
        if kernel.ndim != 3:
            layout = (
                "(heads, head_dim, out)" if name == "attention_output" else "(in, heads, head_dim)"
            )
            raise ValueError(f"{name} kernel must be 3-D {layout}; got shape {kernel.shape}")
    num_heads, head_dim = kernels["query"].shape[1:]
    num_kv_heads = kernels["key"].shape[1]
    for name in ("key", "value"):
        if kernels[name].shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} kernel must have shape (in, {num_kv_heads}, {head_dim}) "
                f"(num_kv_heads, head_dim); got {kernels[name].shape}"
            )
    output = kernels["attention_output"]
    if output.shape[:2] != (num_heads, head_dim):
        raise ValueError(
            f"attention_output kernel must have shape ({num_heads}, {head_dim}, out); "
            f"got {output.shape}"
        )
    heads = spec.check_heads(
        output.shape[2], int(num_heads), num_kv_heads=int(num_kv_heads), head_dim=int(head_dim)
    )
    weights = {
        f"W_{letter}": kernels[name].reshape(kernels[name].shape[0], -1)
        for name, letter in KERAS_GQA_NAMES.items()
        if letter != "o"
    }
    weights["W_o"] = output.reshape(heads.query_features, output.shape[2])
    if with_bias:
        for name, letter in KERAS_GQA_NAMES.items():
            bias = np.asarray(state[f"{name}/bias"])
            expected_shape = (output.shape[2],) if letter == "o" else kernels[name].shape[1:]
            if bias.shape != expected_shape:
                raise ValueError(f"{name} bias must have shape {expected_shape}; got {bias.shape}")
            weights[f"b_{letter}"] = bias.reshape(-1)
    layout = {
        "num_heads": heads.num_heads,
        "num_kv_heads": heads.num_kv_heads,
        "head_dim": heads.head_dim,
    }
    weights = {name: np.ascontiguousarray(array) for name, array in weights.items()}
    return check_weights(weights, **layout)[0], layout


def to_keras_gqa_state(
    weights: Mapping[str, Any], *, num_heads: int, num_kv_heads: int | None = None
) -> dict[str, np.ndarray]:
    """The ``keras.layers.GroupQueryAttention`` arrays (see :func:`from_keras_gqa_state`).

    Args:
        weights: canonical weights, with ``query_size == num_hiddens`` (the
            layer projects back to the query size).
        num_heads: the query heads; ``head_dim`` is ``W_q``'s width over it.
        num_kv_heads: the key/value heads; ``None`` reads them from ``W_k``'s
            width.

    Returns:
        ``query/kernel`` ... ``attention_output/bias`` keyed as in
        :data:`KERAS_GQA_NAMES`.

    Raises:
        ValueError: invalid weights, widths no head layout of ``num_heads``
            heads explains, or ``query_size != num_hiddens``.
    """
    return _native.gqa_state(weights, num_heads, num_kv_heads=num_kv_heads)


def _check_keras_gqa(layer: keras.layers.GroupQueryAttention) -> None:
    if not isinstance(layer, keras.layers.GroupQueryAttention):
        raise TypeError(
            f"layer must be a keras.layers.GroupQueryAttention; got {type(layer).__name__}"
        )
    config = layer.get_config()
    for option, default in (("use_gate", False), ("sliding_window", None)):
        if config.get(option, default) != default:
            raise ValueError(
                f"unsupported keras.layers.GroupQueryAttention option: {option}={config[option]!r}"
            )


def from_keras_gqa(
    layer: keras.layers.GroupQueryAttention,
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Canonical weights and head layout of a built ``keras.layers.GroupQueryAttention``.

    Returns:
        ``(weights, heads)`` as :func:`from_keras_gqa_state` returns them:
        ``num_heads`` is ``num_query_heads``, ``num_kv_heads``
        ``num_key_value_heads``.

    Raises:
        ValueError: a gate or a sliding window, or an unbuilt layer.
    """
    _check_keras_gqa(layer)
    return from_keras_gqa_state(_projection_state(_native.gqa_projections(layer)))


def to_keras_gqa(
    weights: Mapping[str, Any],
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    **kwargs: Any,
) -> keras.layers.GroupQueryAttention:
    """A new, built ``keras.layers.GroupQueryAttention`` holding canonical weights.

    Args:
        weights: canonical weights, with ``query_size == num_hiddens``.
        num_heads: the query heads (``num_query_heads``).
        num_kv_heads: the key/value heads (``num_key_value_heads``); ``None``
            reads them from ``W_k``'s width.
        **kwargs: more ``keras.layers.GroupQueryAttention`` arguments
            (``dropout``, ``dtype``, ``name``, ``seed``...); not ``head_dim``,
            ``num_query_heads``, ``num_key_value_heads`` or ``use_bias``,
            which the weights fix, nor ``use_gate`` or ``sliding_window``,
            which the canonical layer lacks.

    Returns:
        The layer, built for ``(B, Q, query_size)`` queries and
        ``(B, K, key_size|value_size)`` keys and values, called
        ``(query, value, key)``.

    Raises:
        ValueError: as :func:`to_keras_gqa_state`, a keyword refused above, or a
            float64 ``dtype`` on Keras' JAX backend without x64 (which holds float32).
    """
    fixed = sorted({"head_dim", "num_query_heads", "num_key_value_heads", "use_bias"} & set(kwargs))
    if fixed:
        raise ValueError(f"{', '.join(fixed)} follow from the weights; do not pass them")
    unsupported = sorted({"use_gate", "sliding_window"} & set(kwargs))
    if unsupported:
        raise ValueError(
            f"unsupported: {', '.join(unsupported)}; the canonical layer has no gate "
            "and no sliding window"
        )
    return _native.native_gqa_layer(weights, num_heads, num_kv_heads=num_kv_heads, **kwargs)
