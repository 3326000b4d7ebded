"""The four projections of the Keras layer: its variables, their build, the products.

:class:`ProjectionLayer` is the base of :class:`mha_multi.keras.MultiHeadAttention`
holding what is the layer's state rather than its call: the canonical
weights as variables (created lazily, checked against a distribution that
splits heads), their build from the inputs' shapes, the input and output
projections (16-bit products accumulated in float32), saving under
canonical names, and :func:`set_weights`/:func:`get_weights`. The call
flow that uses the projections is :func:`mha_multi.call.forward`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from mha_multi import spec
from mha_multi.keras._facts import (
    as_numpy,
    device_of,
    device_scope,
    host_array,
    values_readable,
)
from mha_multi.keras._ops import OPS, check_held_dtype, is_16_bit, matmul_16_bit
from mha_multi.keras.sharding import cache_layout, check_variable_layout
from mha_multi.weights import (
    BIAS_NAMES,
    KERNEL_NAMES,
    NORM_NAMES,
    SINKS_NAME,
    check_layer_weights,
)

__all__ = ["ProjectionLayer", "get_weights", "set_weights"]

PROJECTIONS = ("q", "k", "v", "o")
_SIZE_NAMES = ("query_size", "key_size", "value_size")


class ProjectionLayer(keras.layers.Layer):
    """A Keras layer holding the projections ``W_q``, ``W_k``, ``W_v``, ``W_o`` (and biases).

    Its subclass sets, before it adds a projection: ``_heads``
    (:class:`~mha_multi.spec.Heads`), ``num_hiddens``, ``num_heads``,
    ``bias``, ``options``, ``kernel_initializer``, ``bias_initializer``, every
    ``W_*`` and ``b_*`` attribute (``None`` until created) and ``_head_parallel``.
    """

    def _add_projection(self, name: str, in_features: int) -> None:
        out_features = {
            "q": self._heads.query_features,
            "k": self._heads.kv_features,
            "v": self._heads.kv_features,
            "o": self.num_hiddens,
        }[name]
        kernel = self._add_head_weight(
            f"W_{name}", (in_features, out_features), self.kernel_initializer
        )
        setattr(self, f"W_{name}", kernel)
        if self.bias:
            bias = self._add_head_weight(f"b_{name}", (out_features,), self.bias_initializer)
            setattr(self, f"b_{name}", bias)

    def _add_norms(self) -> None:
        """The query/key norms' weights ``q_norm``, ``k_norm`` (``None`` without ``qk_norm``),
        initialised as the models do (docs: "Positions and biases")."""
        norm = self.options.qk_norm
        self.q_norm = self.k_norm = None
        for name, shape in ({} if norm is None else norm.shapes(self._heads)).items():
            initial = keras.initializers.Constant(norm.initial_value)
            setattr(self, name, self._add_head_weight(name, shape, initial))

    def qk_norm_weights(self) -> tuple[Any, Any]:
        """``(q_norm, k_norm)`` in the compute dtype (``qk_norm`` set)."""
        dtype = self.compute_dtype
        return tuple(
            w.value if OPS.dtype(w) == dtype else keras.ops.cast(w, dtype)
            for w in (self.q_norm, self.k_norm)
        )

    def _add_head_weight(
        self, name: str, shape: tuple[int, ...], initializer: Any, *, autocast: bool = True
    ) -> Any:
        """``add_weight``, refused where an active distribution would split a head.

        Checked before the variable exists, on the path it will have as far
        as the layer knows it (its parents are unknown before ``build``), so
        that a bad shard count is this ``ValueError`` rather than one from
        the backend laying the variable out; and again on the variable's
        actual path (docs: "Sharding heads").
        """
        check_variable_layout(self, name, f"{self.path or self.name}/{name}")
        variable = self.add_weight(
            shape=shape, initializer=initializer, name=name, autocast=autocast
        )
        if check_variable_layout(self, name, variable.path) > 1 and name == "W_q":
            # Heads split over devices: attend head by head, so that XLA keeps
            # each device's heads on it (docs: "Sharding heads").
            self._head_parallel = True
        return variable

    def canonical_variables(self) -> dict[str, keras.Variable]:
        """Canonical weight name -> variable, for the projections created so far."""
        variables = {}
        for name in (*KERNEL_NAMES, *BIAS_NAMES, *NORM_NAMES, SINKS_NAME):
            variable = getattr(self, name, None)
            if variable is not None:
                variables[name] = variable
        return variables

    def input_sizes(self) -> dict[str, int | None]:
        """``query_size``, ``key_size``, ``value_size``; ``None`` where still lazy."""
        sizes = {}
        for size_name, name in zip(_SIZE_NAMES, PROJECTIONS, strict=False):
            kernel = getattr(self, f"W_{name}")
            sizes[size_name] = None if kernel is None else int(kernel.shape[0])
        return sizes

    def build(
        self,
        queries_shape: tuple[int | None, ...],
        keys_shape: tuple[int | None, ...] | None = None,
        values_shape: tuple[int | None, ...] | None = None,
        valid_lens_shape: tuple[int | None, ...] | None = None,
        cache_shape: spec.KVCache | None = None,
    ) -> None:
        """Creates the projections still missing from the inputs' last dimensions.

        Args:
            queries_shape: ``(B, Q, query_size)``.
            keys_shape: ``(B, K, key_size)``; ``None`` only in a cached call
                that appends nothing.
            values_shape: ``(B, K, value_size)``, likewise.
            valid_lens_shape: ``None``, ``(B,)`` or ``(B, Q)``.
            cache_shape: the shapes of a cached call's cache
                (:class:`~mha_multi.spec.KVCache` of shapes), or ``None``.

        Raises:
            ValueError: shapes that disagree with each other or with known
                sizes, or a cached call without keys and values while
                ``key_size`` or ``value_size`` is still lazy.
        """
        shapes = (queries_shape, keys_shape, values_shape)
        sizes = self.input_sizes()
        if cache_shape is None:
            spec.check_inputs(*shapes, valid_lens_shape, **sizes)
        else:
            spec.check_cached_inputs(
                *shapes, valid_lens_shape, cache_shape, heads=self._heads, **sizes
            )
            lazy = [
                size_name
                for size_name, shape in (("key_size", keys_shape), ("value_size", values_shape))
                if shape is None and sizes[size_name] is None
            ]
            if lazy:
                raise ValueError(
                    f"{' and '.join(lazy)} not known yet, and a cached call without keys and "
                    "values cannot infer them: pass them to the constructor, or make the "
                    "layer's first call with keys and values"
                )
        for name, shape in zip(PROJECTIONS, shapes, strict=False):
            if getattr(self, f"W_{name}") is None and shape is not None:
                self._add_projection(name, int(shape[-1]))

    def _project(self, x: Any, name: str) -> Any:
        dtype = self.compute_dtype
        # (No cast where the dtype is the compute dtype already: an eager
        # operation each, on TensorFlow a dozen Python calls, for nothing.)
        if OPS.dtype(x) != dtype:
            x = OPS.cast(x, dtype)
        weight = getattr(self, f"W_{name}")
        kernel = weight.value if OPS.dtype(weight) == dtype else keras.ops.cast(weight, dtype)
        bias = getattr(self, f"b_{name}")
        if is_16_bit(dtype):
            # The bias joins the float32 accumulator: x @ W + b is rounded once.
            return matmul_16_bit(x, kernel, bias)
        y = OPS.matmul(x, kernel)
        return y if bias is None else keras.ops.add(y, keras.ops.cast(bias, dtype))

    # -- the driver's view of the layer (mha_multi.call.Projections) ----------

    @property
    def heads(self) -> spec.Heads:
        """The layer's heads."""
        return self._heads

    def project_inputs(self, queries: Any, keys: Any, values: Any) -> tuple[Any, ...]:
        """The input projections in the compute dtype; ``k``, ``v`` ``None`` without keys."""
        if keys is None:
            return self._project(queries, "q"), None, None
        return tuple(self._project(x, n) for x, n in ((queries, "q"), (keys, "k"), (values, "v")))

    def sink_logits(self) -> Any:
        """The heads' sink logits ``(H,)``, as their variable holds them (made without
        autocast: the softmax takes them in its own dtype, float32 for 16-bit scores, where a
        float32 logit rounded to a mixed policy's float16 first would be ``inf`` past 65504;
        docs: "Positions and biases")."""
        return self.sinks.value

    def project_output(self, context: Any, gates: Any) -> Any:
        """``W_o`` (and ``b_o``) of the heads' context ``(B, Q, H*dh)`` gated by ``gates``.

        The gates are :func:`mha_multi.spec.apply_head_mask`'s. In 16 bits
        they join the float32 product of the output projection, so that
        ``(context * gates) @ W_o + b_o`` is rounded once, as the projection
        without gates is, and so is its gradient with respect to the context
        (a gated context rounded to 16 bits first would add one rounding each
        way: twice the bfloat16 error in ``W_v``'s gradient).
        """
        dtype = self.compute_dtype
        if gates is None or not is_16_bit(dtype):
            return self._project(spec.apply_head_mask(OPS, context, gates, self.num_heads), "o")
        gated = spec.apply_head_mask(OPS, keras.ops.cast(context, "float32"), gates, self.num_heads)
        kernel = keras.ops.cast(keras.ops.cast(self.W_o, dtype), "float32")
        output = keras.ops.matmul(gated, kernel)
        if self.b_o is not None:
            output = keras.ops.add(output, keras.ops.cast(self.b_o, "float32"))
        return keras.ops.cast(output, dtype)

    def save_own_variables(self, store: Any) -> None:
        """Saves the variables under their canonical names (``W_q``...).

        Keras keys a layer's variables by creation order, which here depends
        on which input sizes were known at construction; names do not.
        """
        for name, variable in self.canonical_variables().items():
            store[name] = as_numpy(variable.value)

    def load_own_variables(self, store: Any) -> None:
        """Loads variables saved by :meth:`save_own_variables`."""
        variables = self.canonical_variables()
        if set(store.keys()) != set(variables):
            raise ValueError(
                f"layer {self.name!r} expects saved variables {sorted(variables)}; "
                f"got {sorted(store.keys())}"
            )
        for name, variable in variables.items():
            variable.assign(store[name])

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> spec.KVCache:
        """An empty key/value cache for incremental decoding with this layer.

        Args:
            batch_size: ``B``, the examples decoded together.
            max_length: the positions each example can hold.
            dtype: the dtype of the keys and values (``None``: the layer's
                compute dtype, what its projections give).

        Returns:
            :class:`~mha_multi.spec.KVCache` of zero ``keys`` and ``values``
            ``(batch_size, num_kv_heads, max_length, head_dim)`` and int32
            ``lengths`` ``(batch_size,)`` all 0, on the device of the layer's
            variables; under a distribution that splits the heads
            (:func:`mha_multi.keras.layout_map`), keys and values are split
            over their heads as ``W_k`` is
            (:func:`mha_multi.keras.sharding.cache_layout`).

        Raises:
            TypeError: ``batch_size`` or ``max_length`` is not an int, or
                ``dtype`` is not floating.
            ValueError: either is negative, or ``dtype`` is float64 on JAX
                without x64 (which would hold float32).
        """
        shape = spec.cache_shape(batch_size, max_length, self._heads)
        if dtype is None:
            dtype = self.compute_dtype
        else:
            spec.check_new_cache_dtype(dtype, _dtype_kind)
            dtype = keras.backend.standardize_dtype(dtype)
            check_held_dtype("dtype", dtype)
        variable = self.W_o.value
        # A traced value (stateless_call under jax.jit) has no device to ask;
        # the trace places the cache.
        placed = values_readable(variable)
        with device_scope(device_of(variable)) if placed else contextlib.nullcontext():
            cache = spec.KVCache(
                keras.ops.zeros(shape, dtype),
                keras.ops.zeros(shape, dtype),
                keras.ops.zeros(shape[:1], "int32"),
            )
        layout = cache_layout(self, batch_size)
        if layout is None:
            return cache
        # Under a distribution splitting the heads, each device keeps the
        # keys and values of its own heads (docs: "Sharding heads").
        distribute = keras.distribution.distribute_tensor
        return cache._replace(
            keys=distribute(cache.keys, layout), values=distribute(cache.values, layout)
        )


def set_weights(layer: ProjectionLayer, weights: Mapping[str, Any]) -> ProjectionLayer:
    """Loads canonical weights into ``layer`` (strict) and returns it.

    Lazy input sizes are fixed by the weights (the missing projections are
    built). Values are cast to each variable's dtype; float32 variables of a
    mixed-precision layer stay float32.

    Args:
        layer: the layer to load into (a :class:`~mha_multi.keras.MultiHeadAttention`).
        weights: canonical mapping ``W_q``, ``W_k``, ``W_v``, ``W_o`` (and
            ``b_*`` iff the layer has biases), ``x @ W + b`` orientation.

    Returns:
        ``layer``.

    Raises:
        ValueError: a missing, extra or mis-shaped entry, named.
    """
    arrays, config = check_layer_weights(weights, layer)
    if not layer.built:
        sizes = (config.query_size, config.key_size, config.value_size)
        layer.build(*((None, None, size) for size in sizes))
    variables = layer.canonical_variables()
    for name, array in arrays.items():
        variables[name].assign(array)
    return layer


def get_weights(layer: ProjectionLayer) -> dict[str, np.ndarray]:
    """The canonical weights of ``layer`` as numpy arrays.

    bfloat16 variables are returned as float32 (numpy has no bfloat16);
    every other dtype is kept.

    Args:
        layer: a :class:`~mha_multi.keras.MultiHeadAttention` whose input sizes are known.

    Returns:
        ``W_q``, ``W_k``, ``W_v``, ``W_o`` (and ``b_*`` with biases).

    Raises:
        ValueError: some input size is still lazy (call the layer once, or
            pass ``query_size``/``key_size``/``value_size``).
    """
    spec.check_sizes_known(layer.input_sizes())
    return {
        name: host_array(variable.value) for name, variable in layer.canonical_variables().items()
    }


def _dtype_kind(dtype: Any) -> str:
    """``"f"`` for a floating dtype Keras knows, ``"o"`` for another one."""
    return "f" if keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype)) else "o"
