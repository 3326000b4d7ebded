"""Canonical weights to and from ``keras.layers.MultiHeadAttention``, as a layer or its arrays.

Part of :mod:`mha_multi.interop.keras`, whose notes say how the layer maps
onto the spec and what it cannot express.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from mha_multi import spec
from mha_multi.interop.keras._projections import _kernels_of_state, _projection_state
from mha_multi.keras import _native
from mha_multi.weights import check_weights

__all__ = [
    "KERAS_MHA_NAMES",
    "from_keras_mha",
    "from_keras_mha_state",
    "to_keras_mha",
    "to_keras_mha_state",
]

#: Keras' sublayer name -> canonical projection letter.
KERAS_MHA_NAMES = _native.NATIVE_PROJECTIONS


def from_keras_mha_state(state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Canonical weights from the arrays of a ``keras.layers.MultiHeadAttention``.

    Args:
        state: ``query/kernel`` ``(query_size, H, dh)``, ``key/kernel``
            ``(key_size, H, dh)``, ``value/kernel`` ``(value_size, H, dh)``,
            ``output/kernel`` ``(H, dh, H * dh)``, and with biases
            ``query/bias`` ``(H, dh)`` ... ``output/bias`` ``(H * dh,)``.

    Returns:
        The canonical mapping (``num_heads`` is the kernels' middle axis).

    Raises:
        ValueError: a missing or unexpected entry, biases on some
            projections only, or shapes the canonical layer cannot express
            (named).
    """
    kernels, with_bias = _kernels_of_state(state, KERAS_MHA_NAMES, "MultiHeadAttention")
    for name in ("query", "key", "value"):
        if kernels[name].ndim != 3:
            raise ValueError(
                f"unsupported: {name} kernel of shape {kernels[name].shape}; expected "
                "(in, num_heads, head_dim), i.e. attention over a single axis of 3-D inputs"
            )
    num_heads, key_dim = kernels["query"].shape[1:]
    for name in ("key", "value"):
        if kernels[name].shape[1] != num_heads:
            raise ValueError(
                f"{name} kernel has {kernels[name].shape[1]} heads; query kernel has {num_heads}"
            )
    value_dim = kernels["value"].shape[2]
    if kernels["key"].shape[2] != key_dim:
        raise ValueError(
            f"key kernel head size {kernels['key'].shape[2]} differs from query's {key_dim}"
        )
    if value_dim != key_dim:
        raise ValueError(
            f"unsupported: value_dim ({value_dim}) != key_dim ({key_dim}); the canonical "
            "layer uses one head size for queries, keys and values"
        )
    num_hiddens = num_heads * key_dim
    output = kernels["output"]
    if output.shape[:2] != (num_heads, key_dim) or output.ndim != 3:
        raise ValueError(
            f"output kernel must have shape ({num_heads}, {key_dim}, out); got {output.shape}"
        )
    if output.shape[2] != num_hiddens:
        raise ValueError(
            f"unsupported: output size {output.shape[2]} != num_heads * key_dim "
            f"({num_hiddens}); the canonical layer projects back to num_hiddens (Keras' "
            "output_shape defaults to the query size)"
        )
    weights = {
        f"W_{letter}": kernels[name].reshape(kernels[name].shape[0], num_hiddens)
        for name, letter in KERAS_MHA_NAMES.items()
        if name != "output"
    }
    weights["W_o"] = output.reshape(num_hiddens, num_hiddens)
    if with_bias:
        for name, letter in KERAS_MHA_NAMES.items():
            bias = np.asarray(state[f"{name}/bias"])
            expected_shape = (num_hiddens,) if name == "output" else (num_heads, key_dim)
            if bias.shape != expected_shape:
                raise ValueError(f"{name} bias must have shape {expected_shape}; got {bias.shape}")
            weights[f"b_{letter}"] = bias.reshape(num_hiddens)
    weights = {name: np.ascontiguousarray(array) for name, array in weights.items()}
    return check_weights(weights)[0]


def to_keras_mha_state(weights: Mapping[str, Any], num_heads: int) -> dict[str, np.ndarray]:
    """The ``keras.layers.MultiHeadAttention`` arrays (see :func:`from_keras_mha_state`).

    Args:
        weights: canonical weights.
        num_heads: ``H``; must divide ``num_hiddens``.

    Returns:
        ``query/kernel`` ... ``output/bias`` keyed as in :data:`KERAS_MHA_NAMES`.

    Raises:
        ValueError: invalid weights, ``num_hiddens`` not divisible by
            ``num_heads``, grouped key/value heads or an explicit ``head_dim``.
    """
    arrays, config = check_weights(weights)
    _native.check_native_mha_layout(config)
    head_dim = spec.check_config(config.num_hiddens, num_heads, 0.0)
    result = {}
    for name, letter in KERAS_MHA_NAMES.items():
        kernel = arrays[f"W_{letter}"]
        shape = (num_heads, head_dim, -1) if name == "output" else (-1, num_heads, head_dim)
        result[f"{name}/kernel"] = np.ascontiguousarray(kernel.reshape(shape))
        if config.bias:
            bias = arrays[f"b_{letter}"]
            result[f"{name}/bias"] = bias if name == "output" else bias.reshape(num_heads, head_dim)
    return result


def _check_keras_mha(layer: keras.layers.MultiHeadAttention) -> None:
    if not isinstance(layer, keras.layers.MultiHeadAttention):
        raise TypeError(
            f"layer must be a keras.layers.MultiHeadAttention; got {type(layer).__name__}"
        )
    config = layer.get_config()
    if config.get("use_gate"):
        raise ValueError("unsupported keras.layers.MultiHeadAttention option: use_gate=True")
    if config.get("sliding_window") is not None:
        raise ValueError(
            "unsupported keras.layers.MultiHeadAttention option: "
            f"sliding_window={config['sliding_window']}"
        )
    axes = config.get("attention_axes")
    if axes is not None and tuple(axes) not in ((1,), (-2,)):
        # (Keras' fast path attends over the sequence whatever the axes; its einsum path,
        # which returns the scores or drops them out, over the axes given.)
        raise ValueError(
            f"unsupported: attention_axes={tuple(axes)}; the canonical layer attends over "
            "the sequence axis of 3-D inputs (attention_axes=(1,) or None)"
        )
    if config["value_dim"] != config["key_dim"]:
        raise ValueError(
            f"unsupported: value_dim ({config['value_dim']}) != key_dim ({config['key_dim']})"
        )
    num_hiddens = config["num_heads"] * config["key_dim"]
    output_shape = config.get("output_shape")
    if output_shape is not None and tuple(output_shape) != (num_hiddens,):
        raise ValueError(
            f"unsupported: output_shape={tuple(output_shape)}; the canonical layer's output "
            f"has num_heads * key_dim = {num_hiddens} features"
        )
    if not layer.built:
        raise ValueError("the keras.layers.MultiHeadAttention is not built yet: call it once")


def from_keras_mha(layer: keras.layers.MultiHeadAttention) -> dict[str, np.ndarray]:
    """Canonical weights of a built ``keras.layers.MultiHeadAttention``.

    Args:
        layer: built on 3-D inputs.

    Returns:
        The canonical mapping; ``num_heads`` is ``layer.num_heads``.

    Raises:
        ValueError: an option the canonical layer cannot express (see the
            module notes), or an unbuilt layer.
    """
    _check_keras_mha(layer)
    projections = {name: getattr(layer, f"{name}_dense") for name in KERAS_MHA_NAMES}
    return from_keras_mha_state(_projection_state(projections))


def to_keras_mha(
    weights: Mapping[str, Any], num_heads: int, **kwargs: Any
) -> keras.layers.MultiHeadAttention:
    """A new, built ``keras.layers.MultiHeadAttention`` holding canonical weights.

    Args:
        weights: canonical weights.
        num_heads: ``H``; ``key_dim`` is ``num_hiddens / H``.
        **kwargs: more ``keras.layers.MultiHeadAttention`` arguments
            (``dropout``, ``dtype``, ``name``...); not ``key_dim``,
            ``value_dim``, ``use_bias`` or ``output_shape``, which the
            weights fix, nor what :func:`from_keras_mha` refuses (a gate,
            a sliding window, attention over other axes).

    Returns:
        The layer, built for ``(B, Q, query_size)`` queries and
        ``(B, K, key_size|value_size)`` keys and values. Its output has
        ``num_hiddens`` features (``output_shape`` is set when
        ``query_size`` differs).

    Raises:
        ValueError: invalid weights, ``num_hiddens`` not divisible by
            ``num_heads``, grouped key/value heads or an explicit ``head_dim``
            (:func:`to_keras_gqa` holds those), a keyword the weights fix,
            one that makes a layer the canonical one is not, or a float64
            ``dtype`` on Keras' JAX backend without x64 (which holds float32).
    """
    fixed = sorted({"key_dim", "value_dim", "use_bias", "output_shape"} & set(kwargs))
    if fixed:
        raise ValueError(f"{', '.join(fixed)} follow from the weights; do not pass them")
    layer = _native.native_layer(weights, num_heads, **kwargs)
    _check_keras_mha(layer)  # (what the other way refuses: a gate, a window, other axes)
    return layer
