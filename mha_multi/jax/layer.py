"""``MultiHeadAttention`` as a Flax NNX module."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from mha_multi import _docs, call, spec
from mha_multi.canonical_layer import FromCanonical
from mha_multi.jax import _plan, functional
from mha_multi.jax._facts import JaxFacts, check_held_dtype, host_array
from mha_multi.jax._kernel import check_implementation
from mha_multi.jax._ops import PrecisionLike
from mha_multi.jax._projections import WeightsProjections
from mha_multi.weights import (
    KERNEL_NAMES,
    NORM_NAMES,
    SINKS_NAME,
    check_layer_weights,
    weight_shapes,
)

__all__ = ["MultiHeadAttention", "get_weights", "set_weights"]

Initializer = Any

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


@_docs.fill
class MultiHeadAttention(FromCanonical, nnx.Module):
    """d2l's multi-head attention, exact to the spec of :mod:`mha_multi.spec`.

    The projections are ``nnx.Linear`` modules named ``W_q``, ``W_k``, ``W_v``
    and ``W_o`` as in d2l (state ``W_q.kernel``, ``W_q.bias``...), with
    kernels in the canonical ``x @ W + b`` orientation. A call is
    :func:`mha_multi.call.forward` with JAX's facts and those parameters'
    projections, as for the Linen module and
    :func:`~mha_multi.jax.functional.multi_head_attention`, so all give
    bit-identical outputs.

    Dropout follows ``nnx.Dropout``: active while ``deterministic`` is
    ``False`` (the default, and after ``.train()``), off after ``.eval()``
    or with ``deterministic=True`` at call time.

    For incremental decoding, :meth:`init_cache` makes a key/value cache
    that a call takes and returns (``cache=``; docs: "Generating with a
    cache"). The cache is an argument, not module state, so a decoding step
    under ``nnx.jit`` is compiled once for each number of new positions.

    Args:
        num_hiddens: size of every projection and of the output.
        {num_heads_arg}
        dropout: dropout rate on the attention weights.
        bias: whether the four projections have biases.
        query_size: last dimension of the queries (default ``num_hiddens``).
        key_size: last dimension of the keys (default ``num_hiddens``).
        value_size: last dimension of the values (default ``num_hiddens``).
        num_kv_heads: key/value heads, shared by groups of query heads
            (grouped-query attention; default ``num_heads``); must divide
            ``num_heads``.
        head_dim: the size of each head (default ``num_hiddens // num_heads``).
        {options_args}
        deterministic: initial mode; ``True`` disables dropout.
        {flax_compute_args}
        kernel_init: initializer of the kernels (Flax's ``lecun_normal``).
        bias_init: initializer of the biases (zeros).
        rngs: ``params`` (or default) stream for initialisation; the
            ``dropout`` (or default) stream is forked for dropout masks.
            ``None`` (the default) stands for ``nnx.Rngs(0)``, a fixed seed:
            enough for a layer whose weights are then set
            (``MultiHeadAttention(**config.kwargs())`` of a pruned layer,
            docs: "Heads"), but give ``rngs`` to initialise layers apart.
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
        deterministic: bool = False,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        precision: PrecisionLike = None,
        implementation: str | None = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        spec.check_config(
            num_hiddens, num_heads, dropout, num_kv_heads=num_kv_heads, head_dim=head_dim
        )
        if rngs is None:
            rngs = nnx.Rngs(0)
        heads = spec.check_heads(
            num_hiddens, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
        )
        self.head_dim = heads.head_dim
        self.num_kv_heads = heads.num_kv_heads
        #: The positions and biases options (docs: "Positions and biases"); static.
        self.options = spec.LayerOptions(
            rotary, alibi, window, softcap, sinks, qk_norm=qk_norm
        ).check(heads.head_dim)
        spec.check_input_sizes(query_size=query_size, key_size=key_size, value_size=value_size)
        check_implementation(implementation)
        self.num_hiddens = int(num_hiddens)
        self.num_heads = int(num_heads)
        self.dropout = float(dropout)
        self.bias = spec.check_flag("bias", bias)
        self.deterministic = spec.check_flag("deterministic", deterministic)
        check_held_dtype("dtype", dtype)
        check_held_dtype("param_dtype", param_dtype)
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.implementation = implementation
        # Static (no Variable): set by shard_heads (docs: "Sharding heads").
        self.head_parallel = False
        linear = functools.partial(
            nnx.Linear,
            use_bias=self.bias,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            kernel_init=kernel_init,
            bias_init=bias_init,
            rngs=rngs,
        )
        self.W_q = linear(
            self.num_hiddens if query_size is None else int(query_size), heads.query_features
        )
        self.W_k = linear(
            self.num_hiddens if key_size is None else int(key_size), heads.kv_features
        )
        self.W_v = linear(
            self.num_hiddens if value_size is None else int(value_size), heads.kv_features
        )
        self.W_o = linear(heads.query_features, self.num_hiddens)
        norm = self.options.qk_norm
        if norm is not None:
            for name, shape in norm.shapes(heads).items():
                setattr(self, name, nnx.Param(jnp.full(shape, norm.initial_value, param_dtype)))
        if self.options.sinks:  # each head's sink logit, zeros at first
            self.sinks = nnx.Param(jnp.zeros((heads.num_heads,), param_dtype))
        self.rngs = rngs.dropout.fork() if self.dropout > 0 else nnx.data(None)

    def input_sizes(self) -> dict[str, int]:
        """``query_size``, ``key_size`` and ``value_size``."""
        return _input_sizes(self)

    def params(self) -> dict[str, jax.Array]:
        """The parameters under their canonical names (``W_q``... ``b_o``, ``q_norm``,
        ``k_norm``, ``sinks``), as arrays."""
        return self._params(stored=False)

    def _params(self, *, stored: bool) -> dict[str, Any]:
        """:meth:`params`; ``stored``: each variable's stored value as it is (what the call
        plan passes its program), not NNX's read of it, a few dozen Python calls each."""
        variables = {}
        for name in KERNEL_NAMES:
            linear = getattr(self, name)
            variables[name] = linear.kernel
            if linear.bias is not None:
                variables[f"b_{name[-1]}"] = linear.bias
        if self.options.qk_norm is not None:
            variables.update({name: getattr(self, name) for name in NORM_NAMES})
        if self.options.sinks:
            variables[SINKS_NAME] = self.sinks
        _check_held(self, variables)
        if stored:
            return {name: variable.get_raw_value() for name, variable in variables.items()}
        return {name: variable[...] for name, variable in variables.items()}

    @property
    def heads(self) -> spec.Heads:
        """The head layout (docs: "The spec")."""
        return spec.Heads(self.num_heads, self.num_kv_heads, self.head_dim)

    def _load_canonical(self, weights: Mapping[str, Any]) -> MultiHeadAttention:
        # (FromCanonical.from_canonical's load: the module's set_weights.)
        return set_weights(self, weights)

    def init_cache(
        self, batch_size: int, max_length: int, dtype: DTypeLike | None = None
    ) -> spec.KVCache:
        """An empty key/value cache for incremental decoding (docs: "Generating with a cache").

        Args:
            batch_size: ``B``, the examples decoded together.
            max_length: the positions each example can hold.
            dtype: the dtype of the keys and values; ``None`` for the
                layer's: its ``dtype``, else its parameters' (a cached call
                writes its projections in its computation dtype, which must
                be the cache's).

        Returns:
            ``KVCache(keys, values, lengths)``: zero keys and values
            ``(B, num_kv_heads, max_length, head_dim)`` and zero lengths
            ``(B,)`` int32, on the device of the layer's parameters; for a
            layer whose heads are sharded (``shard_heads``), keys and values
            split by key/value heads as ``W_k``'s columns are, lengths
            replicated.

        Raises:
            TypeError: ``batch_size`` or ``max_length`` not an int, or
                ``dtype`` not floating.
            ValueError: ``batch_size`` or ``max_length`` negative, or
                ``dtype`` float64 without JAX's x64.
        """
        kernel = self.W_q.kernel[...]
        if dtype is None:
            dtype = kernel.dtype if self.dtype is None else self.dtype
        device = None
        if not isinstance(kernel, jax.core.Tracer) and len(kernel.devices()) == 1:
            (device,) = kernel.devices()
        cache = functional.init_cache(self.heads, batch_size, max_length, dtype, device=device)
        placed = self.W_k.kernel[...]
        if isinstance(placed, jax.core.Tracer) or not isinstance(placed.sharding, NamedSharding):
            return cache
        sharding = placed.sharding
        # Each device keeps the key/value heads of its W_k columns (docs: "Sharding heads").
        heads = sharding.spec[1] if len(sharding.spec) > 1 else None
        return spec.KVCache(
            *(jax.device_put(x, NamedSharding(sharding.mesh, P(None, heads))) for x in cache[:2]),
            jax.device_put(cache.lengths, NamedSharding(sharding.mesh, P())),
        )

    def set_view(self, deterministic: bool | None = None) -> None:
        """Used by ``nnx.view``.

        Args:
            deterministic: if ``True``, disables dropout.
        """
        if deterministic is not None:
            self.deterministic = spec.check_flag("deterministic", deterministic)

    def __call__(
        self,
        queries: jax.Array,
        keys: jax.Array | None,
        values: jax.Array | None,
        valid_lens: Any = None,
        *,
        causal: bool = False,
        return_attention_weights: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
        cache: spec.KVCache | None = None,
        head_mask: Any = None,
        positions: Any = None,
        bias: Any = None,
        segment_ids: Any = None,
    ) -> jax.Array | tuple[jax.Array, ...]:
        """Attends from ``queries`` to ``keys``/``values`` (and, with a ``cache``, to it).

        With a ``cache`` (from :meth:`init_cache`) the call is one step of
        incremental decoding (docs: "Generating with a cache"): example ``b``
        appends its first ``valid_lens[b]`` new keys and values (all ``T`` by
        default) at positions ``cache.lengths[b]`` on, and its query ``i``,
        at position ``cache.lengths[b] + i``, attends to the cache's
        positions up to the last one appended (with ``causal``, up to its
        own). An eager call that would overflow the cache raises
        ``ValueError``; a traced one (``nnx.jit``) cannot read the lengths,
        and writes no position at or past ``max_length`` and overwrites no
        kept one: what does not fit is dropped, and ``lengths`` still counts
        it (``lengths > max_length`` tells that it happened).

        Args:
            queries: ``(B, Q, query_size)``; with a cache ``(B, T, query_size)``,
                ``T`` new positions.
            keys: ``(B, K, key_size)``; with a cache ``(B, T, key_size)``, or
                ``None`` to attend to the cache as it is and append nothing.
            values: ``(B, K, value_size)``, likewise.
            valid_lens: ``None``, ``(B,)`` or ``(B, Q)``, integer or floating
                (JAX or numpy array, or a sequence); key ``j`` is visible to
                query ``i`` iff ``j < valid_lens``. With a cache ``None`` or
                ``(B,)`` integers in ``[0, T]``: the real new positions of
                each example (the rest is padding, not kept).
            causal: also hide key ``j`` from query ``i`` when ``j > i + (K - Q)``;
                with a cache, keys past the query's own position.
            return_attention_weights: also return the pre-dropout weights.
            deterministic: overrides the module's mode for this call.
            rngs: overrides the module's dropout stream for this call: an
                ``nnx.Rngs`` (its ``dropout`` stream), an ``nnx.RngStream`` or
                a PRNG key used as it is.
            cache: ``None``, or a :class:`mha_multi.spec.KVCache` of this
                layer's layout and dtype.
            head_mask: ``None``, or the heads' gates ``(num_heads,)`` or
                ``(B, num_heads)`` (docs: "Heads"), a floating JAX or numpy
                array: head ``h``'s context (its slice of ``weights @ v``)
                is multiplied by ``head_mask[..., h]`` before ``W_o``, on
                every path (fused, generic, cached, compiled). Cast to the
                computation dtype; differentiable.
            positions, bias: the call's positions (integer ``(B, Q)``, what
                ``rotary`` rotates by) and additive bias of the scores
                (broadcastable to ``(B, H, Q, K)``; differentiable); docs:
                "Positions and biases".
            segment_ids: ``None``, or integer ``(B, Q)`` ids of packed
                sequences, or a tuple ``(query_ids, key_ids)``; as in
                :func:`mha_multi.jax.functional.multi_head_attention` (docs:
                "Packed sequences").

        Returns:
            ``(B, Q, num_hiddens)``, and with ``return_attention_weights`` the
            tuple ``(output, weights)`` with weights ``(B, H, Q, K)``. With a
            cache, the cache after the call comes last: ``(output, cache)``
            or ``(output, weights, cache)``, the weights ``(B, H, T,
            max_length)``.

        Raises:
            TypeError: a non-floating input or non-numeric ``valid_lens``;
                with a cache, non-integer lengths or another dtype; a
                ``head_mask`` that is no floating array.
            ValueError: inconsistent shapes (``head_mask``'s included),
                named; raised while tracing.
                With a cache in an eager call, also lengths out of range or
                an overflow.
        """
        if deterministic is None:
            deterministic = self.deterministic
        else:  # (a string would be truthy: "False" would turn dropout off)
            deterministic = spec.check_flag("deterministic", deterministic)
        inputs = (queries, keys, values, valid_lens)
        arrays = {"cache": cache, "head_mask": head_mask, "positions": positions, "bias": bias}
        arrays["segment_ids"] = segment_ids
        dropout_key = None
        if deterministic or self.dropout == 0:
            # An eager call's plan (docs: "Fast paths"); None where it does not serve.
            settings = _plan.LayerSettings(
                self.options,
                (self.num_heads, self.num_kv_heads, self.head_dim),
                self.dtype,
                self.precision,
                self.implementation,
                self.head_parallel,
                self.dropout,
            )
            result = _plan.planned_call(
                settings,
                self._params(stored=True),
                inputs,
                arrays,
                causal=causal,
                return_attention_weights=return_attention_weights,
            )
            if result is not None:
                return result.returned(return_attention_weights)
        else:

            def dropout_key() -> jax.Array:
                return _dropout_key(self.rngs if rngs is None else rngs)

        result = call.forward(
            JaxFacts(self.precision, self.implementation),
            WeightsProjections(
                self.params(),
                self.heads,
                _input_sizes(self),
                dtype=self.dtype,
                precision=self.precision,
            ),
            *inputs,
            causal=causal,
            return_attention_weights=return_attention_weights,
            **arrays,
            layer_options=self.options,
            dropout=functional.flax_dropout(dropout_key, self.dropout),
            dropout_rate=self.dropout,
            head_parallel=self.head_parallel,
            run=functional.attend_compiled,
        )
        return result.returned(return_attention_weights)


def _check_held(layer: MultiHeadAttention, variables: Mapping[str, Any]) -> None:
    """Refuses variables that are not the layer's configuration's: ``nnx.update`` (or
    ``nnx.merge``) takes the state of any layer, of other heads (the call failed deep
    inside) or options (the sinks or norms of another layer, set beside the layer's own
    and ignored).

    Raises:
        ValueError: naming the variable and what the layer's configuration needs.
    """
    held = vars(layer)
    for name in (SINKS_NAME, *NORM_NAMES):
        if name not in variables and held.get(name) is not None:
            raise ValueError(
                f"the layer holds {name!r}, which its options do not use "
                f"(sinks={layer.options.sinks}, qk_norm={layer.options.qk_norm}): "
                "a state of another layer?"
            )
    layout = (
        layer.num_hiddens,
        tuple(_input_sizes(layer).values()),
        layer.bias,
        layer.heads,
        layer.options,
    )
    try:
        expected = _held_shapes(*layout)
    except TypeError:  # (options that cannot be hashed: made anew)
        expected = _held_shapes.__wrapped__(*layout)
    for name, variable in variables.items():
        shape = tuple(variable.get_raw_value().shape)
        if shape != expected.get(name):
            raise ValueError(
                f"the layer holds {name} of shape {shape}; its configuration ({layer.heads}) "
                f"needs {expected.get(name)}: a state of another layer?"
            )


@functools.lru_cache(maxsize=64)
def _held_shapes(
    num_hiddens: int, sizes: tuple[int, ...], bias: bool, heads: spec.Heads, options: Any
) -> dict[str, tuple[int, ...]]:
    """The canonical shapes of a layer's variables (a call asks: made once per layout)."""
    query_size, key_size, value_size = sizes
    shapes = weight_shapes(
        num_hiddens,
        query_size=query_size,
        key_size=key_size,
        value_size=value_size,
        bias=bias,
        num_heads=heads.num_heads,
        num_kv_heads=heads.num_kv_heads,
        head_dim=heads.head_dim,
        sinks=options.sinks,
    )
    if options.qk_norm is not None:
        shapes.update(options.qk_norm.shapes(heads))
    return shapes


def _input_sizes(layer: MultiHeadAttention) -> dict[str, int]:
    """:meth:`MultiHeadAttention.input_sizes`, as a function: a call asks it, and
    ``nnx.tabulate`` compiles each method a call makes and returns its ints as traced
    arrays (the call's checks compare them with the inputs' sizes)."""
    return {
        "query_size": int(layer.W_q.kernel.shape[0]),
        "key_size": int(layer.W_k.kernel.shape[0]),
        "value_size": int(layer.W_v.kernel.shape[0]),
    }


def _dropout_key(rngs: nnx.Rngs | nnx.RngStream | jax.Array | None) -> jax.Array:
    if isinstance(rngs, nnx.Rngs):
        return rngs.dropout()
    if isinstance(rngs, nnx.RngStream):
        return rngs()
    if isinstance(rngs, jax.Array):
        return rngs
    raise ValueError(
        "dropout is active (deterministic=False) but the layer has no dropout rng: "
        "pass rngs= to the call, or call .eval()"
    )


def set_weights(layer: MultiHeadAttention, weights: Mapping[str, Any]) -> MultiHeadAttention:
    """Loads canonical weights into ``layer`` (strict) and returns it.

    Values are converted to each parameter's dtype and placed with its
    sharding (device).

    Raises:
        ValueError: a missing, extra or mis-shaped entry, named.
        TypeError: a non-floating entry.
    """
    arrays, _ = check_layer_weights(weights, layer)
    for name, array in arrays.items():
        if name in NORM_NAMES:
            param = getattr(layer, name)
        elif name == SINKS_NAME:
            param = layer.sinks
        else:
            linear = getattr(layer, f"W_{name[-1]}")
            param = linear.kernel if name in KERNEL_NAMES else linear.bias
        current = param[...]
        value = np.asarray(array).astype(np.dtype(current.dtype))
        param.set_value(jax.device_put(value, current.sharding))
    return layer


def get_weights(layer: MultiHeadAttention) -> dict[str, np.ndarray]:
    """The canonical weights of ``layer`` as numpy arrays.

    bfloat16 parameters are returned as float32 (the canonical format holds
    numpy floating dtypes only); every other dtype is kept.
    """
    return {name: host_array(value) for name, value in layer.params().items()}
