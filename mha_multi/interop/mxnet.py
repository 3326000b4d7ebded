"""Canonical weights to and from d2l's MXNet ``MultiHeadAttention`` (Gluon parameters).

d2l's MXNet layer (numpy interface) holds four ``nn.Dense(num_hiddens,
use_bias=False, flatten=False)`` blocks named ``W_q``, ``W_k``, ``W_v`` and
``W_o``; Gluon stores a Dense weight as ``(out, in)``, the transpose of the
canonical kernel. ``block.save_parameters(path)`` writes them to a ``.params``
file under the names ``W_q.weight`` (and ``W_q.bias`` with ``use_bias=True``),
which is also what :class:`mha_multi.mxnet.MultiHeadAttention` writes, so
such files load into either layer. Ours with grouped key/value heads or an
explicit ``head_dim`` writes the same names with the widths of its layout;
those files load into ours built with that layout (d2l's layer has none).

d2l's layer computes the spec's function (its ``masked_softmax`` replaces
hidden scores by ``-1e6``) for integer-valued ``valid_lens`` (which d2l
passes as float32). A fractional length differs: d2l's ``SequenceMask``
truncates it (2.5 shows 2 keys), while the spec's rule ``j < 2.5`` shows 3.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import gluon, npx

from mha_multi.mxnet._facts import host_array
from mha_multi.mxnet._projections import load_parameter
from mha_multi.weights import (
    KERNEL_NAMES,
    check_only_projections,
    check_state_mapping,
    check_weights,
)

__all__ = [
    "from_mxnet_d2l",
    "from_mxnet_d2l_state",
    "load_mxnet_d2l",
    "save_mxnet_d2l",
    "to_mxnet_d2l",
    "to_mxnet_d2l_state",
]

# d2l's MXNet chapters run on the numpy interface; a no-op when already active.
npx.set_np()

_LAYERS = tuple(KERNEL_NAMES)  # ("W_q", "W_k", "W_v", "W_o")


def _numpy(value: Any) -> np.ndarray:
    return np.asarray(host_array(value))


def from_mxnet_d2l_state(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Canonical weights from d2l's MXNet layer parameters, keyed as in a ``.params`` file.

    Args:
        params: ``W_q.weight`` ``(num_hiddens, query_size)`` ... ``W_o.weight``,
            and ``W_x.bias`` ``(num_hiddens,)`` for a layer with biases (the
            widths of its head layout for ours with grouped heads); values
            are ``mxnet`` arrays, Gluon ``Parameter`` objects or numpy arrays
            (what ``mx.npx.load`` returns for a file from ``save_parameters``).

    Returns:
        Canonical weights (``W_q`` as ``(query_size, num_hiddens)`` ...).

    Raises:
        ValueError: an unexpected, missing or mis-shaped entry, named.
    """
    check_state_mapping(params, "params")
    weights = {}
    for name, value in params.items():
        layer, _, kind = name.partition(".")
        if layer not in _LAYERS or kind not in ("weight", "bias"):
            raise ValueError(f"unexpected entry {name!r} in d2l MultiHeadAttention parameters")
        array = _numpy(value)
        if kind == "weight":
            if array.ndim != 2:
                raise ValueError(f"{name} must be 2-D (out, in); got shape {array.shape}")
            weights[layer] = np.ascontiguousarray(array.T)
        else:
            weights[f"b_{layer[-1]}"] = np.array(array, copy=True)
    return check_weights(weights)[0]


def to_mxnet_d2l_state(weights: Mapping[str, Any]) -> dict[str, mx.np.ndarray]:
    """d2l's MXNet layer parameters (``.params`` names, ``(out, in)`` weights) from canonical ones.

    Raises:
        ValueError: invalid canonical weights (see :func:`mha_multi.weights.check_weights`).
    """
    arrays, _ = check_weights(weights)
    params = {}
    for name, array in arrays.items():
        if name in _LAYERS:
            key, value = f"{name}.weight", np.ascontiguousarray(array.T)
        else:
            key, value = f"W_{name[-1]}.bias", array
        params[key] = mx.np.array(value, dtype=value.dtype)
    return params


def from_mxnet_d2l(block: gluon.Block) -> dict[str, np.ndarray]:
    """Canonical weights of a d2l MXNet ``MultiHeadAttention`` block (or ours).

    Raises:
        ValueError: the block lacks a ``W_q``/``W_k``/``W_v``/``W_o`` Dense
            child, its weights are inconsistent, or it holds weights beyond the
            projections (ours with ``qk_norm`` or ``sinks``).
        RuntimeError: its parameters are not initialized (or sizes still deferred).
    """
    check_only_projections(block, "from_mxnet_d2l")
    params: dict[str, Any] = {}
    for layer in _LAYERS:
        dense = getattr(block, layer, None)
        _check_dense(block, dense, layer)
        params[f"{layer}.weight"] = dense.weight
        if dense.bias is not None:
            params[f"{layer}.bias"] = dense.bias
    return from_mxnet_d2l_state(params)


def to_mxnet_d2l(
    weights: Mapping[str, Any], block: gluon.Block, *, ctx: mx.Context | None = None
) -> gluon.Block:
    """Loads canonical weights into a d2l MXNet ``MultiHeadAttention`` block (strict).

    Deferred input sizes are fixed by the weights; parameters not initialized
    yet are created on ``ctx`` (default: the current context). Values are
    converted to the parameters' dtype. Returns the block.

    Raises:
        ValueError: invalid weights, a missing Dense block, biases on one side
            only, or a weight whose shape differs from the block's.
    """
    arrays, config = check_weights(weights)
    denses = {}
    for layer in _LAYERS:
        dense = getattr(block, layer, None)
        _check_dense(block, dense, layer)
        if (dense.bias is not None) != config.bias:
            raise ValueError(
                f"{layer} has {'a' if dense.bias is not None else 'no'} bias but the weights "
                f"{'have' if config.bias else 'have none'}"
            )
        denses[layer] = dense
    for name, array in arrays.items():
        dense = denses[name] if name in _LAYERS else denses[f"W_{name[-1]}"]
        parameter = dense.weight if name in _LAYERS else dense.bias
        value = np.ascontiguousarray(array.T) if name in _LAYERS else array
        known = tuple(parameter.shape or ())
        if len(known) != value.ndim or any(
            k not in (0, -1, v) for k, v in zip(known, value.shape, strict=True)
        ):
            raise ValueError(
                f"{name} of shape {array.shape} does not fit {parameter.name} of shape {known}"
            )
        load_parameter(parameter, value, ctx)
    return block


def _check_dense(block: gluon.Block, dense: Any, name: str) -> None:
    """Refuses what is no d2l projection: no ``Dense`` block, or one with an activation
    or that flattens its input (d2l's are linear, ``flatten=False``), which would give
    the weights another computation."""
    if not isinstance(dense, gluon.nn.Dense):
        raise ValueError(f"{type(block).__name__} has no Dense block {name!r}")
    if dense.act is not None:
        raise ValueError(f"{name} has the activation {dense.act!r}; d2l's projections are linear")
    if dense._flatten:
        raise ValueError(
            f"{name} flattens its input (flatten=True); d2l's projections take "
            "flatten=False, each position on its own"
        )


def _reason(error: Exception) -> str:
    # MXNet's messages open with a C++ backtrace; the last line is the failed check.
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1].removeprefix("MXNetError: ") if lines else type(error).__name__


def save_mxnet_d2l(path: str | os.PathLike[str], weights: Mapping[str, Any]) -> None:
    """Writes canonical weights as a ``.params`` file that d2l's layer ``load_parameters``."""
    npx.save(os.fspath(path), to_mxnet_d2l_state(weights))


def load_mxnet_d2l(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Canonical weights from a ``.params`` file of d2l's MXNet layer (``save_parameters``).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not a parameter file or does not hold exactly
            the layer's named parameters.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    try:
        try:
            loaded = npx.load(path)
        except mx.base.MXNetError as error:
            if "is_np_shape" not in str(error):
                raise
            # Saved outside the numpy interface (legacy NDArrays): read as Gluon does.
            with mx.util.np_array(False), mx.util.np_shape(False):
                loaded = mx.nd.load(path)
    except (mx.base.MXNetError, UnicodeDecodeError) as error:  # names are decoded as UTF-8
        raise ValueError(
            f"{path!r} is not a Gluon parameter file (truncated or corrupt?): {_reason(error)}"
        ) from error
    if not isinstance(loaded, dict):
        raise ValueError(f"{path!r} holds unnamed arrays, not Gluon parameters")
    return from_mxnet_d2l_state(loaded)
