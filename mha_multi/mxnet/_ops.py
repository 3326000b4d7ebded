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
* ``matmul`` of 16-bit arrays: the spec asks for float32 accumulation
  rounded once, and MXNet 1.9 promises nothing about it (its CPU kernels have
  no float16 products at all), so the operands are cast to float32 and the
  product cast back, on every device.
* ``where`` with a scalar fill has a wrong backward in MXNet 1.9; the fill
  is passed as a 0-d array of ``x``'s dtype (an array fill of another dtype,
  too, is cast to it: MXNet's ``where`` would promote).
* ``softmax``: MXNet's kernel confines a NaN or inf score to its own key;
  the reference's whole row becomes NaN, and so does the adapter's.
* ``arange_like`` counts in float32 where the array is 16-bit (float16
  cannot count past 2048 exactly) and returns int32.
* ``gather_positions``: ``mxnet.numpy`` 1.9's ``take_along_axis`` is a
  fallback to numpy on the host (no symbol, no gradient);
  ``npx.gather_nd`` with the batch index stacked on the positions does the
  same on arrays and symbols, and its backward adds the gradient of each
  picked row to its source.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mxnet as mx
import numpy as np

from mha_multi import spec

__all__ = ["MXNetOps", "apart", "copied_to", "dtype_kind"]

Array = Any


class _Apart:
    """Whether a cache's keys and values share no memory, so that a row written into one
    in place changes nothing of the other (docs: "Generating with a cache").

    ``mx.np.shares_memory`` is an operator whose answer is read (some 50 us): the
    last pair found apart is remembered (weakly), which every decoding step of
    one cache asks about again.
    """

    def __init__(self) -> None:
        self._pair: tuple[Any, Any] | None = None

    def __call__(self, keys: Array, values: Array) -> bool:
        pair = self._pair
        if pair is not None and pair[0]() is keys and pair[1]() is values:
            return True
        if keys is values or mx.np.shares_memory(keys, values):
            return False
        self._pair = weakref.ref(keys), weakref.ref(values)
        return True


#: :class:`_Apart`'s one instance.
apart = _Apart()


def dtype_kind(dtype: Any) -> str:
    """numpy's ``dtype.kind`` letter for an MXNet (numpy-interface) dtype."""
    return np.dtype(dtype).kind


def copied_to(ctx: mx.Context, values: np.ndarray, dtype: Any) -> mx.np.ndarray:
    """``values`` made on the host (an index, lengths, a constant) as an array of ``dtype``
    on ``ctx``.

    An empty array filled by one copy: ``mx.np.array`` takes the same copy
    through ``__setitem__``, some 50 us more a call on the CPU, which a
    decoding step pays for each index it makes.
    """
    values = np.asarray(values, dtype=dtype, order="C")  # (a 0-d constant keeps its shape)
    array = mx.np.empty(values.shape, dtype=values.dtype, ctx=ctx)
    array._sync_copyfrom(values)
    return array


def _is_array(x: Any) -> bool:
    return isinstance(x, mx.nd.NDArray)


class MXNetOps(spec.NumpyDtypes):
    """:class:`mha_multi.spec.ArrayOps` on ``mxnet.numpy`` arrays and symbols.

    Args:
        F: ``mxnet.ndarray`` or ``mxnet.symbol``, as a ``HybridBlock`` receives it.
        input_dtypes: graph input name -> dtype; used only for symbols.
        input_shapes: graph input name -> shape; used only for symbols.
    """

    def __init__(
        self,
        F: Any,
        *,
        input_dtypes: Mapping[str, Any] | None = None,
        input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        #: ``F.np`` and ``F.npx``: MXNet's numpy operations for arrays or symbols.
        self.np = F.np
        self.npx = F.npx
        self._input_dtypes = {k: np.dtype(v).name for k, v in (input_dtypes or {}).items()}
        self._input_shapes = dict(input_shapes or {})

    def float_bits(self, x: Array) -> None:
        return None  # (MXNet's comparisons take subnormal numbers as they are)

    # -- layout -------------------------------------------------------------

    def split_axis(self, x: Array, axis: int, sizes: tuple[int, int]) -> Array:
        _check_axis(axis)
        return self.npx.reshape(x, (-2,) * axis + (-6, *sizes, -4))

    def merge_axes(self, x: Array, axis: int) -> Array:
        _check_axis(axis)
        return self.npx.reshape(x, (-2,) * axis + (-5, -4))

    def permute(self, x: Array, axes: Sequence[int]) -> Array:
        return self.np.transpose(x, tuple(axes))

    def expand_dims(self, x: Array, axis: int) -> Array:
        return self.np.expand_dims(x, axis)

    def matmul_swapped(self, a: Array, b: Array) -> Array:
        if _is_array(a) and _is_array(b) and a.ndim == b.ndim == 3:
            a_dtype, b_dtype = self.dtype(a), self.dtype(b)
            if a_dtype == b_dtype and a_dtype.itemsize >= 4:
                # b as it lies: its swapped copy took 2.7 ms of an (64, 259, 64) step's keys.
                return self.npx.batch_dot(a, b, transpose_b=True)
        return self.matmul(a, self.swap_last(b))

    def swap_last(self, x: Array) -> Array:
        if _is_array(x):
            # The same values and layout as swapaxes, whose kernel took 2.9 ms over an
            # (8, 2, 257, 64) array where transpose's took 0.74 ms (a symbol has no rank
            # to spell the axes with).
            last = x.ndim - 1
            return self.np.transpose(x, (*range(last - 1), last, last - 1))
        return self.np.swapaxes(x, -1, -2)

    def flip(self, x: Array) -> Array:
        return self.np.flip(x, axis=0)

    # -- arithmetic -----------------------------------------------------------

    def matmul(self, a: Array, b: Array) -> Array:
        a_dtype, b_dtype = self.dtype(a), self.dtype(b)
        if a_dtype.itemsize >= 4 and b_dtype.itemsize >= 4:
            return self.np.matmul(a, b)
        # 16-bit operands: accumulate in float32, round once (numpy's result dtype).
        result = np.result_type(a_dtype, b_dtype)
        product = self.np.matmul(_to(a, a_dtype, np.float32), _to(b, b_dtype, np.float32))
        return _to(product, np.dtype(np.float32), result)

    def size(self, x: Array, axis: int) -> _Size:
        # Symbols have no shape: a size is the axis of an array, counted by
        # arange_like in the graph.
        return _Size(x, axis)

    def arange(self, size: _Size) -> Array:
        x = size.array
        if self.itemsize(self.dtype(x)) < 4:
            x = x.astype(np.float32)  # float16 cannot count past 2048
        return self.npx.arange_like(x, axis=size.axis).astype(np.int32)

    def less(self, a: Array, b: Array) -> Array:
        return self.np.less(a, b)

    def greater_equal(self, a: Array, b: Array) -> Array:
        return self.np.greater_equal(a, b)

    def logical_and(self, a: Array, b: Array) -> Array:
        return self.np.multiply(a, b).astype(np.bool_)

    def where(self, condition: Array, x: Array, fill: float | Array) -> Array:
        if _is_array(fill) or isinstance(fill, mx.sym.Symbol):
            return self.np.where(condition, x, _to(fill, self.dtype(fill), self.dtype(x)))
        # Not np.where(condition, x, fill): MXNet 1.9's backward of the scalar
        # form routes the gradient to the wrong elements. A 0-d array is right.
        placement = {"ctx": x.ctx} if _is_array(x) else {}
        fill_array = self.np.full((), fill, dtype=self.dtype(x), **placement)
        return self.np.where(condition, x, fill_array)

    def any_last(self, x: Array) -> Array:
        return self.np.any(x, axis=-1, keepdims=True)

    def logical_not(self, x: Array) -> Array:
        return self.np.logical_not(x)

    def mean(self, x: Array, axis: int) -> Array:
        return self.np.mean(x, axis=axis, keepdims=True)

    def gather_positions(self, x: Array, positions: Array) -> Array:
        positions = _to(positions, self.dtype(positions), np.int32)
        batch = self.np.expand_dims(self.arange(_Size(x, 0)), 1) + positions * 0  # (B, M)
        return self.npx.gather_nd(x, self.np.stack([batch, positions], axis=0))

    def slice_last(self, x: Array, start: int, stop: int) -> Array:
        shape = x.shape if _is_array(x) else None
        if shape is None or not 0 <= start < stop <= shape[-1]:
            return x[..., start:stop]  # (npx.slice fails on an empty slice)
        # The same elements as x[..., start:stop], whose indexing costs some
        # 300 Python calls an array (a rotation takes two slices of each).
        leading = (None,) * (len(shape) - 1)
        return self.npx.slice(x, (*leading, start), (*leading, stop))

    def concat_last(self, xs: Sequence[Array]) -> Array:
        return self.np.concatenate(list(xs), axis=-1)

    def cos(self, x: Array) -> Array:
        return self.np.cos(x)

    def sin(self, x: Array) -> Array:
        return self.np.sin(x)

    def tanh(self, x: Array) -> Array:
        return self.np.tanh(x)

    def largest(self, x: Array) -> Array:
        return self.np.max(x)

    def rsqrt(self, x: Array) -> Array:
        return 1.0 / self.np.sqrt(x)

    def constant(self, value: np.ndarray, like: Array) -> Array:
        # Arrays only: graphs take no host constants (a call with positions
        # or biases runs on the parameters' arrays, docs: "Positions and biases").
        return copied_to(like.ctx, value, value.dtype)

    def softmax(self, x: Array) -> Array:
        # MXNet's kernel gives 0 to the other keys of a row holding a NaN or
        # inf score; the reference (exp(x - max) / sum) makes the whole row
        # NaN. 0 * max is NaN exactly for those rows (MXNet's max keeps NaN)
        # and adds an exact 0 elsewhere.
        weights = self.npx.softmax(x, axis=-1)
        return weights + 0 * self.np.max(x, axis=-1, keepdims=True)

    def cast(self, x: Array, dtype: Any) -> Array:
        return _to(x, self.dtype(x), np.dtype(dtype))

    # -- static information -------------------------------------------------

    def dtype(self, x: Array) -> np.dtype:
        if _is_array(x):
            return np.dtype(x.dtype)
        _, (dtype,), _ = x.infer_type_partial(**_known(x, self._input_dtypes))
        if dtype is None:
            raise ValueError(f"cannot infer the dtype of {x.name!r} from {self._input_dtypes}")
        return np.dtype(dtype)

    def ndim(self, x: Array) -> int:
        if _is_array(x):
            return x.ndim
        _, (shape,), _ = x.infer_shape_partial(**_known(x, self._input_shapes))
        if shape is None:
            raise ValueError(f"cannot infer the rank of {x.name!r} from {self._input_shapes}")
        return len(shape)


@dataclass(frozen=True)
class _Size:
    """The size of ``axis`` of ``array`` (an array or a symbol)."""

    array: Array
    axis: int


def _to(x: Array, dtype: np.dtype, target: Any) -> Array:
    """``x`` (of ``dtype``) as ``target``; no copy, and no graph node, when they are equal."""
    return x if np.dtype(dtype) == np.dtype(target) else x.astype(target)


def _check_axis(axis: int) -> None:
    # Negative axes would need the rank, which symbols do not have.
    if axis < 0:
        raise ValueError(f"axis must be non-negative for MXNet's shape-free reshape; got {axis}")


def _known(symbol: Any, values: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` that are inputs of ``symbol`` (MXNet rejects others)."""
    arguments = set(symbol.list_arguments())
    return {name: value for name, value in values.items() if name in arguments}
