"""The spec's array-ops adapter for ``jax.numpy``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

PrecisionLike = Any


def dtype_kind(dtype: DTypeLike) -> str:
    """numpy's ``dtype.kind`` letter for a JAX dtype.

    ``bfloat16`` and the float8 types are numpy dtypes of kind ``'V'`` (they
    come from ``ml_dtypes``); they are floating point here.
    """
    if jnp.issubdtype(dtype, jnp.floating):
        return "f"
    return np.dtype(dtype).kind


class JaxOps:
    """:class:`mha_multi.spec.ArrayOps` on ``jax.Array`` (and tracers).

    Args:
        precision: passed to every matrix product (``jax.lax.Precision`` or a
            string such as ``"highest"``); ``None`` uses JAX's default, which
            ``jax.default_matmul_precision`` sets.
    """

    def __init__(self, precision: PrecisionLike = None) -> None:
        self.precision = precision

    def split_axis(self, x: jax.Array, axis: int, sizes: tuple[int, int]) -> jax.Array:
        axis = axis % x.ndim
        return jnp.reshape(x, (*x.shape[:axis], *sizes, *x.shape[axis + 1 :]))

    def merge_axes(self, x: jax.Array, axis: int) -> jax.Array:
        axis = axis % x.ndim
        return jnp.reshape(x, (*x.shape[:axis], -1, *x.shape[axis + 2 :]))

    def permute(self, x: jax.Array, axes: Sequence[int]) -> jax.Array:
        return jnp.transpose(x, tuple(axes))

    def expand_dims(self, x: jax.Array, axis: int) -> jax.Array:
        return jnp.expand_dims(x, axis)

    def matmul(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.matmul(a, b, precision=self.precision)

    def swap_last(self, x: jax.Array) -> jax.Array:
        return jnp.swapaxes(x, -1, -2)

    def arange_like(self, x: jax.Array, axis: int) -> jax.Array:
        return jnp.arange(x.shape[axis])

    def flip(self, x: jax.Array) -> jax.Array:
        return jnp.flip(x, 0)

    def less(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.less(a, b)

    def greater_equal(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.greater_equal(a, b)

    def logical_and(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.logical_and(a, b)

    def where(self, condition: jax.Array, x: jax.Array, fill: float | jax.Array) -> jax.Array:
        # The fill takes x's dtype: a Python float must not promote 16-bit x.
        return jnp.where(condition, x, jnp.asarray(fill, dtype=x.dtype))

    def softmax(self, x: jax.Array) -> jax.Array:
        return jax.nn.softmax(x, axis=-1)

    def cast(self, x: jax.Array, dtype: DTypeLike) -> jax.Array:
        return jnp.asarray(x).astype(dtype)

    def dtype(self, x: jax.Array) -> np.dtype:
        return x.dtype

    def dtype_kind(self, dtype: DTypeLike) -> str:
        return dtype_kind(dtype)

    def itemsize(self, dtype: DTypeLike) -> int:
        return np.dtype(dtype).itemsize

    def float32(self) -> np.dtype:
        return np.dtype(jnp.float32)

    def ndim(self, x: jax.Array) -> int:
        return x.ndim

    def any_last(self, x: jax.Array) -> jax.Array:
        return jnp.any(x, axis=-1, keepdims=True)

    def logical_not(self, x: jax.Array) -> jax.Array:
        return jnp.logical_not(x)

    def mean(self, x: jax.Array, axis: int) -> jax.Array:
        # jnp.mean accumulates 16-bit floats in float32 and casts back.
        return jnp.mean(x, axis=axis, keepdims=True)
