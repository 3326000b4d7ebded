"""``MultiHeadAttention`` as a Keras 3 layer, written once against ``keras.ops``.

The layer runs on Keras' TensorFlow (primary), JAX and PyTorch backends: it
calls no TensorFlow, JAX or PyTorch function itself. The call flow (checks,
kernel plan, cache, attention, gates, output) is
:func:`mha_multi.call.forward`'s; Keras' facts are
:data:`mha_multi.keras._facts.FACTS` (docs: "Architecture"). What is
Keras' own stays with the layer: its variables, their build and the
projections (:mod:`mha_multi.keras._projections`), and here the checks
before Keras converts a call's arguments, the symbolic outputs, the
configuration and the cache, placed as a distribution splits the heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from mha_multi import _docs, call, spec
from mha_multi.call.checks import check_segment_ids
from mha_multi.canonical_layer import FromCanonical
from mha_multi.keras._call_plan import planned_call
from mha_multi.keras._direct_call import skips_keras_call
from mha_multi.keras._facts import (
    FACTS,
    checked_lens,
    floating_array,
    is_tensor,
)
from mha_multi.keras._ops import OPS, check_held_policy, index_dtype
from mha_multi.keras._projections import PROJECTIONS, ProjectionLayer, get_weights, set_weights
from mha_multi.weights import SINKS_NAME

__all__ = ["MultiHeadAttention", "get_weights", "set_weights"]


@keras.saving.register_keras_serializable(package="mha_multi")
@_docs.fill
class MultiHeadAttention(FromCanonical, ProjectionLayer):
    """d2l's multi-head attention, exact to the spec of :mod:`mha_multi.spec`.

    The layer's variables are the canonical weights as they are: kernels
    ``W_q``, ``W_k``, ``W_v``, ``W_o`` used as ``x @ W + b`` (Keras ``Dense``
    orientation), and biases ``b_q``... ``b_o`` with ``bias=True``, of the
    shapes of docs: "Canonical weights and files" (every width
    ``num_hiddens`` by default). Input sizes left as ``None`` are inferred
    from the first call (Keras' lazy ``build``); given up front, the layer is
    built at construction.

    {grouped_heads}

    The projections are the layer's own ``add_weight`` kernels rather than
    ``keras.layers.Dense`` sublayers because Keras' type promotion maps
    float64 to float32 on its JAX and PyTorch backends, and on PyTorch
    ``ops.matmul`` (and so ``Dense``) returns float32 for float64 inputs; the
    projections here go through the same float64-preserving product as the
    attention (:class:`mha_multi.keras._ops.KerasOps`).

    Fast path: a call that returns no weights and applies no dropout goes
    through ``keras.ops.dot_product_attention`` on the backends of
    :data:`~mha_multi.keras._kernel.FUSED_BACKENDS` (for the dtypes of
    :data:`~mha_multi.keras._kernel.FUSED_DTYPES`), with
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
    it passes through ``tf.function`` and ``jax.jit`` as it is. On Keras'
    PyTorch backend an eager call recording no gradient (``torch.no_grad()``)
    whose examples all write at one position writes the given cache's
    ``keys`` and ``values`` in place, as PyTorch's own layer does.

    Heads (docs: "Heads"): ``head_mask=`` gates each head's context before
    ``W_o`` on every path; :func:`head_importance` measures the heads by the
    gates' gradients, and :func:`mha_multi.heads.prune_heads` gives the
    weights and constructor arguments of a layer without some heads.

    Args:
        num_hiddens: size of the output (and, by default, of every projection).
        {num_heads_arg}
        dropout: dropout rate on the attention weights, active only in
            training (``training=True``).
        bias: whether the four projections have biases.
        query_size: last dimension of the queries (lazy when ``None``).
        key_size: last dimension of the keys (lazy when ``None``).
        value_size: last dimension of the values (lazy when ``None``).
        {kv_heads_args}
        {options_args}
        kernel_initializer: initializer of the ``W_*`` kernels (Keras
            ``Dense``'s default, as in d2l's TensorFlow layer).
        bias_initializer: initializer of the ``b_*`` biases.
        seed: seed of the dropout's ``keras.random.SeedGenerator``.
        **kwargs: ``keras.layers.Layer`` arguments (``name``, ``dtype``,
            ``trainable``...). A float64 ``dtype`` on Keras' JAX backend
            needs ``jax_enable_x64``, without which JAX holds float32:
            refused (``ValueError``).
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
        rotary: spec.Rotary | Mapping[str, Any] | None = None,
        alibi: bool = False,
        window: int | None = None,
        softcap: float | None = None,
        qk_norm: spec.QKNorm | Mapping[str, Any] | None = None,
        sinks: bool = False,
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
        check_held_policy(self.dtype_policy)
        self._heads = spec.check_heads(num_hiddens, num_heads, **heads)
        self.options = spec.LayerOptions(
            rotary, alibi, window, softcap, sinks, qk_norm=qk_norm
        ).check(self._heads.head_dim)
        self.num_hiddens = int(num_hiddens)
        self.num_heads = self._heads.num_heads
        self.num_kv_heads = self._heads.num_kv_heads
        self.head_dim = self._heads.head_dim
        self.dropout = float(dropout)
        # Set where a distribution splits the heads over devices (docs: "Sharding heads").
        self._head_parallel = False
        self.bias = spec.check_flag("bias", bias)
        self.seed = seed
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.attention_dropout = keras.layers.Dropout(
            self.dropout, seed=seed, dtype=self.dtype_policy, name="attention_dropout"
        )
        for name in PROJECTIONS:
            setattr(self, f"W_{name}", None)
            setattr(self, f"b_{name}", None)
        self._add_norms()
        self._add_projection("o", self._heads.query_features)
        self.sinks = None
        if self.options.sinks:  # each head's sink logit, zeros at first
            self.sinks = self._add_head_weight(
                SINKS_NAME, (self.num_heads,), "zeros", autocast=False
            )
        sizes = (query_size, key_size, value_size)
        if all(size is not None for size in sizes):
            self.build(*((None, None, size) for size in sizes))
        else:
            for name, size in zip(PROJECTIONS, sizes, strict=False):
                if size is not None:
                    self._add_projection(name, int(size))

    def _load_canonical(self, weights: Mapping[str, Any]) -> MultiHeadAttention:
        # (FromCanonical.from_canonical's load: the module's set_weights.)
        return set_weights(self, weights)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Keras turns array arguments into tensors (and rejects other
        # positional values) before ``call``: wrong types must meet the
        # spec's TypeError first, not a backend's conversion error or Keras'
        # ValueError. Lengths that are lists become arrays so that they may
        # be passed positionally like any array.
        cached = kwargs.get("cache") is not None
        for position, name in enumerate(call.INPUT_NAMES):
            value = args[position] if position < len(args) else kwargs.get(name)
            if value is None and cached and name != "queries":
                continue  # a cached call that appends nothing
            if not (is_tensor(value) or isinstance(value, np.ndarray)):
                raise TypeError(
                    f"{name} must be a tensor or a numpy array; got {type(value).__name__}"
                )
            if isinstance(value, np.ndarray):
                floating_array(name, value)
        causal = kwargs.get("causal", False)
        if causal is not False and causal is not True:  # (Keras would make it a tensor)
            kwargs["causal"] = spec.check_flag("causal", causal)
        weights = kwargs.get("return_attention_weights", False)
        if weights is not False and weights is not True:  # (Keras would make it a tensor)
            kwargs["return_attention_weights"] = spec.check_flag(
                "return_attention_weights", weights
            )
        if kwargs.get("head_mask") is not None:  # Keras would pass a list on as it is
            FACTS.as_gates(kwargs["head_mask"], None)
        if kwargs.get("segment_ids") is not None:
            # (Keras would make int64 ids int32 on JAX, and has no uint64 on PyTorch.)
            kwargs["segment_ids"] = call.host_segment_ids(kwargs["segment_ids"])
        positions = kwargs.get("positions")
        if positions is not None and not is_tensor(positions):  # (no uint64 on PyTorch either)
            # (On the host alone: asking the backend its integers makes a tensor, which
            # torch.compile's trace of a call would break at.)
            kwargs["positions"] = call.host_positions(positions, index_dtype())
        if kwargs.get("bias") is not None:  # Keras would cast an integer array
            FACTS.as_bias(kwargs["bias"], None)
            call.host_bias(kwargs["bias"])
        if cached:
            kwargs["cache"] = FACTS.as_cache(kwargs["cache"], None)
        if len(args) > 3:
            args = (*args[:3], checked_lens(args[3]), *args[4:])
        elif "valid_lens" in kwargs:
            kwargs["valid_lens"] = checked_lens(kwargs["valid_lens"])
        if skips_keras_call(self, args, kwargs):
            # Keras' __call__ would pass these on as they are (docs: "Fast paths").
            return self.call(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    @_docs.fill
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
        positions: Any = None,
        bias: Any = None,
        training: bool | None = None,
        segment_ids: Any = None,
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
            {positions_arg}
            bias: ``None``, or floating, broadcastable to ``(B, H, Q, K)``,
                added to the scaled scores before the masks; differentiable.
            training: dropout is active only when ``True``.
            {segment_ids_arg}

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
        if training is not None:  # (a string would be truthy: "False" would turn dropout on)
            spec.check_flag("training", training)
        keywords = {
            "causal": causal,
            "return_attention_weights": return_attention_weights,
            "cache": cache,
            "head_mask": head_mask,
            "positions": positions,
            "bias": bias,
            "training": training,
            "segment_ids": segment_ids,
        }
        # An eager call on JAX or TensorFlow: one compiled program per signature (docs:
        # "Fast paths").
        planned = planned_call(self, (queries, keys, values, valid_lens), keywords)
        if planned is not None:
            return planned[0]
        # Lengths and caches of numpy arrays are converted by the facts:
        # stateless_call does not pass __call__.
        dropout = training and self.dropout > 0
        result = call.forward(
            FACTS,
            self,
            queries,
            keys,
            values,
            valid_lens,
            causal=causal,
            return_attention_weights=return_attention_weights,
            cache=cache,
            head_mask=head_mask,
            positions=positions,
            bias=bias,
            segment_ids=segment_ids,
            layer_options=self.options,
            dropout=self._drop if dropout else None,
            dropout_rate=self.dropout if dropout else 0.0,
            # Heads split over devices: attend head by head, so that XLA keeps
            # each device's heads on it (docs: "Sharding heads").
            head_parallel=self._head_parallel,
        )
        return result.returned(return_attention_weights)

    def _drop(self, weights: Any) -> Any:
        return self.attention_dropout(weights, training=True)

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
        positions: Any = None,
        bias: Any = None,
        training: bool | None = None,
        segment_ids: Any = None,
    ) -> Any:
        """Symbolic outputs for the functional API, from shapes alone.

        The call's checks that read no values (:func:`mha_multi.call.check_call`,
        :func:`mha_multi.call.check_cached_call`, :func:`mha_multi.call.check_gates`).
        """
        batch, num_queries = queries.shape[:2]
        if cache is None:
            call.check_call(FACTS, self, queries, keys, values, valid_lens, causal=causal)
            num_keys = keys.shape[1]
        else:
            *_, cache = call.check_cached_call(
                FACTS, self, queries, keys, values, valid_lens, cache, causal=causal
            )
            if keys is None:
                # A call compares the cache with its projected queries
                # (mha_multi.call.attend); a symbolic one projects nothing.
                spec.check_cache_dtype(OPS, cache, self.compute_dtype, self.compute_dtype)
            num_keys = cache.keys.shape[2]
        # A symbolic batch fits any: a (B, H) mask is then checked against its own.
        batched_mask = len(getattr(head_mask, "shape", ())) == 2
        like = head_mask if batch is None and batched_mask else queries
        call.check_gates(FACTS, head_mask, num_heads=self.num_heads, like=like)
        if batch is not None:  # a symbolic batch: checked when called
            settings = {"num_heads": self.num_heads, "like": queries, "num_keys": num_keys}
            call.check_options(FACTS, positions, bias, **settings, cached=cache is not None)
            check_segment_ids(
                FACTS, segment_ids, like=queries, num_keys=num_keys, cached=cache is not None
            )
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

    def compute_output_shape(
        self,
        queries_shape: tuple[int | None, ...],
        keys_shape: tuple[int | None, ...],
        values_shape: tuple[int | None, ...] | None = None,
        valid_lens_shape: tuple[int | None, ...] | None = None,
        *,
        causal: bool = False,
        return_attention_weights: bool = False,
    ) -> tuple[int | None, ...] | tuple[tuple[int | None, ...], ...]:
        """The output's shape ``(B, Q, num_hiddens)`` for inputs of these shapes (and with
        ``return_attention_weights`` the weights' ``(B, H, Q, K)``), checked as a call
        checks them (:meth:`compute_output_spec`, of floating inputs and integer
        lengths); ``values_shape`` defaults to ``keys_shape``, as Keras' own layer's."""
        floating = self.compute_dtype

        def like(shape: Any, dtype: Any) -> keras.KerasTensor | None:
            return None if shape is None else keras.KerasTensor(tuple(shape), dtype=dtype)

        outputs = self.compute_output_spec(
            like(queries_shape, floating),
            like(keys_shape, floating),
            like(keys_shape if values_shape is None else values_shape, floating),
            like(valid_lens_shape, "int32"),
            causal=causal,
            return_attention_weights=return_attention_weights,
        )
        if isinstance(outputs, tuple):
            return tuple(tuple(output.shape) for output in outputs)
        return tuple(outputs.shape)

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
            **self.options.config(),
            **self.input_sizes(),
        )
        return config
