"""The spec's array-ops adapter for ``jax.numpy``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from mha_multi import spec

PrecisionLike = Any


def dtype_kind(dtype: DTypeLike) -> str:
    """numpy's ``dtype.kind`` letter for a JAX dtype.

    ``bfloat16`` and the float8 types are numpy dtypes of kind ``'V'`` (they
    come from ``ml_dtypes``); they are floating point here.
    """
    if jnp.issubdtype(dtype, jnp.floating):
        return "f"
    return np.dtype(dtype).kind


def is_16_bit(dtype: DTypeLike) -> bool:
    """Whether ``dtype`` is a 16-bit float (``float16``, ``bfloat16``)."""
    return dtype_kind(dtype) == "f" and np.dtype(dtype).itemsize == 2


def matmul(a: jax.Array, b: jax.Array, precision: PrecisionLike = None) -> jax.Array:
    """``a @ b``; 16-bit operands accumulate in float32 and the result is rounded once.

    Left to itself, XLA may accumulate a float16 product in float16 or round
    partial sums (XLA:CPU is measured two units in the last place off), so
    the float32 accumulator is asked for explicitly on every machine.

    Args:
        a: left operand, ``(..., n, k)``.
        b: right operand, ``(..., k, m)``.
        precision: as for :func:`jax.numpy.matmul`.

    Returns:
        The product in the operands' promoted dtype.
    """
    dtype = jnp.result_type(a, b)
    if not is_16_bit(dtype):
        return jnp.matmul(a, b, precision=precision)
    product = jnp.matmul(a, b, precision=precision, preferred_element_type=jnp.float32)
    return product.astype(dtype)


class JaxOps(spec.NumpyDtypes, spec.NamespaceOps):
    """:class:`mha_multi.spec.ArrayOps` on ``jax.Array`` (and tracers).

    Args:
        precision: passed to every matrix product (``jax.lax.Precision`` or a
            string such as ``"highest"``); ``None`` uses JAX's default, which
            ``jax.default_matmul_precision`` sets.
    """

    xp = jnp

    def __init__(self, precision: PrecisionLike = None) -> None:
        self.precision = precision

    def float_bits(self, x: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(x, jnp.int64 if x.dtype.itemsize == 8 else jnp.int32)

    def split_axis(self, x: jax.Array, axis: int, sizes: tuple[int, int]) -> jax.Array:
        axis = axis % x.ndim
        sizes = spec.static_split_sizes(x.shape[axis], sizes)
        return jnp.reshape(x, (*x.shape[:axis], *sizes, *x.shape[axis + 1 :]))

    def merge_axes(self, x: jax.Array, axis: int) -> jax.Array:
        axis = axis % x.ndim
        # No -1: a reshape cannot infer it when another axis is empty (B = 0, Q = 0).
        merged = x.shape[axis] * x.shape[axis + 1]
        return jnp.reshape(x, (*x.shape[:axis], merged, *x.shape[axis + 2 :]))

    def permute(self, x: jax.Array, axes: Sequence[int]) -> jax.Array:
        return jnp.transpose(x, tuple(axes))

    def expand_dims(self, x: jax.Array, axis: int) -> jax.Array:
        return jnp.expand_dims(x, axis)

    def matmul(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return matmul(a, b, self.precision)

    def swap_last(self, x: jax.Array) -> jax.Array:
        return jnp.swapaxes(x, -1, -2)

    def matmul_swapped(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return matmul(a, jnp.swapaxes(b, -1, -2), self.precision)  # (XLA fuses the swap)

    def size(self, x: jax.Array, axis: int) -> int:
        return x.shape[axis]

    def arange(self, size: int) -> jax.Array:
        return jnp.arange(size)

    def flip(self, x: jax.Array) -> jax.Array:
        return jnp.flip(x, 0)

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
        # bfloat16 is of numpy kind "V".
        return dtype_kind(dtype)

    def ndim(self, x: jax.Array) -> int:
        return x.ndim

    def any_last(self, x: jax.Array) -> jax.Array:
        return jnp.any(x, axis=-1, keepdims=True)

    def mean(self, x: jax.Array, axis: int) -> jax.Array:
        # jnp.mean accumulates 16-bit floats in float32 and casts back.
        return jnp.mean(x, axis=axis, keepdims=True)

    def gather_positions(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        # spec.update_cache picks positions inside the call's T rows only;
        # "clip" spares the bounds handling of JAX's default "fill" mode.
        return jnp.take_along_axis(x, positions[..., None], axis=1, mode="clip")

    def concat_last(self, xs: Sequence[jax.Array]) -> jax.Array:
        return jnp.concatenate(list(xs), axis=-1)

    def rsqrt(self, x: jax.Array) -> jax.Array:
        return jax.lax.rsqrt(x)

    def constant(self, value: np.ndarray, like: jax.Array) -> jax.Array:
        return jnp.asarray(value)
