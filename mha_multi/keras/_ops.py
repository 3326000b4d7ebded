"""The spec's array-ops adapter on ``keras.ops``.

Written against ``keras.ops`` only, so the same adapter serves Keras'
TensorFlow, JAX and PyTorch backends. Shapes are read with
``keras.ops.shape``, which gives Python ints where a dimension is static and
scalar tensors where it is not (TensorFlow graphs with an unknown batch), so
the reshapes below work in eager code, in ``tf.function``/XLA and in the
functional API alike.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

Tensor = Any

_KINDS = (("bfloat", "f"), ("float", "f"), ("uint", "u"), ("int", "i"), ("bool", "b"))


def dtype_kind(dtype: Any) -> str:
    """numpy's ``dtype.kind`` letter for a Keras dtype (``'O'`` for strings and the like)."""
    name = keras.backend.standardize_dtype(dtype)
    for prefix, kind in _KINDS:
        if name.startswith(prefix):
            return kind
    return "c" if name.startswith("complex") else "O"


def _itemsize(dtype: Any) -> int:
    name = keras.backend.standardize_dtype(dtype)
    if name == "bool":
        return 1
    bits = re.search(r"\d+", name)
    if bits is None:
        raise TypeError(f"dtype {name!r} has no fixed item size")
    return int(bits.group()) // 8


def to_numpy(x: Any) -> np.ndarray:
    """A backend tensor or variable value as a new numpy array (bfloat16 via ml_dtypes)."""
    with warnings.catch_warnings():
        # Keras converts with np.array(x), and the __array__ of TensorFlow
        # variables and PyTorch tensors predates numpy 2's copy keyword.
        warnings.filterwarnings(
            "ignore", "__array__ implementation doesn't accept a copy keyword", DeprecationWarning
        )
        return np.array(keras.ops.convert_to_numpy(x), copy=True)


class Positions:
    """Stands for a ``(Q, K)`` scores array in :func:`mha_multi.spec.visibility`.

    ``visibility`` reads only the sizes of the last two axes of its
    ``scores`` argument; a fused path has no scores array, and materialising
    one just for its shape would cost ``Q * K`` memory in eager TensorFlow.

    Args:
        num_queries: ``Q``, a Python int or a scalar tensor (unknown size).
        num_keys: ``K``, likewise.
    """

    def __init__(self, num_queries: Any, num_keys: Any) -> None:
        self.shape = (num_queries, num_keys)


class KerasOps:
    """:class:`mha_multi.spec.ArrayOps` on ``keras.ops`` (any Keras backend)."""

    def split_axis(self, x: Tensor, axis: int, sizes: tuple[int, int]) -> Tensor:
        shape = list(ops.shape(x))
        axis %= len(shape)
        return ops.reshape(x, [*shape[:axis], *sizes, *shape[axis + 1 :]])

    def merge_axes(self, x: Tensor, axis: int) -> Tensor:
        shape = list(ops.shape(x))
        axis %= len(shape)
        return ops.reshape(x, [*shape[:axis], -1, *shape[axis + 2 :]])

    def permute(self, x: Tensor, axes: Sequence[int]) -> Tensor:
        return ops.transpose(x, tuple(axes))

    def expand_dims(self, x: Tensor, axis: int) -> Tensor:
        return ops.expand_dims(x, axis)

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        if self.dtype(a) == "float64" and self.dtype(b) == "float64":
            # Keras' promotion maps 64-bit types to 32-bit on its JAX and
            # PyTorch backends, and ops.matmul on PyTorch casts its result to
            # that type; ops.einsum keeps float64.
            return ops.einsum("...ij,...jk->...ik", a, b)
        return ops.matmul(a, b)

    def swap_last(self, x: Tensor) -> Tensor:
        return ops.swapaxes(x, -1, -2)

    def arange_like(self, x: Tensor | Positions, axis: int) -> Tensor:
        shape = x.shape if isinstance(x, Positions) else ops.shape(x)
        return ops.arange(shape[axis], dtype="int32")

    def flip(self, x: Tensor) -> Tensor:
        return ops.flip(x, axis=0)

    def less(self, a: Tensor, b: Tensor) -> Tensor:
        return ops.less(a, b)

    def greater_equal(self, a: Tensor, b: Tensor) -> Tensor:
        return ops.greater_equal(a, b)

    def logical_and(self, a: Tensor, b: Tensor) -> Tensor:
        return ops.logical_and(a, b)

    def where(self, condition: Tensor, x: Tensor, fill: float | Tensor) -> Tensor:
        # An explicit fill of x's dtype: no backend's promotion rules apply.
        return ops.where(condition, x, ops.cast(fill, self.dtype(x)))

    def softmax(self, x: Tensor) -> Tensor:
        # A single key is a legitimate case (its weight is 1); Keras warns
        # about a softmax over an axis of size 1.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "You are using a softmax over axis", UserWarning)
            return ops.softmax(x, axis=-1)

    def cast(self, x: Tensor, dtype: Any) -> Tensor:
        return ops.cast(x, dtype)

    def dtype(self, x: Tensor) -> str:
        return keras.backend.standardize_dtype(x.dtype)

    def dtype_kind(self, dtype: Any) -> str:
        return dtype_kind(dtype)

    def itemsize(self, dtype: Any) -> int:
        return _itemsize(dtype)

    def float32(self) -> str:
        return "float32"

    def ndim(self, x: Tensor) -> int:
        return len(x.shape)

    def any_last(self, x: Tensor) -> Tensor:
        return ops.any(x, axis=-1, keepdims=True)

    def logical_not(self, x: Tensor) -> Tensor:
        return ops.logical_not(x)

    def mean(self, x: Tensor, axis: int) -> Tensor:
        return ops.mean(x, axis=axis, keepdims=True)


OPS = KerasOps()
