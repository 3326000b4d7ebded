"""Reading and writing the ``keras-mha`` and ``keras-gqa`` weight files (Keras' ``.weights.h5``).

Part of :mod:`mha_multi.interop.keras`, whose notes say what the files hold.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from mha_multi import spec
from mha_multi.interop.formats import check_heads_given, check_stored_heads, resolve_heads
from mha_multi.interop.keras._gqa import from_keras_gqa_state, to_keras_gqa
from mha_multi.interop.keras._h5_groups import (
    _GQA_FILE_GROUPS,
    _GQA_GATE_GROUP,
    _MHA_FILE_GROUPS,
    _group_arrays,
    _only_group,
    _open_weights_file,
)
from mha_multi.interop.keras._mha import from_keras_mha_state, to_keras_mha
from mha_multi.keras import _native
from mha_multi.weights import check_weights

__all__ = ["load_keras_gqa", "load_keras_mha", "save_keras_gqa", "save_keras_mha"]


def load_keras_mha(
    path: str | os.PathLike[str],
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> dict[str, np.ndarray]:
    """Canonical weights from a Keras ``.weights.h5`` file holding one ``MultiHeadAttention``.

    The file is what ``model.save_weights`` writes for a model with exactly
    one ``keras.layers.MultiHeadAttention``; other layers' variables are
    ignored.

    Args:
        path: the ``.weights.h5`` file.
        num_heads: if given, checked against the heads stored in the kernels.
        num_kv_heads: if given, likewise (every head has its own key and value).
        head_dim: if given, checked against the stored ``key_dim``.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a file that is not HDF5 or is damaged, no or several
            attention layers, an unexpected variable layout, shapes the
            canonical layer cannot express, or a head option that differs
            from the file's.
    """
    path = os.fspath(path)
    with _open_weights_file(path) as file:
        group = _only_group(path, file, _MHA_FILE_GROUPS, "MultiHeadAttention")
        arrays = _group_arrays(group, _MHA_FILE_GROUPS)
    weights = from_keras_mha_state(arrays)
    shape = arrays["query/kernel"].shape
    check_stored_heads(
        spec.Heads(num_heads=shape[1], num_kv_heads=shape[1], head_dim=shape[2]),
        path,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        detail=f" (query kernel shape {shape})",
    )
    return weights


def _save_model(path: str, layer: keras.layers.Layer, config: Any) -> None:
    """``save_weights`` of the functional model ``layer(query, value, key)``.

    Raises:
        ValueError: the layer's variables are not of its dtype (float64 ones on Keras'
            JAX backend without x64): the file would not hold the weights.
    """
    held = {keras.backend.standardize_dtype(variable.value.dtype) for variable in layer.weights}
    if held != {layer.dtype}:
        raise ValueError(
            f"Keras' {keras.backend.backend()} backend holds {layer.dtype} weights as "
            f"{', '.join(sorted(held))}: the file would change them (on JAX, "
            "jax.config.update('jax_enable_x64', True) gives float64)"
        )
    query = keras.Input((None, config.query_size), name="query")
    value = keras.Input((None, config.value_size), name="value")
    key = keras.Input((None, config.key_size), name="key")
    model = keras.Model([query, value, key], layer(query, value, key))
    model.save_weights(path)


def _dtype_of(arrays: Mapping[str, np.ndarray]) -> str:
    """The weights' dtype, the layer's: a file holds its variables in the layer's dtype
    (Keras' default, float32, would round float64 weights and widen float16 ones)."""
    return str(arrays["W_q"].dtype)


def _check_weights_path(path: str) -> None:
    if not path.lower().endswith(".weights.h5"):
        raise ValueError(f"Keras weights files must end in .weights.h5; got {path!r}")


def save_keras_mha(
    path: str | os.PathLike[str],
    weights: Mapping[str, Any],
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> None:
    """Writes canonical weights as a Keras ``.weights.h5`` file of one ``MultiHeadAttention``.

    The file is ``save_weights`` of a functional model
    ``MultiHeadAttention(num_heads, key_dim)(query, value, key)`` whose layer
    is named ``multi_head_attention`` (Keras' default name); a model of that
    structure, with that layer name, loads it with ``load_weights``.

    Args:
        path: destination, ending in ``.weights.h5`` (Keras' rule).
        weights: canonical weights.
        num_heads: ``H``.
        num_kv_heads: if given, checked against the weights (``H``: the layer
            has no grouped heads).
        head_dim: if given, checked against the weights (``num_hiddens / H``).

    Raises:
        ValueError: a path not ending in ``.weights.h5``, invalid weights,
            ``num_hiddens`` not divisible by ``num_heads``, grouped key/value
            heads or an explicit ``head_dim`` (``keras-gqa`` holds those), or
            head options that do not fit the weights.
    """
    path = os.fspath(path)
    _check_weights_path(path)
    arrays, config = check_weights(weights)
    try:
        _native.check_native_mha_layout(config)
    except ValueError as error:
        raise ValueError(f"{error}; its files are the keras-gqa format") from error
    resolve_heads(arrays, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    layer = to_keras_mha(arrays, num_heads, name="multi_head_attention", dtype=_dtype_of(arrays))
    _save_model(path, layer, config)


def load_keras_gqa(
    path: str | os.PathLike[str],
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> dict[str, np.ndarray]:
    """Canonical weights from a Keras ``.weights.h5`` file holding one ``GroupQueryAttention``.

    The file is what ``model.save_weights`` writes for a model with exactly
    one ``keras.layers.GroupQueryAttention``; other layers' variables are
    ignored. The kernels store the head layout (:func:`from_keras_gqa_state`
    reads it); a weights file holds no configuration, so a layer's
    ``sliding_window``, which has no weights, cannot be seen and is not refused.

    Args:
        path: the ``.weights.h5`` file.
        num_heads: if given, checked against the query heads stored in the kernels.
        num_kv_heads: if given, checked against the key/value heads stored.
        head_dim: if given, checked against the head size stored.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a file that is not HDF5 or is damaged, no or several
            such layers, a gate (``use_gate=True``), an unexpected variable
            layout, shapes no head layout explains, or a head option that
            differs from the file's.
    """
    path = os.fspath(path)
    with _open_weights_file(path) as file:
        group = _only_group(path, file, _GQA_FILE_GROUPS, "GroupQueryAttention")
        arrays = _group_arrays(group, {**_GQA_FILE_GROUPS, **_GQA_GATE_GROUP})
    weights, layout = from_keras_gqa_state(arrays)
    check_stored_heads(
        spec.Heads(**layout),
        path,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        detail=f" (query kernel shape {arrays['query/kernel'].shape}, key kernel shape "
        f"{arrays['key/kernel'].shape})",
    )
    return weights


def save_keras_gqa(
    path: str | os.PathLike[str],
    weights: Mapping[str, Any],
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> None:
    """Writes canonical weights as a Keras ``.weights.h5`` file of one ``GroupQueryAttention``.

    The file is ``save_weights`` of a functional model
    ``GroupQueryAttention(head_dim, num_heads, num_kv_heads)(query, value,
    key)`` whose layer is named ``grouped_query_attention`` (Keras' default
    name); a model of that structure, with that layer name, loads it with
    ``load_weights``.

    Args:
        path: destination, ending in ``.weights.h5`` (Keras' rule).
        weights: canonical weights with ``query_size == value_size ==
            num_hiddens`` (see Raises).
        num_heads, num_kv_heads, head_dim: the head layout; one is needed,
            the widths give the others, and those given too are checked
            (:func:`mha_multi.interop.formats.resolve_heads`).

    Raises:
        ValueError: a path not ending in ``.weights.h5``, invalid weights, no
            head option or ones that do not fit the weights,
            ``query_size != num_hiddens`` (the layer projects back to the
            query size), or ``value_size != query_size`` (Keras builds the
            layer in a model only for values of the query's size).
    """
    path = os.fspath(path)
    _check_weights_path(path)
    options = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    check_heads_given("keras-gqa", reading=False, **options)
    arrays, config = check_weights(weights)
    heads = resolve_heads(arrays, **options)
    assert heads is not None  # check_heads_given
    layer = to_keras_gqa(
        arrays,
        num_heads=heads.num_heads,
        num_kv_heads=heads.num_kv_heads,
        name="grouped_query_attention",
        dtype=_dtype_of(arrays),
    )
    if config.value_size != config.query_size:
        raise ValueError(
            "keras.layers.GroupQueryAttention takes values of the query's size in a model "
            f"(Keras checks the shapes when it builds one): value_size ({config.value_size}) "
            f"must equal query_size ({config.query_size})"
        )
    _save_model(path, layer, config)
