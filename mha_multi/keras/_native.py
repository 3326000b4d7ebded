"""Keras' own attention layers holding canonical weights.

How the canonical arrays map onto the variables of
``keras.layers.MultiHeadAttention`` and ``keras.layers.GroupQueryAttention``,
and those layers built with them: what the converters of
:mod:`mha_multi.interop.keras` hand out, and what the benchmark and the
tests compare the layer with (through the parity harness).
Imports no layer of this package.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from mha_multi import spec
from mha_multi.keras._facts import device_scope
from mha_multi.keras._ops import check_held_policy
from mha_multi.weights import WeightsConfig, check_weights

__all__ = [
    "NATIVE_GQA_PROJECTIONS",
    "NATIVE_PROJECTIONS",
    "check_native_mha_layout",
    "gqa_projections",
    "gqa_state",
    "native_gqa_layer",
    "native_layer",
]

#: ``keras.layers.MultiHeadAttention``'s projection sublayers (``<name>_dense``)
#: -> canonical projection letter.
NATIVE_PROJECTIONS: dict[str, str] = {"query": "q", "key": "k", "value": "v", "output": "o"}

#: ``keras.layers.GroupQueryAttention``'s projection sublayers, by their
#: names (which its variable paths and weights files use) -> canonical
#: projection letter.
NATIVE_GQA_PROJECTIONS: dict[str, str] = {
    "query": "q",
    "key": "k",
    "value": "v",
    "attention_output": "o",
}


def native_layer(
    weights: Mapping[str, Any], num_heads: int, *, device: str = "cpu", **kwargs: Any
) -> keras.layers.MultiHeadAttention:
    """``keras.layers.MultiHeadAttention`` holding canonical weights, built.

    Each canonical array, reshaped to its variable's shape, is that variable:
    head ``h`` owns columns ``[h*dh, (h+1)*dh)`` in both layouts (see
    :mod:`mha_multi.interop.keras`). It is called ``(query, value, key)`` and
    takes key padding as ``attention_mask``
    (:func:`mha_multi.interop.keras.attention_mask`).

    Args:
        weights: canonical weights.
        num_heads: ``H``; ``key_dim`` is ``num_hiddens / H``.
        device: ``"cpu"`` or ``"gpu"``.
        **kwargs: more ``keras.layers.MultiHeadAttention`` arguments
            (``dropout``, ``dtype``, ``name``...).

    Returns:
        The layer, built for ``(B, Q, query_size)`` queries and
        ``(B, K, key_size|value_size)`` keys and values, with ``num_hiddens``
        output features (``output_shape`` is set when ``query_size`` differs).

    Raises:
        ValueError: invalid weights, ``num_hiddens`` not divisible by
            ``num_heads``, a head layout other than d2l's
            (:func:`check_native_mha_layout`), or a float64 ``dtype`` on
            Keras' JAX backend without x64.
    """
    arrays, config = check_weights(weights)
    check_native_mha_layout(config)
    head_dim = spec.check_config(config.num_hiddens, num_heads, 0.0)
    with device_scope(device):
        layer = keras.layers.MultiHeadAttention(
            num_heads,
            head_dim,
            use_bias=config.bias,
            output_shape=None if config.query_size == config.num_hiddens else config.num_hiddens,
            **kwargs,
        )
        check_held_policy(layer.dtype_policy)
        layer.build(
            (None, None, config.query_size),
            (None, None, config.value_size),
            (None, None, config.key_size),
        )
    for name, letter in NATIVE_PROJECTIONS.items():
        dense = getattr(layer, f"{name}_dense")
        dense.kernel.assign(arrays[f"W_{letter}"].reshape(dense.kernel.shape))
        if config.bias:
            dense.bias.assign(arrays[f"b_{letter}"].reshape(dense.bias.shape))
    return layer


def check_native_mha_layout(config: WeightsConfig) -> None:
    """Refuses weights whose head layout the ``keras.layers.MultiHeadAttention``
    converters do not hold: grouped key/value heads, which that layer lacks
    (every head has its own key and value), or an explicit ``head_dim``.

    Args:
        config: what :func:`mha_multi.weights.check_weights` read.

    Raises:
        ValueError: saying which, and that ``keras.layers.GroupQueryAttention``
            holds both.
    """
    if config.kv_features != config.query_features:
        raise ValueError(
            "keras.layers.MultiHeadAttention has no grouped key/value heads "
            f"(num_kv_heads < num_heads): W_k and W_v have {config.kv_features} columns, "
            f"W_q {config.query_features}; keras.layers.GroupQueryAttention holds them "
            "(mha_multi.interop.keras.to_keras_gqa)"
        )
    if config.query_features != config.num_hiddens:
        raise ValueError(
            "the keras.layers.MultiHeadAttention converters hold the default head size "
            f"(num_heads * key_dim = num_hiddens): W_q has {config.query_features} columns, "
            f"not num_hiddens = {config.num_hiddens}; keras.layers.GroupQueryAttention takes "
            "an explicit head_dim (mha_multi.interop.keras.to_keras_gqa)"
        )


def gqa_projections(layer: keras.layers.GroupQueryAttention) -> dict[str, keras.layers.Layer]:
    """The ``EinsumDense`` projections of a built ``keras.layers.GroupQueryAttention``.

    Keyed by their names (:data:`NATIVE_GQA_PROJECTIONS`); the layer holds
    them as private attributes (``_query_dense``...), created by ``build``.

    Raises:
        ValueError: the layer is not built yet.
    """
    if not layer.built:
        raise ValueError("the keras.layers.GroupQueryAttention is not built yet: call it once")
    sublayers = (layer._query_dense, layer._key_dense, layer._value_dense, layer._output_dense)
    return {dense.name: dense for dense in sublayers}


def gqa_state(
    weights: Mapping[str, Any], num_heads: int, *, num_kv_heads: int | None = None
) -> dict[str, np.ndarray]:
    """The variables of a ``keras.layers.GroupQueryAttention`` holding canonical weights.

    Kernels ``(in, heads, head_dim)`` (``query``: ``num_heads`` heads,
    ``key``/``value``: ``num_kv_heads``) and ``(num_heads, head_dim, out)``
    (``attention_output``), biases ``(heads, head_dim)`` and ``(out,)``: the
    canonical arrays reshaped, head ``h`` in columns ``[h*dh, (h+1)*dh)`` in
    both layouts.

    Args:
        weights: canonical weights.
        num_heads: the query heads (``num_query_heads``); ``head_dim`` is
            ``W_q``'s width over it.
        num_kv_heads: the key/value heads (``num_key_value_heads``); ``None``
            reads them from ``W_k``'s width.

    Returns:
        ``query/kernel`` ... ``attention_output/bias``, keyed by the names of
        :data:`NATIVE_GQA_PROJECTIONS` (biases iff the weights have them).

    Raises:
        ValueError: invalid weights, widths no head layout of ``num_heads``
            heads explains, or ``query_size != num_hiddens`` (the layer
            projects back to the query size).
    """
    arrays, config = check_weights(weights)
    heads = spec.heads_of_weights(arrays, num_heads, num_kv_heads=num_kv_heads)
    if config.query_size != config.num_hiddens:
        raise ValueError(
            "keras.layers.GroupQueryAttention projects back to the query size: "
            f"query_size ({config.query_size}) must equal num_hiddens ({config.num_hiddens})"
        )
    head_counts = {"q": heads.num_heads, "k": heads.num_kv_heads, "v": heads.num_kv_heads}
    state = {}
    for name, letter in NATIVE_GQA_PROJECTIONS.items():
        kernel = arrays[f"W_{letter}"]
        if letter == "o":
            shape = (heads.num_heads, heads.head_dim, config.num_hiddens)
        else:
            shape = (kernel.shape[0], head_counts[letter], heads.head_dim)
        state[f"{name}/kernel"] = np.ascontiguousarray(kernel.reshape(shape))
        if config.bias:
            bias = arrays[f"b_{letter}"]
            shape = bias.shape if letter == "o" else (head_counts[letter], heads.head_dim)
            state[f"{name}/bias"] = np.ascontiguousarray(bias.reshape(shape))
    return state


def native_gqa_layer(
    weights: Mapping[str, Any],
    num_heads: int,
    *,
    num_kv_heads: int | None = None,
    device: str = "cpu",
    **kwargs: Any,
) -> keras.layers.GroupQueryAttention:
    """``keras.layers.GroupQueryAttention`` holding canonical weights, built.

    Its variables are :func:`gqa_state` of the weights. It is called
    ``(query, value, key)``; see :mod:`mha_multi.interop.keras` for how it
    computes.

    Args:
        weights: canonical weights.
        num_heads: the query heads (``num_query_heads``).
        num_kv_heads: the key/value heads; ``None`` reads them from ``W_k``'s width.
        device: ``"cpu"`` or ``"gpu"``.
        **kwargs: more ``keras.layers.GroupQueryAttention`` arguments
            (``dropout``, ``dtype``, ``name``...).

    Returns:
        The layer, built for ``(B, Q, query_size)`` queries and
        ``(B, K, key_size|value_size)`` keys and values.

    Raises:
        ValueError: as :func:`gqa_state`, or a float64 ``dtype`` on Keras' JAX
            backend without x64.
    """
    state = gqa_state(weights, num_heads, num_kv_heads=num_kv_heads)
    in_features = {name: state[f"{name}/kernel"].shape[0] for name in ("query", "key", "value")}
    _, num_kv_heads, head_dim = state["key/kernel"].shape
    with device_scope(device):
        layer = keras.layers.GroupQueryAttention(
            head_dim, num_heads, num_kv_heads, use_bias="query/bias" in state, **kwargs
        )
        check_held_policy(layer.dtype_policy)
        layer.build(
            (None, None, in_features["query"]),
            (None, None, in_features["value"]),
            (None, None, in_features["key"]),
        )
    for name, dense in gqa_projections(layer).items():
        dense.kernel.assign(state[f"{name}/kernel"])
        if dense.bias is not None:
            dense.bias.assign(state[f"{name}/bias"])
    return layer
