"""The spec's array-ops adapter for MXNet's numpy interface, on arrays and on symbols.

One adapter serves both halves of a Gluon ``HybridBlock``: ``F`` is
``mxnet.ndarray`` when the block runs imperatively and ``mxnet.symbol`` when
it builds a graph, and ``F.np``/``F.npx`` hold the same operations for both.

What the spec's protocol asks that MXNet 1.9 symbols cannot answer by
themselves is worked around here:

* ``dtype`` and ``ndim`` of a symbol: MXNet 1.9 symbols carry no dtype or
  shape. The adapter is given the dtypes and shapes of the graph's inputs (the
  concrete arrays the layer was called with) and asks MXNet's own type and
  shape inference for the answer.
* ``split_axis``/``merge_axes`` need no shapes: they map to ``npx.reshape``'s
  special codes (-2 copy a dimension, -4 copy the rest, -5 merge two, -6
  split one), for non-negative axes (the spec uses no other).
* ``logical_and``: ``mxnet.numpy`` 1.9 has none; boolean arrays multiply
  (MXNet promotes them to float32, exactly 0 or 1) and are cast back.
* ``matmul`` of float16 arrays on the CPU: MXNet 1.9 has float16 matrix
  products on GPUs only, so the product is taken in float32 and cast back,
  as GPUs accumulate float16 products in float32.
* ``where`` with a scalar fill has a wrong backward in MXNet 1.9; the fill
  is passed as a 0-d array (an array fill is passed as it is).
* ``arange_like`` counts in float32 where the array is 16-bit (float16
  cannot count past 2048 exactly) and returns int32.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mxnet as mx
import numpy as np

__all__ = ["MXNetOps", "dtype_kind"]

Array = Any


def dtype_kind(dtype: Any) -> str:
    """numpy's ``dtype.kind`` letter for an MXNet (numpy-interface) dtype."""
    return np.dtype(dtype).kind


def _is_array(x: Any) -> bool:
    return isinstance(x, mx.nd.NDArray)


class MXNetOps:
    """:class:`mha_multi.spec.ArrayOps` on ``mxnet.numpy`` arrays and symbols.

    Args:
        F: ``mxnet.ndarray`` or ``mxnet.symbol``, as a ``HybridBlock`` receives it.
        float16_in_float32: take float16 matrix products in float32 (MXNet's
            CPU kernels have no float16 products).
        input_dtypes: graph input name -> dtype; used only for symbols.
        input_shapes: graph input name -> shape; used only for symbols.
    """

    def __init__(
        self,
        F: Any,
        *,
        float16_in_float32: bool = False,
        input_dtypes: Mapping[str, Any] | None = None,
        input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        self._np = F.np
        self._npx = F.npx
        self._float16_in_float32 = float16_in_float32
        self._input_dtypes = {k: np.dtype(v).name for k, v in (input_dtypes or {}).items()}
        self._input_shapes = dict(input_shapes or {})

    # -- layout -------------------------------------------------------------

    def split_axis(self, x: Array, axis: int, sizes: tuple[int, int]) -> Array:
        _check_axis(axis)
        return self._npx.reshape(x, (-2,) * axis + (-6, *sizes, -4))

    def merge_axes(self, x: Array, axis: int) -> Array:
        _check_axis(axis)
        return self._npx.reshape(x, (-2,) * axis + (-5, -4))

    def permute(self, x: Array, axes: Sequence[int]) -> Array:
        return self._np.transpose(x, tuple(axes))

    def expand_dims(self, x: Array, axis: int) -> Array:
        return self._np.expand_dims(x, axis)

    def swap_last(self, x: Array) -> Array:
        return self._np.swapaxes(x, -1, -2)

    def flip(self, x: Array) -> Array:
        return self._np.flip(x, axis=0)

    # -- arithmetic -----------------------------------------------------------

    def matmul(self, a: Array, b: Array) -> Array:
        if self._float16_in_float32 and self.dtype(a) == np.float16:
            product = self._np.matmul(a.astype(np.float32), b.astype(np.float32))
            return product.astype(np.float16)
        return self._np.matmul(a, b)

    def arange_like(self, x: Array, axis: int) -> Array:
        if self.itemsize(self.dtype(x)) < 4:
            x = x.astype(np.float32)
        return self._npx.arange_like(x, axis=axis).astype(np.int32)

    def less(self, a: Array, b: Array) -> Array:
        return self._np.less(a, b)

    def greater_equal(self, a: Array, b: Array) -> Array:
        return self._np.greater_equal(a, b)

    def logical_and(self, a: Array, b: Array) -> Array:
        return self._np.multiply(a, b).astype(np.bool_)

    def where(self, condition: Array, x: Array, fill: float | Array) -> Array:
        if _is_array(fill) or isinstance(fill, mx.sym.Symbol):
            return self._np.where(condition, x, fill)
        # Not np.where(condition, x, fill): MXNet 1.9's backward of the scalar
        # form routes the gradient to the wrong elements. A 0-d array is right.
        placement = {"ctx": x.ctx} if _is_array(x) else {}
        fill_array = self._np.full((), fill, dtype=self.dtype(x), **placement)
        return self._np.where(condition, x, fill_array)

    def any_last(self, x: Array) -> Array:
        return self._np.any(x, axis=-1, keepdims=True)

    def logical_not(self, x: Array) -> Array:
        return self._np.logical_not(x)

    def mean(self, x: Array, axis: int) -> Array:
        return self._np.mean(x, axis=axis, keepdims=True)

    def softmax(self, x: Array) -> Array:
        return self._npx.softmax(x, axis=-1)

    def cast(self, x: Array, dtype: Any) -> Array:
        return x.astype(dtype)

    # -- static information -------------------------------------------------

    def dtype(self, x: Array) -> np.dtype:
        if _is_array(x):
            return np.dtype(x.dtype)
        _, (dtype,), _ = x.infer_type_partial(**_known(x, self._input_dtypes))
        if dtype is None:
            raise ValueError(f"cannot infer the dtype of {x.name!r} from {self._input_dtypes}")
        return np.dtype(dtype)

    def dtype_kind(self, dtype: Any) -> str:
        return dtype_kind(dtype)

    def itemsize(self, dtype: Any) -> int:
        return np.dtype(dtype).itemsize

    def float32(self) -> np.dtype:
        return np.dtype(np.float32)

    def ndim(self, x: Array) -> int:
        if _is_array(x):
            return x.ndim
        _, (shape,), _ = x.infer_shape_partial(**_known(x, self._input_shapes))
        if shape is None:
            raise ValueError(f"cannot infer the rank of {x.name!r} from {self._input_shapes}")
        return len(shape)


def _check_axis(axis: int) -> None:
    # Negative axes would need the rank, which symbols do not have.
    if axis < 0:
        raise ValueError(f"axis must be non-negative for MXNet's shape-free reshape; got {axis}")


def _known(symbol: Any, values: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` that are inputs of ``symbol`` (MXNet rejects others)."""
    arguments = set(symbol.list_arguments())
    return {name: value for name, value in values.items() if name in arguments}
