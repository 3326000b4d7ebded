"""Multi-head attention as a pure function of (canonical weights, inputs).

The call flow (checks, kernel plan, cache, attention, gates, output) is
:func:`mha_multi.call.forward`'s, given JAX's facts
(:class:`mha_multi.jax._facts.JaxFacts`) and the projections of canonical
weights (:class:`~mha_multi.jax._projections.WeightsProjections`); docs:
"Architecture". Both Flax modules (:class:`mha_multi.jax.MultiHeadAttention`
on NNX and :class:`mha_multi.jax.linen.MultiHeadAttention`) call it with
those two and their parameters, as :func:`multi_head_attention` does, so for
the same weights they trace the very same operations and give bit-identical
results.

Every check reads static shapes and dtypes only, so it runs (and raises)
while a ``jax.jit``-ed call is being traced, before any array operation.

Two paths compute the attention. The generic one is :func:`mha_multi.spec.attention`
on :class:`~mha_multi.jax._ops.JaxOps`; it materialises the weights and is
the only one that can return them or apply dropout. The fused one is
:func:`jax.nn.dot_product_attention` with the spec's masking rules translated
into its arguments and its fully hidden rows given the spec's value
(:mod:`mha_multi.jax._kernel`); it can run when neither the weights nor
dropout are needed, as :func:`mha_multi.spec.plan_kernel` decides for every
backend. Which kernel runs is ``implementation``:

* ``None`` (the default): cuDNN's flash attention for 16-bit inputs on a
  GPU, which never materialises the ``(B, H, Q, K)`` scores; the generic path
  everywhere else, and wherever cuDNN declines the shapes. XLA's kernel is
  the generic path's own arithmetic and measured no faster (slower
  forward+backward on CPU; the benchmark, docs: "Results"), so it is not
  chosen automatically.
* ``"xla"`` or ``"cudnn"``: that kernel, wherever the fused path is exact
  (and no axis is empty).
* ``"generic"``: always the generic path.

On a CPU the generic path takes a batch whose ``(B, H, Q, K)`` scores outgrow
the caches in pieces of examples, one after another, and recomputes a
piece's scores in its backward pass (see
:meth:`mha_multi.jax._facts.JaxFacts.generic_attention`); the projections
read their kernels with a heads axis (see
:func:`mha_multi.jax._projections.linear`). Both change which kernels XLA
runs, not the function: the numbers agree to float32 rounding.

With a ``cache`` (:class:`mha_multi.spec.KVCache`, docs: "Generating with a
cache") a call is one step of incremental decoding: the new keys and values
are projected and written into the cache by :func:`mha_multi.spec.update_cache`
(a gather and a select over the cache's static ``max_length``, so one
compilation serves every step of the same length), and the queries attend to
the cache's keys and values through the same kernel plan as an ordinary call.
Eager calls read the lengths and raise on a cache overflow; traced calls
cannot, and drop the positions that do not fit (see :func:`multi_head_attention`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from mha_multi import call, spec
from mha_multi.jax import _facts
from mha_multi.jax._facts import JaxFacts, as_valid_lens
from mha_multi.jax._kernel import check_implementation, platform
from mha_multi.jax._ops import PrecisionLike, dtype_kind
from mha_multi.jax._projections import WeightsProjections
from mha_multi.weights import WeightsConfig, check_weights

__all__ = [
    "as_valid_lens",
    "attend_compiled",
    "check_implementation",
    "check_params",
    "flax_dropout",
    "init_cache",
    "multi_head_attention",
]


def _stand_in(name: str, value: Any) -> np.ndarray:
    """A zero-strided numpy array with ``value``'s shape, for shape-only checks.

    Tracers cannot become numpy arrays, and ``bfloat16`` is of numpy kind
    ``'V'``; the stand-in is ``float32`` for any floating dtype and keeps
    other dtypes, so :func:`~mha_multi.weights.check_weights` still rejects
    integer weights with its own message.
    """
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        try:
            value = np.asarray(value)
        except Exception as error:
            raise TypeError(f"weights[{name!r}] is not convertible to a numpy array") from error
    dtype = np.float32 if dtype_kind(value.dtype) == "f" else value.dtype
    return np.broadcast_to(np.zeros((), dtype), tuple(value.shape))


def check_params(
    params: Mapping[str, Any],
    *,
    num_hiddens: int | None = None,
    query_size: int | None = None,
    key_size: int | None = None,
    value_size: int | None = None,
    bias: bool | None = None,
    qk_norm: str | bool | None = None,
    heads: spec.Heads | None = None,
    sinks: bool | None = False,
) -> WeightsConfig:
    """Validates canonical weights by their shapes and dtypes (traceable).

    Args:
        params: canonical weights (``W_q``... and, with biases, ``b_q``...;
            with ``qk_norm``, ``q_norm`` and ``k_norm``); arrays, tracers or
            array-likes.
        num_hiddens, query_size, key_size, value_size, bias, sinks: what the
            weights must describe, where known
            (:func:`~mha_multi.weights.check_weights`).
        qk_norm: the norms' entries, as :func:`mha_multi.weights.check_weights`
            takes them (``None``: where present).
        heads: the head layout, where known.

    Returns:
        The sizes the weights describe.

    Raises:
        TypeError: ``params`` is not a mapping, or an entry is not floating.
        ValueError: a missing, extra or mis-shaped entry, named.
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"weights must be a mapping of names to arrays; got {type(params)}")
    stand_ins = {name: _stand_in(name, value) for name, value in params.items()}
    _, config = check_weights(
        stand_ins,
        num_hiddens=num_hiddens,
        query_size=query_size,
        key_size=key_size,
        value_size=value_size,
        bias=bias,
        qk_norm=qk_norm,
        sinks=sinks,
        **({} if heads is None else dataclasses.asdict(heads)),
    )
    return config


def init_cache(
    heads: spec.Heads,
    batch_size: int,
    max_length: int,
    dtype: DTypeLike,
    *,
    device: jax.Device | None = None,
) -> spec.KVCache:
    """An empty key/value cache for ``heads`` (what the layers' ``init_cache`` return).

    Args:
        heads: the layer's head layout.
        batch_size: ``B``, the examples decoded together.
        max_length: the positions each example can hold.
        dtype: the dtype of the keys and values, floating.
        device: where the arrays live; ``None`` for JAX's default device.

    Returns:
        ``KVCache(keys, values, lengths)``: zero keys and values
        ``(B, num_kv_heads, max_length, head_dim)`` and zero lengths ``(B,)``
        int32.

    Raises:
        TypeError: ``batch_size`` or ``max_length`` not an int, or ``dtype``
            not floating.
        ValueError: ``batch_size`` or ``max_length`` negative, or ``dtype``
            float64 without JAX's x64 (which would hold float32).
    """
    shape = spec.cache_shape(batch_size, max_length, heads)
    spec.check_new_cache_dtype(dtype, dtype_kind)
    _facts.check_held_dtype("dtype", dtype)
    # Two buffers, not one shared: a jit step may donate keys and values.
    keys, values = (jnp.zeros(shape, dtype, device=device) for _ in range(2))
    return spec.KVCache(keys, values, jnp.zeros(shape[:1], jnp.int32, device=device))


def flax_dropout(
    key: Callable[[], jax.Array] | None, rate: float
) -> Callable[[jax.Array], jax.Array] | None:
    """Dropout of the attention weights as Flax draws it; ``None`` without a ``key``.

    Args:
        key: draws the PRNG key of the mask when the mask is drawn (after the
            call's checks), or ``None`` for no dropout.
        rate: the dropout rate.

    Returns:
        ``dropout(weights) -> weights`` for :func:`mha_multi.call.forward`, or ``None``.
    """
    if key is None:
        return None
    keep = 1.0 - float(rate)

    def dropout(x: jax.Array) -> jax.Array:
        # The same draw as flax's Dropout: keep with probability 1 - rate, scale up.
        mask = jax.random.bernoulli(key(), keep, x.shape)
        return lax.select(mask, x / keep, jnp.zeros_like(x))

    return dropout


class _Static(NamedTuple):
    """What a compiled call is specialised on besides the arrays' shapes and dtypes."""

    precision: Any
    implementation: str | None
    platform: str
    heads: spec.Heads
    sizes: tuple[tuple[str, int | None], ...]
    dtype: Any
    settings: tuple[tuple[str, Any], ...]  # attend's keyword arguments that are no arrays
    # The trace reads the CPU budget of the generic path's pieces: a program
    # traced under another budget is another program.
    piece_bytes: int


#: :func:`mha_multi.call.attend`'s keyword arguments that are arrays (or a cache of them).
_ARRAY_ARGUMENTS = ("cache", "gates", "positions", "bias", "segment_ids")


def _attend(
    params: Mapping[str, Any],
    queries: jax.Array,
    keys: jax.Array | None,
    values: jax.Array | None,
    valid_lens: jax.Array | None,
    arrays: Mapping[str, Any],
    static: _Static,
) -> call.Result:
    """:func:`mha_multi.call.attend` of canonical ``params`` and the call's arrays."""
    facts = JaxFacts(static.precision, static.implementation, platform=static.platform)
    layer = WeightsProjections(
        params, static.heads, dict(static.sizes), dtype=static.dtype, precision=static.precision
    )
    return call.attend(
        facts,
        layer,
        facts.ops(queries),
        queries,
        keys,
        values,
        valid_lens,
        **arrays,
        **dict(static.settings),
    )


_attend_program = jax.jit(_attend, static_argnames="static")


def attend_compiled(
    facts: JaxFacts,
    layer: WeightsProjections,
    ops: Any,
    queries: jax.Array,
    keys: jax.Array | None,
    values: jax.Array | None,
    valid_lens: jax.Array | None,
    **arguments: Any,
) -> call.Result:
    """:func:`mha_multi.call.attend` of a checked call, an eager one as one compiled program.

    Eager JAX dispatches (and, for each new shape, compiles) every operation
    on its own; the attention of one call is a few hundred of them. An eager
    call without dropout runs them as one ``jax.jit`` program instead, cached
    per shapes, dtypes and settings, after :func:`mha_multi.call.forward` has
    checked it and read what it reads on the host. The plan and the
    operations are the same as under the caller's own ``jit``: JAX's plan
    reads no values (:class:`~mha_multi.jax._facts.JaxFacts`). A call
    being traced (``jit``, ``grad``, ``vmap``) runs in the caller's trace,
    and so does an eager call with dropout, whose mask key is drawn in it.

    Args:
        facts: the call's JAX facts.
        layer: the layer's projections; their weights are fetched (or, on
            a Linen ``init``, made) once, here.
        ops: the array-ops adapter (``facts.ops``).
        queries, keys, values, valid_lens: as the checks returned them.
        arguments: :func:`mha_multi.call.attend`'s keyword arguments.

    Returns:
        The :class:`mha_multi.call.Result`.
    """
    params = layer.weights_for(queries, keys, values)
    arrays = {name: arguments.pop(name) for name in _ARRAY_ARGUMENTS if name in arguments}
    static = _Static(
        facts.precision,
        facts.implementation,
        platform(queries),
        layer.heads,
        tuple(layer.input_sizes().items()),
        layer.dtype,
        tuple(sorted(arguments.items())),
        _facts.CPU_PIECE_BYTES,
    )
    leaves = jax.tree_util.tree_leaves((params, queries, keys, values, valid_lens, arrays))
    eager = not any(isinstance(x, jax.core.Tracer) for x in leaves)
    if eager and arguments.get("dropout") is None and arguments.get("fill") is None:
        try:
            hash(static)
        except TypeError:  # a precision given as an unhashable object
            pass
        else:
            return _attend_program(params, queries, keys, values, valid_lens, arrays, static)
    return _attend(params, queries, keys, values, valid_lens, arrays, static)


def _layer_options(
    options: spec.LayerOptions | Mapping[str, Any] | None, head_dim: int
) -> spec.LayerOptions | None:
    """Checked positions and biases options; ``None`` for none (d2l's layer)."""
    if options is None:
        return None
    if not isinstance(options, spec.LayerOptions):
        options = spec.LayerOptions.of(options)
    options = options.check(head_dim)
    return None if options.is_default else options


def multi_head_attention(
    params: Mapping[str, Any],
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
    dropout_rate: float = 0.0,
    deterministic: bool = True,
    dropout_rng: jax.Array | None = None,
    dtype: DTypeLike | None = None,
    precision: PrecisionLike = None,
    return_attention_weights: bool = True,
    implementation: str | None = None,
    cache: spec.KVCache | None = None,
    head_mask: Any = None,
    head_parallel: bool = False,
    positions: Any = None,
    bias: Any = None,
    options: spec.LayerOptions | Mapping[str, Any] | None = None,
    segment_ids: Any = None,
) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, spec.KVCache]:
    """d2l's multi-head attention, exact to :mod:`mha_multi.spec`, as a pure function.

    Differentiable in ``params`` and the inputs; works under ``jax.jit``
    (``num_heads``, ``num_kv_heads``, ``causal``, ``dropout_rate``, ``deterministic``,
    ``dtype``, ``precision``, ``return_attention_weights``,
    ``implementation`` and ``head_parallel`` static), ``jax.grad`` and ``jax.vmap``.

    With ``return_attention_weights=False`` and no active dropout, float32
    and 16-bit calls may take the fused path (:func:`jax.nn.dot_product_attention`;
    by default cuDNN's for 16-bit inputs on a GPU, see the module notes); its
    result is the spec's, fully hidden rows included.

    With a ``cache`` the call is one step of incremental decoding (docs:
    "Generating with a cache"): example ``b`` appends its first
    ``valid_lens[b]`` new keys and values (all ``T`` by default) at
    positions ``cache.lengths[b]`` on, and query ``i`` sees the cache's
    positions below ``cache.lengths[b] + valid_lens[b]`` and, when causal,
    up to its own position ``cache.lengths[b] + i``. The cache is an
    argument and a result (a pytree), so a ``jax.jit``-ed step is compiled
    once for each ``T``. Eager calls raise ``ValueError`` on a cache that
    would overflow; a traced call cannot read the lengths, and then writes
    no position at or past ``max_length`` and overwrites no kept position:
    what does not fit is dropped, and ``lengths`` still counts it, so
    ``lengths > max_length`` afterwards tells that it happened.

    With a ``head_mask`` (docs: "Heads") head ``h``'s context, its slice of
    ``weights @ v``, is multiplied by ``head_mask[..., h]`` before ``W_o``
    (:func:`mha_multi.spec.apply_head_mask`), on every path: the fused
    kernel's output is that context, so the gates change no kernel plan.
    The call is differentiable in the gates.

    Args:
        params: canonical weights: ``W_q (query_size, num_heads*head_dim)``,
            ``W_k (key_size, num_kv_heads*head_dim)``, ``W_v (value_size,
            num_kv_heads*head_dim)``, ``W_o (num_heads*head_dim, num_hiddens)``
            and optionally all four biases ``b_q``, ``b_k``, ``b_v``, ``b_o``
            of the widths of their kernels' outputs (docs: "Canonical weights");
            with ``qk_norm`` in ``options``, ``q_norm`` and ``k_norm``.
            ``head_dim`` is ``W_q``'s width over ``num_heads``.
        queries: ``(B, Q, query_size)``.
        keys: ``(B, K, key_size)``; with a cache ``(B, Q, key_size)``, or
            ``None`` to attend to the cache as it is.
        values: ``(B, K, value_size)``, likewise.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``, integer or floating;
            key ``j`` is visible to query ``i`` iff ``j < valid_lens``. With
            a cache ``None`` or ``(B,)`` integers: the new positions of each
            example, in ``[0, Q]``.
        num_heads: number of (query) heads ``H``; must divide ``W_q``'s width.
        num_kv_heads: number of key/value heads; ``None`` reads it from
            ``W_k``'s width. Query head ``h`` reads key/value head
            ``h // (num_heads // num_kv_heads)``.
        causal: also hide key ``j`` from query ``i`` when ``j > i + (K - Q)``
            (with a cache: each example's own positions, see above).
        dropout_rate: dropout rate on the attention weights.
        deterministic: no dropout when ``True``.
        dropout_rng: the PRNG key of the dropout mask; required when
            ``deterministic`` is ``False`` and ``dropout_rate > 0``.
        dtype: the computation dtype; ``None`` promotes the dtypes of the
            inputs and the weights (as Flax layers do). 16-bit softmaxes run
            in float32. A cache must hold this dtype.
        precision: precision of every matrix product (``"highest"`` for IEEE
            float32 products on GPU and TPU).
        return_attention_weights: compute and return the weights; ``False``
            lets the fused path run.
        implementation: ``None`` (choose), ``"generic"``, ``"xla"`` or
            ``"cudnn"`` (see the module notes); a fused kernel runs only
            where :func:`mha_multi.spec.plan_kernel` allows, the generic path elsewhere.
        cache: ``None``, or a :class:`mha_multi.spec.KVCache` (see
            :func:`init_cache`): projected keys and values
            ``(B, num_kv_heads, max_length, head_dim)`` and ``lengths``
            ``(B,)`` int32.
        head_mask: ``None``, or the heads' gates ``(num_heads,)`` or
            ``(B, num_heads)``, a floating array of any floating dtype (cast
            to the computation dtype; its gradient comes back in its own).
        head_parallel: the generic path computes each key/value head's
            group apart (the same numbers), so that XLA can split the heads
            over devices; set for layers whose parameters are sharded by
            heads (docs: "Sharding heads"). Without dropout only.
        positions: ``None``, or integer ``(B, Q)`` positions the rotary
            embedding rotates the queries (and the keys of self-attention or
            a cached call) by (docs: "Positions and biases").
        bias: ``None``, or floating, broadcastable to ``(B, H, Q, K)``,
            added to the scaled scores before the masks; differentiable.
        options: ``rotary``, ``alibi``, ``window``, ``softcap``, ``qk_norm``, ``sinks``
            (:class:`mha_multi.spec.LayerOptions`, or a dict of them); static.
            With ``sinks=True``, ``params`` holds ``sinks`` ``(num_heads,)``.
        segment_ids: ``None``, or integer ``(B, Q)`` ids of packed sequences,
            or a tuple ``(query_ids, key_ids)`` (docs: "Packed sequences"):
            query ``i`` sees key ``j`` only when their ids are equal and not
            negative; rotary positions restart at each sequence unless
            ``positions`` are given. Not with a cache.

    Returns:
        ``(output, attention_weights)``: ``(B, Q, num_hiddens)`` and the
        pre-dropout weights ``(B, H, Q, K)`` (``None`` when not requested),
        both of the computation dtype. With a cache
        ``(output, attention_weights, cache)``: the weights are
        ``(B, H, Q, max_length)``, and the cache is the one after the call.

    Raises:
        TypeError: a non-floating input or weight, or non-numeric ``valid_lens``;
            with a cache, non-integer lengths or a cache of another dtype; a
            ``head_mask`` that is no floating array.
        ValueError: a bad configuration, weights or shapes (``head_mask``'s
            included), named; with a cache, in eager calls, lengths out of
            range or an overflow.
    """
    check_implementation(implementation)
    config = check_params(params, sinks=None)
    heads = spec.heads_of_weights(params, num_heads, num_kv_heads=num_kv_heads)
    layer_options = _layer_options(options, heads.head_dim)
    qk_norm = None if layer_options is None else layer_options.qk_norm
    if qk_norm is not None or "q_norm" in params:
        # The norms' entries as the option has them (none without it).
        check_params(
            params, qk_norm=False if qk_norm is None else qk_norm.scope, heads=heads, sinks=None
        )
    spec.sink_logits_of(params, layer_options is not None and layer_options.sinks, num_heads)
    spec.check_config(
        config.num_hiddens,
        num_heads,
        dropout_rate,
        num_kv_heads=heads.num_kv_heads,
        head_dim=heads.head_dim,
    )
    sizes = {
        "query_size": config.query_size,
        "key_size": config.key_size,
        "value_size": config.value_size,
    }
    dropout_key = None
    if not deterministic and dropout_rate > 0:

        def dropout_key() -> jax.Array:
            if dropout_rng is None:
                raise ValueError(
                    "dropout_rng is required when deterministic is False and dropout_rate > 0"
                )
            return dropout_rng

    result = call.forward(
        JaxFacts(precision, implementation),
        WeightsProjections(params, heads, sizes, dtype=dtype, precision=precision),
        queries,
        keys,
        values,
        valid_lens,
        causal=causal,
        return_attention_weights=return_attention_weights,
        cache=cache,
        head_mask=head_mask,
        dropout=flax_dropout(dropout_key, dropout_rate),
        dropout_rate=dropout_rate,
        head_parallel=head_parallel,
        positions=positions,
        bias=bias,
        segment_ids=segment_ids,
        layer_options=layer_options,
        run=attend_compiled,
    )
    if result.cache is None:
        return result.output, result.weights
    return result.output, result.weights, result.cache
