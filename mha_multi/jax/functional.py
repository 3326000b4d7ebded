"""Multi-head attention as a pure function of (canonical weights, inputs).

Both Flax modules (:class:`mha_multi.jax.MultiHeadAttention` on NNX and
:class:`mha_multi.jax.linen.MultiHeadAttention`) only gather their parameters
and call :func:`multi_head_attention`, so for the same weights they trace the
very same operations and give bit-identical results.

Every check here reads static shapes and dtypes only, so it runs (and raises)
while a ``jax.jit``-ed call is being traced, before any array operation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from mha_multi import spec
from mha_multi.jax._ops import JaxOps, PrecisionLike, dtype_kind
from mha_multi.weights import WeightsConfig, check_weights

__all__ = ["as_valid_lens", "check_call", "check_params", "multi_head_attention"]

INPUT_NAMES = ("queries", "keys", "values")


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
) -> WeightsConfig:
    """Validates canonical weights by their shapes and dtypes (traceable).

    Args:
        params: canonical weights (``W_q``... and, with biases, ``b_q``...);
            arrays, tracers or array-likes.
        num_hiddens, query_size, key_size, value_size, bias: what the weights
            must describe, where known.

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
    )
    return config


def as_valid_lens(valid_lens: Any) -> jax.Array | None:
    """``valid_lens`` as a JAX array (or tracer), its dtype checked.

    Accepts ``None``, JAX arrays, numpy arrays and nested sequences. Integer
    and floating dtypes are accepted (the rule is ``j < valid_lens``).

    Raises:
        TypeError: a boolean, string or otherwise non-numeric ``valid_lens``.
    """
    if valid_lens is None:
        return None
    if not isinstance(valid_lens, jax.Array):
        try:
            valid_lens = np.asarray(valid_lens)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"valid_lens must be an integer or floating-point array; got {valid_lens!r}"
            ) from error
    spec.check_valid_lens_dtype(dtype_kind(valid_lens.dtype))
    return jnp.asarray(valid_lens)


def _check_input(name: str, x: Any) -> Any:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an array; got {type(x).__name__}")
    if dtype_kind(x.dtype) != "f":
        raise TypeError(f"{name} must be a floating-point array; got {x.dtype}")
    return x


def check_call(
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    query_size: int | None = None,
    key_size: int | None = None,
    value_size: int | None = None,
) -> tuple[Any, Any, Any, jax.Array | None]:
    """Validates the arguments of a call (traceable) and converts ``valid_lens``.

    Args:
        queries: ``(B, Q, query_size)`` floating array.
        keys: ``(B, K, key_size)`` floating array.
        values: ``(B, K, value_size)`` floating array.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``, integer or floating.
        query_size, key_size, value_size: the layer's input sizes, or
            ``None`` where not known yet.

    Returns:
        ``(queries, keys, values, valid_lens)`` with ``valid_lens`` a JAX array.

    Raises:
        TypeError: an input is not a floating array, or ``valid_lens`` is
            not numeric.
        ValueError: inconsistent shapes, named (see
            :func:`mha_multi.spec.check_inputs`).
    """
    queries, keys, values = (
        _check_input(name, x) for name, x in zip(INPUT_NAMES, (queries, keys, values), strict=True)
    )
    lens = as_valid_lens(valid_lens)
    spec.check_inputs(
        queries.shape,
        keys.shape,
        values.shape,
        None if lens is None else lens.shape,
        query_size=query_size,
        key_size=key_size,
        value_size=value_size,
    )
    return queries, keys, values, lens


def _linear(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, precision: Any) -> jax.Array:
    y = jnp.matmul(x, kernel, precision=precision)
    return y if bias is None else y + bias


def _dropout(rng: jax.Array, rate: float, x: jax.Array) -> jax.Array:
    # The same draw as flax's Dropout: keep with probability 1 - rate, scale up.
    keep = 1.0 - rate
    mask = jax.random.bernoulli(rng, keep, x.shape)
    return lax.select(mask, x / keep, jnp.zeros_like(x))


def multi_head_attention(
    params: Mapping[str, Any],
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    num_heads: int,
    causal: bool = False,
    dropout_rate: float = 0.0,
    deterministic: bool = True,
    dropout_rng: jax.Array | None = None,
    dtype: DTypeLike | None = None,
    precision: PrecisionLike = None,
) -> tuple[jax.Array, jax.Array]:
    """d2l's multi-head attention, exact to :mod:`mha_multi.spec`, as a pure function.

    Differentiable in ``params`` and the inputs; works under ``jax.jit``
    (``num_heads``, ``causal``, ``dropout_rate``, ``deterministic``,
    ``dtype`` and ``precision`` static), ``jax.grad`` and ``jax.vmap``.

    Args:
        params: canonical weights: ``W_q (query_size, num_hiddens)``,
            ``W_k (key_size, num_hiddens)``, ``W_v (value_size, num_hiddens)``,
            ``W_o (num_hiddens, num_hiddens)`` and optionally all four biases
            ``b_q``, ``b_k``, ``b_v``, ``b_o`` of shape ``(num_hiddens,)``.
        queries: ``(B, Q, query_size)``.
        keys: ``(B, K, key_size)``.
        values: ``(B, K, value_size)``.
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``, integer or floating;
            key ``j`` is visible to query ``i`` iff ``j < valid_lens``.
        num_heads: number of heads ``H``; must divide ``num_hiddens``.
        causal: also hide key ``j`` from query ``i`` when ``j > i + (K - Q)``.
        dropout_rate: dropout rate on the attention weights.
        deterministic: no dropout when ``True``.
        dropout_rng: the PRNG key of the dropout mask; required when
            ``deterministic`` is ``False`` and ``dropout_rate > 0``.
        dtype: the computation dtype; ``None`` promotes the dtypes of the
            inputs and the weights (as Flax layers do). 16-bit softmaxes run
            in float32.
        precision: precision of every matrix product (``"highest"`` for IEEE
            float32 products on GPU and TPU).

    Returns:
        ``(output, attention_weights)``: ``(B, Q, num_hiddens)`` and the
        pre-dropout weights ``(B, H, Q, K)``, both of the computation dtype.

    Raises:
        TypeError: a non-floating input or weight, or non-numeric ``valid_lens``.
        ValueError: a bad configuration, weights or shapes, named.
    """
    config = check_params(params)
    head_dim = spec.check_config(config.num_hiddens, num_heads, dropout_rate)
    queries, keys, values, lens = check_call(
        queries,
        keys,
        values,
        valid_lens,
        query_size=config.query_size,
        key_size=config.key_size,
        value_size=config.value_size,
    )
    use_dropout = not deterministic and dropout_rate > 0
    if use_dropout and dropout_rng is None:
        raise ValueError("dropout_rng is required when deterministic is False and dropout_rate > 0")
    if dtype is None:
        dtype = jnp.result_type(queries, keys, values, *params.values())
    weights = {name: jnp.asarray(value, dtype) for name, value in params.items()}
    queries, keys, values = (jnp.asarray(x, dtype) for x in (queries, keys, values))

    def project(x: jax.Array, name: str) -> jax.Array:
        return _linear(x, weights[f"W_{name}"], weights.get(f"b_{name}"), precision)

    dropout = None
    if use_dropout:

        def dropout(x: jax.Array) -> jax.Array:
            return _dropout(dropout_rng, float(dropout_rate), x)

    context, attention_weights = spec.attention(
        JaxOps(precision),
        project(queries, "q"),
        project(keys, "k"),
        project(values, "v"),
        lens,
        num_heads=num_heads,
        head_dim=head_dim,
        causal=causal,
        dropout=dropout,
    )
    return project(context, "o"), attention_weights
