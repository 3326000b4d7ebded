"""The MXNet layer's projections and parameters, on arrays and on symbols.

:class:`Projections` is the driver's view of the layer
(:class:`mha_multi.call.Projections`) for one call: ``F.npx.fully_connected``
of the inputs and of the gated context, with the parameters an imperative
call reads from its Gluon parameters (:func:`parameter_arrays`) or a graph
receives as inputs. The canonical weights go in and out of the ``W_q``...
``W_o`` ``nn.Dense`` blocks here (:func:`set_weights`, :func:`get_weights`),
and an empty call is answered from shapes (:func:`empty_attention`).

The functions take the layer as a Gluon block with the attributes of
:class:`mha_multi.mxnet.MultiHeadAttention`; this module imports no layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import gluon
from mxnet.gluon import nn

from mha_multi import spec
from mha_multi.mxnet._facts import host_array
from mha_multi.mxnet._ops import MXNetOps
from mha_multi.weights import KERNEL_NAMES, NORM_NAMES, SINKS_NAME, check_layer_weights

__all__ = [
    "PROJECTIONS",
    "Projections",
    "empty_attention",
    "get_weights",
    "in_units",
    "load_parameter",
    "parameter_arrays",
    "set_weights",
    "zero_link",
]

Array = Any
#: The projections, as in the ``W_q``... ``W_o`` block names.
PROJECTIONS = ("q", "k", "v", "o")


class Projections:
    """The layer's projections for one call (:class:`mha_multi.call.Projections`).

    Args:
        ops: the adapter of the call's arrays or symbols (its ``np``/``npx``).
        params: ``W_q_weight``, ``W_q_bias``... as arrays or symbols; biases
            only with ``bias=True``, and only the projections the call uses;
            ``q_norm`` and ``k_norm`` with ``qk_norm``.
        heads: the layer's head layout.
        num_hiddens: the output size.
        dtype: the parameters' dtype.
    """

    def __init__(
        self,
        ops: MXNetOps,
        params: Mapping[str, Array],
        *,
        heads: spec.Heads,
        num_hiddens: int,
        dtype: Any,
    ) -> None:
        self._ops = ops
        self._params = params
        self._heads = heads
        self._dtype = np.dtype(dtype)
        self._features = {
            "q": heads.query_features,
            "k": heads.kv_features,
            "v": heads.kv_features,
            "o": num_hiddens,
        }

    @property
    def heads(self) -> spec.Heads:
        return self._heads

    def _project(self, x: Array, name: str) -> Array:
        weight, bias = self._params[f"W_{name}_weight"], self._params.get(f"W_{name}_bias")
        low_precision = self._dtype.itemsize < 4
        if low_precision:
            # The spec accumulates 16-bit products in float32 and rounds once;
            # MXNet's kernels promise nothing (its CPU kernel has no float16
            # at all), so the product is taken in float32 on every device.
            x, weight = x.astype(np.float32), weight.astype(np.float32)
            bias = None if bias is None else bias.astype(np.float32)
        y = self._ops.npx.fully_connected(
            x, weight, bias, no_bias=bias is None, num_hidden=self._features[name], flatten=False
        )
        return y.astype(self._dtype) if low_precision else y

    def project_inputs(
        self, queries: Array, keys: Array | None, values: Array | None
    ) -> tuple[Array | None, ...]:
        """``(q, k, v)``; ``k`` and ``v`` ``None`` without keys (a cached call appending none)."""
        q = self._project(queries, "q")
        if keys is None:
            return q, None, None
        return (q, *self.project_new(keys, values))

    def project_new(self, keys: Array, values: Array) -> tuple[Array, Array]:
        """``(k, v)``: a cached call's new positions, projected to be written into the cache."""
        return self._project(keys, "k"), self._project(values, "v")

    def qk_norm_weights(self) -> tuple[Array, Array]:
        """``(q_norm, k_norm)``: the query/key norms' arrays (``qk_norm`` set)."""
        return self._params["q_norm"], self._params["k_norm"]

    def sink_logits(self) -> Array:
        """The heads' sink logits ``(H,)`` (the ``sinks`` entry of the parameters)."""
        return self._params[SINKS_NAME]

    def project_output(self, context: Array, gates: Array | None) -> Array:
        """``W_o`` of the context, each head's slice times its gate."""
        gated = spec.apply_head_mask(self._ops, context, gates, self._heads.num_heads)
        return self._project(gated, "o")


def in_units(dense: nn.Dense) -> int | None:
    """The input size of a ``Dense`` block; ``None`` while deferred."""
    size = dense.weight.shape[1]
    return int(size) if size > 0 else None


def parameter_arrays(
    layer: gluon.HybridBlock,
    ctx: mx.Context,
    queries: Array | None,
    keys: Array | None,
    values: Array | None,
    *,
    projections: tuple[str, ...] = PROJECTIONS,
) -> dict[str, Array]:
    """The parameters' arrays on ``ctx``, by graph name; deferred sizes fixed by the inputs.

    A parameter whose size is deferred and no input fixes (``keys`` or
    ``values`` ``None``) has no value yet, and is left out.
    """
    inputs = {"q": queries, "k": keys, "v": values, "o": None}
    arrays = {}
    for name in projections:
        dense, x = getattr(layer, f"W_{name}"), inputs[name]
        for kind, parameter in (("weight", dense.weight), ("bias", dense.bias)):
            if parameter is None:
                continue
            if x is not None and kind == "weight" and in_units(dense) is None:
                # Gluon's deferred initialization, which a graph call would do.
                parameter.shape = (parameter.shape[0], x.shape[2])
                parameter._finish_deferred_init()
            if x is None and parameter._deferred_init:
                continue  # its size is still unknown, so it has no value
            arrays[f"W_{name}_{kind}"] = parameter.data(ctx)
    if layer.options.qk_norm is not None:
        arrays.update({name: getattr(layer, name).data(ctx) for name in NORM_NAMES})
    if "q" in projections and getattr(layer, "sinks", None) is not None:
        arrays[SINKS_NAME] = layer.sinks.data(ctx)  # a call that attends reads them
    return arrays


def zero_link(x: Array) -> Array:
    """A 0-d zero whose gradient to ``x`` is zeros of ``x``'s shape, whatever ``x`` holds.

    ``0 * x`` would be NaN where ``x`` is not finite.
    """
    return mx.np.zeros_like(x).sum()


def empty_attention(
    layer: gluon.HybridBlock,
    queries: Array,
    keys: Array | None,
    values: Array | None,
    num_keys: int,
    head_mask: Array | None = None,
) -> tuple[Array, Array]:
    """The spec's ``(output, weights)`` when ``B``, ``Q`` or ``K`` is 0, built from shapes.

    MXNet 1.9's kernels fail on these shapes (some crash the process, some
    leave the engine unusable). With no keys every query's context is empty
    (zero), so the output is ``b_o`` broadcast (zeros without bias) and the
    weights are ``(B, H, Q, 0)``; with no queries or no batch everything is
    empty. Every input and parameter is linked into the result with a zero
    contribution, so that a backward pass writes them zero gradients of
    their own shapes (and ``b_o`` the sum of the output's gradient), as the
    reference does, instead of leaving earlier gradients in place. ``keys``
    and ``values`` may be ``None`` (a cached call without them); ``num_keys``
    is ``K``, or a cache's ``max_length``. A ``head_mask`` gates a zero
    context: its gradient is zero too.
    """
    ctx, dtype = queries.ctx, layer.dtype
    batch, num_queries = queries.shape[0], queries.shape[1]
    parameters = parameter_arrays(layer, ctx, queries, keys, values).values()
    output = mx.np.zeros((batch, num_queries, layer.num_hiddens), dtype=dtype, ctx=ctx)
    if layer.bias and output.size:
        output = output + layer.W_o.bias.data(ctx)
    if mx.autograd.is_recording():
        for x in (queries, keys, values, head_mask, *parameters):
            if x is not None:
                output = output + zero_link(x)
    weights_shape = (batch, layer.num_heads, num_queries, num_keys)
    return output, mx.np.zeros(weights_shape, dtype=dtype, ctx=ctx)


# -- canonical weights ---------------------------------------------------------------


def _initialized(parameter: gluon.Parameter) -> bool:
    try:
        parameter.data()
    except (gluon.parameter.DeferredInitializationError, RuntimeError):
        return False
    return True


def load_parameter(parameter: gluon.Parameter, array: np.ndarray, ctx: mx.Context | None) -> None:
    """Sets a Gluon parameter to ``array``, creating it (on ``ctx``) where it is not yet."""
    if not _initialized(parameter):
        try:
            contexts = parameter.list_ctx()  # deferred initialization keeps its devices
        except RuntimeError:
            contexts = [ctx or mx.context.current_context()]
        parameter.shape = array.shape
        # Zeros, not the default random initializer: the values are replaced
        # at once, and MXNet 1.9's numpy uniform sampler rejects float64 outputs.
        parameter.initialize(init=mx.init.Zero(), ctx=contexts, force_reinit=True)
    parameter.set_data(mx.np.array(array, dtype=parameter.dtype))


def set_weights(
    layer: gluon.HybridBlock, weights: Mapping[str, Any], *, ctx: mx.Context | None = None
) -> gluon.HybridBlock:
    """Loads canonical weights into ``layer`` (strict) and returns it.

    ``layer`` is a :class:`mha_multi.mxnet.MultiHeadAttention`. Entries may
    be numpy arrays, ``mxnet.numpy`` arrays or legacy ``mxnet.nd`` arrays, on
    any device.

    Deferred input sizes are fixed by the weights. Parameters not initialized
    yet are created on ``ctx`` (default: the current context); initialized
    ones keep their devices. Values are converted to the parameters' dtype.

    Raises:
        ValueError: a missing, extra or mis-shaped entry, named.
    """
    if isinstance(weights, Mapping):
        # numpy would wrap an MXNet array as a 0-d object array, not read it.
        weights = {name: host_array(value) for name, value in weights.items()}
    arrays, _ = check_layer_weights(weights, layer)
    for name, array in arrays.items():
        if name in NORM_NAMES:
            load_parameter(getattr(layer, name), array, ctx)
            continue
        if name == SINKS_NAME:
            load_parameter(layer.sinks, array, ctx)
            continue
        dense = getattr(layer, f"W_{name[-1]}")
        if name in KERNEL_NAMES:
            load_parameter(dense.weight, np.ascontiguousarray(array.T), ctx)
        else:
            load_parameter(dense.bias, array, ctx)
    return layer


def get_weights(layer: gluon.HybridBlock) -> dict[str, np.ndarray]:
    """The canonical weights of a :class:`mha_multi.mxnet.MultiHeadAttention` as numpy arrays.

    They have the parameters' dtype.

    Raises:
        ValueError: some input size is still deferred (call the layer once,
            or pass ``query_size``/``key_size``/``value_size``).
        RuntimeError: the parameters are not initialized.
    """
    spec.check_sizes_known(layer.input_sizes())
    weights = {}
    for name in KERNEL_NAMES:
        dense = getattr(layer, name)
        weights[name] = np.ascontiguousarray(host_array(dense.weight).T)
        if layer.bias:
            weights[f"b_{name[-1]}"] = host_array(dense.bias)
    if layer.options.qk_norm is not None:
        weights.update({name: host_array(getattr(layer, name)) for name in NORM_NAMES})
    if layer.sinks is not None:
        weights[SINKS_NAME] = host_array(layer.sinks)
    return weights
