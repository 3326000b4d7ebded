"""``MultiHeadAttention`` as a Keras 3 layer, written once against ``keras.ops``.

The layer runs on Keras' TensorFlow (primary), JAX and PyTorch backends: it
calls no TensorFlow, JAX or PyTorch function itself (whether values can be
read now is :func:`mha_multi.keras._backend.values_readable`'s to say). The
math is :func:`mha_multi.spec.attention` on the :mod:`mha_multi.keras._ops`
adapter.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import keras
import numpy as np

from mha_multi import heads, spec
from mha_multi.keras._backend import (
    BACKEND,
    as_numpy,
    device_of,
    device_scope,
    head_mask_gradient,
    host_array,
    values_readable,
)
from mha_multi.keras._ops import OPS, dtype_kind, index_dtype, is_16_bit, matmul_16_bit
from mha_multi.keras.sharding import cache_layout, check_variable_layout, head_vmap
from mha_multi.weights import BIAS_NAMES, KERNEL_NAMES, check_weights

__all__ = [
    "FUSED_BACKENDS",
    "FUSED_DTYPES",
    "FUSED_SCORE_LIMIT",
    "MultiHeadAttention",
    "values_exact",
    "check_cache_lengths",
    "get_weights",
    "head_importance",
    "set_weights",
]

#: Keras backends on which the default call goes through
#: ``keras.ops.dot_product_attention``: those where it measured faster than
#: the generic path (``python -m mha_multi.bench run keras-<backend>``, CPU,
#: B=8, D=512, H=8). PyTorch: SDPA, 2.3-2.8x faster at N=512-2048 and
#: O(N) memory. Not TensorFlow: its kernel is einsum + softmax like the
#: generic path, materialises a (B, H, Q, K) boolean mask besides, and was
#: not consistently faster (0.6-1.8x of the generic time eagerly, ~27% more
#: peak memory). Not JAX: 1.0-1.9x slower than the generic path on CPU.
FUSED_BACKENDS: frozenset[str] = frozenset({"torch"})

#: Compute dtypes the fused path takes, per Keras backend. Not float64: the
#: kernels are written for float32 and 16-bit (JAX's runs its softmax in
#: float32, TensorFlow's casts the scale through float32), which would cost
#: float64 its precision. Not float16 on JAX: the kernel asks for a float16
#: product accumulated in float32, which XLA:CPU does not compile. 16-bit
#: inputs run the kernel in float32 (see ``_fused_attention``).
FUSED_DTYPES: dict[str, frozenset[str]] = {
    "tensorflow": frozenset({"float32", "float16", "bfloat16"}),
    "jax": frozenset({"float32", "bfloat16"}),
    "torch": frozenset({"float32", "float16", "bfloat16"}),
}

#: Bound on ``|q . k| / sqrt(head_dim)`` below which the fused kernel gives
#: the spec's weights. The spec *replaces* hidden scores by ``MASK_VALUE``
#: (-1e6) while the kernels add a large negative number (Keras' PyTorch
#: backend: -0.7 times the dtype's maximum): the two agree only when every
#: hidden key's weight is exactly 0 both ways, i.e. when no visible score
#: of a row lies near or below -1e6 (exp(-5e5) is 0 in every float type).
FUSED_SCORE_LIMIT: float = -spec.MASK_VALUE / 2

_INPUT_NAMES = ("queries", "keys", "values")
_PROJECTIONS = ("q", "k", "v", "o")
_SIZE_NAMES = ("query_size", "key_size", "value_size")


def _is_tensor(x: Any) -> bool:
    return keras.ops.is_tensor(x) or isinstance(x, keras.KerasTensor)


@keras.saving.register_keras_serializable(package="mha_multi")
class MultiHeadAttention(keras.layers.Layer):
    """d2l's multi-head attention, exact to the spec of :mod:`mha_multi.spec`.

    The layer's variables are the canonical weights as they are: kernels
    ``W_q``, ``W_k``, ``W_v``, ``W_o`` used as ``x @ W + b`` (Keras ``Dense``
    orientation), and biases ``b_q``... ``b_o`` with ``bias=True``, of the
    shapes of docs: "Canonical weights and files" (every width
    ``num_hiddens`` by default). Input sizes left as ``None`` are inferred
    from the first call (Keras' lazy ``build``); given up front, the layer is
    built at construction.

    Grouped-query attention (docs: "The spec", grouped heads): with
    ``num_kv_heads < num_heads`` query head ``h`` reads key/value head
    ``h // (num_heads // num_kv_heads)``; ``W_k`` and ``W_v`` project to
    ``num_kv_heads * head_dim`` features, ``W_q`` to ``num_heads * head_dim``.

    The projections are the layer's own ``add_weight`` kernels rather than
    ``keras.layers.Dense`` sublayers because Keras' type promotion maps
    float64 to float32 on its JAX and PyTorch backends, and on PyTorch
    ``ops.matmul`` (and so ``Dense``) returns float32 for float64 inputs; the
    projections here go through the same float64-preserving product as the
    attention (:class:`mha_multi.keras._ops.KerasOps`).

    Fast path: a call that returns no weights and applies no dropout goes
    through ``keras.ops.dot_product_attention`` on the backends of
    :data:`FUSED_BACKENDS` (for the dtypes of :data:`FUSED_DTYPES`), with
    the spec's mask as a boolean mask (or the kernel's ``is_causal`` where
    that is the spec's rule: ``Q == K``, no lengths) and fully hidden rows
    corrected by :func:`mha_multi.spec.fix_fully_hidden_rows`; any other
    call takes the generic path of :func:`mha_multi.spec.attention`.

    Mixed precision: variables follow the policy's variable dtype (float32
    under ``mixed_float16``/``mixed_bfloat16``), the projections and the
    attention run in its compute dtype, and the masked softmax of 16-bit
    scores runs in float32 (the spec's rule). Queries, keys and values are
    cast to the compute dtype; ``valid_lens`` keeps its dtype (the layer is
    created with ``autocast=False``), because float lengths rounded to 16
    bits would move the mask.

    Incremental decoding (docs: "Generating with a cache"): :meth:`init_cache`
    makes an empty :class:`~mha_multi.spec.KVCache`, and a call with
    ``cache=`` appends the projected new keys and values at each example's
    own positions and attends to everything the cache holds, returning the
    updated cache with the output. The cache is a named tuple of tensors, so
    it passes through ``tf.function`` and ``jax.jit`` as it is.

    Heads (docs: "Heads"): ``head_mask=`` gates each head's context before
    ``W_o`` on every path; :func:`head_importance` measures the heads by the
    gates' gradients, and :func:`mha_multi.heads.prune_heads` gives the
    weights and constructor arguments of a layer without some heads.

    Args:
        num_hiddens: size of the output (and, by default, of every projection).
        num_heads: number of (query) heads ``H``; must divide ``num_hiddens``
            unless ``head_dim`` is given.
        dropout: dropout rate on the attention weights, active only in
            training (``training=True``).
        bias: whether the four projections have biases.
        query_size: last dimension of the queries (lazy when ``None``).
        key_size: last dimension of the keys (lazy when ``None``).
        value_size: last dimension of the values (lazy when ``None``).
        num_kv_heads: number of key/value heads; must divide ``num_heads``
            (``None``: ``num_heads``).
        head_dim: size of each head (``None``: ``num_hiddens // num_heads``).
        kernel_initializer: initializer of the ``W_*`` kernels (Keras
            ``Dense``'s default, as in d2l's TensorFlow layer).
        bias_initializer: initializer of the ``b_*`` biases.
        seed: seed of the dropout's ``keras.random.SeedGenerator``.
        **kwargs: ``keras.layers.Layer`` arguments (``name``, ``dtype``,
            ``trainable``...).
    """

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = False,
        *,
        query_size: int | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        heads = {"num_kv_heads": num_kv_heads, "head_dim": head_dim}
        spec.check_config(num_hiddens, num_heads, dropout, **heads)
        spec.check_input_sizes(query_size=query_size, key_size=key_size, value_size=value_size)
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        self._heads = spec.check_heads(num_hiddens, num_heads, **heads)
        self.num_hiddens = int(num_hiddens)
        self.num_heads = self._heads.num_heads
        self.num_kv_heads = self._heads.num_kv_heads
        self.head_dim = self._heads.head_dim
        self.dropout = float(dropout)
        # Set where a distribution splits the heads over devices (docs: "Sharding heads").
        self._head_parallel = False
        self.bias = bool(bias)
        self.seed = seed
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.attention_dropout = keras.layers.Dropout(
            self.dropout, seed=seed, dtype=self.dtype_policy, name="attention_dropout"
        )
        for name in _PROJECTIONS:
            setattr(self, f"W_{name}", None)
            setattr(self, f"b_{name}", None)
        self._add_projection("o", self._heads.query_features)
        sizes = (query_size, key_size, value_size)
        if all(size is not None for size in sizes):
            self.build(*((None, None, size) for size in sizes))
        else:
            for name, size in zip(_PROJECTIONS, sizes, strict=False):
                if size is not None:
                    self._add_projection(name, int(size))

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

    def _add_head_weight(self, name: str, shape: tuple[int, ...], initializer: Any) -> Any:
        """``add_weight``, refused where an active distribution would split a head.

        Checked before the variable exists, on the path it will have as far
        as the layer knows it (its parents are unknown before ``build``), so
        that a bad shard count is this ``ValueError`` rather than one from
        the backend laying the variable out; and again on the variable's
        actual path (docs: "Sharding heads").
        """
        check_variable_layout(self, name, f"{self.path or self.name}/{name}")
        variable = self.add_weight(shape=shape, initializer=initializer, name=name)
        if check_variable_layout(self, name, variable.path) > 1 and name == "W_q":
            # Heads split over devices: attend head by head, so that XLA keeps
            # each device's heads on it (docs: "Sharding heads").
            self._head_parallel = True
        return variable

    def canonical_variables(self) -> dict[str, keras.Variable]:
        """Canonical weight name -> variable, for the projections created so far."""
        variables = {}
        for name in (*KERNEL_NAMES, *BIAS_NAMES):
            variable = getattr(self, name)
            if variable is not None:
                variables[name] = variable
        return variables

    def input_sizes(self) -> dict[str, int | None]:
        """``query_size``, ``key_size``, ``value_size``; ``None`` where still lazy."""
        sizes = {}
        for size_name, name in zip(_SIZE_NAMES, _PROJECTIONS, strict=False):
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
        for name, shape in zip(_PROJECTIONS, shapes, strict=False):
            if getattr(self, f"W_{name}") is None and shape is not None:
                self._add_projection(name, int(shape[-1]))

    def _project(self, x: Any, name: str) -> Any:
        dtype = self.compute_dtype
        x = keras.ops.cast(x, dtype)
        kernel = keras.ops.cast(getattr(self, f"W_{name}"), dtype)
        bias = getattr(self, f"b_{name}")
        if is_16_bit(dtype):
            # The bias joins the float32 accumulator: x @ W + b is rounded once.
            return matmul_16_bit(x, kernel, bias)
        y = OPS.matmul(x, kernel)
        return y if bias is None else keras.ops.add(y, keras.ops.cast(bias, dtype))

    def _output(self, context: Any, head_mask: Any) -> Any:
        """``W_o`` (and ``b_o``) of the heads' context gated by ``head_mask``.

        The gates are :func:`mha_multi.spec.apply_head_mask`'s. In 16 bits
        they join the float32 product of the output projection, so that
        ``(context * gates) @ W_o + b_o`` is rounded once, as the projection
        without gates is, and so is its gradient with respect to the context
        (a gated context rounded to 16 bits first would add one rounding each
        way: twice the bfloat16 error in ``W_v``'s gradient).
        """
        dtype = self.compute_dtype
        if head_mask is None or not is_16_bit(dtype):
            return self._project(spec.apply_head_mask(OPS, context, head_mask, self.num_heads), "o")
        gated = spec.apply_head_mask(
            OPS, keras.ops.cast(context, "float32"), head_mask, self.num_heads
        )
        kernel = keras.ops.cast(keras.ops.cast(self.W_o, dtype), "float32")
        output = keras.ops.matmul(gated, kernel)
        if self.b_o is not None:
            output = keras.ops.add(output, keras.ops.cast(self.b_o, "float32"))
        return keras.ops.cast(output, dtype)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Keras turns array arguments into tensors (and rejects other
        # positional values) before ``call``: wrong types must meet the
        # spec's TypeError first, not a backend's conversion error or Keras'
        # ValueError. Lengths that are lists become arrays so that they may
        # be passed positionally like any array.
        cached = kwargs.get("cache") is not None
        for position, name in enumerate(_INPUT_NAMES):
            value = args[position] if position < len(args) else kwargs.get(name)
            if value is None and cached and name != "queries":
                continue  # a cached call that appends nothing
            if not (_is_tensor(value) or isinstance(value, np.ndarray)):
                raise TypeError(
                    f"{name} must be a tensor or a numpy array; got {type(value).__name__}"
                )
            if isinstance(value, np.ndarray) and value.dtype.kind != "f":
                # Keras would cast it to the layer's dtype without a word.
                raise TypeError(f"{name} must be a floating-point array; got {value.dtype}")
        spec.check_causal(kwargs.get("causal", False))
        _check_gates_type(kwargs.get("head_mask"))  # Keras would pass a list on as it is
        if cached:
            kwargs["cache"] = _checked_cache(kwargs["cache"])
        if len(args) > 3:
            args = (*args[:3], _checked_lens(args[3]), *args[4:])
        elif "valid_lens" in kwargs:
            kwargs["valid_lens"] = _checked_lens(kwargs["valid_lens"])
        return super().__call__(*args, **kwargs)

    def call(
        self,
        queries: Any,
        keys: Any,
        values: Any,
        valid_lens: Any = None,
        *,
        causal: bool = False,
        return_attention_weights: bool = False,
        cache: spec.KVCache | None = None,
        head_mask: Any = None,
        training: bool | None = None,
    ) -> Any:
        """Attends from ``queries`` to ``keys``/``values``, or to a cache.

        Args:
            queries: ``(B, Q, query_size)``, floating.
            keys: ``(B, K, key_size)``, floating; with a ``cache``, the ``T =
                Q`` new positions ``(B, T, key_size)``, or ``None`` to attend
                to the cache as it is, appending nothing.
            values: ``(B, K, value_size)``, floating (``None`` with ``keys``).
            valid_lens: ``None``, ``(B,)`` or ``(B, Q)``, integer or floating;
                key ``j`` is visible to query ``i`` iff ``j < valid_lens``.
                With a ``cache``: ``None`` or ``(B,)`` integers, the real new
                positions ``n_b`` of each example (``0 <= n_b <= T``; the rest
                is padding, not kept).
            causal: also hide key ``j`` from query ``i`` when
                ``j > i + (K - Q)``; with a ``cache``, when ``j >
                cache.lengths[b] + i``.
            return_attention_weights: also return the pre-dropout weights.
            cache: a :class:`~mha_multi.spec.KVCache` from :meth:`init_cache`
                or an earlier cached call. Example ``b``'s new keys and values
                are written at positions ``cache.lengths[b] ..
                cache.lengths[b] + n_b - 1``, and query ``i`` sees the key
                positions below ``cache.lengths[b] + n_b`` (causal: below
                ``cache.lengths[b] + min(n_b, i + 1)``). In eager mode an
                example that would hold more than ``max_length`` positions
                raises a ``ValueError``; compiled code (``tf.function``,
                ``jax.jit``) cannot raise on values, and drops the positions
                past ``max_length`` instead, overwriting none it keeps, while
                ``lengths`` still counts them (``lengths > max_length`` tells
                that it happened).
            head_mask: ``None``, or ``(H,)`` or ``(B, H)`` floating gates:
                head ``h``'s context (its slice of ``weights @ v``, before
                ``W_o``) is multiplied by ``head_mask[..., h]`` on every path
                (:func:`mha_multi.spec.apply_head_mask`), differentiably; cast
                to the compute dtype.
            training: dropout is active only when ``True``.

        Returns:
            ``(B, Q, num_hiddens)`` in the compute dtype, and with
            ``return_attention_weights`` the tuple ``(output, weights)`` with
            weights ``(B, H, Q, K)``. With a ``cache``, the updated cache
            comes last: ``(output, cache)`` or ``(output, weights, cache)``
            with weights ``(B, H, T, max_length)``.

        Raises:
            TypeError: inputs that are not floating tensors, a ``causal`` that
                is not a bool, non-integer lengths of a cached call, a
                cache of another dtype than the layer's, or a ``head_mask``
                that is not a floating tensor or array.
            ValueError: shapes that disagree (the argument named, ``head_mask``
                included), or, in
                eager mode, a cached call's lengths out of range.
        """
        valid_lens = _checked_lens(valid_lens)  # stateless_call does not pass __call__
        dropout = self._drop if training and self.dropout > 0 else None
        if cache is not None:
            return self._cached_call(
                queries,
                keys,
                values,
                valid_lens,
                causal,
                _checked_cache(cache),
                dropout,
                return_attention_weights,
                head_mask,
            )
        self._check_call(queries, keys, values, valid_lens, causal, head_mask)
        q, k, v = (self._project(x, n) for x, n in ((queries, "q"), (keys, "k"), (values, "v")))
        output, weights = self._attend(
            q, k, v, valid_lens, causal, dropout, return_attention_weights, head_mask=head_mask
        )
        return (output, weights) if return_attention_weights else output

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
            TypeError: ``batch_size`` or ``max_length`` is not an int.
            ValueError: either is negative.
        """
        shape = spec.cache_shape(batch_size, max_length, self._heads)
        dtype = self.compute_dtype if dtype is None else keras.backend.standardize_dtype(dtype)
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

    def _cached_call(
        self,
        queries: Any,
        keys: Any,
        values: Any,
        valid_lens: Any,
        causal: bool,
        cache: spec.KVCache,
        dropout: Any,
        return_attention_weights: bool,
        head_mask: Any = None,
    ) -> tuple[Any, ...]:
        """A call with a cache (:meth:`call`): written into it, then attended to.

        The attention over the cache's ``max_length`` keys is an ordinary
        call's, fused kernel included, with the lengths
        :func:`mha_multi.spec.update_cache` gives (the causal rule is in them).
        """
        self._check_cached_call(queries, keys, values, valid_lens, causal, cache, head_mask)
        readable = [queries, cache.lengths] + ([] if valid_lens is None else [valid_lens])
        if all(values_readable(x) for x in readable):
            check_cache_lengths(queries, keys, valid_lens, cache)
        q = self._project(queries, "q")
        k = v = None
        if keys is not None:
            k, v = self._project(keys, "k"), self._project(values, "v")
        cache, lens = spec.update_cache(
            OPS, cache, k, v, valid_lens, head_dim=self.head_dim, causal=causal
        )
        output, weights = self._attend(
            q,
            cache.keys,
            cache.values,
            lens,
            False,
            dropout,
            return_attention_weights,
            kv_split=True,
            head_mask=head_mask,
        )
        return (output, weights, cache) if return_attention_weights else (output, cache)

    def _attend(
        self,
        q: Any,
        k: Any,
        v: Any,
        valid_lens: Any,
        causal: bool,
        dropout: Any,
        return_attention_weights: bool,
        *,
        kv_split: bool = False,
        head_mask: Any = None,
    ) -> tuple[Any, Any]:
        """Attention on projected inputs and the output projection, fused where planned.

        ``head_mask`` gates the heads' concatenated context before ``W_o``,
        whichever path made it (the fused kernel's output is that context).

        Args:
            q: projected queries ``(B, Q, num_heads * head_dim)``.
            k, v: projected keys and values ``(B, K, num_kv_heads *
                head_dim)``, or ``(B, num_kv_heads, K, head_dim)`` with
                ``kv_split`` (a cache's layout).

        Returns:
            ``(output, weights)``; weights ``None`` when the fused kernel ran.
        """
        plan = _plan(
            q, k, v, valid_lens, self._heads, causal, dropout, return_attention_weights, kv_split
        )
        if plan.fused:
            context = self._fused_attention(q, k, v, valid_lens, plan, kv_split=kv_split)
            return self._output(context, head_mask), None
        options = {
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "num_kv_heads": self.num_kv_heads,
            "causal": causal,
            "kv_split": kv_split,
        }
        if self._head_parallel and dropout is None:
            context, weights = spec.attention_by_kv_heads(
                OPS, q, k, v, valid_lens, vmap=head_vmap(), **options
            )
        else:
            context, weights = spec.attention(OPS, q, k, v, valid_lens, dropout=dropout, **options)
        return self._output(context, head_mask), weights

    def _drop(self, weights: Any) -> Any:
        return self.attention_dropout(weights, training=True)

    def _fused_attention(
        self, q: Any, k: Any, v: Any, valid_lens: Any, plan: spec.KernelPlan, *, kv_split: bool
    ) -> Any:
        """``keras.ops.dot_product_attention`` with the spec's masking semantics.

        Grouped key/value heads reach the kernel as they are where it takes
        them (query head ``h`` reads key/value head ``h // G`` there too);
        otherwise they are repeated, once, on the projected heads (the
        plan's ``repeat_kv``).

        Args:
            q: projected queries ``(B, Q, num_heads * head_dim)``; k, v
                ``(B, K, num_kv_heads * head_dim)``, or ``(B, num_kv_heads,
                K, head_dim)`` with ``kv_split``.
            valid_lens: ``None``, ``(B,)`` or ``(B, Q)``.
            plan: what :func:`_plan` decided the kernel is given.

        Returns:
            The concatenated heads ``(B, Q, num_heads * head_dim)``.
        """
        dtype = OPS.dtype(q)
        if is_16_bit(dtype):
            # In float32 the kernel's products of 16-bit numbers are exact and
            # accumulated in float32, its scores cannot overflow float16, and
            # its additive mask (-0.7 times the dtype's maximum: -45850 in
            # float16) cannot be overcome by a hidden score; the output is
            # rounded once, below.
            q, k, v = (keras.ops.cast(x, "float32") for x in (q, k, v))
        # (B, T, H*dh) -> (B, T, H, dh): the kernel's layout; head h owns
        # columns [h*dh, (h+1)*dh) exactly as in transpose_qkv.
        q = OPS.split_axis(q, 2, (self.num_heads, self.head_dim))
        if kv_split:
            k, v = (OPS.permute(x, (0, 2, 1, 3)) for x in (k, v))
        else:
            k, v = (OPS.split_axis(x, 2, (self.num_kv_heads, self.head_dim)) for x in (k, v))
        group_size = self._heads.group_size
        if plan.repeat_kv:
            k, v = (keras.ops.repeat(x, group_size, axis=2) for x in (k, v))
        grouped = self._heads.grouped and not plan.repeat_kv
        num_queries, num_keys = OPS.size(q, 1), OPS.size(k, 1)
        mask = plan.mask(OPS, num_queries, num_keys, valid_lens)
        if mask is not None and OPS.ndim(mask) == 2:  # (Q, K) -> (1, 1, Q, K) for every kernel
            mask = OPS.expand_dims(OPS.expand_dims(mask, 0), 0)
        output = keras.ops.dot_product_attention(
            q, k, v, mask=mask, scale=1.0 / math.sqrt(self.head_dim), is_causal=plan.is_causal
        )
        visible = plan.fix_visibility(OPS, num_queries, num_keys, valid_lens)
        output = spec.fix_fully_hidden_rows(
            OPS, output, v, visible, heads_axis=2, group_size=group_size if grouped else 1
        )
        return keras.ops.cast(OPS.merge_axes(output, 2), dtype)

    def _check_call(
        self,
        queries: Any,
        keys: Any,
        values: Any,
        valid_lens: Any,
        causal: Any,
        head_mask: Any = None,
    ) -> None:
        for name, tensor in zip(_INPUT_NAMES, (queries, keys, values), strict=True):
            _check_floating(name, tensor)
        self._check_head_mask(head_mask, queries.shape[0])
        if valid_lens is not None:
            spec.check_valid_lens_dtype(dtype_kind(valid_lens.dtype))
        spec.check_inputs(
            queries.shape,
            keys.shape,
            values.shape,
            None if valid_lens is None else valid_lens.shape,
            causal=causal,
            **self.input_sizes(),
        )

    def _check_cached_call(
        self,
        queries: Any,
        keys: Any,
        values: Any,
        valid_lens: Any,
        causal: Any,
        cache: spec.KVCache,
        head_mask: Any = None,
    ) -> None:
        """The spec's shape and dtype checks of a cached call (values are not read)."""
        for name, tensor in zip(_INPUT_NAMES, (queries, keys, values), strict=True):
            if tensor is not None or name == "queries":
                _check_floating(name, tensor)
        self._check_head_mask(head_mask, queries.shape[0])
        spec.check_cached_call(
            queries,
            keys,
            values,
            valid_lens,
            cache,
            heads=self._heads,
            dtype_kind=dtype_kind,
            causal=causal,
            **self.input_sizes(),
        )
        if keys is None:
            # With new keys spec.update_cache compares the dtypes; without,
            # nothing else would, and the products would promote silently.
            for name in ("keys", "values"):
                held = OPS.dtype(getattr(cache, name))
                if held != self.compute_dtype:
                    raise TypeError(
                        f"cache.{name} dtype {held} differs from the layer's projected {name} "
                        f"dtype {self.compute_dtype}; make the cache with layer.init_cache"
                    )

    def _check_head_mask(self, head_mask: Any, batch: int | None) -> None:
        """:func:`mha_multi.spec.check_head_mask` on a tensor (or array) ``head_mask``."""
        if head_mask is None:
            return
        _check_gates_type(head_mask)
        shape = tuple(head_mask.shape)
        if batch is None and len(shape) == 2:  # a symbolic batch: any size fits
            batch = shape[0]
        spec.check_head_mask(
            shape, dtype_kind(head_mask.dtype), num_heads=self.num_heads, batch=batch
        )

    def compute_output_spec(
        self,
        queries: Any,
        keys: Any,
        values: Any,
        valid_lens: Any = None,
        *,
        causal: bool = False,
        return_attention_weights: bool = False,
        cache: spec.KVCache | None = None,
        head_mask: Any = None,
        training: bool | None = None,
    ) -> Any:
        """Symbolic outputs for the functional API, from shapes alone."""
        batch, num_queries = queries.shape[:2]
        if cache is None:
            self._check_call(queries, keys, values, valid_lens, causal, head_mask)
            num_keys = keys.shape[1]
        else:
            cache = _checked_cache(cache)
            self._check_cached_call(queries, keys, values, valid_lens, causal, cache, head_mask)
            num_keys = cache.keys.shape[2]
        outputs = [
            keras.KerasTensor((batch, num_queries, self.num_hiddens), dtype=self.compute_dtype)
        ]
        if return_attention_weights:
            shape = (batch, self.num_heads, num_queries, num_keys)
            outputs.append(keras.KerasTensor(shape, dtype=self.compute_dtype))
        if cache is not None:
            outputs.append(
                spec.KVCache(*(keras.KerasTensor(x.shape, dtype=x.dtype) for x in cache))
            )
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

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

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments; input sizes are recorded once known."""
        config = super().get_config()
        config.update(
            num_hiddens=self.num_hiddens,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dropout=self.dropout,
            bias=self.bias,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=keras.initializers.serialize(self.bias_initializer),
            seed=self.seed,
            autocast=self.autocast,
            **self.input_sizes(),
        )
        return config


#: Keras' fused kernel: no dropout, no key lengths, and an *added* mask, so it
#: runs only on values read as exact (:func:`values_exact`). It takes fewer
#: key/value heads than query heads (``(B, K, H_kv, dh)``; query head ``h``
#: reads key/value head ``h // G``), except on Keras' TensorFlow backend,
#: whose einsum does not broadcast a single key/value head (multi-query
#: attention): there the heads are repeated before the call.
DOT_PRODUCT_ATTENTION = spec.FusedKernel(
    "keras.ops.dot_product_attention", takes_grouped_heads=BACKEND != "tensorflow"
)


def _plan(
    q: Any,
    k: Any,
    v: Any,
    valid_lens: Any,
    heads: spec.Heads,
    causal: bool,
    dropout: Any,
    return_attention_weights: bool,
    kv_split: bool = False,
) -> spec.KernelPlan:
    """The kernel plan of a call, by :func:`mha_multi.spec.plan_kernel`.

    The backend and dtype decide first (:data:`FUSED_BACKENDS`,
    :data:`FUSED_DTYPES`); the values are read only where they can still
    change the decision. ``kv_split``: keys and values are a cache's
    ``(B, H_kv, K, dh)``.
    """
    backend = keras.backend.backend()
    facts = {
        "sizes": (q.shape[0], q.shape[1], k.shape[2 if kv_split else 1]),
        "lens_ndim": None if valid_lens is None else len(valid_lens.shape),
        "lens_integer": valid_lens is None or dtype_kind(valid_lens.dtype) in "iu",
        "causal": causal,
        "dropout": dropout is not None,
        "return_attention_weights": return_attention_weights,
        "dtype_supported": OPS.dtype(q) in FUSED_DTYPES.get(backend, ())
        and backend in FUSED_BACKENDS,
        "grouped": heads.grouped,
    }
    optimistic = spec.plan_kernel(DOT_PRODUCT_ATTENTION, **facts, values_exact=True)
    if not optimistic.fused:
        return optimistic
    exact = values_exact(q, k, v, heads.head_dim)
    return spec.plan_kernel(DOT_PRODUCT_ATTENTION, **facts, values_exact=exact)


def values_exact(q: Any, k: Any, v: Any, head_dim: int) -> bool | None:
    """Whether the fused kernel gives the spec's numbers for these values.

    The kernels differ from the spec where values are extreme: PyTorch's
    SDPA turns a NaN query row into zeros, and any additive mask lets a
    hidden key's ``+inf`` score through as NaN where the spec replaces it.
    So the fused path needs every projected element finite and every score
    bounded by :data:`FUSED_SCORE_LIMIT`, which ``sqrt(head_dim) * max|q| *
    max|k|`` bounds from above (Cauchy-Schwarz, per element). That costs a
    few reductions over ``(B, T, D)`` and one read of a boolean: nothing
    next to the ``(B, H, Q, K)`` attention.

    Args:
        q: projected queries ``(B, Q, num_heads * head_dim)``; k, v
            ``(B, K, num_kv_heads * head_dim)``.
        head_dim: the size of each head.

    Returns:
        ``True`` where the fused path is exact for these values, ``None``
        where they cannot be read (a traced graph: ``tf.function``,
        ``jax.jit``, ``torch.compile``; there the generic path, exact for
        every value, is taken).
    """
    if not values_readable(q):
        return None
    ops = keras.ops
    finite = [ops.all(ops.isfinite(x)) for x in (q, k, v)]
    largest_q, largest_k = (ops.max(ops.abs(ops.cast(x, "float32")), initial=0.0) for x in (q, k))
    within = ops.less(largest_q * largest_k * math.sqrt(head_dim), FUSED_SCORE_LIMIT)
    return bool(as_numpy(ops.all(ops.stack([*finite, within]))))


def _check_floating(name: str, tensor: Any) -> None:
    if not _is_tensor(tensor):
        raise TypeError(f"{name} must be a tensor; got {type(tensor).__name__}")
    if dtype_kind(tensor.dtype) != "f":
        raise TypeError(f"{name} must be a floating-point tensor; got {tensor.dtype}")


def _check_gates_type(head_mask: Any) -> None:
    if head_mask is not None and not (_is_tensor(head_mask) or isinstance(head_mask, np.ndarray)):
        raise TypeError(
            f"head_mask must be a tensor or a numpy array; got {type(head_mask).__name__}"
        )


def _checked_cache(cache: Any) -> spec.KVCache:
    """``cache`` as a :class:`~mha_multi.spec.KVCache` of tensors (numpy arrays converted).

    Raises:
        TypeError: not a ``(keys, values, lengths)`` tuple of tensors or arrays.
    """
    if not (isinstance(cache, tuple) and len(cache) == 3):
        raise TypeError(
            "cache must be a KVCache (keys, values, lengths), as init_cache makes it; "
            f"got {type(cache).__name__}"
        )
    fields = []
    for name, x in zip(spec.KVCache._fields, cache, strict=True):
        if isinstance(x, np.ndarray):
            x = keras.ops.convert_to_tensor(x)
        elif not _is_tensor(x):
            raise TypeError(f"cache.{name} must be a tensor; got {type(x).__name__}")
        fields.append(x)
    return spec.KVCache(*fields)


def check_cache_lengths(queries: Any, keys: Any, valid_lens: Any, cache: spec.KVCache) -> None:
    """The value checks of a cached call whose shapes are checked (eager mode only).

    :func:`mha_multi.spec.check_cache_values` on the lengths read from the
    device, in one read where they fit.

    Raises:
        ValueError: a negative ``cache.lengths``, new lengths outside ``[0,
            T]``, or an example that would hold more than ``max_length``
            positions.
    """
    lengths, new = _host_lengths(cache.lengths, valid_lens)
    if keys is None:
        new = np.zeros_like(lengths)
    spec.check_cache_values(lengths, new, queries.shape[1], cache.keys.shape[2])


def _host_lengths(lengths: Any, valid_lens: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """``cache.lengths`` and a cached call's ``valid_lens`` as numpy, in one read where they fit.

    Lengths of 32 or 64-bit signed integers hold the int32 cache lengths, so
    the two come back from the device together; other integer types are read
    on their own rather than cast (a uint32 beyond int32 would wrap).
    """
    if valid_lens is None or isinstance(valid_lens, np.ndarray):
        return as_numpy(lengths), valid_lens
    dtype = OPS.dtype(valid_lens)
    if dtype not in ("int32", "int64"):
        return as_numpy(lengths), as_numpy(valid_lens)
    both = as_numpy(keras.ops.concatenate([keras.ops.cast(lengths, dtype), valid_lens]))
    return both[: len(both) // 2], both[len(both) // 2 :]


def _checked_lens(valid_lens: Any) -> Any:
    """``valid_lens`` as a tensor or a numeric numpy array (``TypeError`` otherwise).

    Integer arrays are converted to the backend's integer type by clipping:
    Keras' JAX backend without ``jax_enable_x64`` would wrap ``2**62`` to 0
    and hide every key. Tensors are within their backend's range already.
    """
    if valid_lens is None or _is_tensor(valid_lens):
        return valid_lens
    return spec.lens_as_numpy(valid_lens, index_dtype())


def set_weights(layer: MultiHeadAttention, weights: Mapping[str, Any]) -> MultiHeadAttention:
    """Loads canonical weights into ``layer`` (strict) and returns it.

    Lazy input sizes are fixed by the weights (the missing projections are
    built). Values are cast to each variable's dtype; float32 variables of a
    mixed-precision layer stay float32.

    Args:
        layer: the layer to load into.
        weights: canonical mapping ``W_q``, ``W_k``, ``W_v``, ``W_o`` (and
            ``b_*`` iff the layer has biases), ``x @ W + b`` orientation.

    Returns:
        ``layer``.

    Raises:
        ValueError: a missing, extra or mis-shaped entry, named.
    """
    arrays, config = check_weights(
        weights,
        num_hiddens=layer.num_hiddens,
        bias=layer.bias,
        num_heads=layer.num_heads,
        num_kv_heads=layer.num_kv_heads,
        head_dim=layer.head_dim,
        **layer.input_sizes(),
    )
    if not layer.built:
        sizes = (config.query_size, config.key_size, config.value_size)
        layer.build(*((None, None, size) for size in sizes))
    variables = layer.canonical_variables()
    for name, array in arrays.items():
        variables[name].assign(array)
    return layer


def get_weights(layer: MultiHeadAttention) -> dict[str, np.ndarray]:
    """The canonical weights of ``layer`` as numpy arrays.

    bfloat16 variables are returned as float32 (numpy has no bfloat16);
    every other dtype is kept.

    Args:
        layer: a layer whose input sizes are known.

    Returns:
        ``W_q``, ``W_k``, ``W_v``, ``W_o`` (and ``b_*`` with biases).

    Raises:
        ValueError: some input size is still lazy (call the layer once, or
            pass ``query_size``/``key_size``/``value_size``).
    """
    lazy = [name for name, size in layer.input_sizes().items() if size is None]
    if lazy:
        raise ValueError(
            f"{', '.join(lazy)} not known yet: call the layer once or pass them to the constructor"
        )
    return {
        name: host_array(variable.value) for name, variable in layer.canonical_variables().items()
    }


def head_importance(
    layer: MultiHeadAttention,
    batches: Iterable[tuple[Any, Any, Any, Any]],
    loss_fn: Callable[[Any], Any],
    *,
    normalize: bool = True,
) -> np.ndarray:
    """The importance of each head: the mean ``|dL/dξ_h|`` at gates of ones (docs: "Heads").

    Michel, Levy & Neubig (2019): each batch's loss ``loss_fn(layer(queries,
    keys, values, valid_lens, head_mask=ξ))`` is differentiated with respect
    to the gates ``ξ`` at ``ξ = 1``, in evaluation mode (no dropout), and
    :func:`mha_multi.heads.importance` averages the absolute gradients over
    the batches and normalizes them.

    Args:
        layer: the layer whose ``num_heads`` heads are measured.
        batches: yields ``(queries, keys, values, valid_lens)`` of tensors
            (``valid_lens`` may be ``None``).
        loss_fn: ``output -> scalar`` tensor of the active Keras backend
            (``keras.ops`` works on every one).
        normalize: divide by the L2 norm over the heads (all-zero gradients
            stay zero).

    Returns:
        ``(num_heads,)`` float64 numpy.

    Raises:
        ValueError: no batches.
    """
    gradients = [
        head_mask_gradient(layer, queries, keys, values, valid_lens, loss_fn)
        for queries, keys, values, valid_lens in batches
    ]
    if not gradients:
        raise ValueError("head_importance needs at least one batch")
    return heads.importance(gradients, normalize=normalize)
