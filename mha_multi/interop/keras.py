"""Canonical weights to and from ``keras.layers.MultiHeadAttention``,
``keras.layers.GroupQueryAttention`` and d2l's Keras layer.

``keras.layers.MultiHeadAttention(num_heads=H, key_dim=dh)`` on 3-D inputs
computes the spec's function with ``num_hiddens = H * dh``. Its projections
are ``EinsumDense`` layers named ``query``, ``key``, ``value`` (kernels
``(in, H, dh)``, biases ``(H, dh)``) and ``output`` (kernel ``(H, dh, out)``,
bias ``(out,)``); reshaping a kernel to ``(in, H * dh)`` puts head ``h`` in
columns ``[h*dh, (h+1)*dh)``, the spec's head layout, so the canonical
weights are those kernels reshaped. Things callers must mind:

* scaling: Keras scales the scores by ``1/sqrt(key_dim)``, which is the
  spec's ``1/sqrt(head_dim)`` since ``key_dim`` is the head size;
* call order: Keras' layer is called ``(query, value, key)``, the spec's
  ``(queries, keys, values)``;
* masks: Keras' ``attention_mask`` is ``(B, Q, K)`` with ``True`` where a key
  is *visible* (:func:`attention_mask` builds it from ``valid_lens``);
  ``valid_lens`` counts visible keys. Keras' ``use_causal_mask`` aligns the
  triangle top-left, which equals the spec's bottom-right ``causal`` only
  when ``Q == K``; :func:`attention_mask` with ``causal=True`` gives the
  spec's rule for any sizes;
* fully hidden rows: the spec replaces hidden scores by ``-1e6``, so a
  query that sees no key gets uniform weights (the mean of all values).
  Keras' layer has two paths. Without scores and dropout it calls
  ``keras.ops.dot_product_attention``, which replaces hidden scores by a
  huge negative number: uniform weights, the spec's result. With
  ``return_attention_scores=True`` or dropout it uses its masked
  ``Softmax``, which zeroes hidden weights after the softmax: such a row
  attends to nothing, and its output is the output bias alone. Rows that
  see a key agree on both paths;
* returned scores are ``(B, H, Q, K)`` like the spec's weights.

What the canonical layer cannot express raises a ``ValueError`` saying what
is unsupported: attention over several axes, ``value_dim != key_dim``, an
``output_shape`` other than ``num_hiddens``, biases on some projections
only, a gate (``use_gate``) or a ``sliding_window``. The other way, these
converters hold d2l's head layout only: grouped key/value heads, which
``keras.layers.MultiHeadAttention`` lacks, or an explicit ``head_dim`` raise
a ``ValueError`` pointing to ``GroupQueryAttention``.

``keras.layers.GroupQueryAttention(head_dim, num_query_heads,
num_key_value_heads)`` computes the spec's grouped-query attention (docs:
"The spec", grouped heads) with ``num_heads = num_query_heads`` and
``num_kv_heads = num_key_value_heads``: it repeats each projected key/value
head ``G = num_heads // num_kv_heads`` times one after the other
(``ops.repeat`` on the heads axis), so query head ``h`` reads key/value head
``h // G``, the spec's rule. Its projections are ``EinsumDense`` layers named
``query`` (kernel ``(in, num_heads, head_dim)``), ``key`` and ``value``
(``(in, num_kv_heads, head_dim)``) and ``attention_output`` (``(num_heads,
head_dim, query_size)``), biases ``(heads, head_dim)`` and ``(query_size,)``
iff ``use_bias`` (on by default); the canonical weights are those kernels
reshaped, as above. What differs from ``MultiHeadAttention``, and what not:

* it scales the scores by ``1/sqrt(head_dim)``, the spec's scale, for any
  ``head_dim`` (it need not divide the output size);
* its output has the query's size (it has no ``output_shape``), so only
  weights with ``query_size == num_hiddens`` convert to it;
* call order, ``attention_mask`` polarity and shape, the top-left
  ``use_causal_mask`` and the two paths for fully hidden rows are those of
  ``MultiHeadAttention`` above (the same ``ops.dot_product_attention``, or
  the masked ``Softmax`` with scores or dropout); its dropout, like the
  spec's, drops attention weights;
* a gate (``use_gate``) or a ``sliding_window`` has no canonical form and
  is refused both ways.

Files: :func:`load_keras_mha`/:func:`save_keras_mha` and
:func:`load_keras_gqa`/:func:`save_keras_gqa` read and write what
``model.save_weights`` writes (``.weights.h5``) for a model holding one such
layer (the ``keras-mha`` and ``keras-gqa`` formats of ``python -m mha_multi
convert``; :func:`weights_file_format` tells them apart). The kernels store
the head layout, which the readers check head options against. A weights
file holds no configuration: a ``sliding_window``, which has no weights,
cannot be seen in one. Keras builds a ``GroupQueryAttention`` in a model
only for values of the query's size, so only such weights are written.

d2l's Keras/TensorFlow ``MultiHeadAttention`` holds ``keras.layers.Dense``
projections ``W_q``, ``W_k``, ``W_v``, ``W_o`` (``use_bias=False`` in the
book); their kernels are already canonical (:func:`from_keras_d2l`,
:func:`to_keras_d2l`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from mha_multi import spec
from mha_multi.interop.formats import check_heads_given, check_stored_heads, resolve_heads
from mha_multi.keras import _facts as _backend
from mha_multi.keras import _native
from mha_multi.weights import check_weights

__all__ = [
    "KERAS_GQA_NAMES",
    "KERAS_MHA_NAMES",
    "attention_mask",
    "from_keras_d2l",
    "from_keras_gqa",
    "from_keras_gqa_state",
    "from_keras_mha",
    "from_keras_mha_state",
    "load_keras_gqa",
    "load_keras_mha",
    "save_keras_gqa",
    "save_keras_mha",
    "to_keras_d2l",
    "to_keras_gqa",
    "to_keras_gqa_state",
    "to_keras_mha",
    "to_keras_mha_state",
    "weights_file_format",
]

#: Keras' sublayer name -> canonical projection letter.
KERAS_MHA_NAMES = _native.NATIVE_PROJECTIONS
#: ``keras.layers.GroupQueryAttention``'s sublayer name -> canonical projection letter.
KERAS_GQA_NAMES = _native.NATIVE_GQA_PROJECTIONS


def _kernels_of_state(
    state: Mapping[str, Any], names: Mapping[str, str], layer: str
) -> tuple[dict[str, np.ndarray], bool]:
    """The kernels of a Keras attention layer's arrays, and whether it has biases.

    Args:
        state: ``<sublayer>/kernel`` and ``<sublayer>/bias`` arrays.
        names: the layer's sublayer names.
        layer: the layer's class name, for messages.

    Raises:
        ValueError: an unexpected entry, a missing kernel, or biases on some
            projections only.
    """
    expected = {f"{name}/{kind}" for name in names for kind in ("kernel", "bias")}
    extra = sorted(set(state) - expected)
    if extra:
        raise ValueError(f"unexpected keras.layers.{layer} entries: {extra}")
    missing = [f"{name}/kernel" for name in names if f"{name}/kernel" not in state]
    if missing:
        raise ValueError(f"keras.layers.{layer} weights are missing {missing}")
    with_bias = [name for name in names if f"{name}/bias" in state]
    if with_bias and len(with_bias) != len(names):
        raise ValueError(
            f"unsupported: biases on some projections only ({', '.join(with_bias)}); "
            "the canonical layer has biases on all four or on none"
        )
    return {name: np.asarray(state[f"{name}/kernel"]) for name in names}, bool(with_bias)


def _projection_state(projections: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``<name>/kernel`` and, where there is one, ``<name>/bias`` of each projection, as numpy."""
    state = {}
    for name, dense in projections.items():
        state[f"{name}/kernel"] = _backend.host_array(dense.kernel)
        if dense.bias is not None:
            state[f"{name}/bias"] = _backend.host_array(dense.bias)
    return state


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
    config = layer.get_config()
    if config.get("use_gate"):
        raise ValueError("unsupported keras.layers.MultiHeadAttention option: use_gate=True")
    if config.get("sliding_window") is not None:
        raise ValueError(
            "unsupported keras.layers.MultiHeadAttention option: "
            f"sliding_window={config['sliding_window']}"
        )
    axes = config.get("attention_axes")
    if axes is not None and len(tuple(axes)) != 1:
        raise ValueError(
            f"unsupported: attention over several axes (attention_axes={tuple(axes)}); "
            "the canonical layer attends over the sequence axis of 3-D inputs"
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
            weights fix.

    Returns:
        The layer, built for ``(B, Q, query_size)`` queries and
        ``(B, K, key_size|value_size)`` keys and values. Its output has
        ``num_hiddens`` features (``output_shape`` is set when
        ``query_size`` differs).

    Raises:
        ValueError: invalid weights, ``num_hiddens`` not divisible by
            ``num_heads``, grouped key/value heads or an explicit ``head_dim``
            (:func:`to_keras_gqa` holds those), or a keyword the weights fix.
    """
    fixed = sorted({"key_dim", "value_dim", "use_bias", "output_shape"} & set(kwargs))
    if fixed:
        raise ValueError(f"{', '.join(fixed)} follow from the weights; do not pass them")
    return _native.native_layer(weights, num_heads, **kwargs)


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
        ValueError: as :func:`to_keras_gqa_state`, or a keyword refused above.
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


def attention_mask(
    valid_lens: Any, num_queries: int, num_keys: int, *, causal: bool = False
) -> np.ndarray:
    """Keras' boolean ``attention_mask`` equivalent to the spec's masking.

    Args:
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``; with ``None``, pass
            ``causal=True`` (otherwise nothing is hidden and no mask is needed).
        num_queries: ``Q``.
        num_keys: ``K``.
        causal: the spec's bottom-right aligned causal rule.

    Returns:
        ``(B, Q, K)`` (or ``(1, Q, K)`` without lengths), ``True`` where a key
        is visible (Keras' polarity).

    Raises:
        ValueError: neither lengths nor ``causal``.
    """
    if valid_lens is None and not causal:
        raise ValueError("nothing is hidden without valid_lens or causal=True: pass no mask")
    lens = None if valid_lens is None else np.asarray(valid_lens)
    if lens is not None:
        spec.check_valid_lens_dtype(lens.dtype.kind)
    visible = spec.visibility(spec.NumpyOps(), num_queries, num_keys, lens, causal=causal)
    batch = 1 if lens is None else lens.shape[0]
    return np.broadcast_to(visible, (batch, 1, num_queries, num_keys))[:, 0].copy()


def from_keras_d2l(layer: Any) -> dict[str, np.ndarray]:
    """Canonical weights of d2l's Keras/TensorFlow ``MultiHeadAttention`` (or ours).

    d2l's layer holds ``keras.layers.Dense`` projections ``W_q``, ``W_k``,
    ``W_v``, ``W_o``; their kernels are canonical as they are.

    Args:
        layer: any object whose ``W_q``... attributes have a ``kernel`` and,
            with biases, a ``bias`` (Dense layers), or are variables (ours).

    Raises:
        ValueError: a missing projection or invalid weights.
    """
    weights = {}
    for name in ("W_q", "W_k", "W_v", "W_o"):
        projection = getattr(layer, name, None)
        if projection is None:
            raise ValueError(f"the layer has no {name} projection (not built yet?)")
        if isinstance(projection, keras.Variable):  # ours: the kernel itself, b_* beside it
            kernel, bias = projection, getattr(layer, f"b_{name[-1]}", None)
        else:  # a Dense layer
            kernel, bias = projection.kernel, projection.bias
        weights[name] = _backend.host_array(kernel)
        if bias is not None:
            weights[f"b_{name[-1]}"] = _backend.host_array(bias)
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


#: The groups of a ``.weights.h5`` file under a ``MultiHeadAttention``'s own
#: group -> its sublayer names (:data:`KERAS_MHA_NAMES`).
_MHA_FILE_GROUPS = {f"{name}_dense": name for name in KERAS_MHA_NAMES}
#: Likewise for ``GroupQueryAttention``, whose projections Keras saves under
#: the attributes that hold them (``_query_dense``...), not under their names.
_GQA_FILE_GROUPS = {
    "_query_dense": "query",
    "_key_dense": "key",
    "_value_dense": "value",
    "_output_dense": "attention_output",
}
#: A gated ``GroupQueryAttention``'s gate projection, refused when read.
_GQA_GATE_GROUP = {"_gate_dense": "gate"}


def _open_weights_file(path: str) -> Any:
    """``h5py.File(path, "r")``, with the errors of the file readers.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a file that is not HDF5, or is damaged.
    """
    import h5py

    if not os.path.exists(path):  # h5py reports it as a plain OSError
        raise FileNotFoundError(f"no such file: {path!r}")
    try:
        return h5py.File(path, "r")
    except OSError as error:  # h5py's error for a file that is not HDF5, or is damaged
        raise ValueError(f"{path!r} is not a readable .weights.h5 file: {error}") from error


def _find_groups(file: Any, children: Mapping[str, str]) -> list[Any]:
    """The groups of an h5 weights file that hold all of ``children`` (a layer's projections)."""
    import h5py

    found = []

    def visit(_: str, group: Any) -> None:
        if isinstance(group, h5py.Group) and all(child in group for child in children):
            found.append(group)

    file.visititems(visit)
    return found


def _only_group(path: str, file: Any, children: Mapping[str, str], layer: str) -> Any:
    """The one group holding a ``keras.layers.<layer>``'s projections.

    Raises:
        ValueError: none or several, named.
    """
    groups = _find_groups(file, children)
    if len(groups) != 1:
        names = [group.name for group in groups]
        raise ValueError(
            f"{path!r} must hold exactly one keras.layers.{layer}; "
            f"found {len(groups)} {names if names else ''}".rstrip()
        )
    return groups[0]


def _group_arrays(group: Any, children: Mapping[str, str]) -> dict[str, np.ndarray]:
    """``<sublayer>/kernel`` and ``<sublayer>/bias`` of the projections under ``group``.

    Children missing from ``group`` are skipped.

    Raises:
        ValueError: a projection holding other variables than a kernel and
            an optional bias.
    """
    arrays = {}
    for child, name in children.items():
        if child not in group:
            continue
        variables = group[child].get("vars", {})
        keys = sorted(variables, key=int)
        if keys not in (["0"], ["0", "1"]):
            raise ValueError(
                f"{group.name}/{child} holds variables {keys}; expected a kernel "
                "and an optional bias"
            )
        arrays[f"{name}/kernel"] = np.asarray(variables["0"])
        if len(keys) == 2:
            arrays[f"{name}/bias"] = np.asarray(variables["1"])
    return arrays


def weights_file_format(path: str | os.PathLike[str]) -> str:
    """Which layer a Keras ``.weights.h5`` file holds: ``"keras-gqa"`` or ``"keras-mha"``.

    A file with a ``GroupQueryAttention``'s projections (groups
    ``_query_dense``... under the layer's group) and no
    ``MultiHeadAttention``'s is ``keras-gqa``; any other is taken for
    ``keras-mha``, whose reader then checks it.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a file that is not HDF5, or is damaged.
    """
    with _open_weights_file(os.fspath(path)) as file:
        grouped = _find_groups(file, _GQA_FILE_GROUPS)
        multi_head = _find_groups(file, _MHA_FILE_GROUPS)
    return "keras-gqa" if grouped and not multi_head else "keras-mha"


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
    """``save_weights`` of the functional model ``layer(query, value, key)``."""
    query = keras.Input((None, config.query_size), name="query")
    value = keras.Input((None, config.value_size), name="value")
    key = keras.Input((None, config.key_size), name="key")
    model = keras.Model([query, value, key], layer(query, value, key))
    model.save_weights(path)


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
    _save_model(path, to_keras_mha(arrays, num_heads, name="multi_head_attention"), config)


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
    )
    if config.value_size != config.query_size:
        raise ValueError(
            "keras.layers.GroupQueryAttention takes values of the query's size in a model "
            f"(Keras checks the shapes when it builds one): value_size ({config.value_size}) "
            f"must equal query_size ({config.query_size})"
        )
    _save_model(path, layer, config)
